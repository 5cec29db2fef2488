"""Closing the process groups at the end of a multi-process run (`pipeline.dist.close_process_group`)."""

import torch
import torch.distributed as dist

from draftsmith.pipeline import dist as ds_dist


def test_closing_waits_on_every_group_in_the_order_they_were_made(tmp_path, monkeypatch):
    """A gloo barrier waits only for its own group's earlier work, and DeepSpeed (ZeRO-3 prefetches) and tensor
    parallelism issue theirs on groups of their own: work still held by a gloo thread when the interpreter
    finalizes aborts the rank ("terminate called without an active exception"). So each group gets its barrier
    before all are destroyed, in creation order (the order every rank made them in). One real gloo rank here; the
    2-rank runs of tests/pipeline/test_target_sharding.py and test_train.py close the same way."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        sub = dist.new_group([0])
        pending = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
        waited = []
        real_barrier = dist.barrier

        def barrier(group=None, **kwargs):
            waited.append(group)
            return real_barrier(group=group, **kwargs)

        monkeypatch.setattr(dist, "barrier", barrier)
        ds_dist.close_process_group()
        assert waited == [world, sub]
        assert pending.is_completed()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_closing_leaves_groups_of_other_backends_alone(tmp_path, monkeypatch):
    """An NCCL group is made at its first collective: a barrier would build communicators for groups that DeepSpeed
    made and never used. Only the default group and gloo groups get one (the sub-group here stands for NCCL)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        sub = dist.new_group([0])
        real_backend = dist.get_backend
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is sub else real_backend(group))
        waited = []
        real_barrier = dist.barrier
        monkeypatch.setattr(
            dist, "barrier", lambda group=None, **k: (waited.append(group), real_barrier(group=group))[1]
        )
        ds_dist.close_process_group()
        assert waited == [world]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_closing_after_an_error_skips_the_barriers(tmp_path, monkeypatch):
    """After an error the other ranks may never reach a barrier: the groups are destroyed without one."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a barrier ran")))
        ds_dist.close_process_group(succeeded=False)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
