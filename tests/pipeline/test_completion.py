"""The completion rule (pipeline/completion.py): complete with the same inputs, resumable when interrupted with the
same inputs, stale when a setting or an input artifact changed, absent otherwise; and the run directory's layout."""

import json
from pathlib import Path

import pytest
from accelerate import PartialState

import draftsmith.pipeline.generate as gen_stage
from draftsmith.data.artifacts import write_manifest
from draftsmith.pipeline.completion import (
    Status,
    completion,
    fingerprint,
    stage_completion,
    stage_inputs,
    start,
    write_progress,
)
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.prepare import run_prepare

ANSWER = {"role": "assistant", "content": "an old answer"}
INPUTS = {"target": {"name": "t", "sha256": "abc"}, "generate": {"temperature": 0.0, "seed": 0}, "prepared": "f1"}


def test_the_rule_on_records_alone(tmp_path):
    d = tmp_path / "artifact"
    assert completion(d, INPUTS).status is Status.ABSENT
    write_progress(d, INPUTS)
    assert completion(d, INPUTS).status is Status.RESUMABLE  # interrupted with the same inputs
    other = json.loads(json.dumps(INPUTS))
    other["generate"]["temperature"] = 0.5
    stale = completion(d, other)
    assert stale.status is Status.STALE and stale.differences == ("generate.temperature: 0.0 -> 0.5",)
    assert "generate.temperature: 0.0 -> 0.5" in stale.refusal("generate")
    write_manifest(d, "generated", inputs=INPUTS, shards=[])
    assert completion(d, INPUTS).complete  # the manifest decides once it exists
    assert completion(d, {**INPUTS, "prepared": "f2"}).differences == ("prepared: 'f1' -> 'f2'",)
    # a manifest that records no inputs, or another status, is not complete for anyone
    write_manifest(d, "generated", shards=[])
    assert completion(d, INPUTS).status is Status.STALE
    write_manifest(d, "generated", inputs=INPUTS, status="running")
    assert completion(d, INPUTS).status is Status.STALE
    # work left by a draftsmith from before the rule (a plan.json, no inputs) is not continued unchecked
    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text(json.dumps(INPUTS))
    assert completion(old, INPUTS).differences == ("recorded without its inputs",)


def test_start_refuses_stale_work_and_marks_new_work(tmp_path):
    state = PartialState(cpu=True)
    d = tmp_path / "artifact"
    assert start(d, INPUTS, state, "collect").status is Status.ABSENT
    assert json.loads((d / "progress.json").read_text())["inputs"] == INPUTS
    assert start(d, INPUTS, state, "collect").status is Status.RESUMABLE
    with pytest.raises(StageError, match=r"generate\.seed: 0 -> 1"):
        start(d, {**INPUTS, "generate": {"temperature": 0.0, "seed": 1}}, state, "collect")
    write_manifest(d, "features", inputs=INPUTS, shards=[])
    assert start(d, INPUTS, state, "collect").complete


def test_fingerprints_follow_content_not_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_manifest(a, "prepared", inputs={"x": 1}, shards=[{"file": "s0.parquet", "sha256": "11"}])
    write_manifest(b, "prepared", inputs={"x": 2}, shards=[{"file": "s0.parquet", "sha256": "11"}])
    assert fingerprint(a) == fingerprint(b)  # the same payload, whatever made it and when
    write_manifest(b, "prepared", inputs={"x": 2}, shards=[{"file": "s0.parquet", "sha256": "22"}])
    assert fingerprint(a) != fingerprint(b)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "eval.json").write_text("{}")
    write_manifest(tmp_path / "c", "eval", files=["eval.json"])  # bare names are hashed
    before = fingerprint(tmp_path / "c")
    (tmp_path / "c" / "eval.json").write_text('{"runs": []}')
    assert fingerprint(tmp_path / "c") != before
    assert fingerprint(tmp_path / "none") is None


def test_the_layout_names_every_artifact(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "eval.output=eval-b"])
    layout = RunLayout.of(cfg)
    assert layout.prepared == tmp_path / "prepared" and layout.generated_chunks == tmp_path / "generated" / "chunks"
    assert layout.features == tmp_path / "features"
    assert layout.train("dspark").final == tmp_path / "train" / "dspark" / "final"
    assert layout.train("eagle3").checkpoints == tmp_path / "train" / "eagle3" / "checkpoints"
    assert (
        layout.eval_json == tmp_path / "eval-b" / "eval.json" and layout.export_format("eagle3").parent.name == "export"
    )
    assert (
        layout.stage_dir("train", "eagle3") == layout.train("eagle3").root and layout.stage_dir("eval") == layout.eval
    )
    with pytest.raises(ValueError):
        layout.stage_dir("train")


def _cfg(root: Path, target, *overrides):
    root.mkdir(parents=True, exist_ok=True)
    data = root / "chat.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Say {i} twice."}, ANSWER]} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        None,
        [
            f"run_dir={root / 'run'}",
            f"model.target={target}",
            f"data.sources=[{{path: {data}}}]",
            "generate.max_new_tokens=6",
            "generate.chunk_size=2",
            *overrides,
        ],
    )


def test_stages_complete_resumable_and_stale(tmp_path, tiny_target_dir, monkeypatch):
    cfg = _cfg(tmp_path, tiny_target_dir)
    assert stage_completion(cfg, "prepare").status is Status.ABSENT
    run_prepare(cfg)
    assert stage_completion(cfg, "prepare").complete
    changed = stage_completion(_cfg(tmp_path, tiny_target_dir, "data.max_length=512"), "prepare")
    assert changed.status is Status.STALE and changed.differences == ("data.max_length: 2048 -> 512",)

    # generate, interrupted after its first chunk: resumable with these settings, stale with others
    real_write = gen_stage.write_chunk

    def dying_write(chunks_dir, k, *args):
        if k == 1:
            raise KeyboardInterrupt("killed")
        return real_write(chunks_dir, k, *args)

    monkeypatch.setattr(gen_stage, "write_chunk", dying_write)
    with pytest.raises(KeyboardInterrupt):
        gen_stage.run_generate(cfg)
    assert stage_completion(cfg, "generate").status is Status.RESUMABLE
    hotter = stage_completion(_cfg(tmp_path, tiny_target_dir, "generate.temperature=0.7"), "generate")
    assert hotter.status is Status.STALE and hotter.differences == ("generate.temperature: 0.0 -> 0.7",)
    monkeypatch.setattr(gen_stage, "write_chunk", real_write)
    gen_stage.run_generate(cfg)
    assert stage_completion(cfg, "generate").complete
    recorded = json.loads((RunLayout.of(cfg).generated / "manifest.json").read_text())
    assert recorded["status"] == "complete" and recorded["inputs"] == stage_inputs(cfg, "generate")

    # its input changes: prepare made again from other data makes the generated records stale
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"id": "z", "messages": [{"role": "user", "content": "Hi"}, ANSWER]})
    )
    run_prepare(cfg)
    stale = stage_completion(cfg, "generate")
    assert stale.status is Status.STALE and [d.split(":")[0] for d in stale.differences] == ["prepared"]
    with pytest.raises(StageError, match="other settings or other inputs"):
        gen_stage.run_generate(cfg)
