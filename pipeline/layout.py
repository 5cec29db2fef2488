"""The run directory: where every artifact of a run lives. Stages, `draftsmith run`, the budget and the CLI name
paths through `RunLayout`, never as literals, so the layout is written down once, here:

    RUN_DIR/
      config.yaml              the config the last command ran with
      budget.json              `budget.minutes`: the sizes chosen, the predicted and the actual stage times
      prepared/                prepare: parquet shards + manifest.json
      generated/               generate: chunks/ (shards + sidecars), synth/ (synthesized prompt rounds), manifest.json
      features/                collect: safetensors shards + sidecars, manifest.json
      train/<family>/          train: checkpoints/step-N, best/, final/, vocab.safetensors, manifest.json
      <eval.output>/           eval (default eval/): eval.json, report.md, plots, manifest.json
      export/                  export: eagle3/, speculators/, dspark/, README.md, manifest.json
      imported/                `draftsmith import`: a drafter read back from an exported directory

Every artifact directory is complete exactly when it holds a manifest.json (written last); a stage that resumes
its own work keeps a progress.json beside it while it runs (pipeline/completion.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith.data.artifacts import MANIFEST
from draftsmith.pipeline.config import RunConfig

__all__ = ["MANIFEST", "PROGRESS", "RunLayout", "TrainDirs"]

PROGRESS = "progress.json"
"""Beside an artifact while a stage that resumes is making it: the inputs it is being made from."""


@dataclass(frozen=True)
class TrainDirs:
    """RUN_DIR/train/<family>/ and what is inside."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        """checkpoints/step-NNNNNNN: accelerate state + drafter + trainer_state.json, the newest kept."""
        return self.root / "checkpoints"

    @property
    def best(self) -> Path:
        """The drafter with the highest holdout τ_sim so far (+ metrics.json, calibration.json)."""
        return self.root / "best"

    @property
    def final(self) -> Path:
        """The drafter at the last step."""
        return self.root / "final"

    @property
    def vocab(self) -> Path:
        """The draft vocabulary (d2t / t2d), fixed at the start of a run: a resumed run reads it back."""
        return self.root / "vocab.safetensors"

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory. `RunLayout.of(cfg)` for a config's run directory."""

    root: Path
    eval_output: str = "eval"
    """The eval directory's name (`eval.output`)."""

    @classmethod
    def of(cls, cfg: RunConfig) -> RunLayout:
        return cls(cfg.run_path, cfg.eval.output)

    # ------------------------------------------------------------------------------------------ run files

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def budget_file(self) -> Path:
        return self.root / "budget.json"

    # ------------------------------------------------------------------------------------------ artifacts

    @property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def generated(self) -> Path:
        return self.root / "generated"

    @property
    def generated_chunks(self) -> Path:
        """One parquet shard + one JSON sidecar (its completion mark) per chunk of conversations."""
        return self.generated / "chunks"

    @property
    def synthesized(self) -> Path:
        """round-NNNNN.jsonl: the self-synthesized prompt candidates, one file per round."""
        return self.generated / "synth"

    def records(self, kind: str) -> Path:
        """The conversation records of `kind` (`prepared` or `generated`)."""
        if kind not in ("prepared", "generated"):
            raise ValueError(f"no records artifact of kind {kind!r}")
        return self.root / kind

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def train_root(self) -> Path:
        return self.root / "train"

    def train(self, family: str) -> TrainDirs:
        return TrainDirs(self.train_root / family)

    @property
    def eval(self) -> Path:
        return self.root / self.eval_output

    @property
    def eval_json(self) -> Path:
        """Every number of the eval with its settings; rewritten after each temperature (`complete` marks the end)."""
        return self.eval / "eval.json"

    @property
    def eval_report(self) -> Path:
        return self.eval / "report.md"

    @property
    def export(self) -> Path:
        return self.root / "export"

    def export_format(self, name: str) -> Path:
        """export/<name>/: `eagle3`, `speculators` or `dspark`."""
        return self.export / name

    @property
    def imported(self) -> Path:
        return self.root / "imported"

    def stage_dir(self, stage: str, family: str | None = None) -> Path:
        """The artifact directory `draftsmith run` judges for `stage` (train: one per family)."""
        if stage == "train":
            if family is None:
                raise ValueError("train has one directory per family: pass `family`")
            return self.train(family).root
        return {
            "prepare": self.prepared,
            "generate": self.generated,
            "collect": self.features,
            "eval": self.eval,
            "export": self.export,
        }[stage]
