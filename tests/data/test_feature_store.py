"""Shard writer and store reader units: packing, write errors surface, truncated shards are refused; the batch loader
gives the serial batches in order (a batch ahead on a thread), surfaces load errors and stops cleanly."""

import json
import threading
import time

import pytest
import torch

from draftsmith.data.artifacts import ArtifactError, write_manifest
from draftsmith.data.feature_store import BatchLoader, FeatureStore, ShardWriter, is_done, pack_shard, shard_name


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


# ------------------------------------------------------------------------------------- the batch loader


def _batches_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].cpu(), b[k].cpu()) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def _plans(store, epochs=2):
    from draftsmith.data.features import plan_batches

    return [plan_batches(store, 12, "train", seed=3, epoch=e) for e in range(epochs)]


def test_the_loader_gives_the_serial_batches_in_order(tmp_path, test_device):
    """A batch ahead on a thread (and, on CUDA, copied to the device from pinned memory) or serial: the same batches
    in the same order, every epoch, and from the middle of an epoch as a resumed run starts."""
    _store(tmp_path, lengths=(3, 5, 2, 4, 4, 1, 6, 2, 3, 5, 2, 4))
    store = FeatureStore(tmp_path)
    for plan in _plans(store):
        assert len(plan) >= 5
        for start in (0, 3):  # 3: resumed mid-epoch
            serial = [store.load_batch(indices) for indices in plan[start:]]
            with BatchLoader(store.load_batch, plan[start:], test_device) as loader:
                ahead = list(loader)
            assert len(ahead) == len(serial)
            assert all(_batches_equal(a, s) for a, s in zip(ahead, serial))
            if test_device.type == "cuda":  # handed over on the device
                assert all(t.device.type == "cuda" for b in ahead for t in b.values() if torch.is_tensor(t))
            with BatchLoader(store.load_batch, plan[start:], test_device, background=False) as loader:
                assert all(_batches_equal(a, s) for a, s in zip(loader, serial))


def test_a_load_error_surfaces_in_the_caller_with_its_traceback(tmp_path):
    _store(tmp_path)
    store = FeatureStore(tmp_path)

    def load(indices):
        if indices == [2]:
            raise ValueError("shard 7 is unreadable")
        return store.load_batch(indices)

    loader = BatchLoader(load, [[0], [1], [2], [0]], torch.device("cpu"))
    got = []
    with pytest.raises(ValueError, match="shard 7 is unreadable") as err:
        with loader:
            for batch in loader:
                got.append(batch["ids"])
    assert got == [["s0"], ["s1"]]  # the batches before it, in order
    assert any(entry.name == "load" for entry in err.traceback)  # raised where it happened, in the thread
    assert not loader._thread.is_alive()


@pytest.mark.parametrize("how", ["break", "raise"])
def test_the_thread_stops_when_the_caller_stops_early(tmp_path, how):
    """Leaving the loop (the last optimizer step) or an exception in the step (e.g. KeyboardInterrupt) stops the
    thread, though it is blocked handing over the next batch: nothing hangs (the caller runs on a thread of its own
    here, so that a hang fails the test instead of stalling it)."""
    _store(tmp_path)
    store = FeatureStore(tmp_path)
    loader = BatchLoader(store.load_batch, [[i % 3] for i in range(50)], torch.device("cpu"))
    raised: list[BaseException] = []

    def step() -> None:
        try:
            with loader:
                for _ in loader:
                    time.sleep(0.2)  # the thread fills its queue meanwhile and waits to hand over the next batch
                    if how == "raise":
                        raise KeyboardInterrupt
                    break
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=step, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "closing the loader hung"
    assert [type(e) for e in raised] == ([KeyboardInterrupt] if how == "raise" else [])
    assert not loader._thread.is_alive()
