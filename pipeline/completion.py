"""When is a stage done: one rule for every artifact of a run directory.

A stage's manifest.json (written last, by `data.artifacts.write_manifest`) records `status: complete` and the
stage's `inputs`: the settings that decide the artifact, the target's identity, and the fingerprints of the
artifacts it was made from. A stage that can be interrupted and resumed writes the same `inputs` to progress.json
when it starts. `completion(directory, inputs)` compares what is recorded with what this run would use:

    manifest.json, status complete, the same inputs   COMPLETE    nothing to do
    progress.json with the same inputs                RESUMABLE   interrupted work: continue it (or start over)
    either of them with other inputs                  STALE       made from other settings or other input data
    neither                                           ABSENT      never run here

`stage_inputs(cfg, stage)` is the one place that says what each stage's inputs are, and `stage_completion` applies
the rule to a stage of a config's run directory: `draftsmith run` decides with it alone, and the stages that
resume (generate, collect, train) check themselves with it (`start`). What a stage does with a STALE artifact is
the stage's policy (pipeline/run.py): prepare, eval and export make it again, generate, collect and train (hours
of work) refuse, naming what differs.

An input artifact's fingerprint is a digest of the payload checksums its manifest lists (`shards`, or `files`),
so an artifact made again with the same content leaves what was built from it complete.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.data.artifacts import atomic_write_text, sha256_file
from draftsmith.data.features import resolve_aux_ids
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.inputs import records_source
from draftsmith.pipeline.layout import MANIFEST, PROGRESS, RunLayout
from draftsmith.pipeline.target import chat_template_digest, load_config_of, resolve_target

log = logging.getLogger(__name__)


LEGACY_PROGRESS = "plan.json"
"""The progress record of draftsmith before this rule: read as one without inputs (stale), so that an old
unfinished artifact is never continued with settings nobody checked."""


class Status(enum.Enum):
    ABSENT = "absent"
    RESUMABLE = "resumable"
    COMPLETE = "complete"
    STALE = "stale"


@dataclass(frozen=True)
class Completion:
    status: Status
    directory: Path
    differences: tuple[str, ...] = ()
    """For STALE: what differs, `key: recorded -> now`."""

    @property
    def complete(self) -> bool:
        return self.status is Status.COMPLETE

    def refusal(self, stage: str) -> str:
        """The message of a stage that will not overwrite a stale artifact."""
        return (
            f"{self.directory} holds a {stage} made with other settings or other inputs "
            f"({'; '.join(self.differences)}); use another run_dir or delete {self.directory}"
        )


def _normalized(value: Any) -> Any:
    """`value` as JSON gives it back (tuples become lists, keys strings): what a record compares equal to."""
    return json.loads(json.dumps(value))


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """`key.path: old -> new` for every leaf that differs between two JSON-like values."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            found += differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return found
    return [] if old == new else [f"{prefix.rstrip('.') or 'inputs'}: {old!r} -> {new!r}"]


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def completion(directory: Path, inputs: dict[str, Any]) -> Completion:
    """The rule (module docstring): COMPLETE, RESUMABLE, STALE or ABSENT for an artifact made from `inputs`."""
    directory = Path(directory)
    inputs = _normalized(inputs)
    manifest = _read(directory / MANIFEST)
    progress = _read(directory / PROGRESS) or _read(directory / LEGACY_PROGRESS)
    record, status = (manifest, Status.COMPLETE) if manifest is not None else (progress, Status.RESUMABLE)
    if record is None:
        return Completion(Status.ABSENT, directory)
    recorded = record.get("inputs")
    found = differences(recorded, inputs) if isinstance(recorded, dict) else ["recorded without its inputs"]
    if manifest is not None and manifest.get("status") != "complete":
        found.append(f"status: {manifest.get('status')!r}")
    return Completion(Status.STALE, directory, tuple(found)) if found else Completion(status, directory)


# ---------------------------------------------------------------------------------------------- records


def write_progress(directory: Path, inputs: dict[str, Any]) -> None:
    """Mark `directory` as work in progress made from `inputs` (the main process writes it)."""
    record = {"status": "running", "inputs": _normalized(inputs)}
    atomic_write_text(Path(directory) / PROGRESS, json.dumps(record, indent=2) + "\n")


def clear(directory: Path) -> None:
    """Forget the completion records of an artifact about to be made again (its payload is left to the stage)."""
    for name in (MANIFEST, PROGRESS):
        (Path(directory) / name).unlink(missing_ok=True)


def start(directory: Path, inputs: dict[str, Any], state, stage: str) -> Completion:
    """For a stage that resumes its own work (generate, collect): the artifact's completion, a STALE one refused
    (StageError naming what differs); unless COMPLETE, its progress record is written once every rank has read the
    old one."""
    found = completion(directory, inputs)
    if found.status is Status.STALE:
        raise StageError(found.refusal(stage))
    if found.complete:
        log.info("%s: %s is already complete", stage, directory)
        return found
    state.wait_for_everyone()
    if state.is_main_process and found.status is Status.ABSENT:
        write_progress(directory, inputs)
    return found


# ------------------------------------------------------------------------------------------ fingerprints


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def fingerprint(directory: Path) -> str | None:
    """A digest of the payload checksums the manifest of the complete artifact in `directory` lists (`shards`, or
    `files`: entries with a sha256, or bare names hashed now); None when it holds no complete artifact."""
    directory = Path(directory)
    manifest = _read(directory / MANIFEST)
    if manifest is None:
        return None
    entries = []
    for entry in manifest.get("shards") or manifest.get("files") or []:
        if isinstance(entry, str):
            entry = {"file": entry, "sha256": sha256_file(directory / entry)}
        entries.append([entry["file"], entry["sha256"]])
    if not entries:
        return _digest(manifest)
    return _digest(sorted(entries))


def payload_files(directory: Path, subdirs: list[str]) -> list[dict[str, str]]:
    """`files` entries (path relative to `directory`, sha256) of every file in `subdirs` of `directory`: what a
    manifest lists so that `fingerprint` can name the artifact's content."""
    directory = Path(directory)
    return [
        {"file": str(path.relative_to(directory)), "sha256": sha256_file(path)}
        for sub in subdirs
        if (directory / sub).is_dir()
        for path in sorted((directory / sub).rglob("*"))
        if path.is_file()
    ]


def drafter_fingerprint(path: Path) -> str | None:
    """A digest of the files of one drafter directory (an explicit `--drafter DIR`, not a run's artifact)."""
    path = Path(path)
    if not path.is_dir():
        return None
    return _digest([[f["file"], f["sha256"]] for f in payload_files(path.parent, [path.name])])


# ------------------------------------------------------------------------------------------ stage inputs


def _drafters(cfg: RunConfig, layout: RunLayout, explicit: str | None) -> dict[str, str | None]:
    if explicit:
        return {"explicit": drafter_fingerprint(Path(explicit))}
    return {family: fingerprint(layout.train(family).root) for family in cfg.train.drafters}


def _records(cfg: RunConfig, layout: RunLayout) -> dict[str, Any]:
    found = records_source(cfg)
    if found is None:
        return {"kind": None, "fingerprint": None}
    return {"kind": found[0], "fingerprint": fingerprint(found[1])}


def stage_inputs(
    cfg: RunConfig, stage: str, *, identity: dict[str, Any] | None = None, drafter: str | None = None
) -> dict[str, Any]:
    """Everything that decides what `stage` makes in this run directory: what its manifest records, and what
    `completion` compares. `identity`: the target's, when the caller has it already; `drafter`: an explicit
    drafter directory (eval, export)."""
    layout = RunLayout.of(cfg)
    identity = identity if identity is not None else resolve_target(cfg.model).identity()
    if stage == "prepare":
        return {
            "target": identity,
            "model": cfg.model.model_dump(mode="json"),
            "data": cfg.data.model_dump(mode="json", by_alias=True),
        }
    if stage == "generate":
        return {
            "target": identity,
            "chat_template_sha256": chat_template_digest(cfg.model),
            "generate": cfg.generate.model_dump(mode="json"),
            "max_length": cfg.data.max_length,
            "overlong": cfg.data.overlong,
            "holdout_fraction": cfg.data.holdout_fraction,
            "prepared": fingerprint(layout.prepared) if cfg.data.sources else None,
        }
    if stage == "collect":
        target_config = load_config_of(cfg.model)
        return {
            "target": identity,
            "source": _records(cfg, layout),
            "aux_layer_ids": resolve_aux_ids(cfg.collect.aux_layer_ids, target_config.num_hidden_layers),
            "hidden_size": target_config.hidden_size,
            "dtype": cfg.collect.dtype,
            "shard_tokens": cfg.collect.shard_tokens,
        }
    if stage == "train":
        offline = cfg.train.features == "offline"
        return {
            "target": identity,
            # (not the teacher cache's size: a memory knob, the drafter it trains is the same)
            "train": cfg.train.model_dump(mode="json", exclude={"teacher_cache_tokens"}),
            "seed": cfg.seed,
            "aux_layer_ids": cfg.collect.aux_layer_ids,
            "source": {"kind": "features", "fingerprint": fingerprint(layout.features)}
            if offline
            else _records(cfg, layout),
        }
    if stage == "eval":
        trained = "trained" in cfg.eval.drafters
        return {
            "target": identity,
            "eval": cfg.eval.model_dump(mode="json"),
            "drafters": _drafters(cfg, layout, drafter or cfg.eval.drafter_path) if trained else {},
        }
    if stage == "export":
        return {
            "target": identity,
            "export": cfg.export.model_dump(mode="json"),
            "draft_length": cfg.eval.draft_length,
            "drafters": _drafters(cfg, layout, drafter),
            "eval": fingerprint(layout.eval),
        }
    raise ValueError(f"no completion rule for stage {stage!r}")


def stage_completion(
    cfg: RunConfig,
    stage: str,
    *,
    family: str | None = None,
    identity: dict[str, Any] | None = None,
    drafter: str | None = None,
) -> Completion:
    """`completion` of `stage`'s artifact in the config's run directory (train: of one family's)."""
    directory = RunLayout.of(cfg).stage_dir(stage, family)
    return completion(directory, stage_inputs(cfg, stage, identity=identity, drafter=drafter))
