"""Drafter families by name: the architecture class and its training objective. The trainer, checkpoints
and eval only go through this table, so a new family plugs in by adding a row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftsmith.drafters.dspark import DSparkDrafter
from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.objectives import dspark_objective, eagle3_objective


@dataclass(frozen=True)
class DrafterFamily:
    name: str
    model_class: Any
    """Class with `from_target(...)`, `save_pretrained(dir)`, `from_pretrained(dir)`."""
    objective: Callable
    """(model, batch, head_weight, settings, buffers) -> (loss, stats)."""


REGISTRY: dict[str, DrafterFamily] = {
    "eagle3": DrafterFamily("eagle3", Eagle3Drafter, eagle3_objective),
    "dspark": DrafterFamily("dspark", DSparkDrafter, dspark_objective),
}


def get_family(name: str) -> DrafterFamily:
    if name not in REGISTRY:
        raise KeyError(f"unknown drafter {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def load_drafter(directory) -> Any:
    """Load any registered drafter from a checkpoint directory (its config.json names the family)."""
    import json
    from pathlib import Path

    name = json.loads((Path(directory) / "config.json").read_text()).get("drafter")
    return get_family(name).model_class.from_pretrained(directory)
