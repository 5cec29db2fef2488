"""The drafter families, registered in one place: `FAMILIES` maps each name to its `Family` (base.py says what
one holds). The built-in families register themselves below; another family is one module that calls
`register(Family(...))` before the config is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith.pipeline.families.base import Family, FamilySettings

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (a name registered twice is refused: two modules would claim one train/<name>/ directory)."""
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"a drafter family named {family.name!r} is already registered")
    if not issubclass(family.settings, FamilySettings):
        raise TypeError(f"{family.name}: settings must subclass FamilySettings, got {family.settings!r}")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    FAMILIES.pop(name, None)


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown drafter family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def load_drafter(directory: str | Path) -> Any:
    """Load any registered family's drafter from a draftsmith checkpoint directory (its config.json names it)."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    return get_family(raw.get("drafter")).model_class.from_pretrained(directory)


def import_drafter(directory: str | Path, embed_weight: torch.Tensor | None = None) -> Any:
    """Load an exported directory (any family's engine layout, or a draftsmith checkpoint) as our drafter class.
    The engine layouts carry no embedding: pass the target's (`embed_weight`). ValueError when no family
    recognizes it."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    if "drafter" in raw:
        return load_drafter(directory)
    for family in FAMILIES.values():
        model = family.import_export(directory, raw, embed_weight)
        if model is not None:
            return model
    raise ValueError(
        f"{directory}: no drafter family reads this layout (architectures {raw.get('architectures')}, "
        f"speculators_model_type {raw.get('speculators_model_type')}); known families: {', '.join(sorted(FAMILIES))}"
    )


# the built-in families register themselves on import (last: they import this module's names)
from draftsmith.pipeline.families import dspark, eagle3  # noqa: E402,F401
