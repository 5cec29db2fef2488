"""A run's artifacts read back as a later stage's inputs: the conversation records to collect or train from,
and the trained drafter that eval and export use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.data.artifacts import ArtifactError, check_same_target, read_manifest, read_records
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import MANIFEST, RunLayout

RECORD_KINDS = {"generated": ["generated"], "prepared": ["prepared"], "auto": ["generated", "prepared"]}
"""collect.source -> the records artifacts it reads, in order of preference."""


def records_source(cfg: RunConfig) -> tuple[str, Path] | None:
    """(kind, directory) of the complete records artifact this run collects (or trains online) from, or None."""
    layout = RunLayout.of(cfg)
    for kind in RECORD_KINDS[cfg.collect.source]:
        directory = layout.records(kind)
        if (directory / MANIFEST).is_file():
            return kind, directory
    return None


def input_records(cfg: RunConfig, identity: dict[str, Any]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """(kind, manifest, records with supervised tokens) of the records this run collects from."""
    found = records_source(cfg)
    if found is None:
        kinds = RECORD_KINDS[cfg.collect.source]
        raise StageError(
            f"no {' or '.join(kinds)} records in {cfg.run_path}; run `draftsmith prepare` / `draftsmith generate` first"
        )
    kind, directory = found
    manifest, rows = read_records(directory, kind)
    check_same_target(manifest, identity, directory)
    rows = [r for r in rows if r["num_supervised"] > 0]
    if not rows:
        raise StageError(
            f"{directory} has no record with assistant tokens (prompt-only data needs `draftsmith generate`)"
        )
    return kind, manifest, rows


def trained_drafter(
    cfg: RunConfig, identity: dict[str, Any], explicit: str | None = None, family: str | None = None
) -> Path:
    """The drafter directory later stages use (an explicit one, else RUN_DIR/train/<family>/best, else final),
    refused when its training manifest says it was trained for another target."""
    if explicit:
        path = Path(explicit)
    else:
        dirs = RunLayout.of(cfg).train(family or cfg.train.drafters[0])
        path = dirs.best if (dirs.best / "config.json").is_file() else dirs.final
    if not (path / "config.json").is_file():
        raise StageError(f"no trained drafter at {path}; run `draftsmith train` or pass --drafter DIR")
    if (path.parent / MANIFEST).is_file():
        try:
            check_same_target(read_manifest(path.parent, "drafter"), identity, path)
        except ArtifactError as exc:
            raise StageError(str(exc)) from None
    return path
