"""The training step never waits on the device: a few optimizer steps of the real Trainer on a tiny target, with
every host read of a tensor counted (issue 20). Logging, evaluation, checkpoints and the work after training read
the device on purpose and are not counted; the step (loading, objective, backward, optimizer) may read at most
twice per optimizer step, whatever the number of micro-batches.

On the CPU nothing is a device sync, so the counter patches the tensor methods that would be one on a GPU (`item`,
`tolist`, `float(t)`, `int(t)`, `bool(t)`, `cpu`, `numpy`, `nonzero`) and counts the calls made outside torch's own
code (AdamW reads its step counters, CPU tensors on every device, with `item`). On CUDA (DRAFTSMITH_TEST_DEVICE=cuda)
it counts what torch's sync debug mode reports instead, which sees every synchronizing operation.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import draftsmith.pipeline.train as train_stage
from draftsmith.pipeline.collect import run_collect
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.prepare import run_prepare
from tests.tiny import save_tiny_target

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "nonzero")
"""Tensor methods that copy device data to the host (a sync on a GPU)."""

TORCH_DIR = str(Path(torch.__file__).parent)
HOST_DATA = {"supervised_from", "record_keys"}
"""Functions that read the batch as loaded, on the host, before it is copied to the device (not a sync on a GPU:
`supervised_from` returns 0 and `record_keys` None for a tensor on a device without reading it, and CUDA's sync
debug mode checks that)."""
STEPS, ACCUMULATION = 3, 3


class HostReads:
    """Counts host reads while `active`; `where` names the calling lines."""

    def __init__(self) -> None:
        self.active = False
        self.where: Counter[str] = Counter()
        self._inside = False  # a patched method calling another (float -> item) is one read

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def record(self, frame) -> None:
        if frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_name in HOST_DATA:
            return  # torch's own bookkeeping (the optimizer's CPU step counters), host data (HOST_DATA)
        self.where[f"{frame.f_code.co_filename}:{frame.f_lineno}"] += 1

    def patch(self, monkeypatch) -> None:
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counted(torch.nonzero))

    def _counted(self, real: Callable) -> Callable:
        def read(*args, **kwargs):
            if not self.active or self._inside:
                return real(*args, **kwargs)
            self.record(sys._getframe(1))
            self._inside = True
            try:
                return real(*args, **kwargs)
            finally:
                self._inside = False

        return read

    @contextmanager
    def paused(self) -> Iterator[None]:
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was


class CudaSyncs(HostReads):
    """The same count from torch's sync debug mode: every synchronizing CUDA operation warns while `active`."""

    def patch(self, monkeypatch) -> None:
        pass  # nothing to patch: `caught` collects the warnings

    def collect(self, caught: list[warnings.WarningMessage]) -> None:
        for w in caught:
            if "synchroniz" in str(w.message):
                self.where[f"{w.filename}:{w.lineno}"] += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        torch.cuda.set_sync_debug_mode(0)
        try:
            with super().paused():
                yield
        finally:
            torch.cuda.set_sync_debug_mode("warn" if self.active else 0)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, write_chats):
    """A tiny target with prepared data and an fp32 feature store; batches of one sequence, so an epoch
    has enough of them for several optimizer steps of ACCUMULATION micro-batches."""
    root = tmp_path_factory.mktemp("syncs-ws")
    target = save_tiny_target(root / "target", seed=0, num_layers=4)
    data = write_chats(root / "chat.jsonl", 16)
    base = [
        f"model.target={target}",
        f"data.sources=[{{path: {data}}}]",
        "data.holdout_fraction=0.25",
        "collect.aux_layer_ids=[1,2,3]",
        "collect.dtype=float32",
        "model.dtype=float32",
        "train.mixed_precision='no'",
        "train.batch_tokens=160",
        "train.draft_vocab_size=384",
        "train.eagle3.ttt_steps=3",
        "train.dspark.block_size=3",
        "train.dspark.num_layers=1",
        "train.dspark.anchors_per_sequence=4",
        "train.dspark.calibrate=false",
        f"train.max_steps={STEPS}",
        f"train.gradient_accumulation={ACCUMULATION}",
        # one log, evaluation and checkpoint, at the last step: the steps before it are the plain ones
        "train.log_every=1000",
        "train.eval_every=1000",
        "train.save_every=1000",
    ]
    cfg = load_config(None, [f"run_dir={root / 'run'}", *base])
    run_prepare(cfg)
    run_collect(cfg)
    return root, base


def _trainer(workspace, tmp_path, family: str) -> train_stage.Trainer:
    import shutil

    root, base = workspace
    shutil.copytree(root / "run", tmp_path / "run", ignore=shutil.ignore_patterns("train"))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", *base, f"train.drafters=[{family}]"])
    return train_stage.Trainer(cfg, family)


def _count_step_reads(trainer: train_stage.Trainer, monkeypatch, cuda: bool) -> HostReads:
    """Train, counting host reads everywhere but in logging, evaluation, checkpoints and the final work."""
    reads = CudaSyncs() if cuda else HostReads()
    reads.patch(monkeypatch)
    for name in ("_log", "_evaluate_and_keep_best", "save_checkpoint", "_finish"):
        real = getattr(trainer, name)

        def paused(*args, real=real, **kwargs):
            with reads.paused():
                return real(*args, **kwargs)

        monkeypatch.setattr(trainer, name, paused)
    reads.active = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            trainer.train()
    finally:
        reads.active = False
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    if isinstance(reads, CudaSyncs):
        reads.collect(caught)
    assert trainer.step == STEPS
    return reads


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_the_training_step_reads_the_device_at_most_twice(workspace, tmp_path, monkeypatch, family, test_device):
    trainer = _trainer(workspace, tmp_path, family)
    reads = _count_step_reads(trainer, monkeypatch, test_device.type == "cuda")
    print(f"{family}: {reads.count} host reads in {STEPS} steps of {ACCUMULATION} micro-batches: {dict(reads.where)}")
    assert reads.count <= 2 * STEPS, (reads.count, dict(reads.where))


def test_the_counter_sees_a_read_per_micro_batch(workspace, tmp_path, monkeypatch, test_device):
    """The check has power: an objective that reads its loss (`float(loss)`, the sync issue 20 removed from the
    trainer) is caught."""
    trainer = _trainer(workspace, tmp_path, "eagle3")
    real = trainer.family.objective

    def reads_its_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        float(loss.detach())
        return loss, stats

    trainer.family = dataclasses.replace(trainer.family, objective=reads_its_loss)
    reads = _count_step_reads(trainer, monkeypatch, test_device.type == "cuda")
    assert reads.count > 2 * STEPS and reads.count >= STEPS * ACCUMULATION, dict(reads.where)


def test_training_batches_say_where_supervision_starts(workspace, tmp_path, monkeypatch):
    """Every micro-batch the training loop hands the objective carries `supervised_from`, read from its loss mask on
    the host by the loader (so EAGLE-3 skips the prompt's vocabulary projections in training, not only in holdout)."""
    from draftsmith.drafters.objectives import supervised_from

    trainer = _trainer(workspace, tmp_path, "eagle3")
    real, seen = trainer.family.objective, []

    def records(model, batch, *args, **kwargs):
        seen.append((batch.get("supervised_from"), supervised_from(batch["loss_mask"].cpu())))
        return real(model, batch, *args, **kwargs)

    trainer.family = dataclasses.replace(trainer.family, objective=records)
    trainer.train()
    assert len(seen) >= STEPS * ACCUMULATION
    assert all(given == want for given, want in seen), seen
    assert any(want > 0 for _, want in seen)  # the chats start with a prompt: there is something to skip
