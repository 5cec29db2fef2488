"""The real default target end to end through the CLI: prepare MT-Bench, self-synthesize prompts, and
answer everything on-policy with SmolLM2-135M-Instruct (`model.dtype: auto`, which the suite pins to fp32 so
that it runs alike on every CPU; short answers)."""

import pytest

from draftsmith.data.artifacts import read_records
from draftsmith.pipeline.cli import main


@pytest.mark.slow
def test_smollm2_prepare_and_generate(tmp_path):
    run = tmp_path / "run"
    common = ["run_dir=" + str(run), "data.sources=[{builtin: mtbench, limit: 3}]"]
    assert main(["prepare", "configs/smollm2-eagle3.yaml", *common]) == 0
    gen = [
        "generate.max_new_tokens=24",
        "generate.synthesize=3",
        "generate.synth.round_size=8",
        "generate.chunk_size=4",
    ]
    assert main(["generate", "configs/smollm2-eagle3.yaml", *common, *gen]) == 0
    manifest, rows = read_records(run / "generated", "generated")
    assert manifest["records"] == 6 and manifest["synthesis"]["accepted"] == 3
    assert manifest["target"]["name"] == "smollm2-135m-instruct"
    synth = [r for r in rows if r["source"] == "synthesize"]
    assert all(len(r["messages"][0]["content"]) >= 12 for r in synth)
    mt = [r for r in rows if r["source"] == "mtbench"]
    # two turns each, both answered by the model, and the eot <|im_end|> closes each masked run
    assert all(sum(m["role"] == "assistant" and m["token_ids"] is not None for m in r["messages"]) == 2 for r in mt)
    for r in rows:
        masked = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        assert masked.count(2) == sum(m["role"] == "assistant" for m in r["messages"])  # id 2 = <|im_end|>
