"""Closing the process groups at the end of a multi-process run (`pipeline.dist.close_process_group`), on one real
gloo rank; the 2-rank runs of tests/pipeline/test_target_sharding.py and test_train.py close the same way."""

import pytest
import torch
import torch.distributed as dist

from draftsmith.pipeline import dist as ds_dist


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank, destroyed afterwards if the code under test did not."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def record_barriers(monkeypatch) -> list:
    """The groups `dist.barrier` is called on, in order (each barrier still runs)."""
    waited: list = []
    real_barrier = dist.barrier

    def barrier(group=None, **kwargs):
        waited.append(group)
        return real_barrier(group=group, **kwargs)

    monkeypatch.setattr(dist, "barrier", barrier)
    return waited


def test_closing_waits_on_every_group_in_the_order_they_were_made(one_rank, monkeypatch):
    """A gloo barrier waits only for its own group's earlier work, and DeepSpeed (ZeRO-3 prefetches) and tensor
    parallelism issue theirs on groups of their own: work still held by a gloo thread when the interpreter
    finalizes aborts the rank ("terminate called without an active exception"). So each group gets its barrier
    before all are destroyed, in creation order (the order every rank made them in)."""
    sub = dist.new_group([0])
    pending = dist.all_reduce(torch.ones(4), group=sub, async_op=True)
    waited = record_barriers(monkeypatch)
    ds_dist.close_process_group()
    assert waited == [one_rank, sub]
    assert pending.is_completed()
    assert not dist.is_initialized()


def test_closing_leaves_groups_of_other_backends_alone(one_rank, monkeypatch):
    """An NCCL group is made at its first collective: a barrier would build communicators for groups that DeepSpeed
    made and never used. Only the default group and gloo groups get one (the sub-group here stands for NCCL)."""
    sub = dist.new_group([0])
    real_backend = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is sub else real_backend(group))
    waited = record_barriers(monkeypatch)
    ds_dist.close_process_group()
    assert waited == [one_rank]


def test_closing_after_an_error_skips_the_barriers(one_rank, monkeypatch):
    """After an error the other ranks may never reach a barrier: the groups are destroyed without one."""
    waited = record_barriers(monkeypatch)
    ds_dist.close_process_group(succeeded=False)
    assert waited == []
    assert not dist.is_initialized()
