"""The process's place in a multi-process run (accelerate launch / torchrun), or a single process."""

from __future__ import annotations

import functools
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
    """Under torchrun / accelerate launch, tear the process group down while the interpreter is fully alive, all
    ranks together (the PyTorch docs ask for it). A rank that destroyed its gloo group and exited while a peer was
    still working was seen to abort ("terminate called without an active exception") after its work was done,
    which a SLURM job reports as a failure. After an error the barrier is skipped: the other ranks may never
    reach it."""
    if dist.is_available() and dist.is_initialized():
        if succeeded:
            dist.barrier()
        dist.destroy_process_group()


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
