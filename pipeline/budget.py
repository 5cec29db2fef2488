"""Sizing `draftsmith run` to a wall-time budget from this machine's measured speed (`budget.minutes`).

A run's stages cost what the machine's speed at four kinds of work makes them cost: `generate` is batched
generation, `collect` the target's forward over many tokens (prefill), `train` the trained families' training steps
(in the precision the trainer picks), and `eval` one-token and verification passes at batch 1; each stage also loads
the target. So before the first stage the target is loaded (timed) and four short probes of exactly that work run
(seconds each), and every stage's time is predicted from one measured run of the same recipe (the
`budget.reference`): its loads at this machine's load time, plus the rest of its time there times the ratio of
the probe here to the probe there, times the ratio of the sizes. The data stages scale with
`generate.synthesize`, eval with `eval.max_prompts_per_domain`.

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

from draftsmith.data.artifacts import atomic_write_text
from draftsmith.pipeline.config import BudgetStage, ProbeName, RunConfig
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import RunLayout

log = logging.getLogger(__name__)

DATA_STAGES: tuple[BudgetStage, ...] = ("generate", "collect", "train")
PROBE_OF: dict[BudgetStage, ProbeName | None] = {
    "generate": "gen_step",
    "collect": "prefill",
    "train": "train_step",
    "eval": "decode",
    "export": None,
}


@dataclass
class Probes:
    gen_step: float
    """Seconds per new token of transformers' `generate` over a `generate.batch_size` batch of 16-token prompts."""
    prefill: float
    """Seconds per forward over 2 x 256 tokens."""
    decode: float
    """Seconds for one 1-token and one 6-token pass (a γ = 5 verification) of eval's target runner (batch 1, aux
    hooks on) after a 64-token prompt."""
    load: float
    """Seconds to load the target (each stage does, once per drafter family in `train`)."""
    train_step: float
    """Seconds per training step (objective, backward, AdamW) over 512 tokens of random features, shaped and in the
    precision the trainer would use: each family the recipe trains (`train.drafters`) is timed, and the times are
    averaged weighted by the family's epochs, which is how the train stage divides its steps among them (the
    families train on the same data). One family's step alone does not follow the stage from one kind of machine
    to another: on an AMX Xeon an EAGLE-3 step probed 0.53x an AMD EPYC's while the stage, half of it DSpark's
    steps, ran at 0.84x. A bare step still over-predicts how much slower the stage gets where the kernels are
    slower (+40% on torch's AVX2 path in fp32, where most of a real step does not depend on them; see
    docs/benchmarks.md)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls of fn after one untimed warm-up call (first-call allocations, kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _extra_step_seconds(long, short, extra: int, device: torch.device, repeats: int) -> float:
    """Seconds per step of the `extra` steps `long()` runs beyond `short()`: the median of `repeats` differences of
    a long and a short call timed back to back (after one untimed call of each), so that a change in the machine's
    speed between them reaches both alike. A difference of two timings can still come out at or below zero on a
    busy machine (one demo measured -108 ms per generated token and planned a negative generate stage and a
    train stage of 65 minutes); then the pairs are timed again, twice as many, and if no positive median comes
    out, the long call per step (an upper bound: it includes the short call's fixed work) is used instead."""
    long(), short()
    for attempt in range(3):
        diffs, longs = [], []
        for _ in range(repeats * 2**attempt):
            t = []
            for fn in (long, short):
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                t.append(time.perf_counter() - t0)
            diffs.append((t[0] - t[1]) / extra)
            longs.append(t[0])
        if statistics.median(diffs) > 0:
            return statistics.median(diffs)
    log.warning(
        "budget: the generation probe's extra steps measured no time (median %.1f ms per step over %d pairs: the "
        "machine is busy); taking the long call per step instead",
        1e3 * statistics.median(diffs),
        len(diffs),
    )
    return statistics.median(longs) / extra


GEN_PROBE_STEPS = 24
"""New tokens the generation probe's long call makes beyond its short one (`generation_step_seconds`). With 6, the
difference of two calls (0.9 and 0.3 s at the demo's batch of 32 on a 2-core Xeon) was about as large as their
jitter (the same short call took 0.26-0.38 s in one process): six pairs of one process read 65-103 ms per token
where 30 more tokens read 71-80, and of six demo runs, the two whose probe read 57-58 ms generated at the speed of
those that read 82-101, planned 1.6-1.7x the data that fit, and overran the 25 minutes (docs/benchmarks.md,
2026-12-07). 24 steps cost about 5 s more of the probe."""


def generation_step_seconds(generate, device: torch.device, repeats: int) -> float:
    """Seconds per new token of batched generation: `generate(n)` is a call that makes n new tokens; the probe is the
    difference of a long call and a short one (`_extra_step_seconds`), `GEN_PROBE_STEPS` tokens apart, so the
    prompt's prefill and the call's fixed work drop out."""
    return _extra_step_seconds(generate(2 + GEN_PROBE_STEPS), generate(2), GEN_PROBE_STEPS, device, repeats)


def measure_probes(
    model, cfg: RunConfig, aux_ids: list[int], load: float, repeats: int = 3, steps: int = 6, train_repeats: int = 5
) -> Probes:
    """The probes on the target `model`, which took `load` seconds to load (see `Probes`). The training step is
    the median of `train_repeats` timed steps per family: it is the longest probed call (0.4 s and more on a
    2-core CPU), so one stall of the machine during it is likeliest, and with two timed steps one stall of 1.6 s once
    made a 0.41 s step read 1.18 s (docs/benchmarks.md, 2026-12-05)."""
    from draftsmith.eval.runner import HFTarget

    runner = HFTarget(model, aux_ids)  # eval's own target runner: its cache and hooks are what eval pays for
    device = runner.device
    g = torch.Generator().manual_seed(0)

    def tokens(rows: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (rows, length), generator=g).to(device)

    with torch.inference_mode():
        # batched generation as the HF backend runs it (transformers' generate loop, its cache and processors): the
        # difference of a long and a short call is the cost of the extra new tokens, without the prompt's prefill
        ids = tokens(cfg.generate.batch_size, 16)
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

        def generate(n: int):
            return lambda: model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )

        gen_step = generation_step_seconds(generate, device, repeats)
        prompt = tokens(2, 256)
        prefill = _timed(lambda: model(input_ids=prompt, use_cache=False), device, repeats)
        # eval's passes: one token (plain decoding, and the drafters' prefill of verified tokens) and 1+5 tokens (a
        # γ = 5 verification), through eval's own runner (cache, aux hooks)
        context = tokens(1, 64)
        one, six = context[:, -1:], context[:, -6:]
        runner.prefill([context[0].tolist()])

        def eval_passes() -> None:
            for _ in range(steps // 2):
                for chunk in (one, six):
                    runner.step(chunk, torch.ones_like(chunk, dtype=torch.bool))
                    runner.keep(0, chunk.shape[1], [])  # nothing kept: the cache keeps the same length
                    runner.compact()

        decode = _timed(eval_passes, device, repeats) / (steps // 2)
    per_family = {f: _timed(_train_step_fn(model, cfg, aux_ids, f), device, train_repeats) for f in cfg.train.drafters}
    log.info(
        "budget: a training step per family: %s", ", ".join(f"{f} {1e3 * t:.0f} ms" for f, t in per_family.items())
    )
    return Probes(
        gen_step=gen_step,
        prefill=prefill,
        decode=decode,
        load=load,
        train_step=train_probe(per_family, cfg),
    )


def train_probe(step_seconds: dict[str, float], cfg: RunConfig) -> float:
    """The families' step times averaged, each weighted by its epochs (`Probes.train_step`). A family capped by
    `max_steps` is weighted by its epochs all the same: how many steps an epoch has is not known before the data."""
    epochs = {family: cfg.train.epochs_for(family) for family in step_seconds}
    return sum(epochs[f] * step_seconds[f] for f in step_seconds) / sum(epochs.values())


def _train_step_fn(model, cfg: RunConfig, aux_ids: list[int], family_name: str, length: int = 512):
    """One training step of `family_name`'s drafter on random features, as the trainer runs it (its section's
    shape, objective, autocast, AdamW)."""
    from draftsmith.drafters.vocab import select_draft_vocab
    from draftsmith.pipeline.families import get_family
    from draftsmith.pipeline.families.base import TargetParts
    from draftsmith.pipeline.precision import resolve_mixed_precision

    device = next(model.parameters()).device
    tc = model.config
    vocab, hidden = tc.vocab_size, tc.hidden_size
    draft_vocab = min(cfg.train.draft_vocab_size, vocab)
    g = torch.Generator().manual_seed(0)
    d2t, t2d = select_draft_vocab(torch.rand(vocab, generator=g), draft_vocab)
    family = get_family(family_name)
    section = cfg.train.section(family_name)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    head = model.get_output_embeddings().weight.detach().float()
    parts = TargetParts(tc, list(aux_ids), draft_vocab, embed, head.cpu(), d2t, t2d)
    drafter = family.build(parts, section).to(device).train()
    settings = family.objective_settings(cfg.train, section, cfg.seed)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    bf16 = resolve_mixed_precision(cfg.train.mixed_precision, device.type == "cuda") == "bf16"
    batch = {
        "input_ids": torch.randint(0, vocab, (1, length), generator=g),
        "ids": ["probe"],
        "loss_mask": torch.ones(1, length, dtype=torch.uint8),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "aux": torch.randn(1, length, len(aux_ids) * hidden, generator=g),
        "final": torch.randn(1, length, hidden, generator=g),
        "domains": ["probe"],
        "epoch": 0,
    }

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = family.objective(drafter, batch, head, settings)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


@dataclass
class Plan:
    synthesize: int
    max_prompts_per_domain: int
    predicted: dict[BudgetStage, float]
    """Seconds per stage at the chosen sizes."""
    probes: Probes
    budget_s: float

    @property
    def total(self) -> float:
        return sum(self.predicted.values())


def target_loads(cfg: RunConfig) -> dict[str, int]:
    """How many times each stage loads the target: a fixed cost per stage that does not scale with its work."""
    return {"generate": 1, "collect": 1, "train": len(cfg.train.drafters), "eval": 1, "export": 1}


def choose_sizes(cfg: RunConfig, probes: Probes, spent: float = 0.0) -> Plan:
    """The sizes that make the predicted run fill `safety` of the budget less the `spent` seconds (probing).

    A stage's time = its target loads x the load time here + (its reference time less the reference's loads)
    x (its probe here / its probe there) x (its size here / its size there)."""
    b, ref = cfg.budget, cfg.budget.reference
    assert b.minutes is not None and ref is not None  # the config refuses minutes without a reference
    bad = {k: v for k, v in asdict(probes).items() if not v > 0 and k != "load"}
    if bad:  # a stage time scaled by a probe at or below zero would be negative, and the sizes nonsense
        raise StageError(f"budget: the probes measured no time for {bad} (seconds); run again on a quieter machine")
    loads = target_loads(cfg)
    # per stage: seconds that do not scale, and the scaling part at the reference sizes, here
    fixed: dict[BudgetStage, float] = {}
    work: dict[BudgetStage, float] = {}
    for stage, seconds in ref.seconds.items():
        fixed[stage] = loads.get(stage, 0) * probes.load
        probe = PROBE_OF[stage]
        ratio = getattr(probes, probe) / ref.probes[probe] if probe else 1.0
        work[stage] = max(0.0, seconds - loads.get(stage, 0) * ref.probes["load"]) * ratio
    budget = b.minutes * 60.0 * b.safety - spent - sum(fixed.values())
    eval_per_prompt = work.get("eval", 0.0) / ref.max_prompts_per_domain
    wanted = cfg.eval.max_prompts_per_domain or ref.max_prompts_per_domain
    fits = math.floor(b.eval_share * budget / eval_per_prompt) if eval_per_prompt > 0 else wanted
    prompts = max(1, min(wanted, fits))
    data_per_prompt = sum(work.get(s, 0.0) for s in DATA_STAGES) / ref.synthesize
    left = budget - prompts * eval_per_prompt - work.get("export", 0.0)
    most = math.floor(cfg.generate.synthesize * b.max_data_scale)
    synthesize = max(b.min_synthesize, min(most, math.floor(left / data_per_prompt)))
    size = {s: synthesize / ref.synthesize for s in DATA_STAGES} | {"eval": prompts / ref.max_prompts_per_domain}
    predicted = {stage: fixed[stage] + work[stage] * size.get(stage, 1.0) for stage in ref.seconds}
    return Plan(synthesize, prompts, predicted, probes, b.minutes * 60.0)


def _record(cfg: RunConfig) -> dict[str, Any]:
    return {
        "budget": cfg.budget.model_dump(mode="json"),
        "generate": cfg.generate.model_dump(mode="json"),
        "eval": cfg.eval.model_dump(mode="json", exclude={"max_prompts_per_domain"}),
        "model": cfg.model.model_dump(mode="json"),
    }


def plan_budget(cfg: RunConfig, is_main: bool, wait) -> tuple[RunConfig, dict[str, Any]]:
    """The config sized to the budget, and the budget record. The main process measures (or reuses the record of
    an earlier run of the same budget and recipe) and writes RUN_DIR/budget.json; the other ranks read it."""
    from draftsmith.pipeline.console import console

    if cfg.generate.synthesize == 0:
        raise StageError(
            "budget.minutes sizes the self-synthesized data (generate.synthesize), and this recipe has none"
        )
    path = RunLayout.of(cfg).budget_file
    if is_main:
        earlier = json.loads(path.read_text()) if path.is_file() else None
        if earlier and earlier.get("inputs") == _record(cfg):
            log.info("budget: reusing the sizes chosen at the start of this run (%s)", path)
        else:
            from draftsmith.data.features import resolve_aux_ids
            from draftsmith.pipeline.target import load_model

            t0 = time.perf_counter()
            model = load_model(cfg.model)
            load = time.perf_counter() - t0
            aux = resolve_aux_ids(cfg.collect.aux_layer_ids, model.config.num_hidden_layers)
            probes = measure_probes(model, cfg, aux, load)
            del model
            plan = choose_sizes(cfg, probes, spent=time.perf_counter() - t0)
            earlier = {
                "inputs": _record(cfg),
                "probes": asdict(plan.probes),
                "probe_seconds": round(time.perf_counter() - t0, 1),
                "chosen": {
                    "generate.synthesize": plan.synthesize,
                    "eval.max_prompts_per_domain": plan.max_prompts_per_domain,
                },
                "predicted_seconds": {k: round(v, 1) for k, v in plan.predicted.items()},
                "budget_seconds": plan.budget_s,
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(earlier, indent=2))
            ref = cfg.budget.reference
            assert ref is not None  # as in choose_sizes
            console.print(
                f"budget {cfg.budget.minutes:g} min: probes here {_fmt(plan.probes)} (reference {ref.machine or 'run'}: "
                f"{_fmt(Probes(**ref.probes))}); chose generate.synthesize={plan.synthesize} "
                f"(recipe {cfg.generate.synthesize}), eval.max_prompts_per_domain={plan.max_prompts_per_domain}; "
                f"predicted {plan.total / 60:.1f} min: "
                + ", ".join(f"{k} {v:.0f}s" for k, v in plan.predicted.items()),
                highlight=False,
            )
            if plan.total > plan.budget_s:
                log.warning(
                    "budget: predicted %.1f min, over the %g min budget, with the data at its floor "
                    "(budget.min_synthesize=%d)",
                    plan.total / 60,
                    cfg.budget.minutes,
                    cfg.budget.min_synthesize,
                )
    wait()
    record = json.loads(path.read_text())
    sized = cfg.model_copy(deep=True)
    sized.generate.synthesize = record["chosen"]["generate.synthesize"]
    sized.eval.max_prompts_per_domain = record["chosen"]["eval.max_prompts_per_domain"]
    return sized, record


def _fmt(p: Probes) -> str:
    return (
        f"gen_step {p.gen_step * 1e3:.1f} ms, prefill {p.prefill * 1e3:.0f} ms, decode {p.decode * 1e3:.1f} ms, "
        f"train_step {p.train_step * 1e3:.0f} ms, load {p.load:.1f} s"
    )


def record_actuals(cfg: RunConfig, record: dict[str, Any], seconds: dict[str, float], total: float) -> dict[str, Any]:
    """Write each stage's real time beside its prediction, the run's whole wall time, and the `measured` entry
    that can serve as another run's budget.reference (only when every stage really ran at the chosen sizes)."""
    record = dict(record, actual_seconds={k: round(v, 1) for k, v in seconds.items()}, wall_seconds=round(total, 1))
    record.pop("measured", None)
    if set(seconds) >= set(record["predicted_seconds"]):
        record["measured"] = {
            "seconds": record["actual_seconds"],
            "probes": record["probes"],
            "synthesize": record["chosen"]["generate.synthesize"],
            "max_prompts_per_domain": record["chosen"]["eval.max_prompts_per_domain"],
        }
    atomic_write_text(RunLayout.of(cfg).budget_file, json.dumps(record, indent=2))
    return record


def budget_table(record: dict[str, Any]) -> str:
    """Markdown: each stage's predicted and actual seconds, and the whole run against the budget."""
    rows = ["| stage | predicted | actual |", "|---|---|---|", f"| probes | | {record['probe_seconds']:.0f} s |"]
    actual = record.get("actual_seconds", {})
    for stage, pred in record["predicted_seconds"].items():
        got = actual.get(stage)
        rows.append(f"| {stage} | {pred:.0f} s | {f'{got:.0f} s' if got is not None else 'not run'} |")
    predicted = sum(record["predicted_seconds"].values()) + record["probe_seconds"]
    rows.append(
        f"| **run** | {predicted:.0f} s | {record.get('wall_seconds', 0):.0f} s (budget {record['budget_seconds']:.0f} s) |"
    )
    return "\n".join(rows)
