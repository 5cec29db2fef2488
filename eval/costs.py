"""Measuring the cost table (eval.schedule.CostTable) on the machine at hand, through the decoding engine itself.

For each batch size, the engine decodes a batch of real prompts greedily with a fixed chain length γ = 0 (plain
decoding) ... γmax for a fixed number of rounds (`rounds` for every γ, however many drafts are accepted: a weak
drafter does not make the table take longer), three times in turn (the median is kept); the engine's own timers give each
round's verification time (one target pass `γ + 1` slots wide, with the acceptance rule) and drafting time. Drafting time per round is fitted as
`round + (γ − 1) · step` (least squares over γ = 1 ... γmax), and the pass times made nondecreasing in the width: `round` is what a round costs whatever it drafts (the
drafter's update with the verified tokens and its first position or block), `step` each further position. Timing
through `decode` rather than bare forwards means the table holds what the scheduler will actually pay.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import NoDraft
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.schedule import CostTable

METHOD = 5
"""The version of how tables are measured, part of the cache key: a table measured another way is measured again
(4: the CPU's few-row fp32 products of eval.cpu_linear, which make a wider pass much cheaper than tables measured
before them say; 5: eval.cpu_attention, whose masked wider passes no longer copy a grouped-query target's cache)."""


def _per_round(results, field: str) -> float:
    """Seconds per batch round of a decode (each row's share times the rows, over the batch's rounds)."""
    rounds = max(len(r.rounds) for r in results)
    return sum(getattr(r, field) for r in results) / max(rounds, 1)


def _timed(runs: dict[int, Any], repeats: int, progress) -> dict[int, tuple[float, float]]:
    """Per chain length, the median over `repeats` decodes of (verify, draft) seconds per round. The lengths take
    turns (all once, then all again, ...): a drift of the machine's speed reaches every length alike, and one busy
    moment does not become the table."""
    samples: dict[int, list] = {g: [] for g in runs}
    for _ in range(repeats):
        for gamma, run in runs.items():
            samples[gamma].append(run())
            progress()
    return {
        g: (
            statistics.median(_per_round(r, "verify_seconds") for r in rs),
            statistics.median(_per_round(r, "draft_seconds") for r in rs),
        )
        for g, rs in samples.items()
    }


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest nondecreasing sequence in least squares (pool adjacent violators): a pass over more slots never
    costs less, so where timing noise says it does, the neighbours are averaged."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(int(n))]


def measure_costs(
    runner: Any,
    proposer: Any,
    prompts: Sequence[Sequence[int]],
    batches: Sequence[int],
    gamma_max: int,
    rounds: int = 16,
    key: dict[str, str] | None = None,
    repeats: int = 3,
) -> CostTable:
    """The cost table of `proposer` (its schedule and threshold off while measuring) on `runner`'s target, with a
    progress bar over its decodes (minutes at batch 64 on a CPU)."""
    saved = (getattr(proposer, "schedule", None), getattr(proposer, "threshold", None))
    proposer.schedule, proposer.threshold = None, None
    greedy = SamplingParams()
    verify: dict[int, dict[int, float]] = {}
    draft_step: dict[int, float] = {}
    draft_round: dict[int, float] = {}
    name = getattr(proposer, "name", "")
    bar = tqdm(total=len(batches) * repeats * (gamma_max + 1), desc=f"cost table {name}".strip(), unit="decode")
    try:
        for batch in batches:
            rows = [list(prompts[i % len(prompts)]) for i in range(batch)]
            decode(runner, proposer, rows, greedy, 1, 3)  # untimed: allocations and kernel choice for this shape
            # γ = 0 is plain decoding: a pass one slot wide, nothing drafted. Every γ runs exactly `rounds` rounds:
            # room for every draft accepted, and a stop after `rounds` however few are
            runs = {0: partial(decode, runner, NoDraft(), rows, greedy, 1, rounds + 1, max_rounds=rounds)}
            for gamma in range(1, gamma_max + 1):
                n_tokens = (rounds + 1) * (gamma + 1)
                runs[gamma] = partial(decode, runner, proposer, rows, greedy, gamma, n_tokens, max_rounds=rounds)
            bar.set_postfix(batch=batch)
            timed = _timed(runs, repeats, bar.update)
            widths = nondecreasing([timed[g][0] for g in sorted(timed)])
            verify[batch] = {g + 1: w for g, w in zip(sorted(timed), widths)}
            drafting = {g: timed[g][1] for g in timed if g > 0}
            gammas = sorted(drafting)
            if len(gammas) > 1:
                mean_g = sum(g - 1 for g in gammas) / len(gammas)
                mean_d = sum(drafting.values()) / len(gammas)
                cov = sum((g - 1 - mean_g) * (drafting[g] - mean_d) for g in gammas)
                var = sum((g - 1 - mean_g) ** 2 for g in gammas)
                step = max(cov / var, 0.0)
            else:
                step, mean_g, mean_d = 0.0, 0.0, drafting[gammas[0]]
            draft_step[batch] = step
            draft_round[batch] = max(mean_d - step * mean_g, 0.0)
    finally:
        bar.close()
        proposer.schedule, proposer.threshold = saved
    return CostTable(verify, draft_step, draft_round, key or {})


def cached_costs(cache_dir: Path, key: dict[str, Any], measure) -> tuple[CostTable, bool]:
    """The table cached under `key` in `cache_dir`, else `measure()` saved there. Returns (table, from cache)."""
    key = {**key, "method": METHOD}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"costs-{digest}.json"
    if path.is_file():
        return CostTable.load(path), True
    table = measure()
    table.key = {k: str(v) for k, v in key.items()}
    table.save(path)
    return table, False
