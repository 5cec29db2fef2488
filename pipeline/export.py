"""`draftsmith export` / `draftsmith import`: drafters in the layouts serving engines load as they are.

Each family decides its own engine directories (pipeline/families/: EAGLE-3 writes `eagle3/` for vLLM and
SGLang and `speculators/`; DSpark writes `dspark/`); this stage loads the trained drafters, writes what their
families give under RUN_DIR/export/, a README.md on how to serve each, and the manifest. README's export section
states the layouts.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draftsmith.data.artifacts import write_manifest
from draftsmith.pipeline import families
from draftsmith.pipeline.completion import stage_inputs
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console
from draftsmith.pipeline.dist import single_writer
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.families.base import ExportContext, ExportedDirectory
from draftsmith.pipeline.inputs import trained_drafter
from draftsmith.pipeline.layout import MANIFEST, RunLayout
from draftsmith.pipeline.target import load_config_of, load_head_weights, resolve_target

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _write(d: ExportedDirectory, directory: Path) -> None:
    files = {"model.safetensors": d.tensors, **d.sidecars}
    for name, tensors in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / name))
    (directory / "config.json").write_text(json.dumps(d.config, indent=2) + "\n")


def import_drafter(directory: str | Path, embed_weight: torch.Tensor | None = None) -> Any:
    """Load an exported directory (any registered family's layout, or a draftsmith checkpoint) as our drafter.
    The engine layouts carry no embedding: pass the target's (`embed_weight`)."""
    try:
        return families.import_drafter(directory, embed_weight)
    except ValueError as exc:
        raise StageError(str(exc)) from None


# ------------------------------------------------------------------------------------------ stage


def _readme(cfg: RunConfig, models: dict[str, Any], written: list[ExportedDirectory], target_name: str) -> str:
    lines = [f"# Drafters for `{target_name}`", ""]
    for d in written:
        lines += d.readme
    layout = RunLayout.of(cfg)
    for family in models:
        train_manifest = layout.train(family).manifest
        if train_manifest.is_file():
            tm = json.loads(train_manifest.read_text())
            lines += [
                f"## Training ({family})",
                "",
                f"{tm.get('steps')} optimizer steps, best holdout simulated τ "
                f"{tm.get('best_holdout_tau')}; features from `{layout.features}`.",
                "",
            ]
    feats = layout.features / MANIFEST
    if feats.is_file():
        fm = json.loads(feats.read_text())
        lines += [
            f"Training data: {fm['counts']['samples']} conversations, {fm['counts']['tokens']} tokens "
            f"({fm['counts']['supervised_tokens']} assistant tokens).",
            "",
        ]
    eval_json = layout.eval_json
    if eval_json.is_file():
        ev = json.loads(eval_json.read_text())
        lines += [
            "## Measured acceptance length (draftsmith eval)",
            "",
            "| T | drafter | domain | τ | speedup |",
            "|---|---|---|---|---|",
        ]
        for run in ev["runs"]:
            for name in [d for d in run["drafters"] if d in models]:
                for domain, row in run["domains"].items():
                    st = row[name]
                    lines.append(
                        f"| {run['temperature']} | {name} | {domain} | {st['tau']:.2f} | {st.get('speedup', 0):.2f}x |"
                    )
        lines.append("")
    return "\n".join(lines)


@single_writer
def run_export(cfg: RunConfig, drafter: str | None = None) -> Path:
    """Export the trained drafter(s): `drafter` (a directory), else every family of train.drafters."""
    x = cfg.export
    spec = resolve_target(cfg.model)
    sources = (
        [trained_drafter(cfg, spec.identity(), drafter)]
        if drafter
        else [trained_drafter(cfg, spec.identity(), None, family) for family in cfg.train.drafters]
    )
    models = {}
    for source in sources:
        model = families.load_drafter(source)
        models[model.name] = model
    layout = RunLayout.of(cfg)
    out = layout.export
    ctx = ExportContext(
        root=out,
        target_config=load_config_of(cfg.model, spec),
        target_name=spec.location if spec.kind != "gguf" else spec.name,
        dtype=DTYPES[x.dtype],
        formats=list(x.formats),
        draft_length=cfg.eval.draft_length,
        hub_target=spec.kind == "hub",
    )
    exported = [d for name, model in models.items() for d in families.get_family(name).export(model, ctx)]
    refused = {d.name: d.refused for d in exported if d.refused}
    written = [d for d in exported if not d.refused]
    names = [d.name for d in written]
    if len(set(names)) != len(names):
        raise StageError(f"two drafter families export a directory of the same name: {names}")
    if out.exists():
        shutil.rmtree(out)
    for name, why in refused.items():
        console.print(f"[bold red]export: {name}/ NOT WRITTEN: {why}[/]", highlight=False)
        log.error("export: %s/ not written: %s", name, why)
    for d in written:
        for note in d.notes:
            console.print(f"[yellow]export: {note}[/]", highlight=False)
        _write(d, layout.export_format(d.name))
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(_readme(cfg, models, exported, spec.name))
    write_manifest(
        out,
        "export",
        inputs=stage_inputs(cfg, "export", identity=spec.identity(), drafter=drafter),
        target=spec.identity(),
        sources={n: str(s) for n, s in zip(models, sources)},
        dtype=x.dtype,
        formats={d.name: str(layout.export_format(d.name).relative_to(out)) for d in written},
        notes={d.name: d.notes for d in written if d.notes},
        refused=refused,
    )
    console.print(f"export -> {out}: " + ", ".join(f"{n}/" for n in names), highlight=False)
    return out


def run_import(cfg: RunConfig, source: str) -> Path:
    """Load an exported directory back into draftsmith's drafter class and save it as RUN_DIR/imported/."""
    _, _, embed = load_head_weights(cfg.model)
    model = import_drafter(source, embed)
    out = RunLayout.of(cfg).imported
    model.float().save_pretrained(out)
    console.print(f"import: {source} -> {out}", highlight=False)
    return out
