"""What a drafter family is, to the stages: one `Family` record per family, holding everything that differs between
families. The trainer, eval, export and import only ever go through it, so a family is one module (its model and
objective live in `drafters/`, its proposer in `eval/`) plus one `register(Family(...))` call.

The stages call, in order:
- train: `settings` validates the `train.<name>` section; `build` makes the drafter from the target;
  `objective_settings` turns the config into what `objective` takes; `objective(model, batch, head, settings,
  unwrapped)` is the loss of one `TrainBatch`; `after_training` (optional) runs on best/ and final/ once training
  ended, e.g. to calibrate confidences on the holdout split.
- eval: `proposer(drafter, eval_config)` is what the decoding engine drafts with; `trees` says whether it drafts
  token trees.
- export: `export(drafter, ExportContext)` gives the engine directories, each as tensors and a config.json;
  `import_export(directory, config, embed)` reads such a directory back (None: not this family's layout).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from draftsmith.data.artifacts import atomic_write_text
from draftsmith.drafters.calibration import fit_sequential_scaling, survival_ece
from draftsmith.drafters.objectives import TrainBatch
from draftsmith.pipeline.config import FamilySettings
from draftsmith.pipeline.console import console

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetParts:
    """What `build` makes a drafter from: the target's config and weights, the aux layers and the draft vocab."""

    config: Any
    """The target's HF config."""
    aux_ids: list[int]
    """HF hidden_states indices the drafter fuses, ascending."""
    draft_vocab_size: int
    embed: torch.Tensor
    """[V, H] the target's input embedding (frozen in the drafter)."""
    head: torch.Tensor
    """[V, H] the target's LM head."""
    d2t: torch.Tensor
    t2d: torch.Tensor


class TrainContext(Protocol):
    """What `after_training` may use of the trainer."""

    accelerator: Any
    device: torch.device
    head_weight: torch.Tensor
    """[V, H] the target's LM head in fp32 on `device`."""
    settings: Any
    """The family's objective settings."""
    section: Any
    """The family's `train.<name>` section."""
    temperature: float
    """train.temperature."""

    def holdout_share(self) -> Iterator[TrainBatch]:
        """This rank's share of the whole holdout split, as loaded batches (every rank gets a disjoint share)."""
        ...


@dataclass(frozen=True)
class ExportContext:
    """What a family's export needs besides the drafter."""

    root: Path
    """RUN_DIR/export/: an `ExportedDirectory` named N is written to root/N."""

    target_config: Any
    target_name: str
    """The verifier's name as the engines' commands and configs cite it."""
    dtype: torch.dtype
    formats: list[str]
    """export.formats: the engines asked for (`vllm`, `sglang`, `speculators`)."""
    draft_length: int
    """eval.draft_length: speculative tokens a chain drafter is served with."""
    hub_target: bool
    """The target is a hub repository (engines accept it as a verifier name); else a local directory or GGUF."""


@dataclass
class ExportedDirectory:
    """One directory of an export: its name under RUN_DIR/export/, its tensors and config.json, and the README
    section telling how to serve it."""

    name: str
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    readme: list[str] = field(default_factory=list)
    """Markdown lines of its README section."""
    notes: list[str] = field(default_factory=list)
    """What a user must be told (e.g. an engine that will not load it, and why)."""
    refused: str | None = None
    """Why this directory is not written at all (no engine would compute what was trained); tensors are empty."""
    sidecars: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Further safetensors files, by path under the directory, in a subfolder no engine reads (`CONFIDENCE_FILE`)."""


@dataclass(frozen=True)
class Family:
    name: str
    """The name in train.drafters, the run directory (train/<name>/) and checkpoints' config.json."""
    settings: type[FamilySettings]
    """The typed `train.<name>` section."""
    model_class: Any
    """Class with `save_pretrained(dir, state_dict=)` and `from_pretrained(dir)` (drafters.common.DrafterBase)."""
    build: Callable[[TargetParts, Any], torch.nn.Module]
    """(target parts, section) -> a new drafter. May raise ValueError for a shape it cannot take."""
    objective: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """(model, TrainBatch, head_weight, objective settings, unwrapped model) -> (loss, summed statistics). The
    statistics are those `drafters.objectives.summarize` reads for `settings.steps` steps. The batch may carry the
    teacher's full-vocabulary statistics from the trainer's cache (`drafters.objectives.known_stats`), which
    `teacher_from_final(..., known=...)` takes instead of computing them."""
    objective_settings: Callable[[Any, Any, int], Any]
    """(train config, section, seed) -> what `objective` takes; it has a `steps` attribute."""
    proposer: Callable[[Any, Any], Any]
    """(drafter, eval config) -> an `eval.proposers` proposer."""
    export: Callable[[Any, ExportContext], list[ExportedDirectory]]
    """The engine directories of a trained drafter (empty: none of export.formats applies)."""
    import_export: Callable[[Path, dict[str, Any], torch.Tensor | None], Any | None]
    """(directory, its config.json, the target's embedding) -> our drafter, or None when not this family's layout."""
    after_training: Callable[[TrainContext, Path], None] | None = None
    """Runs on every rank for best/ and final/ once they are on disk (e.g. fit confidence temperatures)."""
    trees: bool = False
    """The proposer drafts token trees (eval.tree_depth)."""


@torch.no_grad()
def calibrate_confidences(trainer: TrainContext, directory: Path, data_fn: Callable, unit: str) -> None:
    """Fit the confidence scaling (a temperature and a bias per position, `drafters.calibration`) of the drafter in
    `directory` on the whole holdout split and write it into its config: once on the acceptance at the training
    temperature (`confidence_temperatures` and `confidence_biases`), and once per sampling temperature of the
    section's `calibrate_at` (`sampled_confidence_calibration`: eval reads the one nearest the temperature it decodes
    at), and at each of those above 0 on the acceptance of drafts taken as the drafter's argmax
    (`greedy_confidence_calibration`, for eval.draft_sample_method = greedy). Every rank computes the confidences of
    its share of the holdout batches (a long calibration on one rank would leave the others waiting in a collective
    until the NCCL timeout); the main process gathers them, fits and writes. `data_fn(model, batch, head, objective
    settings)` gives (confidence logits, acceptance probabilities, validity), each [N, positions], the family's own
    (its objectives module), at the settings' temperature and way of drawing drafts (`greedy_drafts`); the section (a
    `config.CalibratedSettings`) says whether and with how many bins."""
    from accelerate.utils import gather_object

    from draftsmith.pipeline.families import load_drafter  # the registry imports this module

    if not trainer.section.calibrate:
        return
    acc = trainer.accelerator
    model = load_drafter(directory).to(trainer.device).eval()  # complete on disk under every ZeRO stage
    head = trainer.head_weight.float()
    trained = float(trainer.settings.temperature)
    temperatures = sorted({trained, *(float(t) for t in trainer.section.calibrate_at)})
    # (temperature, drafts taken as the argmax): above 0 both ways of drawing a draft (eval.draft_sample_method)
    fits = [(t, False) for t in temperatures] + [(t, True) for t in temperatures if t > 0]
    parts: list[tuple[tuple[float, bool], tuple[torch.Tensor, ...]]] = []
    for batch in trainer.holdout_share():  # read once, every temperature's acceptance computed from it
        for t, greedy in fits:
            # the teacher cache's statistics are the training temperature's (its logsumexp): another recomputes them
            at = batch if t == trained else {k: v for k, v in batch.items() if not k.startswith("teacher_")}
            settings = dataclasses.replace(trainer.settings, temperature=t, greedy_drafts=greedy)
            parts.append(((t, greedy), tuple(x.cpu() for x in data_fn(model, at, head, settings))))
    if acc.num_processes > 1:
        parts = gather_object(parts)
    if not acc.is_main_process:
        return
    if sum(p[0].shape[0] for (t, greedy), p in parts if t == trained and not greedy) == 0:
        log.warning("train: no %s to calibrate %s on; confidences left uncalibrated", unit, directory)
        return
    bins = trainer.section.calibration_bins
    fitted: dict[tuple[float, bool], dict[str, Any]] = {}
    for key in fits:
        conf, alpha, valid = (torch.cat([p[i] for u, p in parts if u == key]) for i in range(3))
        temps, biases = fit_sequential_scaling(conf, alpha, valid)
        first = valid[:, 0]
        fitted[key] = {
            "samples": int(conf.shape[0]),
            "temperatures": temps,
            "biases": biases,
            "survival_ece_before": survival_ece(conf, alpha, valid, [1.0] * conf.shape[1], bins),
            "survival_ece_after": survival_ece(conf, alpha, valid, temps, bins, biases),
            # what the first slot's calibrated confidence predicts on average, and what was accepted
            "first_slot_predicted": float(torch.sigmoid(conf[first, 0].double() / temps[0] + biases[0]).mean()),
            "first_slot_accepted": float(alpha[first, 0].double().mean()),
        }
    cfg_path = directory / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["confidence_temperatures"] = fitted[trained, False]["temperatures"]
    raw["confidence_biases"] = fitted[trained, False]["biases"]
    for name, greedy in (("sampled_confidence_calibration", False), ("greedy_confidence_calibration", True)):
        raw[name] = {
            str(t): {"temperatures": f["temperatures"], "biases": f["biases"]}
            for (t, g), f in fitted.items()
            if g == greedy
        }
    atomic_write_text(cfg_path, json.dumps(raw, indent=2, allow_nan=False))
    report = {
        **fitted[trained, False],
        "bins": bins,
        "temperature": trainer.temperature,
        "ranks": acc.num_processes,
        "by_sampling_temperature": {str(t): f for (t, g), f in fitted.items() if not g},
        "greedy_drafts_by_sampling_temperature": {str(t): f for (t, g), f in fitted.items() if g},
    }
    atomic_write_text(directory / "calibration.json", json.dumps(report, indent=2, allow_nan=False))
    for (t, greedy), f in fitted.items():
        drafts = ", argmax drafts" if greedy else ""
        console.print(
            f"calibrated {directory.name}/ at T = {t:g}{drafts}: survival ECE by position "
            f"{_eces(f['survival_ece_before'])} -> {_eces(f['survival_ece_after'])}; "
            f"first slot predicted {f['first_slot_predicted']:.1%}, accepted {f['first_slot_accepted']:.1%} "
            f"({f['samples']} {unit})",
            highlight=False,
            markup=False,
        )


def _eces(values: list[float | None]) -> str:
    """Survival ECEs by position for the console; '-' where no block reached the position."""
    return "[" + ", ".join("-" if e is None else f"{e:.3f}" for e in values) + "]"


def engine_refusal(aux_layer_ids: list[int], target_config) -> str | None:
    """Why no engine would feed this drafter the features it was trained on, or None: vLLM and SGLang capture the
    aux layers in ascending order, and neither captures draftsmith's id L (the final normed output)."""
    ids, L = list(aux_layer_ids), target_config.num_hidden_layers
    if any(a >= b for a, b in zip(ids, ids[1:])):
        return (
            f"aux layers {ids} are not in ascending order, and vLLM and SGLang concatenate the captured layers in "
            "ascending order: fc would get permuted columns"
        )
    if L in ids:
        return (
            f"aux layer {L} is draftsmith's final normed output, which vLLM captures before the final norm and "
            f"SGLang never captures; train with aux layers below {L} (collect.aux_layer_ids)"
        )
    return None


def vocab_tensors(model: Any) -> dict[str, torch.Tensor]:
    """`d2t` and `t2d` for a reduced draft vocabulary; nothing for a full one (vLLM 0.33 refuses the tensors when the
    vocabularies are equal). A full draft vocabulary is the identity by construction; anything else is refused."""
    if model.config.draft_vocab_size != model.config.vocab_size:
        return {"d2t": model.d2t, "t2d": model.t2d}
    if bool(model.d2t.any()) or not bool(model.t2d.all()):
        raise ValueError("a full draft vocabulary whose d2t is not the identity cannot be expressed without d2t")
    return {}


def implied_vocab(directory: Path, vocab: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    """The `d2t`/`t2d` an export without them means (the identity over a full vocabulary); nothing when it has them."""
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        if "d2t" in f.keys():
            return {}
    if vocab != draft_vocab:
        raise ValueError(f"{directory}: no d2t/t2d, but the draft vocab ({draft_vocab}) is not the target's ({vocab})")
    return {"d2t": torch.zeros(draft_vocab, dtype=torch.int64), "t2d": torch.ones(vocab, dtype=torch.bool)}


CONFIDENCE_FILE = "draftsmith/confidence.safetensors"
"""Where an engine directory carries a confidence head that its layout has no tensors for (EAGLE-3's): a subfolder,
because vLLM 0.33 and SGLang 0.5.23 load every `*.safetensors` at the top of the directory and refuse (vLLM) or drop
(SGLang) names their model lacks, while neither looks into subfolders (tests/engines runs both loaders' own file
discovery on the exports)."""


def calibration_config(cfg: Any) -> dict[str, Any]:
    """The fitted confidence scaling as extra config.json keys (no engine layout has a field for it; engines and
    speculators keep or ignore unknown keys): what `calibration_fields` reads back."""
    keys = {
        "draftsmith_confidence_temperatures": cfg.confidence_temperatures,
        "draftsmith_confidence_biases": cfg.confidence_biases,
        "draftsmith_sampled_confidence_calibration": cfg.sampled_confidence_calibration,
        "draftsmith_greedy_confidence_calibration": cfg.greedy_confidence_calibration,
    }
    return {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in keys.items() if v}


def calibration_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The drafter config fields `calibration_config` wrote into an export's config.json."""
    return {
        "confidence_temperatures": raw.get("draftsmith_confidence_temperatures"),
        "confidence_biases": raw.get("draftsmith_confidence_biases"),
        "sampled_confidence_calibration": raw.get("draftsmith_sampled_confidence_calibration"),
        "greedy_confidence_calibration": raw.get("draftsmith_greedy_confidence_calibration"),
    }


def load_renamed_weights(
    model: Any,
    directory: Path,
    embed_weight: torch.Tensor | None,
    renames: dict[str, str],
    extra: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Fill `model` from DIRECTORY/model.safetensors (names renamed by prefix), the confidence head of
    DIRECTORY/`CONFIDENCE_FILE` when there is one, and `extra` (tensors the layout implies, e.g. an identity
    vocabulary), the embedding from the target when the export has none; refuses missing or unexpected tensors (a
    confidence head may be missing: the caller decides what a drafter without one is). Keeps the export's dtype."""
    from safetensors.torch import load_file

    ours = dict(extra or {})
    if (directory / CONFIDENCE_FILE).is_file():
        ours |= load_file(str(directory / CONFIDENCE_FILE))
    for key, value in load_file(str(directory / "model.safetensors")).items():
        prefix = next((p for p in renames if key.startswith(p)), None)
        ours[renames[prefix] + key[len(prefix) :] if prefix else key] = value
    if "embed_tokens.weight" not in ours:
        if embed_weight is None:
            raise ValueError(f"{directory} has no embedding (engines share the target's); pass the target to import it")
        ours["embed_tokens.weight"] = embed_weight
    state = model.state_dict()
    missing = [k for k in state if k not in ours and not k.startswith(("confidence.", "rotary."))]
    unexpected = [k for k in ours if k not in state]
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the drafter (missing {missing}, unexpected {unexpected})")
    dtype = next(v.dtype for v in ours.values() if v.is_floating_point())  # the export's (from its file, first)
    model.load_state_dict({**state, **{k: v.to(state[k].dtype) for k, v in ours.items()}})
    return model.to(dtype) if dtype != torch.float32 else model
