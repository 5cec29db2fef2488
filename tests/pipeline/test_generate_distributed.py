"""A real 2-rank gloo run (torchrun on CPU): each rank takes its own chunks and synthesis rounds, and the
merged artifact holds exactly the records of a single-process run."""

import json
import os
import subprocess
import sys

from draftsmith.data.artifacts import read_records
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.generate import run_generate
from draftsmith.pipeline.prepare import run_prepare


def test_two_ranks_produce_the_same_records_as_one(tmp_path, tiny_target_dir):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i} about the sum of numbers?"}]}
            )
            + "\n"
            for i in range(7)
        )
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{target: {tiny_target_dir}}}\n"
        f"data: {{sources: [{{path: {data}}}], holdout_fraction: 0.2}}\n"
        "generate: {temperature: 0.8, max_new_tokens: 8, batch_size: 4, chunk_size: 2, synthesize: 3,\n"
        "           synth: {round_size: 16, max_new_tokens: 10, min_chars: 3}}\n"
    )
    one = load_config(recipe, [f"run_dir={tmp_path / 'one'}"])
    run_prepare(one)
    _, single = read_records(run_generate(one), "generated")

    two = load_config(recipe, [f"run_dir={tmp_path / 'two'}"])
    run_prepare(two)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "draftsmith",
            "generate",
            str(recipe),
            f"run_dir={tmp_path / 'two'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stderr
    out = tmp_path / "two" / "generated"
    manifest, double = read_records(out, "generated")
    # both ranks wrote synthesis rounds and chunks
    assert len(list((out / "synth").glob("round-*.jsonl"))) >= 2
    assert manifest["records"] == 10

    def key(r):
        return r["id"]

    assert sorted(double, key=key) == sorted(single, key=key)
