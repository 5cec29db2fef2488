"""`draftsmith prepare` on the tiny target: shards, manifest, masks, splits, truncation/skip counting, errors."""

import json

import pytest

from draftsmith.data.artifacts import ArtifactError, read_records
from draftsmith.pipeline.cli import main
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.prepare import run_prepare

CONVS = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "user", "content": f"Question {i}: what is the sum of {i} and {i + 1}?"},
            {"role": "assistant", "content": f"The sum is {2 * i + 1}."},
            {"role": "user", "content": "Explain why."},
            {"role": "assistant", "content": "Because adding one more gives the next number."},
        ],
    }
    for i in range(30)
] + [{"id": "p0", "prompt": "Plan a travel day."}]


def _data(tmp_path, records=CONVS):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cfg(tmp_path, target, *overrides):
    return load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.target={target}",
            f"data.sources=[{{path: {_data(tmp_path)}}}]",
            *overrides,
        ],
    )


def test_prepare_writes_complete_artifact(tmp_path, tiny_target_dir, tiny_tok):
    out = run_prepare(_cfg(tmp_path, tiny_target_dir, "data.shard_size=8", "data.holdout_fraction=0.2"))
    manifest, rows = read_records(out, "prepared")
    assert manifest["records"] == 31 and len(rows) == 31
    assert manifest["target"]["kind"] == "dir" and len(manifest["target"]["sha256"]) == 64
    assert manifest["counts"]["chat"]["prompt_only"] == 1 and manifest["counts"]["chat"]["tokenized"] == 30
    assert len(manifest["shards"]) >= 4  # 8 records per shard
    assert manifest["splits"]["train"] + manifest["splits"]["holdout"] == 31 and manifest["splits"]["holdout"] > 0
    assert sum(s["supervised_tokens"] for s in manifest["shards"]) == manifest["supervised_tokens"]
    by_id = {r["id"]: r for r in rows}
    r = by_id["chat:c3"]
    masked = tiny_tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m])
    assert masked == "The sum is 7.<|im_end|>Because adding one more gives the next number.<|im_end|>"
    assert by_id["chat:p0"]["num_tokens"] == 0 and by_id["chat:p0"]["messages"][-1]["content"] is None


def test_holdout_split_is_stable_and_order_independent(tmp_path, tiny_target_dir):
    a = read_records(run_prepare(_cfg(tmp_path / "a", tiny_target_dir, "data.holdout_fraction=0.3")), "prepared")[1]
    path = _data(tmp_path / "b", list(reversed(CONVS)))
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'b' / 'run'}",
            f"model.target={tiny_target_dir}",
            f"data.sources=[{{path: {path}}}]",
            "data.holdout_fraction=0.3",
        ],
    )
    b = read_records(run_prepare(cfg), "prepared")[1]
    assert {r["id"]: r["split"] for r in a} == {r["id"]: r["split"] for r in b}
    assert 0 < sum(r["split"] == "holdout" for r in a) < len(a)


def test_overlong_truncate_and_skip_are_counted(tmp_path, tiny_target_dir, tiny_tok):
    full = read_records(run_prepare(_cfg(tmp_path / "full", tiny_target_dir)), "prepared")[1]
    lengths = sorted(r["num_tokens"] for r in full if r["num_tokens"])
    limit = lengths[0]  # every conversation longer than the shortest one is over the limit
    n_long = sum(n > limit for n in lengths)
    assert 0 < n_long < len(lengths)

    out = run_prepare(_cfg(tmp_path / "t", tiny_target_dir, f"data.max_length={limit}"))
    manifest, rows = read_records(out, "prepared")
    assert manifest["counts"]["chat"]["truncated"] == n_long
    assert all(r["num_tokens"] <= limit for r in rows)
    assert sum(r["truncated"] for r in rows) == n_long

    out = run_prepare(_cfg(tmp_path / "s", tiny_target_dir, f"data.max_length={limit}", "data.overlong=skip"))
    manifest, rows = read_records(out, "prepared")
    assert manifest["counts"]["chat"]["overlong_skipped"] == n_long
    assert len(rows) == 31 - n_long

    # so short that no assistant token survives truncation: counted, not kept
    out = run_prepare(_cfg(tmp_path / "z", tiny_target_dir, "data.max_length=16"))
    manifest, _ = read_records(out, "prepared")
    assert manifest["counts"]["chat"]["no_supervised_tokens"] == 30


def test_dataset_that_yields_nothing_is_an_error(tmp_path, tiny_target_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no schema"}\n{oops\n')
    cfg = load_config(
        None, [f"run_dir={tmp_path / 'run'}", f"model.target={tiny_target_dir}", f"data.sources=[{{path: {path}}}]"]
    )
    with pytest.raises(StageError, match="no usable record"):
        run_prepare(cfg)
    assert not (tmp_path / "run" / "prepared" / "manifest.json").exists()
    with pytest.raises(StageError, match="data.sources is empty"):
        run_prepare(load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.target={tiny_target_dir}"]))


def test_corrupted_shard_is_refused(tmp_path, tiny_target_dir):
    out = run_prepare(_cfg(tmp_path, tiny_target_dir))
    shard = out / json.loads((out / "manifest.json").read_text())["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="checksum"):
        read_records(out, "prepared")


def test_cli_prepare_and_errors(tmp_path, tiny_target_dir, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{target: {tiny_target_dir}}}\ndata: {{sources: [{{path: {_data(tmp_path)}}}]}}\n")
    assert main(["prepare", str(recipe), f"run_dir={tmp_path / 'run'}"]) == 0
    assert (tmp_path / "run" / "prepared" / "manifest.json").is_file()
    assert "target" in (tmp_path / "run" / "config.yaml").read_text()  # resolved config saved in the run dir
    assert main(["prepare", str(recipe), "data.max_lenght=5"]) == 2
    assert "data.max_lenght" in capsys.readouterr().err


def test_undecodable_input_is_reported_not_a_traceback(tmp_path, tiny_target_dir, capsys):
    """A Latin-1 file (every line undecodable as UTF-8) through the CLI: a counted skip per record, then the
    'no usable record' error with the counts, exit status 1, and no partial artifact."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": f"caf\u00e9 {i}"}, ensure_ascii=False) + "\n" for i in range(3)
        ).encode("latin-1")
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{target: {tiny_target_dir}}}\ndata: {{sources: [{{path: {path}}}]}}\n")
    assert main(["prepare", str(recipe), f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "no usable record" in err and "'not_utf8':" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "prepared" / "manifest.json").exists()
