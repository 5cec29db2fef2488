"""The process's place in a multi-process run (accelerate launch / torchrun), or a single process."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState


def dist_state() -> PartialState:
    """accelerate's shared state. Without CUDA, `cpu=True` is what makes accelerate join the gloo process
    group that torchrun/accelerate set up (otherwise every CPU rank believes it is alone)."""
    return PartialState(cpu=not torch.cuda.is_available())


def close_process_group(succeeded: bool = True) -> None:
    """Under torchrun / accelerate launch, tear the process groups down while the interpreter is fully alive, all
    ranks together (the PyTorch docs ask for it). After an error the barriers are skipped: the other ranks may
    never reach them.

    A rank whose gloo worker threads still hold a collective's work when the interpreter finalizes aborts with
    "terminate called without an active exception" after its work is done (a SLURM job reports a failure; the
    sharded-target test saw it once in eight suite runs). A barrier on a gloo group waits for that group's earlier
    work, but on that group only, and DeepSpeed and transformers' tensor parallelism issue theirs on groups of
    their own (ZeRO-3 prefetches parameters asynchronously). So, first, objects that are no longer reachable but
    hold work or groups (an engine in a reference cycle) are collected; then the default group and every gloo group
    this rank belongs to get a barrier, in the order the groups were made: all ranks made them in that order, so no
    two ranks wait on each other's next group; then all are destroyed. NCCL groups other than the default one get
    none: NCCL makes a group's communicator at its first collective, and DeepSpeed makes groups it may never use."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if succeeded:
        gc.collect()
        world = dist.group.WORLD
        for group in open_groups():
            if group is world or dist.get_backend(group) == "gloo":
                dist.barrier(group=group)
    dist.destroy_process_group()


def open_groups() -> list[dist.ProcessGroup]:
    """The process groups this rank belongs to, in the order they were made (the default group first). torch keeps
    them in a private registry and has no public call that lists them; should a release move it, the default group
    alone is returned (the barrier as it was before) rather than failing at the end of a run."""
    try:
        from torch.distributed.distributed_c10d import _world

        return list(_world.pg_names)
    except (ImportError, AttributeError):
        world = dist.group.WORLD
        return [] if world is None else [world]


def single_writer(stage: Callable[..., Path]) -> Callable[..., Path]:
    """For stages that write one artifact and compute little (prepare, export): under several processes the main
    process runs the stage while the other ranks wait, and every rank returns its result. A failure on the main
    process still releases the others, which then fail pointing at it (rather than waiting out a timeout)."""

    @functools.wraps(stage)
    def run(*args, **kwargs) -> Path:
        state = dist_state()
        if state.num_processes == 1:
            return stage(*args, **kwargs)
        result, error = None, None
        if state.is_main_process:
            try:
                result = stage(*args, **kwargs)
            except Exception as exc:  # re-raised below, after the other ranks are released
                error = exc
        outcome = [(str(result), None if error is None else f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(outcome, src=0)
        if error is not None:
            raise error
        path, failure = outcome[0]
        if failure is not None:
            from draftsmith.pipeline.errors import StageError

            raise StageError(f"{stage.__name__} failed on the main process ({failure})")
        return Path(path)

    return run
