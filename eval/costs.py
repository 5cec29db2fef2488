"""Measuring the cost table (eval.schedule.CostTable) on the machine at hand, through the decoding engine itself.

For each batch size, the engine decodes a batch of real prompts greedily while the chain lengths γ = 0 (a plain
target step) ... γmax take turns round by round: each cycle of γmax + 1 rounds runs every length once, in a fresh
shuffled order, and every row drafts and verifies that many slots (`Rotation`; a proposer that drafts fewer is
timed at the width it verified). Its own timers give each
round's verification time (one target pass `γ + 1` slots wide, with the acceptance rule) and drafting time.
Decodes last about `rounds` rounds (the context lengths of the rounds the table prices), each on the next of the
prompts given (the eval's: what a wider pass adds includes attention over the whole context, and the demo's prompts
run from 44 to 233 tokens), until every length has about `repeats * rounds` rounds. Each decode is whole cycles, and
starts a new one: a pair never spans two decodes, whose contexts differ by up to the prompts' spread (16 rounds
over 6 lengths used to leave a third of the cycles across a decode's end, pairing a plain pass after one prompt with
wider ones after the next).

A pass `γ + 1` wide is priced as the plain pass (the median over its rounds) plus the median over the cycles of the
difference to the plain round of the same cycle. The pair is at most γmax rounds apart, so a drift of the machine's
speed (a neighbour on a shared CPU, a clock change), which is slow next to a round but not next to a whole decode,
reaches both alike; the shuffled order makes what is left of it fall either way. (Whole decodes of each length timed
one after another, the method before, put a second slot of a 53 ms pass at +0 ms where the schedule's own plain and
wider rounds, timed a round apart during the eval, measured +4.6 ms: it then drafted coding prompts at a first-slot
acceptance of 14% against a real break-even of 19%.) The widths are then made nondecreasing. Drafting time per round is fitted as
`round + (γ − 1) · step` (least squares over γ = 1 ... γmax, the median round of each, leaving out the rounds that
catch up on a skipped round or a prompt): `round` is what a round costs whatever it drafts (the drafter's update
with the verified tokens and its first position or block), `step` each further position. Timing through `decode`
rather than bare forwards means the table holds what the scheduler will actually pay.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.eval.engine import decode
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.schedule import CostTable, ScriptedSchedule

METHOD = 8
"""The version of how tables are measured, part of the cache key: a table measured another way is measured again
(4: the CPU's few-row fp32 products of eval.cpu_linear, which make a wider pass much cheaper than tables measured
before them say; 5: eval.cpu_attention, whose masked wider passes no longer copy a grouped-query target's cache;
6: the chain lengths take turns round by round, each wider pass priced against the plain round of its cycle; 7: each
timed decode on the next prompts, where 6 timed the first prompt only; 8: each timed decode whole cycles, where 7 let
a cycle run on into the next decode)."""


@dataclass
class Round:
    """One timed round of a measuring decode."""

    cycle: int
    gamma: int
    verify: float
    """Seconds of the target pass and the acceptance rule."""
    draft: float
    """Seconds of drafting (the drafter's update with the last verified slots, and its draft steps)."""
    catch_up: bool
    """The drafter's update ran over more than one round's slots (a decode's prompt, or a plain round before)."""


class Rotation(ScriptedSchedule):
    """The admission rule `measure_costs` decodes with (a `TrainedProposer.schedule`): round after round the chain
    lengths 0 ... γmax take turns, each cycle in a fresh order (shuffled by a seeded generator, so a table is measured
    the same way every time), and every active row drafts and verifies the round's length; the engine's timers of each
    round are kept with the length it drafted (`rounds`: a proposer that drafts fewer, as a family's may, is timed at
    the width it verified). A round's length is set by `worth_drafting`, or by `begin` for a proposer that drafts
    without asking."""

    def __init__(self, gamma_max: int, seed: int = 0):
        self.gamma_max, self.rng = gamma_max, random.Random(seed)
        self.cycle, self.gamma, self.depth = -1, 0, 0
        self.order: list[int] = []  # what is left of this cycle's lengths
        self.decided, self.behind = False, False
        self.rounds: list[Round] = []

    def _next(self) -> None:
        if not self.order:
            self.cycle += 1
            self.order = list(range(self.gamma_max + 1))
            self.rng.shuffle(self.order)
        self.gamma, self.decided = self.order.pop(), True

    def worth_drafting(self, c0, active) -> bool:
        self._next()
        return self.gamma > 0

    def begin(self, drafting: torch.Tensor) -> None:
        if not self.decided:
            self._next()
        super().begin(drafting)

    def admit(self, i: int, conf, survival, drafting: torch.Tensor) -> torch.Tensor:
        # halted once the round's length is drafted: the proposer takes no further draft step
        self.halted = i + 1 >= self.gamma
        if i >= self.gamma:
            return torch.zeros_like(drafting)
        if bool(drafting.any()):
            self.depth = i + 1
        return drafting

    def catching_up(self) -> None:
        self.behind = True

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        self.rounds.append(Round(self.cycle, self.depth, verify_seconds, draft_seconds, self.behind))
        self.decided, self.depth, self.behind = False, 0, False

    def reset(self) -> None:
        """A new decode: a new cycle (a wider pass is paired only with a plain one of its own decode)."""
        self.decided, self.depth, self.behind = False, 0, False
        self.order = []


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


def fit(rounds: Sequence[Round], gamma_max: int) -> tuple[dict[int, float], float, float]:
    """(verify seconds per width 1 ... γmax + 1, draft step, draft round) from a rotation's timed rounds. Widths no
    round verified are left out (the table extrapolates from the widest two)."""
    cycles: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rounds:
        cycles[r.cycle][r.gamma].append(r.verify)
    plain = statistics.median(r.verify for r in rounds if r.gamma == 0)
    widths = {1: plain}
    for g in range(1, gamma_max + 1):
        paired = [v - statistics.mean(c[0]) for c in cycles.values() if c[0] for v in c[g]]
        if paired:
            widths[g + 1] = plain + statistics.median(paired)
    if len(widths) < 2:
        raise ValueError("measure_costs: the proposer verified no draft slot in any timed round")
    drafting = {}
    for g in range(1, gamma_max + 1):
        times = [r.draft for r in rounds if r.gamma == g and not r.catch_up]
        if times:
            drafting[g] = statistics.median(times)
    gammas = sorted(drafting)
    if not gammas:  # every drafted round caught up: nothing to price a round by
        return verify_of(widths), 0.0, 0.0
    mean_g = sum(g - 1 for g in gammas) / len(gammas)
    mean_d = sum(drafting.values()) / len(gammas)
    var = sum((g - 1 - mean_g) ** 2 for g in gammas)
    cov = sum((g - 1 - mean_g) * (drafting[g] - mean_d) for g in gammas)
    step = max(cov / var, 0.0) if var > 0 else 0.0
    return verify_of(widths), step, max(mean_d - step * mean_g, 0.0)


def verify_of(widths: dict[int, float]) -> dict[int, float]:
    """{width: seconds}, made nondecreasing in the width."""
    order = sorted(widths)
    return dict(zip(order, nondecreasing([widths[w] for w in order])))


def _rows(prompts: Sequence[Sequence[int]], batch: int, j: int) -> list[list[int]]:
    """The rows of the j-th timed decode: the next `batch` prompts, taken in turn (wrapping around)."""
    return [list(prompts[(j * batch + i) % len(prompts)]) for i in range(batch)]


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
    """The cost table of `proposer` (its own schedule and threshold set aside while measuring) on `runner`'s target,
    with a progress bar over its decodes (minutes at batch 64 on a CPU)."""
    saved = (getattr(proposer, "schedule", None), getattr(proposer, "threshold", None))
    proposer.threshold = None
    greedy = SamplingParams()
    verify: dict[int, dict[int, float]] = {}
    draft_step: dict[int, float] = {}
    draft_round: dict[int, float] = {}
    name = getattr(proposer, "name", "")
    # each decode whole cycles of the γmax + 1 lengths, and as many decodes as give every length `repeats * rounds`
    # rounds (16 rounds over 6 lengths: 16 decodes of 3 cycles, 288 rounds, as 18 decodes of 16 rounds were)
    cycles = -(-rounds // (gamma_max + 1))
    per_decode = cycles * (gamma_max + 1)
    decodes = -(-repeats * rounds // cycles)
    room = (per_decode + 1) * (gamma_max + 1)  # tokens: every draft accepted; a decode stops after its rounds
    bar = tqdm(total=len(batches) * decodes, desc=f"cost table {name}".strip(), unit="decode")
    try:
        for batch in batches:
            rotation = Rotation(gamma_max, seed=batch)
            proposer.schedule = rotation
            # untimed: allocations and kernel choices for every width at this batch size
            decode(runner, proposer, _rows(prompts, batch, 0), greedy, gamma_max, room, max_rounds=gamma_max + 1)
            rotation.rounds.clear()
            bar.set_postfix(batch=batch)
            for j in range(decodes):
                decode(runner, proposer, _rows(prompts, batch, j), greedy, gamma_max, room, max_rounds=per_decode)
                bar.update()
            verify[batch], draft_step[batch], draft_round[batch] = fit(rotation.rounds, gamma_max)
    finally:
        bar.close()
        proposer.schedule, proposer.threshold = saved
    return CostTable(verify, draft_step, draft_round, key or {})


def cost_key(
    target, drafter: Mapping[str, Any], batches: Sequence[int], gamma: int, rounds: int, **more: str
) -> dict[str, Any]:
    """What a cost table is cached under (`cached_costs`): the target (`pipeline.target.Target`: its identity, dtype
    and device), the drafter's config (`drafter.config.to_dict()`: its family's fields and architecture, which is what
    a table prices, and the confidence scaling fitted with it, so each trained drafter gets its own), the batch sizes
    and chain length measured and the rounds per timed decode, and anything `more` the caller measures apart (a bench
    names its run).
    Written once: eval and the benches that reuse its tables build the same key.

    The drafter is its config, never a family name: keyed by "dspark" and the run, a bench reused the table of the
    two-layer drafter a run directory held before for the one-layer drafter trained there after (a 7.1 ms block
    round priced where 4.2 ms was measured), and its schedule declined to draft."""
    if not isinstance(drafter, Mapping):
        raise TypeError(
            f"cost_key takes the drafter's config (drafter.config.to_dict()), not {type(drafter).__name__} "
            f"{drafter!r}: a table prices an architecture, and a family name does not say which"
        )
    return {
        "target": json.dumps(target.identity, sort_keys=True),
        "dtype": str(target.model.dtype),
        "device": str(target.device),
        "drafter": json.dumps(dict(drafter), sort_keys=True),
        "batches": list(batches),
        "gamma": gamma,
        "rounds": rounds,
        **more,
    }


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
