"""Sizing `draftsmith run` to a wall-time budget from this machine's measured speed (`budget.minutes`).

A run's stages cost what the machine's speed at three kinds of work makes them cost: `generate` is batched
decoding, `collect` and `train` are large matrix products over many tokens (prefill-like), and `eval` is
one-token decoding at batch 1. So before the first stage, the target runs three short probes of exactly that
work (seconds each), and every stage's time is predicted from one measured run of the same recipe (the
`budget.reference`): its time there, times the ratio of the probe here to the probe there, times the ratio of
the sizes. The data stages scale with `generate.synthesize`, eval with `eval.max_prompts_per_domain`.

The sizes are then chosen so that the prediction fills `safety` of the budget: eval keeps the recipe's prompts
per domain while it fits in `eval_share` of the budget (never fewer than one), and the data gets the rest, from
`min_synthesize` up to `max_data_scale` times the recipe's. The choice, the probes and the prediction go to
RUN_DIR/budget.json before any stage runs (a re-run with the same budget reuses them, so resuming never
re-sizes), and the end of the run records each stage's real time beside its prediction.

No library sizes a pipeline to a time budget, so this is written here; the model is deliberately linear and
its error is printed at the end of every budgeted run.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from data.artifacts import atomic_write_text
from pipeline.config import RunConfig
from pipeline.errors import StageError

log = logging.getLogger(__name__)

DATA_STAGES = ("generate", "collect", "train")
PROBE_OF = {"generate": "gen_step", "collect": "prefill", "train": "prefill", "eval": "decode", "export": None}


@dataclass
class Probes:
    gen_step: float
    """Seconds per decoding step of a `generate.batch_size` batch after a 64-token prompt."""
    prefill: float
    """Seconds per forward over 2 x 256 tokens."""
    decode: float
    """Seconds per one-token pass of eval's target runner (batch 1, aux hooks on) after a 64-token prompt."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_probes(model, batch_size: int, aux_ids: list[int] | None = None, repeats: int = 3, steps: int = 6) -> Probes:
    """The three probes on `model`: each the median of `repeats` timings after one untimed warm-up."""
    from eval.runner import HFTarget

    runner = HFTarget(model, aux_ids)  # eval's own target runner: its cache and hooks are what eval pays for
    device = runner.device
    g = torch.Generator().manual_seed(0)

    def tokens(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (rows, length), generator=g).to(device)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    runner.reset()  # batched decoding: the generate backend's forward with a KV cache over `batch_size` rows
    ids = tokens(batch_size, 64)
    model(input_ids=ids, use_cache=True, **{runner._cache_kw: runner.cache})
    step = ids[:, -1:]

    def gen_steps() -> None:
        for _ in range(steps):
            model(input_ids=step, use_cache=True, **{runner._cache_kw: runner.cache})

    gen_step = timed(gen_steps) / steps
    prompt = tokens(2, 256)
    prefill = timed(lambda: model(input_ids=prompt, use_cache=False))
    runner.reset()
    runner.step(tokens(1, 64)[0].tolist())
    last = [int(tokens(1, 1))]

    def decode_steps() -> None:
        for _ in range(steps):
            runner.step(last)

    return Probes(gen_step=gen_step, prefill=prefill, decode=timed(decode_steps) / steps)


@dataclass
class Plan:
    synthesize: int
    max_prompts_per_domain: int
    predicted: dict[str, float]
    """Seconds per stage at the chosen sizes."""
    probes: Probes
    budget_s: float

    @property
    def total(self) -> float:
        return sum(self.predicted.values())


def choose_sizes(cfg: RunConfig, probes: Probes, spent: float = 0.0) -> Plan:
    """The sizes that make the predicted run fill `safety` of the budget less the `spent` seconds (probing)."""
    b, ref = cfg.budget, cfg.budget.reference
    assert b.minutes is not None and ref is not None  # the config refuses minutes without a reference
    ref_probes = ref.probes
    # each stage at the reference sizes, on this machine
    at_ref = {stage: seconds * (getattr(probes, PROBE_OF[stage]) / ref_probes[PROBE_OF[stage]] if PROBE_OF[stage] else 1.0)
              for stage, seconds in ref.seconds.items()}
    budget = b.minutes * 60.0 * b.safety - spent
    eval_per_prompt = at_ref.get("eval", 0.0) / ref.max_prompts_per_domain
    wanted = cfg.eval.max_prompts_per_domain or ref.max_prompts_per_domain
    fits = math.floor(b.eval_share * budget / eval_per_prompt) if eval_per_prompt > 0 else wanted
    prompts = max(1, min(wanted, fits))
    data_per_prompt = sum(at_ref.get(s, 0.0) for s in DATA_STAGES) / ref.synthesize
    left = budget - prompts * eval_per_prompt - at_ref.get("export", 0.0)
    most = math.floor(cfg.generate.synthesize * b.max_data_scale)
    synthesize = max(b.min_synthesize, min(most, math.floor(left / data_per_prompt)))
    scale = synthesize / ref.synthesize
    predicted = {stage: seconds * (scale if stage in DATA_STAGES else prompts / ref.max_prompts_per_domain if stage == "eval" else 1.0)
                 for stage, seconds in at_ref.items()}
    return Plan(synthesize, prompts, predicted, probes, b.minutes * 60.0)


def _record(cfg: RunConfig) -> dict[str, Any]:
    return {"budget": cfg.budget.model_dump(mode="json"), "generate": cfg.generate.model_dump(mode="json"),
            "eval": cfg.eval.model_dump(mode="json", exclude={"max_prompts_per_domain"}), "model": cfg.model.model_dump(mode="json")}


def plan_budget(cfg: RunConfig, is_main: bool, wait) -> tuple[RunConfig, dict[str, Any]]:
    """The config sized to the budget, and the budget record. The main process measures (or reuses the record of
    an earlier run of the same budget and recipe) and writes RUN_DIR/budget.json; the other ranks read it."""
    from pipeline.console import console

    if cfg.generate.synthesize == 0:
        raise StageError("budget.minutes sizes the self-synthesized data (generate.synthesize), and this recipe has none")
    path = cfg.run_path / "budget.json"
    if is_main:
        earlier = json.loads(path.read_text()) if path.is_file() else None
        if earlier and earlier.get("inputs") == _record(cfg):
            log.info("budget: reusing the sizes chosen at the start of this run (%s)", path)
        else:
            from pipeline.target import load_model

            t0 = time.perf_counter()
            model = load_model(cfg.model)
            from data.features import resolve_aux_ids

            aux = resolve_aux_ids(cfg.collect.aux_layer_ids, model.config.num_hidden_layers)
            probes = measure_probes(model, cfg.generate.batch_size, aux)
            del model
            plan = choose_sizes(cfg, probes, spent=time.perf_counter() - t0)
            earlier = {
                "inputs": _record(cfg), "probes": asdict(plan.probes), "probe_seconds": round(time.perf_counter() - t0, 1),
                "chosen": {"generate.synthesize": plan.synthesize, "eval.max_prompts_per_domain": plan.max_prompts_per_domain},
                "predicted_seconds": {k: round(v, 1) for k, v in plan.predicted.items()},
                "budget_seconds": plan.budget_s,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(earlier, indent=2))
            ref = cfg.budget.reference
            console.print(
                f"budget {cfg.budget.minutes:g} min: probes here {_fmt(plan.probes)} (reference {ref.machine or 'run'}: "
                f"{_fmt(Probes(**ref.probes))}); chose generate.synthesize={plan.synthesize} "
                f"(recipe {cfg.generate.synthesize}), eval.max_prompts_per_domain={plan.max_prompts_per_domain}; "
                f"predicted {plan.total / 60:.1f} min: " + ", ".join(f"{k} {v:.0f}s" for k, v in plan.predicted.items()),
                highlight=False)
            if plan.total > plan.budget_s:
                log.warning("budget: even the smallest sizes are predicted to take %.1f min, over the %g min budget",
                            plan.total / 60, cfg.budget.minutes)
    wait()
    record = json.loads(path.read_text())
    sized = cfg.model_copy(deep=True)
    sized.generate.synthesize = record["chosen"]["generate.synthesize"]
    sized.eval.max_prompts_per_domain = record["chosen"]["eval.max_prompts_per_domain"]
    return sized, record


def _fmt(p: Probes) -> str:
    return f"gen_step {p.gen_step * 1e3:.1f} ms, prefill {p.prefill * 1e3:.0f} ms, decode {p.decode * 1e3:.1f} ms"


def record_actuals(cfg: RunConfig, record: dict[str, Any], seconds: dict[str, float], total: float) -> dict[str, Any]:
    """Write each stage's real time beside its prediction, the run's whole wall time, and the `measured` entry
    that can serve as another run's budget.reference (only when every stage really ran at the chosen sizes)."""
    record = dict(record, actual_seconds={k: round(v, 1) for k, v in seconds.items()}, wall_seconds=round(total, 1))
    record.pop("measured", None)
    if set(seconds) >= set(record["predicted_seconds"]):
        record["measured"] = {
            "seconds": record["actual_seconds"], "probes": record["probes"],
            "synthesize": record["chosen"]["generate.synthesize"],
            "max_prompts_per_domain": record["chosen"]["eval.max_prompts_per_domain"],
        }
    atomic_write_text(cfg.run_path / "budget.json", json.dumps(record, indent=2))
    return record


def budget_table(record: dict[str, Any]) -> str:
    """Markdown: each stage's predicted and actual seconds, and the whole run against the budget."""
    rows = ["| stage | predicted | actual |", "|---|---|---|", f"| probes | | {record['probe_seconds']:.0f} s |"]
    actual = record.get("actual_seconds", {})
    for stage, pred in record["predicted_seconds"].items():
        got = actual.get(stage)
        rows.append(f"| {stage} | {pred:.0f} s | {f'{got:.0f} s' if got is not None else 'not run'} |")
    predicted = sum(record["predicted_seconds"].values()) + record["probe_seconds"]
    rows.append(f"| **run** | {predicted:.0f} s | {record.get('wall_seconds', 0):.0f} s (budget {record['budget_seconds']:.0f} s) |")
    return "\n".join(rows)
