"""`draftsmith collect` on the tiny target: store round trip, resume after a crash mid-shard, 2 ranks == 1
rank, mismatch refusals, online == offline, and --verify catching a corrupted store."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import draftsmith.pipeline.collect as collect_stage
from draftsmith.data.artifacts import ArtifactError, read_records
from draftsmith.data.feature_store import FeatureStore
from draftsmith.data.features import FeatureCapture, OnlineFeatureSource, iterate_batches
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.prepare import run_prepare
from draftsmith.pipeline.target import load_target

DOMAINS = ["math", "code", "chat"]


def _records(n=14):
    out = []
    for i in range(n):
        turns = [
            {"role": "user", "content": f"Question {i}: what is {i} plus " + "one " * (i % 5) + "?"},
            {"role": "assistant", "content": f"The answer is {i + 1}." + " Because math." * (i % 4)},
        ]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Counting."}]
        out.append({"id": f"q{i}", "messages": turns, "topic": DOMAINS[i % 3]})
    return out


def _cfg(root, target, *overrides):
    root.mkdir(parents=True, exist_ok=True)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return load_config(
        None,
        [
            f"run_dir={root / 'run'}",
            f"model.target={target}",
            f"data.sources=[{{path: {data}, domain_field: topic}}]",
            "data.holdout_fraction=0.25",
            "collect.aux_layer_ids=[0,1,2]",
            "collect.shard_tokens=200",
            "collect.batch_tokens=128",
            *overrides,
        ],
    )


def _shard_hashes(out):
    return {s["file"]: s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]}


def test_store_round_trip(tmp_path, tiny_target_dir, tiny_tok):
    cfg = _cfg(tmp_path, tiny_target_dir, "collect.dtype=float32", "collect.batch_tokens=1")
    _, records = read_records(run_prepare(cfg), "prepared")
    out = collect_stage.run_collect(cfg)
    store = FeatureStore(out)
    m = store.manifest
    assert m["aux_layer_ids"] == [0, 1, 2] and m["hidden_size"] == 64 and m["num_layers"] == 2
    assert m["counts"]["samples"] == len(records) == len(store) and len(m["shards"]) > 2
    assert m["bytes_per_token"] == 4 * 64 * 4 + 5
    assert m["counts"]["tokens"] == sum(r["num_tokens"] for r in records)
    target = load_target(cfg.model)
    capture = FeatureCapture(target.model, [0, 1, 2])
    by_id = {r["id"]: r for r in records}
    for i in range(len(store)):
        s = store[i]
        r = by_id[s["id"]]
        assert s["input_ids"].tolist() == r["input_ids"] and s["loss_mask"].tolist() == r["loss_mask"]
        assert (s["domain"], s["split"]) == (r["domain"], r["split"])
        aux, final = capture(torch.tensor([r["input_ids"]]))
        assert torch.equal(s["aux"], aux[0]) and torch.equal(s["final"], final[0])  # fp32, same shapes: bit-exact
    assert {s["domain"] for s in store.meta} == set(DOMAINS)
    assert {s["split"] for s in store.meta} == {"train", "holdout"}


def test_bf16_store_and_verify_catches_corruption(tmp_path, tiny_target_dir):
    cfg = _cfg(tmp_path, tiny_target_dir)
    run_prepare(cfg)
    out = collect_stage.run_collect(cfg, verify=5)  # passes on an intact store
    store = FeatureStore(out)
    assert store[0]["aux"].dtype == torch.bfloat16 and store.manifest["bytes_per_token"] == 4 * 64 * 2 + 5
    shard = out / store.manifest["shards"][0]["file"]
    tensors = load_file(shard)
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors["final"][3] += 0.5  # a silently corrupted token, same file size
    save_file(tensors, str(shard), metadata=meta)
    with pytest.raises(StageError, match="verify failed: final"):
        collect_stage.run_collect(cfg, verify=len(store))


def test_resume_after_crash_mid_shard(tmp_path, tiny_target_dir, monkeypatch):
    ref = _cfg(tmp_path / "ref", tiny_target_dir)
    run_prepare(ref)
    reference = _shard_hashes(collect_stage.run_collect(ref))

    cfg = _cfg(tmp_path / "crash", tiny_target_dir)
    run_prepare(cfg)
    real_call, calls = FeatureCapture.__call__, []

    def crashing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt("crash")
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(FeatureCapture, "__call__", crashing)
    with pytest.raises(KeyboardInterrupt):
        collect_stage.run_collect(cfg)
    out = cfg.run_path / "features"
    done = sorted(p.name for p in out.glob("shard-*.json"))
    assert 0 < len(done) < len(reference)  # some shards finished, the one being computed did not
    assert not (out / "manifest.json").exists()
    assert len(list(out.glob("shard-*.safetensors"))) == len(done)  # no partial shard left looking complete

    monkeypatch.setattr(FeatureCapture, "__call__", real_call)
    assert _shard_hashes(collect_stage.run_collect(cfg)) == reference


def test_mismatches_are_refused(tmp_path, tiny_target_dir):
    from tests.tiny import save_tiny_target

    cfg = _cfg(tmp_path, tiny_target_dir)
    run_prepare(cfg)
    out = collect_stage.run_collect(cfg)
    ident = load_target(cfg.model, with_model=False).identity
    FeatureStore(out, target=ident, aux_ids=[0, 1, 2], hidden_size=64)  # the matching expectations pass
    with pytest.raises(ArtifactError, match=r"aux layers \[0, 1, 2\] but this run uses \[1, 2\]"):
        FeatureStore(out, aux_ids=[1, 2])
    with pytest.raises(ArtifactError, match="hidden size 64 but this run's target has 576"):
        FeatureStore(out, hidden_size=576)
    other = load_config(None, [f"model.target={save_tiny_target(tmp_path / 'other', seed=5)}"])
    with pytest.raises(ArtifactError, match="another target"):
        FeatureStore(out, target=load_target(other.model, with_model=False).identity)
    with pytest.raises(StageError, match=r"aux_layer_ids: \[0, 1, 2\] -> \[1, 2\]"):
        collect_stage.run_collect(_cfg(tmp_path, tiny_target_dir, "collect.aux_layer_ids=[1,2]"))
    with pytest.raises(StageError, match="run `draftsmith prepare`"):
        collect_stage.run_collect(_cfg(tmp_path / "empty", tiny_target_dir))


def test_online_source_equals_offline_store(tmp_path, tiny_target_dir):
    # Same forward shapes (one sample per forward) on both sides: bit-identical tensors.
    cfg = _cfg(tmp_path, tiny_target_dir, "collect.dtype=float32", "collect.batch_tokens=1")
    _, records = read_records(run_prepare(cfg), "prepared")
    store = FeatureStore(collect_stage.run_collect(cfg))
    online = OnlineFeatureSource(load_target(cfg.model).model, records, [0, 1, 2])
    # the store keeps input order, so the two sources line up sample by sample
    assert [m["id"] for m in online.meta] == [m["id"] for m in store.meta] and online.lengths == store.lengths
    for split in ("train", "holdout"):
        a = list(iterate_batches(store, batch_tokens=1, split=split, seed=3, epoch=1))
        b = list(iterate_batches(online, batch_tokens=1, split=split, seed=3, epoch=1))
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x["ids"] == y["ids"] and x["domains"] == y["domains"]
            for key in ("input_ids", "loss_mask", "attention_mask", "aux", "final"):
                assert torch.equal(x[key].cpu(), y[key].cpu()), key
    # Multi-sample padded batches: same samples and masks; features equal up to float summation order. How far
    # fp32 sums in another order drift depends on the CPU's kernels (9.8e-5 seen with AVX2 kernels), so this part
    # computes in float64, where the order costs ~1e-15, and the store's float32 copy must be the rounding of
    # the online float64 features: within one float32 ulp (2^-23 relative; rounding itself costs at most half).
    cfg64 = _cfg(
        tmp_path / "f64", tiny_target_dir, "model.dtype=float64", "collect.dtype=float32", "collect.batch_tokens=256"
    )
    run_prepare(cfg64)
    store = FeatureStore(collect_stage.run_collect(cfg64))
    online = OnlineFeatureSource(load_target(cfg64.model).model, records, [0, 1, 2])
    a = list(iterate_batches(store, batch_tokens=256, seed=0, epoch=0))
    b = list(iterate_batches(online, batch_tokens=256, seed=0, epoch=0))
    assert [x["ids"] for x in a] == [y["ids"] for y in b] and any(len(x["ids"]) > 1 for x in a)
    for x, y in zip(a, b):
        assert torch.equal(x["loss_mask"], y["loss_mask"]) and torch.equal(x["input_ids"], y["input_ids"])
        assert x["aux"].dtype == torch.float32 and y["aux"].dtype == torch.float64
        for key in ("aux", "final"):
            torch.testing.assert_close(x[key].double(), y[key], rtol=2.0**-23, atol=1e-30)


def test_two_ranks_collect_the_same_store_as_one(tmp_path, tiny_target_dir):
    cfg = _cfg(tmp_path, tiny_target_dir)
    run_prepare(cfg)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(cfg.dump()))  # JSON is YAML
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "draftsmith", "collect", str(recipe)]

    def run(prefix, run_dir):
        import shutil

        shutil.copytree(cfg.run_path / "prepared", run_dir / "prepared")
        proc = subprocess.run(
            prefix + base[1:] + [f"run_dir={run_dir}"], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run([sys.executable], tmp_path / "one")
    proc = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], tmp_path / "two"
    )
    assert "2 rank(s)" in proc.stderr
    one, two = _shard_hashes(tmp_path / "one" / "features"), _shard_hashes(tmp_path / "two" / "features")
    assert len(one) > 2 and one == two
