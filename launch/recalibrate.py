"""Fit a finished run's drafter confidences again, without training them again, into a new run directory (the old one
is left as it was): e.g. to calibrate drafters trained before `train.<family>.calibrate_at` existed at the sampling
temperatures it names. The new run links the old one's generated answers and features, holds copies of its trained
drafters (train/<family>/ without the checkpoints), recalibrated by the family's own `after_training`, and a config.yaml
naming it; each copied training manifest is rewritten with the new inputs, calibration and file hashes, and says which
run it was recalibrated from.

    python launch/recalibrate.py RUN/config.yaml --out NEW_RUN [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from draftsmith.data.artifacts import MANIFEST, read_manifest, write_manifest
from draftsmith.pipeline.completion import payload_files
from draftsmith.pipeline.config import load_config, save_config
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.train import Trainer

MANIFEST_HEADER = ("kind", "schema_version", "status", "created", "versions", "inputs")
"""What `write_manifest` writes itself."""

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("config", help="the finished run's config.yaml")
ap.add_argument("--out", required=True, help="the new run directory (must not exist)")
ap.add_argument("overrides", nargs="*", help="config overrides for the new run, e.g. train.eagle3.calibrate_at=[0,1]")
args = ap.parse_intermixed_args()  # overrides may follow --out

old_cfg = load_config(args.config)
old = RunLayout.of(old_cfg)
new_dir = Path(args.out)
if new_dir.exists():
    raise SystemExit(f"recalibrate: {new_dir} exists; name a new run directory")
families = list(old_cfg.train.drafters)
for family in families:
    dirs = old.train(family)
    if not (dirs.root / MANIFEST).is_file():
        raise SystemExit(f"recalibrate: {dirs.root} holds no finished training run (no {MANIFEST})")

new_dir.mkdir(parents=True)
for part in ("generated", "features"):  # shared, read-only to training: linked, not copied
    if (old.root / part).exists():
        (new_dir / part).symlink_to((old.root / part).resolve())
cfg = load_config(args.config, [f"run_dir={new_dir}", *args.overrides])
layout = RunLayout.of(cfg)
save_config(cfg, layout.config_file)
for family in families:
    src, dst = old.train(family), layout.train(family)
    dst.root.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src.root, dst.root, ignore=shutil.ignore_patterns(src.checkpoints.name))
    trainer = Trainer(cfg, family)
    if trainer.family.after_training is None:
        print(f"recalibrate: {family} has no calibration; copied as it was")
    else:
        for d in (trainer.dirs.best, trainer.dirs.final):
            if (d / "config.json").is_file():
                trainer.family.after_training(trainer, d)
    calibration = next(
        (d / "calibration.json" for d in (dst.best, dst.final) if (d / "calibration.json").is_file()), None
    )
    # the training run's own fields (steps, history, ...) kept; what the recalibration changed, and the manifest's
    # header (kind, status, created, versions), written as every stage writes a manifest
    kept = {k: v for k, v in read_manifest(src.root, "drafter").items() if k not in MANIFEST_HEADER}
    kept.update(
        config={"train": cfg.train.model_dump(mode="json")},
        calibration=json.loads(calibration.read_text()) if calibration else None,
        files=payload_files(dst.root, [dst.best.name, dst.final.name]),
        recalibrated={"from": str(src.root)},
    )
    write_manifest(dst.root, "drafter", inputs=trainer.inputs, **kept)
    del trainer
print(f"recalibrate: {', '.join(families)} of {old.root} recalibrated into {new_dir}")
