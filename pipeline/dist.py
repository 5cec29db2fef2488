"""The process's place in a multi-process run (accelerate launch / torchrun), or a single process."""

from __future__ import annotations

import torch
from accelerate import PartialState


def dist_state() -> PartialState:
    """accelerate's shared state. Without CUDA, `cpu=True` is what makes accelerate join the gloo process
    group that torchrun/accelerate set up (otherwise every CPU rank believes it is alone)."""
    return PartialState(cpu=not torch.cuda.is_available())
