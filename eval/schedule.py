"""How many draft slots to verify each round: from the drafter's confidences and what a target pass and a draft step
cost on the machine at hand, admit a slot only while it raises the expected tokens per second.

The engine verifies a batch in one padded pass: every row is widened to the longest row's slots, so a round's
target time is `verify(width, batch)`, and a batch's draft step costs `draft_step(batch)` however many rows draft
in it. Per round, the schedule walks the draft depths in order. At depth i, once the drafter has given each still
drafting row its confidence c_i (read before x_i is drawn), row b's slot i survives with probability
s_b = c_0 ... c_i (its running survival); the rows are taken in decreasing s_b, and the depth is admitted, for the
rows taken, when the rate

    E / (round cost)    E = Σ_rows (1 + Σ admitted survivals),   round cost = round overhead + draft steps + verify(width)

is at least what it was without it (the first slot of a new depth pays the whole width increment; later slots of
the same depth ride free in the padded pass, so the rate is compared over the cumulative set). A row gets no slot
at all when even its first does not pay: the round is a plain target step for it. Before paying another draft
step, the next depth's gain is predicted from each admitted row's survival times its latest confidence, and drafting
stops when that cannot pay for the step and the wider pass.

Before a round, whether to run the drafter at all: from each row's level, the chance that its next first slot is
accepted (`row_level`: the mean confidence of the first slots drafted so far times the row's own calibration), drafting
pays when those predicted first slots raise the rate above a plain step's. A round that does not draft costs the
drafter nothing (EAGLE-3 catches up on the verified slots in one pass when it next drafts), and the drafter is asked
again after n, 2n, 4n, ... such rounds, n chosen so that these probes cost at most a small share (`probe_share`) of
the time they save. Nothing known before a round tells whether its first slot will be accepted: on the demo's
EAGLE-3, every such score (the last first slot's confidence, its top-1 probability, its fate) ranked it at chance
(launch/bench_confidence.py). So the decision goes by a level, and by each row's own (`row_ratio`), weighted by how
far decoded rows were seen to differ. Until 2026-12-07 it decided from each row's last first-slot confidence. A block
drafter's spread (DSpark's, 0.05 to 0.4 around a mean of 0.19), and each low one stopped drafting for the backoff's
rounds where drafting paid: replayed over the demo's logged first slots, deciding from the level ran 1.054x and
1.069x of plain decoding with DSpark at T = 0 and 1, against 1.018x and 1.038x, and EAGLE-3's flat confidences
(0.15-0.18) came out level (launch/replay_schedule.py). Side by side on the machine, where the timings put DSpark's
break-even nearer its acceptance than the table did, the two rules came out level for both drafters
(docs/benchmarks.md, "Deciding to draft from a row's level").
A level is read off `level_slots` first slots at least before it may stop the drafter. (A decision from the pooled
level was run on the machine once before, and starved: admission then turned down every DSpark slot at T = 1, no
first slot was verified, the level stayed at its prior and every round paid a draft round, 0.88x. Admission now
counts the round's draft as paid, so a drafted round verifies its first slot unless it is near hopeless, and the
slots it turns down count toward the level too.)
The level is read high by `evidence` standard errors of its calibration (`ratio_error`) when deciding: a round stops
drafting only where the evidence that drafting loses is stronger than chance. Drafting where it does not pay verifies
slots and so corrects itself; not drafting verifies nothing but probes, so a level read low by a few unlucky slots
would keep a drafter that pays from drafting.

The table is measured once, in a minute of the machine's life, and a 2-core machine shared with others is not the
same machine a minute later (on one AMD EPYC the same plain batch-4 pass was timed at 57, 76 and 82 ms in three
tables of one day). So every round the engine's own timers report what the round cost (`timed`), and the schedule
corrects the table with it, per batch size: a plain pass, a wider pass, a draft round of one depth and each further
depth (from the rounds that drafted deeper, beyond a round of one depth: `step_time`) each get the mean of
(measured − table) over the rounds seen (a pass clipped to half or twice the table: a stall of the machine is not
its speed; a draft round that catches up on a prompt or on skipped rounds timed apart: it sets how long a probe
waits, not what a stretch of drafting costs), shrunk toward 0 by `cost_prior` rounds (a wider pass shrunk toward the
plain pass's correction, and above it by the table's increment as the paired timings correct it). Both sides of the
decision must be timed: a schedule that drafts every round times no plain pass, so while drafting pays by less than
`check_margin` (the decision hangs on the timings) it takes a plain round now and then (`check_every`, until
`check_rounds` plain passes are timed at that batch size, and beyond while what drafting gains is within
`check_errors` standard errors of the increment's estimate: its pairs are what tells a slot that pays from one that
does not). A table that made verifying two slots look as cheap as one, or a plain pass
look dearer than it is, is corrected after the few rounds that drafted on it. One that made a wider pass look dearer
than it is would never be: no wider pass is run to show it. So while fewer than `explore_rounds` wider passes are
timed at a batch size, a drafted round whose first slot does not pay by the table verifies the likeliest row's first
slot anyway, when that is predicted to cost at most `explore_margin` of the round's rate; and once plain and wider
passes have been timed one round apart, their paired difference corrects the wider pass's increment, up or down,
each pair held within `pair_window` of the estimate so far (a hiccup of the machine is not the increment), both
passes of one decode and neither a round's that caught up on skipped rounds (a probe's pass is dearer than drafting's)
(on one AMD EPYC, two tables measured minutes apart put a second slot at +0% and +12% of a 32 ms pass, and EAGLE-3
drafted on the first and never on the second; a third said +0% where pairs of rounds timed +8.9 ms).

What verification showed fades over a few hundred rounds (`memory_rounds`): a stretch of failed drafts (a domain
the drafter is weak in) does not keep it from drafting in the next, and without new rounds verified the confidences
are trusted again as the holdout calibrated them.

What the rounds teach (the online calibration, the timings, the backoff) is kept per sampling regime (`regime`: the
temperature, top-p and top-k the proposer decodes with): the drafter's confidences do not know the temperature, and a
sampled round costs more to draft than a greedy one.

Non-anticipating: whether slot i is verified depends on the confidences c_0..c_i of the rows, which the drafter
computes before drawing x_i, never on x_i or anything drawn after it; so the verifier's output keeps the target's
distribution (the chapter's slot-by-slot admission).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class CostTable:
    """Seconds of a target pass and of drafting, measured on this machine (`measure_costs`)."""

    verify: dict[int, dict[int, float]]
    """batch size -> slots per row (the padded width: last committed token + drafts) -> seconds of one target pass."""
    draft_step: dict[int, float] = field(default_factory=dict)
    """batch size -> seconds of one more draft depth (an EAGLE-3 step; a DSpark slot's heads)."""
    draft_round: dict[int, float] = field(default_factory=dict)
    """batch size -> seconds a round spends drafting whatever it admits (the drafter's update with the verified
    tokens, its first step or block pass)."""
    key: dict[str, str] = field(default_factory=dict)
    """What it was measured for (target, dtype, device, drafter)."""

    def __post_init__(self) -> None:
        self._memo: dict[tuple[int, int], float] = {}  # (width, batch) -> verify_time; not a field: never saved

    def _at(self, table: dict[int, float], batch: int) -> float:
        """Linear in the batch size between the measured ones (held flat outside them)."""
        sizes = sorted(table)
        if batch <= sizes[0]:
            return table[sizes[0]]
        if batch >= sizes[-1]:
            return table[sizes[-1]] * batch / sizes[-1]
        j = bisect.bisect_left(sizes, batch)
        lo, hi = sizes[j - 1], sizes[j]
        return table[lo] + (table[hi] - table[lo]) * (batch - lo) / (hi - lo)

    def verify_time(self, width: int, batch: int) -> float:
        # asked every round with the same few (width, batch): remembered, so a round that drafts nothing stays cheap
        if (width, batch) not in self._memo:
            self._memo[width, batch] = self._at({b: _width(row, width) for b, row in self.verify.items()}, batch)
        return self._memo[width, batch]

    def step_time(self, batch: int) -> float:
        return self._at(self.draft_step, batch) if self.draft_step else 0.0

    def round_time(self, batch: int) -> float:
        return self._at(self.draft_round, batch) if self.draft_round else 0.0

    def save(self, path: Path) -> None:
        """Written whole (to a temporary name, then renamed): ranks measuring the same table at once never read a
        half-written one."""
        from draftsmith.data.artifacts import atomic_write_text

        atomic_write_text(path, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> CostTable:
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CostTable:
        """A table as `save` writes it (or as eval.json and bench_schedule.json hold it), parsed."""
        to_int = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 (JSON keys are strings)
        return cls(
            verify={int(b): to_int(row) for b, row in raw["verify"].items()},
            draft_step=to_int(raw.get("draft_step", {})),
            draft_round=to_int(raw.get("draft_round", {})),
            key=raw.get("key", {}),
        )


def _width(row: dict[int, float], width: int) -> float:
    """A pass `width` slots wide, linear between the measured widths and extrapolated past the widest."""
    widths = sorted(row)
    if width in row:
        return row[width]
    if width > widths[-1]:
        a, b = widths[-2], widths[-1]
        return row[b] + (row[b] - row[a]) * (width - b) / (b - a)
    j = bisect.bisect_left(widths, width)
    lo, hi = widths[j - 1], widths[j]
    return row[lo] + (row[hi] - row[lo]) * (width - lo) / (hi - lo)


def _clipped(measured: float, table: float) -> float:
    """measured − table, with `measured` held to within half and twice the table: a round the machine stalled in (a
    collection, another process) says little about what the next round costs. A table entry of 0 (a drafter too cheap
    to time) is not clipped."""
    if table > 0:
        measured = min(max(measured, 0.5 * table), 2.0 * table)
    return measured - table


TIMED_KINDS = ("plain", "wide", "increment", "draft", "step", "catch-up")
"""The kinds of round whose cost a schedule's timings correct, per batch size (`CostSchedule.timed`)."""


def trimmed_mean(values: Sequence[float], trim: float) -> float:
    """The mean of `values` without the `trim` share at each end (int(trim · n) values; the plain mean under 1 / trim
    values)."""
    k = int(trim * len(values))
    kept = sorted(values)[k : len(values) - k]
    return sum(kept) / len(kept)


def trimmed_mean_error(values: Sequence[float], trim: float) -> float | None:
    """The standard error of `trimmed_mean(values, trim)` (None under 2 values): the winsorized standard deviation
    (each end's k = int(trim · n) values pulled in to the nearest kept one) over (1 − 2k/n)√n."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 2:
        return None
    k = int(trim * n)
    clipped = [min(max(x, ordered[k]), ordered[n - 1 - k]) for x in ordered]
    mean = sum(clipped) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in clipped) / (n - 1))
    return sd / ((1.0 - 2.0 * k / n) * math.sqrt(n))


class CostSchedule:
    """The per-round admission rule of a trained proposer (`TrainedProposer.schedule`)."""

    max_backoff = 64
    """Most rounds in a row without drafting before the drafter is asked again (to refresh its confidences)."""
    probe_share = 0.02
    """At most this share of a plain step's time, averaged over the rounds skipped, goes to asking a drafter that does
    not pay again: the first probe waits `draft round / (probe_share * plain step)` rounds (then twice as many, ...)."""

    prior = 4.0
    """Weight, in slots, of the online calibration's prior (predictions taken as right) against what was seen."""
    memory_rounds = 512.0
    """Rounds over which what verification showed fades: every round, drafted or not, the online calibration's sums are
    multiplied by 1 − 1/memory_rounds, so its ratio drifts back toward the prior (the holdout calibration taken as
    right) when nothing new is verified. Without it a stretch where drafts failed weighed on every later round: in one
    bench at T = 0 (an AMD EPYC) EAGLE-3 had 5 of 79 first slots accepted in extraction and then verified 3, 0 and 10
    slots in the next three domains, where the threshold rule had 20-23% of its first slots accepted, over the 15% the
    table priced them at. Replayed over 20 shuffled prompt orders (launch/replay_schedule.py): without fading 1.049x
    [0.998, 1.055] at T = 0 and 1.025x [0.998, 1.033] at T = 1; with 512 rounds 1.051x [1.034, 1.055] and 1.029x
    [1.018, 1.035]; 128 rounds gained as much where drafting paid and lost 0.5% where it did not (a table putting
    break-even at 25%: 0.995x against 0.999x without fading; 512 rounds: 0.998x / 0.997x)."""
    row_prior: float | None = 16.0
    """Weight, in predicted slots, of the pooled calibration (`ratio`) against a row's own verified slots in the ratio
    a decode's row has its predictions multiplied by (`row_ratio`), until `row_rows` rows have been decoded: from then
    on the weight is estimated from how far those rows' own ratios spread (`row_weight`). None: the pooled calibration
    alone. What a drafter's confidences predict is off by prompt, not only overall: the demo's EAGLE-3 at T = 0 said
    0.26-0.27 for its first slots in every domain, and had 9% of them accepted in extraction and 24% in roleplay and
    STEM; priced by the pooled calibration, spread over `memory_rounds` rounds of earlier prompts, it drafted nearly
    every round of extraction at 0.97x of plain decoding, and DSpark every round of coding (8% accepted) at 0.90x."""
    decide_by_level = True
    """Whether the decision to draft predicts a row's next first slot from its level (`row_level`: the mean
    first-slot confidence times the row's own calibration) rather than from its last first-slot confidence. A round's
    confidence is read after its draft; the next round's decision can only use an older one, and over 2,268 first
    slots of the demo's EAGLE-3 the last first slot's confidence ranked the next one's fate at chance (AUC 0.49). Read
    at face value, one low confidence turned drafting off for the backoff's 6-64 rounds where the row's drafts paid on
    average (docs/benchmarks.md, "Deciding to draft from a row's level")."""
    level_slots = 16
    """First slots a sampling regime drafts before its level (`first_slot_rate`, `row_level`) may stop drafting: each
    is predicted at 1 until then, as before any, so a round drafts wherever a sure first slot would pay (and a table
    where none can never drafts). A level read off fewer is one prompt's luck: DSpark's first slot of the demo's first
    eval prompt had a confidence of 0.06 (and 0.06 again at its first probe), against a mean of 0.19 over the eval
    (17.5% accepted, paying from 10%); that level stopped the drafter, and the probes (after 5, 10, 20, 40, then every
    64 skipped rounds) added a slot at a time too rarely to lift it: replayed in eval's order, 5 first slots verified
    in 1,100 rounds, 0.999x of plain decoding where drafting every round gave 1.064x. Counted per regime and never
    faded; it costs at most this many draft rounds of a drafter that does not pay (under 0.1 s at the demo's costs)."""
    evidence = 1.0
    """How many standard errors of the first slots' online calibration (`ratio_error`) the decision to draft reads it
    high by: a round stops drafting only where even that optimistic level does not pay, so the evidence that drafting
    loses must be stronger than chance. The two mistakes are not alike. Drafting where it does not pay verifies slots,
    so the level learns it and the loss stops; not drafting where it pays verifies nothing but a probe every
    `max_backoff` rounds, so a level read low by a few unlucky slots stays low. On an AMX Xeon, the demo's EAGLE-3 at
    T = 0 had 3 of 24 first slots accepted in its first prompt, read its level at 0.13 against a break-even of 0.13-0.16,
    and drafted 20 of 461 rounds in the next four domains; drafting one slot every round, it had 22% of its first
    slots accepted over the bench's prompts. DSpark at T = 1 stopped after 16 first slots, at 0.13-0.16 against
    0.18-0.20. The optimism shrinks as slots are verified and grows again as what they showed fades
    (`memory_rounds`), so a stop is tried again in time.
    0: the level as estimated (the rule before 2026-12-07's fifth session)."""
    row_rows = 8
    """Decoded rows with verified first slots from which the spread of rows' own ratios sets the weight (`row_weight`);
    the last `row_memory` are kept."""
    row_memory = 256
    """Decoded rows whose (predicted, accepted) first slots `row_weight` estimates from."""
    row_weight_range = (2.0, 64.0)
    """Bounds of the estimated weight: a few rows can make the spread look near 0 (weight unbounded) or huge."""
    cost_prior = 2.0
    """Weight, in rounds, of the cost table against the times measured on this schedule's own rounds (`timed`): small,
    since a table measured in one minute can be 20-40% off a minute later, while one round's timing is off by a few
    percent (and clipped when the machine stalls)."""
    pair_window = 0.2
    """Most that one pair of a plain and a wider pass (`_paired`) may say the increment is off its estimate so far, as
    a share of the table's plain pass: a pair beyond it counts at that bound. A pair's two passes are one round apart,
    and a hiccup of the machine in one of them (well inside the single pass's clip at twice the table) is not the
    increment: on an AMX Xeon, EAGLE-3's first pair at T = 0 timed a pass two slots wide 32 ms over a 39 ms plain one,
    where the next pairs timed +1.0 and +0.3 ms; shrunk by `cost_prior`, it priced a second slot at +11.9 ms, a first
    slot paid from 41% acceptance, and the schedule did not draft for about 450 rounds, in which its probes timed 5
    pairs more. A wider pass dear for good moves the window with the estimate, a bound per pair (+0.2, +0.27, +0.32, ...
    for a table 0.46 under the machine's): it is learned in a few pairs more, not missed."""
    pair_trim = 0.2
    """Share of the pairs at each end left out of the increment's estimate (a trimmed mean, `_pair_estimate`): a pair
    is two passes a round apart, and one pass in a slow moment of the machine moves it by more than the increment.
    Timed pair by pair on an AMX Xeon (EAGLE-3, 18 eval prompts, a plain round after every 3 drafted ones), pairs
    spread by 3.9 ms (one standard deviation) around an increment of 1.4-1.8 ms."""
    pair_memory = 256
    """Pairs per batch size the increment is estimated from (the last ones): the machine's speed drifts, and the
    increment with it."""
    check_margin = 0.25
    """While drafting is predicted to raise the rate by less than this share, the decision hangs on the timings, and
    the plain pass is timed too (a plain round in place of a drafted one, every `check_every` drafted rounds)."""
    check_every = 4
    """Drafted rounds between two plain rounds taken to time the plain pass (while the margin is under
    `check_margin`)."""
    check_rounds = 16
    """Plain passes timed at a batch size after which plain rounds are taken only while the increment is too unsure
    for the decision (`check_errors`)."""
    check_errors = 2.0
    """Plain rounds go on being taken past `check_rounds` while what drafting gains per round, in seconds, is under
    this many standard errors of the increment's estimate (`pair_error`): the pairs each check times are what tells
    a slot that pays from one that does not, and a check costs little where drafting gains little. Stopped at 16, a
    bench's EAGLE-3 at T = 0 (an AMX Xeon, 54 eval prompts) priced a second slot by 16 pairs at +0.7 ms, where pass by
    pass it cost +1.8-2.0 ms (a standard error of about 1 ms at 16 pairs): drafting paid from 11% by its reckoning and
    from about 14% on the machine, and extraction, its first slots accepted 12% of the time, ran at 0.96x of plain
    decoding; at T = 1, 22 pairs said +5.2 ms, 18%, and it stopped drafting in writing at 17%."""
    explore_rounds = 4
    """Wider passes timed at a batch size below which a drafted round that admits nothing verifies one slot anyway,
    to time a wider pass (a table can make it look dearer than it is, and nothing else would run one)."""
    explore_margin = 0.25
    """Most share of a round's predicted rate such a round may give up to time a wider pass."""

    # what the rounds teach, per sampling regime (`_learned` says what each is, `regime` swaps them)
    backoff: int
    skipped: int
    excess: dict[int, dict[str, list[float]]]
    pairs: dict[int, list[float]]
    since_plain: dict[int, int]
    checks: dict[int, int]
    probes: dict[int, int]
    explores: dict[int, int]
    predicted: list[float]
    accepted: list[float]
    verified: list[float]
    declined: list[float]
    slots: int
    decoded: list[tuple[float, float]]
    row_weight_now: float | None

    def __init__(self, costs: CostTable, learn_costs: bool = True):
        self.costs = costs
        self.learn_costs = learn_costs
        """Correct the table with the engine's timings of the rounds run (off: the table alone, for tests that script
        decisions on a table of made-up seconds)."""
        self.halted = False
        self.last: tuple[int, int, int] | None = None  # (batch, width, draft steps; -1: not drafted) of this round
        self.behind = False  # this round's drafter update is a catch-up (`catching_up`)
        # per batch size, the last pass of this decode that a pair may take (plain/wide, its excess): `timed`
        self.previous: dict[int, tuple[str, float]] = {}
        self.batch = 0
        # what the rounds teach (see `_learned`), per sampling regime (`regime`); the current one's as attributes
        self.sampling: Hashable = None
        self.regimes: dict[Hashable, dict[str, Any]] = {}
        self.__dict__.update(self._learned())
        self.row_sums: dict[int, tuple[list[float], list[float]]] = {}  # row -> per depth (Σ predicted, Σ accepted)
        self.reset()

    @staticmethod
    def _learned() -> dict[str, Any]:
        """What a schedule learns from the rounds it decides, before any: the backoff and the rounds skipped since
        the last probe (kept across decodes: `reset`); per batch size, (sum of measured − table, rounds) of plain
        passes, wider passes, the increment of neighbouring ones (and the last `pair_memory` pairs it is estimated
        from, `pairs`), draft rounds of one depth, the further depths of deeper ones (per depth) and catch-ups, the
        drafted rounds timed since the last plain pass (`since_plain`), the plain rounds taken in place of drafted ones
        to time it (`checks`),
        the rounds that asked a drafter that did not pay again (`probes`) and the slots verified only to time a wider
        pass (`explores`); and the online calibration, per
        depth i: the predicted survival Σ c_0...c_i of the slots verified so far, how many of them were accepted and
        how many verified, and (Σ confidence, count) of the first slots admission turned down (`declined`, for
        `first_slot_rate`) (kept across decodes, fading over `memory_rounds` rounds: only rounds already verified
        count, never this one's); the (predicted, accepted) first slots of the rows decoded so far (`decoded`) and
        the weight they set for a row's own slots (`row_weight_now`, `row_weight`; None before any decode)."""
        return {
            "backoff": 1,
            "skipped": 0,
            "excess": {},
            "pairs": {},
            "since_plain": {},
            "checks": {},
            "probes": {},
            "explores": {},
            "predicted": [],
            "accepted": [],
            "verified": [],
            "declined": [0.0, 0.0],
            "slots": 0,
            "decoded": [],
            "row_weight_now": None,
        }

    def regime(self, sampling: Hashable) -> None:
        """The sampling the coming rounds decode with (the proposer passes its temperature, top-p and top-k): what the
        rounds teach (`_learned`) is kept per sampling. A drafter's confidences do not know the temperature (EAGLE-3's
        first slots were accepted 17% of the time at T = 0 and 13% at T = 1 on the same confidences, on an AMD EPYC),
        and a sampled round costs more to draft than a greedy one (drawing from q over the target's vocabulary: a
        6 ms EAGLE-3 round took 2 ms more). Learned at one temperature and kept at the next, both made drafting at
        T = 1 look as good as at T = 0, where it lost."""
        if sampling == self.sampling:
            return
        self.regimes[self.sampling] = {k: getattr(self, k) for k in self._learned()}
        self.__dict__.update(self.regimes.get(sampling) or self._learned())
        self.sampling = sampling

    def observe(self, confidences: list[list[float]], accepted: list[int]) -> None:
        """A verified round: row b drafted with confidences `confidences[b]` and had `accepted[b]` drafts accepted."""
        for b, (confs, n) in enumerate(zip(confidences, accepted)):
            self.slots += bool(confs)
            mine = self.row_sums.setdefault(b, ([], []))
            survival = 1.0
            for i, c in enumerate(confs):
                if i == len(self.predicted):
                    self.predicted.append(0.0)
                    self.accepted.append(0.0)
                    self.verified.append(0.0)
                if i == len(mine[0]):
                    mine[0].append(0.0)
                    mine[1].append(0.0)
                survival *= c
                self.predicted[i] += survival
                self.accepted[i] += float(n > i)
                self.verified[i] += 1.0
                mine[0][i] += survival
                mine[1][i] += float(n > i)

    def ratio(self, i: int) -> float:
        """What depth i's predicted survivals are multiplied by: accepted / predicted so far, shrunk toward 1 by
        `prior`. Confidences calibrated at another temperature or on other text (EAGLE-3's head at T = 1 predicted
        0.3 where 0.07 was accepted) are corrected from what verification has shown, one round late."""
        if i >= len(self.predicted):
            return 1.0
        return (self.accepted[i] + self.prior) / (self.predicted[i] + self.prior)

    def ratio_error(self) -> float:
        """The standard error of the first slots' pooled ratio (`ratio(0)`). Verified first slots of predicted survival
        P in all (faded), of which A were accepted, give ρ = (A + k) / (P + k) (k the `prior`); A varies by chance about
        ρP(1 − ρc̄) (c̄ the mean first-slot confidence, as in `row_weight`), so ρ by √(ρ(1 − ρc̄) / (P + k)): wide
        after a few slots, narrow after many."""
        predicted = self.predicted[0] if self.predicted else 0.0
        verified = self.verified[0] if self.verified else 0.0
        rho = self.ratio(0)
        mean = predicted / verified if verified else 0.0
        return math.sqrt(max(rho * (1.0 - min(rho * mean, 1.0)), 0.0) / (predicted + self.prior))

    def row_ratio(self, i: int, b: int, lift: float = 0.0) -> float:
        """What row b's predicted survivals at depth i are multiplied by: its own accepted / predicted over this
        decode's verified rounds, shrunk toward the pooled `ratio(i)` (plus `lift`) by `row_prior` predicted slots
        (the pooled ratio alone before the row has verified anything)."""
        pooled = self.ratio(i) + lift
        mine = self.row_sums.get(b)
        if self.row_prior is None or mine is None or i >= len(mine[0]):
            return pooled
        predicted, accepted = mine[0][i], mine[1][i]
        # the weight estimated as this decode started (`row_weight`), `row_prior` before it can be
        weight = self.row_prior if self.row_weight_now is None else self.row_weight_now
        return (accepted + weight * pooled) / (predicted + weight)

    def row_weight(self) -> float | None:
        """The weight of the pooled ratio against a row's own verified slots, estimated from the rows decoded so far
        (empirical Bayes, by the method of moments): a row with predicted survival P over its first slots has A of
        them accepted, A ≈ Poisson-binomial with mean ρ_row P and variance ρ P (1 − ρ c̄) (ρ the pooled ratio, c̄ the
        mean first-slot confidence); rows' own ratios ρ_row spread around ρ with variance τ² = Σ [(A − ρP)² −
        ρP(1 − ρc̄)] / Σ P², and the posterior mean of a row's ratio is (A + w ρ) / (P + w) with w = ρ(1 − ρc̄) / τ².
        Rows that differ little (next to what chance makes of a row's few slots) get a large weight: their own
        slots barely move the pooled ratio; rows that differ much, a small one. None before `row_rows` rows (or with
        `row_prior` None); bounded by `row_weight_range`. Over the demo's 18 eval prompts (64-token answers) it came
        to 11 for EAGLE-3 and 7.5 for DSpark at T = 0, and to the bound, 64, at T = 1, where the prompts' first-slot
        acceptance differed by no more than chance (docs/benchmarks.md, "Each row's own calibration")."""
        rows = [(p, a) for p, a in self.decoded if p > 0]
        if self.row_prior is None or len(rows) < self.row_rows or not self.verified or not self.verified[0]:
            return None
        rho, c = self.ratio(0), self.predicted[0] / self.verified[0]
        chance = max(rho * (1.0 - rho * c), 1e-6)
        spread = sum((a - rho * p) ** 2 - chance * p for p, a in rows) / sum(p * p for p, _ in rows)
        low, high = self.row_weight_range
        return high if spread <= chance / high else max(chance / spread, low)

    def row_ratios(self, i: int, batch: int) -> torch.Tensor:
        """`row_ratio(i, b)` of every row b of a batch of `batch` [batch] (float64)."""
        return torch.tensor([self.row_ratio(i, b) for b in range(batch)], dtype=torch.float64)

    def first_slot_rate(self, lift: float = 0.0) -> float:
        """The chance that a first draft is accepted, for a row that has not drafted yet (a new decode): the mean
        confidence of the first slots drafted so far, verified or turned down by admission, times the online
        calibration's `ratio(0)`, which is what admission predicts for a first slot of that confidence (1 before any:
        the first round drafts, to learn). The row's own first confidence does not exist before its first round.

        The slots turned down count. Predicted from the first slots verified alone (the share accepted, shrunk toward
        1), a drafter whose every first slot admission declined verified none, its rate stayed at its prior of 1, and
        every new decode's first round caught up on its prompt only to decline again (DSpark on an AMX Xeon: one of
        its ~9 ms catch-ups per decode, with no slot verified)."""
        return self.row_level(None, lift)

    def row_level(self, b: int | None, lift: float = 0.0) -> float:
        """The chance that row b's next first slot is accepted, before it is drafted: the mean confidence of the first
        slots drafted so far (verified or turned down) times the row's own calibration (`row_ratio`; the pooled
        `ratio` for b None, or before the row has verified first slots of its own), the pooled ratio read `lift`
        high; 1 before any slot (draft, to learn)."""
        confidence = (self.predicted[0] if self.verified else 0.0) + self.declined[0]
        drafted = (self.verified[0] if self.verified else 0.0) + self.declined[1]
        if not drafted:
            return 1.0
        ratio = self.ratio(0) + lift if b is None else self.row_ratio(0, b, lift)
        return min(confidence / drafted * ratio, 1.0)

    def reset(self) -> None:
        """A new decode. The backoff and the rounds skipped since the last probe are kept, like the online calibration:
        a drafter that did not pay on the last prompts is probed as rarely on the next, and no more rarely (each
        decode's first round is decided from its calibrated prior, and a row whose drafts pay resets the backoff at
        once). Counted from 0 at every decode, the skipped rounds never reached a backoff longer than a decode: in a
        bench of 64-token answers (about 60 rounds each), DSpark's backoff reached its cap of 64 at T = 1 and the
        drafter was never asked again, through 8 domains and about 2,000 rounds (docs/benchmarks.md, 2026-12-07,
        third session). A catch-up said of a round that was never timed (a proposer driven outside the engine) does not
        mark the new decode's first timed round."""
        self.behind = False
        self.previous = {}  # a pair never spans two decodes: their contexts differ by the prompts' spread
        # the last decode's rows, for the weight of a row's own slots (`row_weight`), with the regime they ran in
        for predicted, accepted in self.row_sums.values():
            if predicted:
                self.decoded.append((predicted[0], accepted[0]))
        del self.decoded[: -self.row_memory]
        self.row_weight_now = self.row_weight()
        self.row_sums = {}

    def worth_drafting(self, c0: torch.Tensor | Sequence[float], active: torch.Tensor | Sequence[bool]) -> bool:
        """Whether this round runs the drafter at all, from each active row's level (`row_level`; with
        `decide_by_level` off, its first-slot confidence of the last round it drafted, `c0` [B], times its
        calibration; NaN in `c0`: the row has not drafted in this decode, and is predicted at `first_slot_rate`):
        drafting pays when the rows' predicted first slots raise the rate above a plain step's. Until the regime has
        seen `level_slots` first slots, each is predicted at 1 (a round drafts wherever a sure first slot would pay).
        A round that does not draft skips all drafter work; after `backoff` such rounds the drafter is asked again
        (doubling while it keeps not paying, up to `max_backoff`), so a row whose text turns predictable is noticed.
        Only the rows that drafted in this decode reset the backoff: a new decode drafted on the pooled
        `first_slot_rate` does not, so a drafter that stopped paying on the last prompts is not probed from scratch
        on every new one.

        Runs every round, drafted or not, so it is plain Python over at most a few numbers per row: a skipped round
        should cost what a plain step costs."""
        rows = [bool(a) for a in (active.tolist() if isinstance(active, torch.Tensor) else active)]
        batch, n = len(rows), sum(rows)
        self._fade()
        lift = self.evidence * self.ratio_error()  # stop only where even a level read this high does not pay
        pooled = self.first_slot_rate(lift)
        # until a level can be told from luck, every row's first slot is predicted at 1, as before any was seen
        learning = self.slots < self.level_slots
        seen = new = 0.0  # predicted first slots of the rows that drafted before, and of the new rows
        for b, (c, a) in enumerate(zip(c0.tolist() if isinstance(c0, torch.Tensor) else c0, rows)):
            if a and math.isnan(c):
                new += 1.0 if learning else pooled
            elif a and learning:
                seen += 1.0
            elif a:
                seen += self.row_level(b, lift) if self.decide_by_level else min(c * self.row_ratio(0, b, lift), 1.0)
        plain_step = self.verify_time(1, batch)
        plain = n / plain_step
        pass_cost = self.round_time(batch) + self.verify_time(2, batch)
        self.last = (batch, 1, -1)  # a round that does not draft: one plain pass (until `begin` says otherwise)
        if (n + seen + new) / pass_cost >= plain:
            if (n + seen) / pass_cost >= plain:  # the rows' own confidences say it pays: no backoff
                self.backoff = 1
                gain = (n + seen) / plain - pass_cost  # seconds a drafted round could cost more and still pay
                if (n + seen) / pass_cost < plain * (1 + self.check_margin) and self._check_plain(batch, gain):
                    self.checks[batch] = self.checks.get(batch, 0) + 1
                    return False  # a plain round, to time the plain pass: the backoff and skip count stay
            self.skipped = 0
            return True
        # a probe costs a draft round: wait until the rounds skipped since the last one make it a small share
        floor = math.ceil(self.probe_time(batch) / (self.probe_share * plain_step))
        self.backoff = min(max(self.backoff, floor), self.max_backoff)
        if self.skipped >= self.backoff:  # probe, after `backoff` skipped rounds: decided by that count alone
            self.skipped, self.backoff = 0, min(2 * self.backoff, self.max_backoff)
            self.probes[batch] = self.probes.get(batch, 0) + 1
            return True
        self.skipped += 1
        return False

    def _fade(self) -> None:
        """One round older: the online calibration's sums times 1 − 1/`memory_rounds` (a few numbers per depth)."""
        keep = 1.0 - 1.0 / self.memory_rounds
        for sums in (
            self.predicted,
            self.accepted,
            self.verified,
            self.declined,
            *(x for r in self.row_sums.values() for x in r),
        ):
            sums[:] = [x * keep for x in sums]

    def _check_plain(self, batch: int, gain: float) -> bool:
        """Whether this drafted round should be a plain one instead, to time the plain pass and, with the drafted
        round before it, a pair: at least `check_every` drafted rounds since the last plain pass at this batch size,
        the last of them pairable (not a catch-up), and fewer than `check_rounds` plain passes timed in all, or `gain`
        (the seconds a drafted round could cost more and still pay) under `check_errors` standard errors of the
        increment (`pair_error`)."""
        seen = self.excess.get(batch)
        if not self.learn_costs or seen is None:
            return False
        # only right after a drafted round's pass that a pair may take, and `check_every` drafted rounds after the
        # last plain pass: checked against the plain passes timed overall, a schedule that had long drafted without
        # checks took one every other round once checks resumed, each after the catch-up of the last, and no pair
        # formed (37 pairs from 536 checks, in a bench on an AMX Xeon)
        last = self.previous.get(batch)
        if last is None or last[0] != "wide" or self.since_plain.get(batch, 0) < self.check_every:
            return False
        if seen["plain"][1] < self.check_rounds:
            return True
        error = self.pair_error(batch)
        return error is not None and gain < self.check_errors * error

    def _shrunk(self, batch: int, kind: str, toward: float = 0.0) -> float:
        """The mean of measured − table over the rounds seen of this kind, shrunk toward `toward`."""
        total, n = self.excess.get(batch, {}).get(kind, (0.0, 0.0))
        return (total + self.cost_prior * toward) / (n + self.cost_prior)

    def verify_time(self, width: int, batch: int) -> float:
        """The table's pass time corrected by this schedule's measured rounds. A wider pass is the plain pass plus the
        table's increment, corrected by what plain and wider passes timed a round apart show (`_paired`), up or down.
        Before any such pair, the wider passes' own mean also counts, as a floor: it takes the plain pass's correction
        until wider passes have been timed (a machine running slower now is slower at every width). (A schedule that
        drafts every round times no plain pass; had wider passes timed below the table made them as cheap as the plain
        pass's stale figure, drafting would look free.)

        Once pairs exist, that mean no longer counts: it mixes the increment with the machine's speed in the minutes
        the wider passes ran, and nothing refreshes it once drafting stops. On an AMX Xeon, in a bench whose first
        minutes ran slow, EAGLE-3's 13 wider passes averaged 21 ms over the table while its plain passes averaged
        7 ms under it and 11 pairs put the increment at +5.5 ms; as a floor, that mean priced a second slot at 24 ms
        over a plain pass, and EAGLE-3 never drafted again at T = 0 (τ 1.00 over 1,120 rounds, where its own eval had
        drafted at τ 1.22; docs/benchmarks.md, "A slow first minute")."""
        plain_excess = self._shrunk(batch, "plain")
        table_plain = self.costs.verify_time(1, batch)
        plain = table_plain + plain_excess
        if width == 1:
            return plain
        table = self.costs.verify_time(width, batch)
        paired = self._paired(batch)
        if paired is not None:
            return plain + table - table_plain + paired
        return max(table + self._shrunk(batch, "wide", plain_excess), plain + table - table_plain)

    def _paired(self, batch: int) -> float | None:
        """How much more (or less) than the table the increment of a wider pass over a plain one is, as timed (None
        before any pair is timed at this batch size): the trimmed mean (`pair_trim`, over the last `pair_memory`) over
        pairs of a plain and a wider pass timed one round apart of (wider excess − plain excess), each held within
        `pair_window` of the estimate before it, shrunk toward 0 by `cost_prior` pairs, and never below a plain pass.
        Paired, not the difference of the two means: the plain passes are timed in a few stretches (the skipped rounds,
        the checks) and the wider ones in others, and a 2-core machine shared with others changes speed by more than
        the increment between them. Both ways, on one AMD EPYC:
        - plain passes timed early at 65 ms against wider ones averaging 62 over the minutes after made a second slot
          look free, where side by side it cost +4 ms, 7% (EAGLE-3 drafted at T = 1 at 0.96x of plain decoding);
        - a table measured a pass 2 slots wide at what a plain one took (66.3 ms both), so a first slot paid from 8%
          acceptance; the means of the rounds said the same (wider passes 6.7 ms under it, plain ones 1.1), while 14
          pairs put the second slot at +8.9 ms; EAGLE-3 drafted every round, at 0.91x of plain decoding in one domain.
          Taken only to lower the increment (as they were then), the pairs left that table as it was.

        Both passes of a pair are of one decode (`reset`: the contexts of two decodes differ by the prompts' spread),
        and neither is the pass of a round that caught up on skipped rounds or a prompt (`catching_up`). Where drafting
        has stopped, every wider pass is a probe's, right after such a catch-up, and it is not the pass a stretch of
        drafting pays: on an AMX Xeon (launch/bench_round_pairs.py, both drafters at T = 0 and 1), a probe's target pass
        after 12 or 13 skipped rounds took 0.8 ms more than a drafted round's after a drafted one (the mean of 8
        medians, −0.3 to +2.4 ms), and its pairs put the increment 1.3 ms above the pairs of a plain round after a
        drafted one (2.4 against 1.1 ms, medians). Paired, the probes of a stall priced a slot by what switching
        costs, about 2 points of break-even on a 57 ms pass, and so held the stall. A stall now times no pair: its
        increment stays what drafting last timed."""
        seen = self.excess.get(batch)
        if seen is None or not seen["increment"][1]:
            return None
        diff, n = seen["increment"]
        table = self.costs.verify_time(2, batch) - self.costs.verify_time(1, batch)
        return max(diff / (n + self.cost_prior), -table)

    def _pair(self, batch: int, diff: float) -> None:
        """One pair's wider − plain excess over the table: held within `pair_window` of the estimate so far (one
        hiccup of the machine is not the increment), kept with the last `pair_memory`, and the increment's correction
        (`excess["increment"]`, as `corrections` reports it and `_paired` reads it) set to their trimmed mean times
        their count."""
        seen = self._timings(batch)
        diff_sum, n = seen["increment"]
        so_far, window = diff_sum / (n + self.cost_prior), self.pair_window * self.costs.verify_time(1, batch)
        pairs = self.pairs.setdefault(batch, [])
        pairs.append(min(max(diff, so_far - window), so_far + window))
        del pairs[: -self.pair_memory]
        seen["increment"] = [self._pair_estimate(pairs) * len(pairs), float(len(pairs))]

    def _pair_estimate(self, pairs: Sequence[float]) -> float:
        """The increment's correction from `pairs`: their `trimmed_mean`."""
        return trimmed_mean(pairs, self.pair_trim)

    def pair_error(self, batch: int) -> float | None:
        """The standard error of the increment's correction at this batch size (`trimmed_mean_error` of its pairs)."""
        return trimmed_mean_error(self.pairs.get(batch, ()), self.pair_trim)

    def round_time(self, batch: int) -> float:
        """The table's draft round corrected by the measured rounds of one depth that followed a drafted round (the
        update with the last round's verified tokens, the first depth and the drafter's bookkeeping): what each round
        of a stretch of drafting costs (deeper rounds correct `step_time`).
        A catch-up is timed apart (`probe_time`): counted here, one probe's catch-up over the prompts of 64 rows and
        the rounds skipped (+415 ms on a 13 ms round, on an AMX Xeon) made every later round look 10x dearer to draft."""
        return max(self.costs.round_time(batch) + self._shrunk(batch, "draft"), 0.0)

    def step_time(self, batch: int) -> float:
        """The table's draft step corrected by the measured rounds that drafted deeper than one depth: per further
        depth, what such a round took beyond a round of one depth (`round_time`), shrunk toward 0 by `cost_prior`
        rounds. Timed apart from the draft round because the table's step is a least-squares slope over rounds of 1 to
        γmax depths, and the first further depth costs more than the slope: on an AMX Xeon, EAGLE-3's first step took
        2.6 ms after its update and the fourth 1.9 (the drafter's weights, evicted by the target's pass, are read back
        from memory by the first ones), against a slope of 2.3 ms, and in eval, with admission's own work, a round of
        two depths took 3.3 ms more than one of one depth. Lumped into the draft round, that excess made drafting at all
        look dearer while a second slot still looked as cheap as the table said. EAGLE-3 at T = 0 then verified a
        second slot in 346 of 932 rounds, at a survival near a tenth or less, which did not pay for it: 1.036x of plain
        decoding where one slot every round ran at 1.052x, and 1.046x with the step priced apart; at T = 1 the dearer
        rounds stopped it drafting in 63% of its rounds, 0.992x against 1.022x (docs/benchmarks.md)."""
        return max(self.costs.step_time(batch) + self._shrunk(batch, "step"), 0.0)

    def probe_time(self, batch: int) -> float:
        """What asking the drafter again after skipped rounds costs: the table's draft round corrected by the
        measured catch-ups (the drafter's pass over the prompt or the rounds it skipped, in one go), shrunk toward
        the correction of the rounds that did not catch up. Sets how many rounds a probe waits."""
        toward = self._shrunk(batch, "draft")
        return max(self.costs.round_time(batch) + self._shrunk(batch, "catch-up", toward), 0.0)

    def break_even(self, batch: int) -> float:
        """The first-slot acceptance p from which drafting one slot per row beats a plain step at this batch size, by
        the table as corrected so far: (1 + p) tokens per (2-wide pass + draft round) against 1 per plain pass, the
        comparison `worth_drafting` makes."""
        return (self.verify_time(2, batch) + self.round_time(batch)) / self.verify_time(1, batch) - 1.0

    @classmethod
    def as_timed(cls, costs: CostTable, corrections: dict) -> CostSchedule:
        """A schedule holding what an eval's rounds timed (`corrections` as it reports them, or as eval.json keeps
        them: string batch sizes), so `break_even` and the times read the table as that eval corrected it. Learns
        nothing more."""
        schedule = cls(costs, learn_costs=False)
        for b, kinds in corrections.items():
            seen = schedule._timings(int(b))
            for kind, said in kinds.items():
                seen[kind] = [said["excess_s"] * said["rounds"], said["rounds"]]
        return schedule

    def _timings(self, batch: int) -> dict[str, list[float]]:
        """(sum of measured − table, rounds) per kind of round (`TIMED_KINDS`) at this batch size, empty at first."""
        return self.excess.setdefault(batch, {kind: [0.0, 0.0] for kind in TIMED_KINDS})

    def catching_up(self) -> None:
        """Called by the proposer when this round's drafter update runs over more than the last round's verified slots
        (a new decode's prompt, or rounds it skipped): its drafting time is a catch-up, timed apart."""
        self.behind = True

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        """The round just run took `verify_seconds` in its target pass and `draft_seconds` drafting (the engine's
        timers): what it cost beyond the table is remembered for its batch size. Rounds this schedule did not decide
        (a tree, a chain drafted without `worth_drafting`) are ignored."""
        behind, self.behind = self.behind, False
        if self.last is None or not self.learn_costs:
            self.last = None
            return
        batch, width, steps = self.last
        self.last = None
        seen = self._timings(batch)
        kind = "plain" if width == 1 else "wide"
        self.since_plain[batch] = 0 if kind == "plain" else self.since_plain.get(batch, 0) + 1
        excess = _clipped(verify_seconds, self.costs.verify_time(width, batch))
        seen[kind][0] += excess
        seen[kind][1] += 1
        # a plain and a wider pass timed one after the other, a round apart: their difference is the increment as
        # the machine runs now, whatever its speed did between the minutes the two means were taken over. Not the
        # pass of a round that caught up (a probe after skipped rounds, a decode's first drafted round): it is not
        # the pass a stretch of drafting pays (`_paired`)
        before = self.previous.pop(batch, None)
        if not behind:
            if before is not None and before[0] != kind:
                wide, plain = (excess, before[1]) if kind == "wide" else (before[1], excess)
                self._pair(batch, wide - plain)
            self.previous[batch] = (kind, excess)
        if steps < 0:
            return
        table_step = self.costs.step_time(batch)
        if behind:  # not clipped: a catch-up over many skipped rounds is dear
            seen["catch-up"][0] += draft_seconds - self.costs.round_time(batch) - steps * table_step
            seen["catch-up"][1] += 1
        elif steps == 0:  # a round of one depth: what drafting at all costs
            seen["draft"][0] += draft_seconds - self.costs.round_time(batch)
            seen["draft"][1] += 1
        else:  # deeper: what it took beyond a round of one depth (as corrected so far), per further depth
            seen["step"][0] += (draft_seconds - self.round_time(batch) - steps * table_step) / steps
            seen["step"][1] += 1

    def corrections(self) -> dict[int, dict[str, dict[str, float]]]:
        """What the rounds timed so far said the table missed, over every sampling regime (`regime`): per batch size
        and kind of round (plain pass, wider pass, the increment of a wider pass over a plain one timed a round apart,
        draft round, catch-up: a draft round over a prompt or skipped rounds), the mean measured − table in seconds and
        the rounds it is over (for the report); the plain passes also say how many of them were taken in place of a
        drafted round to time it (`checks`), the catch-ups how many were probes of a drafter that did not pay
        (`probes`), the wider passes how many verified a slot only to time one (`explores`)."""
        return merge_corrections([_said(state) for state in self._states().values()])

    def regime_corrections(self, sampling: Hashable) -> dict[int, dict[str, dict[str, float]]]:
        """`corrections` of the rounds of one sampling regime alone (`regime`; {} when none ran in it)."""
        state = self._states().get(sampling)
        return _said(state) if state is not None else {}

    def _states(self) -> dict[Hashable, dict[str, Any]]:
        """What the rounds taught (`_learned`), per sampling regime, the current one's included."""
        return {**self.regimes, self.sampling: {k: getattr(self, k) for k in self._learned()}}

    def begin(self, drafting: torch.Tensor) -> None:
        """A new round for the rows in `drafting` (bool [B])."""
        self.batch = int(drafting.shape[0])
        if self.last is not None:  # decided by `worth_drafting`: this round drafts
            self.last = (self.batch, 1, 0)
        self.rows = int(drafting.sum())
        self.expected = float(self.rows)  # every active row commits at least one token per pass
        self.width = 1  # the last committed token
        self.steps = 0
        self.halted = False

    def _cost(self, width: int, steps: int) -> float:
        b = self.batch
        return self.round_time(b) + steps * self.step_time(b) + self.verify_time(width, b)

    def admit(self, i: int, conf: torch.Tensor, survival: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """The rows that draft slot i, from their confidences `conf` [B] of slot i (read before x_i is drawn) and
        running survivals [B]; sets `halted` when drafting another depth cannot pay."""
        self.steps = i  # depth 0 comes with the round's drafting (draft_round); each later depth is one step
        raw = (survival * conf).where(drafting, torch.zeros_like(conf))
        s = (raw * self.row_ratios(i, len(raw))).clamp(max=1.0)  # the calibrated survival of slot i
        order = [b for b in torch.argsort(s, descending=True, stable=True).tolist() if drafting[b] and s[b] > 0]
        rate = self.expected / self._cost(self.width, self.steps)
        wider = self._cost(self.width + 1, self.steps)
        taken, gain, best, best_gain = [], 0.0, 0, 0.0
        for b in order:
            taken.append(b)
            gain += float(s[b])
            if (self.expected + gain) / wider >= rate and gain > best_gain:
                best, best_gain = len(taken), gain
        if i == 0 and not best and order and self._explore(rate, wider, float(s[order[0]])):
            best, best_gain = 1, float(s[order[0]])
            self.explores[self.batch] = self.explores.get(self.batch, 0) + 1
        admitted = torch.zeros_like(drafting)
        if best:
            admitted[torch.tensor(taken[:best])] = True
            self.expected += best_gain
            self.width += 1
        if i == 0:  # first slots turned down: their confidence counts toward `first_slot_rate` too
            for b in taken[best:]:
                self.declined[0] += float(raw[b])
                self.declined[1] += 1.0
                self.slots += 1
        if self.last is not None:  # depth i was drafted (admitted or not): i steps past the round's first
            self.last = (self.batch, self.width, i)
        # another depth: each admitted row's next slot survives with about its survival times its latest confidence
        later_ratios = self.row_ratios(i + 1, len(raw))
        nxt = float((raw * conf * later_ratios).clamp(max=1.0).where(admitted, torch.zeros_like(conf)).sum())
        later = self._cost(self.width + 1, i + 1)
        self.halted = not best or (self.expected + nxt) / later < self.expected / self._cost(self.width, self.steps)
        return admitted

    def _explore(self, rate: float, wider: float, survival: float) -> bool:
        """Whether a drafted round whose first slot does not pay verifies the likeliest one anyway (survival
        `survival`), to time a wider pass: fewer than `explore_rounds` timed at this batch size and none of them showing
        the increment at or above the table's, a plain pass timed (the increment is their difference), and the
        round's predicted rate at least 1 − `explore_margin` of its rate without it. Decided from confidences and
        counts, never from the slot's drafted token."""
        seen = self.excess.get(self.batch)
        if not self.learn_costs or self.last is None or seen is None:
            return False
        (_, n_wide), (_, n_plain), (increment, pairs) = seen["wide"], seen["plain"], seen["increment"]
        if n_wide >= self.explore_rounds or not n_plain:
            return False
        if (
            pairs and increment >= 0
        ):  # the wider passes timed were no cheaper over their plain neighbours than the table's
            return False
        return (self.expected + survival) / wider >= (1 - self.explore_margin) * rate


class ScriptedSchedule:
    """A schedule (`TrainedProposer.schedule`) whose rounds follow a script rather than what they teach: the protocol
    the proposers call, learning nothing (`regime`, `observe`, `timed`, `catching_up` and `reset` do nothing), and one
    slot per drafted row (`admit`). A subclass says which rounds draft (`worth_drafting`) and keeps what it needs of
    the rest: the cost table's measuring rotation (`eval.costs.Rotation`) and the benches' fixed patterns."""

    halted = False
    """Whether the proposer takes no further draft step this round (read after each `admit`)."""

    def regime(self, sampling: Hashable) -> None:
        """The sampling the coming rounds decode with: nothing is learned, so nothing is kept per regime."""

    def worth_drafting(self, c0: torch.Tensor | Sequence[float], active: torch.Tensor | Sequence[bool]) -> bool:
        """Whether this round runs the drafter: the script's, never the rows' confidences."""
        raise NotImplementedError

    def begin(self, drafting: torch.Tensor) -> None:
        """A new drafted round for the rows in `drafting` (bool [B])."""
        self.halted = False

    def admit(self, i: int, conf: torch.Tensor, survival: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """Every drafting row drafts slot 0, and no further one."""
        self.halted = True
        return drafting

    def observe(self, confidences: list[list[float]], accepted: list[int]) -> None:
        """A verified round's outcomes: a script does not learn from them."""

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        """The round's timers: kept by subclasses that record them."""

    def catching_up(self) -> None:
        """This round's drafter update catches up on skipped rounds or a prompt: noted by subclasses that time it."""

    def reset(self) -> None:
        """A new decode: subclasses whose script restarts there say so."""


VARIANTS: dict[str, dict[str, Any]] = {
    "pooled": {"row_prior": None},
    "last": {"decide_by_level": False, "level_slots": 0, "evidence": 0.0},
    "greedy": {"evidence": 0.0},
    "pair-mean": {"pair_trim": 0.0, "check_errors": 0.0},
}
"""Rules the benches and replays compare the cost schedule with, as the `CostSchedule` attributes each sets (`variant`):
`pooled` calibrates by the pooled ratio alone, without each row's own (`row_prior`); `last` decides whether to draft
from each row's last first-slot confidence, from the first slot on (the rule before 2026-12-07: `decide_by_level`,
`level_slots`); `greedy` decides from the level as estimated, stopping where it says drafting does not pay (the rule
before 2026-12-07's fifth session: `evidence`); `pair-mean` prices a wider pass by the plain mean of its pairs and takes
no plain round to time one past `check_rounds` (the rule before 2026-12-07's seventh session: `pair_trim`,
`check_errors`)."""


def variant(schedule: CostSchedule, name: str | None) -> CostSchedule:
    """`schedule` switched to the rule `VARIANTS[name]`, or back to the cost schedule's own for None (every attribute
    a variant sets goes back to the class's), and returned, for chaining."""
    for key in {k for rule in VARIANTS.values() for k in rule}:
        setattr(schedule, key, getattr(CostSchedule, key))
    for key, value in VARIANTS[name].items() if name is not None else ():
        setattr(schedule, key, value)
    return schedule


def _said(state: dict[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
    """One regime's learned state (`CostSchedule._learned`) as `corrections` reports it."""
    said: dict[int, dict[str, dict[str, float]]] = {}
    for b, kinds in sorted(state["excess"].items()):
        said[b] = {k: {"excess_s": t / n, "rounds": n} for k, (t, n) in kinds.items() if n}
        if "plain" in said[b]:
            said[b]["plain"]["checks"] = state["checks"].get(b, 0)
        if "catch-up" in said[b]:  # a probe follows skipped rounds: it catches up
            said[b]["catch-up"]["probes"] = state["probes"].get(b, 0)
        if "wide" in said[b]:
            said[b]["wide"]["explores"] = state["explores"].get(b, 0)
    return said


def merge_corrections(ranks: Sequence[dict]) -> dict:
    """Several `corrections` (one per rank, or per sampling regime) as one: per batch size and kind of round, the mean over all
    their rounds (each rank's mean weighted by its rounds), the rounds, plain-pass checks, probes and explores
    summed."""
    merged: dict = {}
    for said in ranks:
        for b, kinds in said.items():
            for kind, c in kinds.items():
                m = merged.setdefault(b, {}).setdefault(kind, {"excess_s": 0.0, "rounds": 0.0})
                total = m["excess_s"] * m["rounds"] + c["excess_s"] * c["rounds"]
                m["rounds"] += c["rounds"]
                m["excess_s"] = total / m["rounds"]
                for count in ("checks", "probes", "explores"):
                    if count in c:
                        m[count] = m.get(count, 0) + c[count]
    return {b: merged[b] for b in sorted(merged)}
