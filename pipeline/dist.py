"""The process's place in a multi-process run (accelerate launch / torchrun), or a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import PartialState


def dist_state() -> PartialState:
    """accelerate's shared state. Without CUDA, `cpu=True` is what makes accelerate join the gloo process
    group that torchrun/accelerate set up (otherwise every CPU rank believes it is alone)."""
    return PartialState(cpu=not torch.cuda.is_available())


def close_process_group() -> None:
    """Under torchrun / accelerate launch, tear the process group down while the interpreter is fully alive (the
    PyTorch docs ask for it; gloo worker threads left to interpreter finalization can abort the rank after its
    work is done, which a SLURM job would report as a failure)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
