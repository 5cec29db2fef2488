"""Shard writer and store reader units: packing, write errors surface, truncated shards are refused."""

import json

import pytest
import torch

from draftsmith.data.artifacts import ArtifactError, write_manifest
from draftsmith.data.feature_store import FeatureStore, ShardWriter, is_done, pack_shard, shard_name


def _samples(lengths, H=4):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux": torch.randn(n, 3 * H, generator=g),
            "final": torch.randn(n, H, generator=g),
        }
        for n in lengths
    ]


def _store(tmp_path, lengths=(3, 5, 2)):
    samples = _samples(lengths)
    w = ShardWriter(tmp_path)
    meta = [{"id": f"s{i}", "domain": "d", "split": "train"} for i in range(len(lengths))]
    w.submit(0, pack_shard(samples), meta, {"shard": 0, "samples": len(lengths), "tokens": sum(lengths)})
    w.close()
    entry = json.loads((tmp_path / shard_name(0)).with_suffix(".json").read_text())
    write_manifest(
        tmp_path,
        "features",
        target={"name": "t"},
        aux_layer_ids=[1, 2, 3],
        hidden_size=4,
        dtype="float32",
        shards=[entry],
    )
    return samples


def test_pack_and_read_back(tmp_path):
    samples = _store(tmp_path)
    assert is_done(tmp_path, 0) and not is_done(tmp_path, 1)
    store = FeatureStore(tmp_path)
    assert store.lengths == [3, 5, 2] and len(store) == 3
    for i, s in enumerate(samples):
        got = store[i]
        assert got["id"] == f"s{i}" and torch.equal(got["aux"], s["aux"]) and torch.equal(got["final"], s["final"])
    batch = store.load_batch([2, 1])
    assert batch["aux"].shape == (2, 5, 12) and batch["attention_mask"].sum().item() == 7
    assert torch.equal(batch["aux"][0, 2:], torch.zeros(3, 12))  # padding is zeros


def test_write_errors_surface(tmp_path):
    w = ShardWriter(tmp_path / "store")
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("not a directory")
    w.submit(0, pack_shard(_samples([2])), [{"id": "a"}], {})
    with pytest.raises(RuntimeError, match="shard writer failed"):
        w.close()


def test_truncated_shard_is_refused(tmp_path):
    _store(tmp_path)
    path = tmp_path / shard_name(0)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ArtifactError, match="size its manifest lists"):
        FeatureStore(tmp_path)
