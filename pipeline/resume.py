"""Resumable artifacts: a plan.json records everything that decides an artifact's contents, so a
re-run continues only when it would produce the same thing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from draftsmith.data.artifacts import atomic_write_text

log = logging.getLogger(__name__)


class PlanMismatch(RuntimeError):
    """An artifact directory holds work made with other settings."""


def plan_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += plan_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def start_or_resume(out: Path, plan: dict[str, Any], state, stage: str) -> bool:
    """Record `plan` in `out` (or check it against the recorded one). Returns True when the artifact is
    already complete. Raises PlanMismatch, naming what differs, when `out` was made with other settings."""
    plan = json.loads(json.dumps(plan))  # normalize tuples etc. to what JSON gives back
    path = out / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != plan:
            raise PlanMismatch(
                f"{out} holds a {stage} made with other settings ({'; '.join(plan_diff(old, plan))}); "
                f"use another run_dir or delete {out}"
            )
        if (out / "manifest.json").is_file():
            log.info("%s: %s is already complete", stage, out)
            return True
    state.wait_for_everyone()  # every rank has read the old plan before the main process writes
    if state.is_main_process and not path.is_file():
        atomic_write_text(path, json.dumps(plan, indent=2) + "\n")
    return False
