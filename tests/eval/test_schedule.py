"""The cost-based schedule (eval.schedule): its admission rule on scripted confidences, and exactness with it on:
the emitted distribution is the target's at T = 1 for one row and for a batch (chi-square on the exactly solvable
bigram target), greedy output is the target's greedy output at batch 1 and 3 (EAGLE-3, with rounds the drafter
skips), and a schedule that reads a slot's own drafted token is caught."""

import math
from collections import Counter
from dataclasses import asdict

import pytest
import torch

from draftsmith.eval.costs import nondecreasing
from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer, Eagle3Proposer, Proposal
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator
from draftsmith.eval.schedule import CostSchedule, CostTable, ScriptedSchedule, variant
from tests.eval.test_dspark_exactness import FeatureBigramTarget, _emitted_dspark, _exact, _tiny_dspark
from tests.eval.test_exactness import P, _eagle3, chi_square_pvalue, plain_greedy

# a pass 1 slot wide costs 1.0; each further slot 0.3; a draft round 0.1, each further depth 0.05
TABLE = CostTable(
    verify={1: {1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9}, 4: {1: 1.2, 2: 1.8, 3: 2.4, 4: 3.0}},
    draft_step={1: 0.05, 4: 0.06},
    draft_round={1: 0.1, 4: 0.12},
)


def by_last_confidence(table: CostTable, learn_costs: bool = True) -> CostSchedule:
    """A schedule that decides whether to draft from each row's last first-slot confidence, from the first slot on
    (the variant `last`: `cost-last` in launch/bench_schedule.py). The tests of the backoff, the
    probes and the timing corrections script "drafting pays" and "it does not" through that confidence, a round at a
    time; what they test does not depend on where the prediction comes from."""
    return variant(CostSchedule(table, learn_costs), "last")


def test_a_scripted_schedule_answers_everything_a_proposer_asks_of_a_schedule():
    """The proposers call a schedule's methods by name (`self.schedule.X`): the cost schedule and the scripted base the
    cost table's rotation and the benches' patterns share must both have each one, so a call added to the proposers
    fails here rather than mid-bench. The base learns nothing and drafts one slot per row."""
    import re
    from pathlib import Path

    import draftsmith.eval.proposers as proposers

    called = set(re.findall(r"self\.schedule\.(\w+)", Path(proposers.__file__).read_text()))
    assert {"worth_drafting", "admit", "timed", "reset"} <= called  # the search reads what it should
    script = ScriptedSchedule()
    for schedule in (CostSchedule(TABLE), script):
        assert not {name for name in called if not hasattr(schedule, name)}, type(schedule).__name__
    drafting = torch.tensor([True, False, True])
    script.begin(drafting)
    assert not script.halted
    assert torch.equal(script.admit(0, torch.ones(3), torch.ones(3), drafting), drafting) and script.halted
    with pytest.raises(NotImplementedError):
        script.worth_drafting([math.nan], [True])


def test_a_variant_sets_its_rule_on_one_schedule():
    """The rules benches compare the cost schedule with (`VARIANTS`) are attributes set on one schedule, never on the
    class: `last` decides from the last first-slot confidence from the first slot on, `pooled` drops each row's own
    calibration, and None is the cost schedule's own rule."""
    last, pooled = variant(CostSchedule(TABLE), "last"), variant(CostSchedule(TABLE), "pooled")
    assert (last.decide_by_level, last.level_slots, last.row_prior) == (False, 0, CostSchedule.row_prior)
    assert (pooled.decide_by_level, pooled.row_prior) == (True, None)
    assert (CostSchedule.decide_by_level, CostSchedule.level_slots) == (True, 16) and CostSchedule.row_prior
    # switched again (the bench's batch curve switches one schedule between rules): nothing of the last rule is left
    back, other = variant(last, None), variant(variant(CostSchedule(TABLE), "last"), "pooled")
    assert (back.decide_by_level, back.level_slots, back.row_prior) == (True, 16, CostSchedule.row_prior)
    assert (other.decide_by_level, other.level_slots, other.row_prior) == (True, 16, None)
    counted = variant(CostSchedule(TABLE), "pair-mean")  # the pairs' plain mean, no checks past `check_rounds`
    assert (counted.pair_trim, counted.check_errors) == (0.0, 0.0) and CostSchedule.pair_trim > 0
    assert variant(counted, None).check_errors == CostSchedule.check_errors


def test_admission_follows_the_rate():
    """One row: slot 0 pays when (1 + s) / (0.1 + 1.3) >= 1 / (0.1 + 1.0), i.e. s >= 0.273."""
    s = CostSchedule(TABLE)
    on = torch.tensor([True])
    s.begin(on)
    assert not s.admit(0, torch.tensor([0.25], dtype=torch.float64), torch.ones(1, dtype=torch.float64), on).any()
    assert s.halted  # nothing admitted: no further depth
    s.begin(on)
    assert s.admit(0, torch.tensor([0.3], dtype=torch.float64), torch.ones(1, dtype=torch.float64), on).all()
    # a batch: the depth's first slot pays the width increment, later ones ride free in the padded pass
    s4 = CostSchedule(TABLE)
    rows = torch.ones(4, dtype=torch.bool)
    s4.begin(rows)
    conf = torch.tensor([0.9, 0.9, 0.8, 0.0], dtype=torch.float64)
    admitted = s4.admit(0, conf, torch.ones(4, dtype=torch.float64), rows)
    # the top slot alone does not pay ((4 + 0.9) / 1.92 < 4 / 1.32), the three together do ((4 + 2.6) / 1.92);
    # a slot of zero survival never
    assert admitted.tolist() == [True, True, True, False]


def test_rounds_without_drafting_back_off_and_probe_again():
    """A drafter that does not pay is asked again after n, 2n, 4n, ... skipped rounds (at most max_backoff), n the
    fewest rounds whose plain steps make a probe's draft round at most `probe_share` of their time."""
    low, on = torch.tensor([0.01], dtype=torch.float64), torch.tensor([True])
    cheap = CostTable(verify=TABLE.verify, draft_step=TABLE.draft_step, draft_round={1: 0.001, 4: 0.001})
    s = by_last_confidence(cheap)  # a round costs 0.1% of a plain step: n = 1
    decisions = [s.worth_drafting(low, on) for _ in range(16)]
    assert [i for i, d in enumerate(decisions) if d] == [1, 4, 9]  # after 1 skipped round, then 2, then 4
    assert s.probes == {1: 3}  # counted for the report
    assert s.worth_drafting(torch.tensor([0.9], dtype=torch.float64), on)  # paying again: drafts, backoff reset
    assert s.backoff == 1
    s = by_last_confidence(TABLE)  # a round costs 10% of a plain step: n = 0.1 / 0.02 = 5
    decisions = [s.worth_drafting(low, on) for _ in range(40)]
    assert [i for i, d in enumerate(decisions) if d] == [5, 16, 37]  # after 5, then 10, then 20 skipped rounds
    s.max_backoff = 8
    s.reset()  # a new decode keeps the backoff (20, capped at 8 from now on) and the 2 rounds skipped since round 37
    decisions = [s.worth_drafting(low, on) for _ in range(20)]
    assert [i for i, d in enumerate(decisions) if d] == [6, 15]  # never more than max_backoff skipped in a row
    s = by_last_confidence(TABLE)
    s.max_backoff = 8
    decisions = [s.worth_drafting(low, on) for _ in range(20)]
    assert [i for i, d in enumerate(decisions) if d] == [5, 14]


# DSpark's costs in the demo's bench (plain pass 49.7 ms, two slots wide 50.3, block round 4.5), in plain passes: a
# first slot pays from (1.012 + 0.09) / 1.0 - 1 = 10.2% acceptance
BLOCK_TABLE = CostTable(verify={1: {1: 1.0, 2: 1.012}}, draft_step={1: 0.012}, draft_round={1: 0.09})


def _first_slots_verified(s: CostSchedule, slots: list[tuple[float, int]], rounds: int) -> int:
    """One row decoded for `rounds` rounds, as launch/replay_schedule.py replays a log: each round the schedule
    decides whether to draft; a drafted round's first slot is the next of `slots` ((confidence, accepted), in the order
    drafted, cycled), admitted or not, and observed when verified. The first slots verified."""
    on, ones = torch.tensor([True]), torch.ones(1, dtype=torch.float64)
    c0 = torch.tensor([math.nan], dtype=torch.float64)  # what the proposer keeps: the last drafted first slot's
    s.reset()
    drafted = verified = 0
    for _ in range(rounds):
        if not s.worth_drafting(c0, on):
            continue
        conf, hit = slots[drafted % len(slots)]
        drafted += 1
        c0 = torch.tensor([conf], dtype=torch.float64)
        s.begin(on)
        if s.admit(0, c0, ones, on).any():
            s.observe([[conf]], [hit])
            verified += 1
    return verified


def test_a_row_whose_level_pays_drafts_whatever_its_last_confidence_said():
    """First-slot confidences that spread (0.02 and 0.38 in turn, a mean of 0.2) but rank nothing: one slot in five is
    accepted whatever its confidence (the demo's drafters: the last first slot's confidence ranked the next one's
    fate at chance, AUC 0.49). Drafting pays (20% against 10.2%), and a decision from the row's level drafts every
    round of 400. From the last confidence (the mutation, `decide_by_level` off), each 0.02 stops the drafter until a
    probe (after 5 skipped rounds, then 10, ...): it verified 125."""
    slots = [(0.02 if i % 2 else 0.38, int(i % 5 == 0)) for i in range(10)]
    assert _first_slots_verified(CostSchedule(BLOCK_TABLE, learn_costs=False), slots, 400) == 400
    last = CostSchedule(BLOCK_TABLE, learn_costs=False)
    last.decide_by_level = False
    assert _first_slots_verified(last, slots, 400) < 200


def test_a_few_low_first_confidences_do_not_stop_a_drafter_before_it_has_a_level():
    """A drafter whose first four first slots say 0.05 and fail, and whose later ones say 0.2 and are accepted one in
    five (paying from 10.2%): its level is drawn from `level_slots` first slots before it may stop drafting, so it
    drafts nearly all of 300 rounds. Drawn from whatever it has seen (the mutation, `level_slots` 0), the first one
    (0.05) stops it, each probe adds one slot, and the level stays under the break-even for about 140 rounds: 161
    verified with the level read as estimated (`evidence` 0), 225 with it read a standard error high, which lifts it
    over the break-even sooner (DSpark in the demo's eval order, replayed: 5 first slots verified in 1,100 rounds,
    0.999x of plain decoding where drafting every round ran 1.064x)."""
    slots = [(0.05, 0)] * 4 + [(0.2, int(i % 5 == 0)) for i in range(1000)]
    assert _first_slots_verified(CostSchedule(BLOCK_TABLE, learn_costs=False), slots, 300) >= 290
    for rule, most in ((None, 250), ("greedy", 200)):
        hasty = variant(CostSchedule(BLOCK_TABLE, learn_costs=False), rule)
        hasty.level_slots = 0
        assert _first_slots_verified(hasty, slots, 300) < most


def _spread(rate: float, n: int) -> list[int]:
    """n fates, `rate` of them accepted, spread evenly (no luck: the same fates every run)."""
    return [int(int((i + 1) * rate) > int(i * rate)) for i in range(n)]


def test_a_level_read_low_by_a_few_unlucky_first_slots_does_not_stop_drafting():
    """A drafter whose first slots all say 0.14 and pay from 15% (`DEEP_TABLE`: (1 + s) / (0.1 + 1.05) >= 1 / 1.0):
    its first 24 have 3 accepted (12.5%), then 22% are. As estimated, the level after those 24 is 0.13, drafting
    stops, and a probe every 5, 10, ..., 64 rounds is all it verifies: the level never climbs back over 0.15 (fading
    returns it toward the confidence, 0.14), 30 first slots verified in 600 rounds. Read a standard error high
    (`evidence` 1), the same 24 slots say 0.18: it keeps drafting, learns the 22%, and verifies all 600. The demo's
    EAGLE-3 on an AMX Xeon, T = 0: 3 of 24 accepted in its first prompt, level 0.13 against a break-even of
    0.13-0.16, 20 of 461 rounds drafted in the next four domains, where one slot every round had 22% accepted over
    the bench. Mutations caught: the lift left out (`lift` 0 in `worth_drafting`), or subtracted."""
    slots = [(0.14, int(i in (0, 8, 16))) for i in range(24)] + [(0.14, hit) for hit in _spread(0.22, 3000)]
    assert _first_slots_verified(CostSchedule(DEEP_TABLE, learn_costs=False), slots, 600) >= 590  # (600)
    assert _first_slots_verified(variant(CostSchedule(DEEP_TABLE, learn_costs=False), "greedy"), slots, 600) <= 60


def test_a_drafter_that_does_not_pay_still_stops_when_evidence_is_asked():
    """The same drafter where its first slots are accepted 5% or 10% of the time (a break-even of 15%): read a standard
    error high, the level still stops it once enough slots are verified, and what fading gives back is tried again
    now and then: 71 and 149 first slots verified in 2,000 rounds, against 49 as estimated; drafting every round would
    verify 2,000. The lift is a standard error: it shrinks as slots are verified (mutation: a fixed lift of 0.5, which
    verified 113 at 5%)."""
    for rate, most in ((0.05, 100), (0.10, 200)):
        slots = [(0.14, hit) for hit in _spread(rate, 3000)]
        assert _first_slots_verified(CostSchedule(DEEP_TABLE, learn_costs=False), slots, 2000) <= most
    s = CostSchedule(DEEP_TABLE, learn_costs=False)
    for r in range(400):
        s.observe([[0.14]], [int(r % 20 == 0)])
    assert s.ratio_error() < 0.15 < CostSchedule(DEEP_TABLE).ratio_error()  # (0.08 after 400 slots; 0.5 before any)


def test_a_new_decode_drafted_on_the_pooled_first_slot_rate_keeps_the_backoff():
    """A new decode's rows have no confidence yet, so its first round may draft on `first_slot_rate` alone; that does
    not reset the backoff a drafter which stopped paying earned on the last prompts (only a row's own confidence
    saying it pays does): its next probe waits as long as it would have, rather than n, 2n, ... from scratch."""
    low, new = (torch.tensor([x], dtype=torch.float64) for x in (0.01, float("nan")))
    on = torch.tensor([True])
    s = by_last_confidence(TABLE)  # n = 5 (a draft round costs 10% of a plain step)
    decisions = [s.worth_drafting(low, on) for _ in range(40)]
    assert [i for i, d in enumerate(decisions) if d] == [5, 16, 37] and s.backoff == 40
    s.reset()
    assert s.worth_drafting(new, on)  # nothing verified yet: the pooled rate is 1, the first round drafts
    assert s.backoff == 40
    decisions = [s.worth_drafting(low, on) for _ in range(45)]
    assert [i for i, d in enumerate(decisions) if d] == [40]
    assert s.worth_drafting(torch.tensor([0.9], dtype=torch.float64), on) and s.backoff == 1  # its own: reset


def test_a_drafter_is_asked_again_every_max_backoff_rounds_across_decodes_shorter_than_that():
    """Decodes of 40 rounds, a drafter whose first slots say 0.05 and are never accepted (on DSpark's costs: a probe
    waits 5 rounds, then 10, 20, 40, then `max_backoff`, 64). The rounds skipped since the last probe are counted
    across decodes, so it is asked again every 64 rounds: in the last 10 decodes, 400 rounds, 6 times. Counted from 0
    at every decode (the mutation: `reset` zeroes `skipped`), once the backoff outgrew a decode it was never asked
    again (DSpark at T = 1 in a bench of 64-token answers: no slot drafted through 8 domains)."""
    low, on = torch.tensor([0.05], dtype=torch.float64), torch.tensor([True])
    s = CostSchedule(BLOCK_TABLE, learn_costs=False)
    asked = []
    for _ in range(20):
        s.reset()
        c0 = torch.tensor([math.nan], dtype=torch.float64)
        drafted = 0
        for _ in range(40):
            if s.worth_drafting(c0, on):
                c0, drafted = low, drafted + 1
                s.begin(on)
                if s.admit(0, low, torch.ones(1, dtype=torch.float64), on).any():
                    s.observe([[0.05]], [0])
        asked.append(drafted)
    assert sum(asked[10:]) == 6  # 400 rounds, a probe after every 64 skipped (the 65th round)
    assert s.backoff == s.max_backoff == 64


def test_the_schedule_corrects_overconfident_drafts_from_verified_rounds():
    """Online calibration: a drafter that says 0.5 for slot 0 (where drafting pays: 0.5 >= 0.273) but has its drafts
    accepted a tenth of the time stops being drafted once verification has shown it, and one that is right keeps
    being drafted. Per depth, ratio = (accepted + prior) / (predicted survival + prior)."""
    on, c = torch.tensor([True]), torch.tensor([0.5], dtype=torch.float64)
    s = CostSchedule(TABLE)
    assert s.ratio(0) == 1.0 and s.worth_drafting(c, on)  # nothing seen: the confidences as they are
    for r in range(40):  # slot 0 at 0.5, slot 1 at 0.5 * 0.8; one round in ten accepts one draft
        s.observe([[0.5, 0.8]], [1 if r % 10 == 0 else 0])
    assert s.ratio(0) == pytest.approx((4 + 4) / (20 + 4)) and s.ratio(1) == pytest.approx(4 / (16 + 4))
    assert s.ratio(5) == 1.0  # a depth never seen
    s.reset()
    assert not s.worth_drafting(c, on)  # 0.5 * 1/3 = 0.17 < 0.273
    s.begin(on)
    assert not s.admit(0, c, torch.ones(1, dtype=torch.float64), on).any()
    right = CostSchedule(TABLE)
    for r in range(40):
        right.observe([[0.5]], [r % 2])
    assert right.ratio(0) == 1.0 and right.worth_drafting(c, on)
    right.begin(on)
    assert right.admit(0, c, torch.ones(1, dtype=torch.float64), on).all()


def test_a_stretch_of_failed_drafts_fades_and_drafting_resumes():
    """After 40 first slots predicted 0.5 with one in ten accepted (ratio 8 / 24), a row of a new decode (no evidence
    of its own, `row_ratio`) is priced at the mean first-slot confidence times that ratio, 0.5 / 3 = 0.17, whatever its
    own last confidence (0.7), and does not draft (a round drafts when (1 + s) / (0.1 + 1.3) >= 1 / 1.0, s >= 0.4).
    Rounds that verify nothing make that evidence fade (each round times 1 - 1/memory_rounds) until
    0.5 (4 + 4f) / (4 + 20f) >= 0.4, at f <= 1/15: about 2.7 * memory_rounds rounds later the row drafts every round
    again. Without fading it would only ever be probed. This is the level read as estimated (the variant `greedy`,
    `evidence` 0): read a standard error high, as the cost schedule reads it, drafting resumes sooner still."""
    on, c = torch.tensor([True]), torch.tensor([0.7], dtype=torch.float64)
    s = variant(CostSchedule(TABLE), "greedy")
    for r in range(40):
        s.observe([[0.5]], [1 if r % 10 == 0 else 0])
    s.reset()
    assert not s.worth_drafting(c, on)
    decisions = [s.worth_drafting(c, on) for _ in range(1600)]
    resumed = next(i for i in range(len(decisions)) if all(decisions[i:]))
    f = (4 - 0.4 / 0.5 * 4) / (0.4 / 0.5 * 20 - 4)  # the fraction of the evidence left when drafting pays again
    expected = math.log(f) / math.log(1 - 1 / s.memory_rounds) - 1  # (the first call above faded once)
    assert abs(resumed - expected) < 2, (resumed, expected)
    # before: probes only (after 5, 10, 20, 40 skipped rounds, then every 64); after: the level pays
    probes = 4 + (resumed - 5 - 10 - 20 - 40 - 4) // 65 + 1
    assert sum(decisions[:resumed]) <= probes and s.backoff == 1
    lifted = CostSchedule(TABLE)
    for r in range(40):
        lifted.observe([[0.5]], [1 if r % 10 == 0 else 0])
    lifted.reset()
    decisions = [lifted.worth_drafting(c, on) for _ in range(1600)]
    assert next(i for i in range(len(decisions)) if all(decisions[i:])) < 0.75 * resumed  # (769 against 1,384)


def _rows_drafting(s: CostSchedule, conf: list[float], hits: list[list[int]]) -> list[int]:
    """Rounds of a decode of len(conf) rows that say `conf` every round, row b's first slot accepted in round r when
    hits[b][r]: per row, the rounds whose first slot was verified (drafted and admitted)."""
    on = torch.ones(len(conf), dtype=torch.bool)
    c = torch.tensor(conf, dtype=torch.float64)
    s.reset()
    verified = [0] * len(conf)
    for r in range(len(hits[0])):
        if not s.worth_drafting(c, on):
            continue
        s.begin(on)
        admitted = s.admit(0, c, torch.ones(len(conf), dtype=torch.float64), on).tolist()
        s.observe(
            [[x] if a else [] for x, a in zip(conf, admitted)], [h[r] if a else 0 for h, a in zip(hits, admitted)]
        )
        verified = [v + a for v, a in zip(verified, admitted)]
    return verified


def test_a_prompt_whose_drafts_fail_stops_drafting_within_its_decode():
    """A drafter whose first slots, said 0.5, were accepted half the time over 600 rounds of earlier decodes (the
    pooled ratio near 1) starts a prompt where the same 0.5 is accepted one round in ten. A round drafts from
    s >= 0.4 ((1 + s) / (0.1 + 1.3) >= 1 / 1.0): 0.5 pays as the pooled calibration prices it, 0.05 does not.
    The row's own verified slots (`row_ratio`, shrunk toward the pooled ratio by `row_prior` = 16 predicted slots,
    one decode being too few to estimate the weight from) stop it within a few rounds; on the pooled calibration alone, its 600 rounds of history outweigh the prompt's 200
    (on the demo's drafters, coding and extraction prompts were drafted every round at 0.90-0.98x of plain
    decoding). A new decode starts from the pooled ratio again."""
    history = [[1 if r % 2 == 0 else 0 for r in range(600)]]
    bad = [[1 if r % 10 == 0 else 0 for r in range(200)]]
    own, pooled = CostSchedule(TABLE), CostSchedule(TABLE)
    pooled.row_prior = None
    for s in (own, pooled):
        assert _rows_drafting(s, [0.5], history) == [600]
    assert own.ratio(0) == pytest.approx(1.0, abs=0.05)
    assert _rows_drafting(own, [0.5], bad)[0] <= 30  # a few rounds, then probes (27; 15 read as estimated)
    assert _rows_drafting(pooled, [0.5], bad)[0] >= 80  # (113)
    own.reset()
    assert own.row_ratio(0, 0) == own.ratio(0)


def test_rows_of_one_batch_are_calibrated_apart():
    """Two rows saying the same 0.5 every round, one accepted three times in four and one a tenth: after 60 rounds (18
    slots verified per row: 8 rounds drafted to read a level off `level_slots` first slots, and 10 more before drafting
    stopped paying for the pair, with the level read a standard error high: 3 more read as estimated) the first row
    alone still makes a round worth
    drafting and the second alone does not, where one pooled ratio would price both alike. (Once a round drafts, a
    batch's second slot at a depth rides in the padded pass: admission then takes both.)"""
    s = CostSchedule(TABLE)
    s.row_prior = 4.0  # (no decode before this one: the weight is `row_prior`)
    hits = [[1 if r % 4 != 3 else 0 for r in range(60)], [1 if r % 10 == 0 else 0 for r in range(60)]]
    assert _rows_drafting(s, [0.5, 0.5], hits) == [18, 18]
    assert s.row_ratio(0, 0) > 1.1 and s.row_ratio(0, 1) < 0.5  # (1.25 and 0.43; pooled 0.86)
    c = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert s.worth_drafting(c, torch.tensor([True, False]))
    assert not s.worth_drafting(c, torch.tensor([False, True]))


def test_admission_prices_a_rows_slot_by_its_own_ratio():
    """40 rounds of two rows saying 0.5, row 0 accepted half the time and row 1 a tenth (weight 4): pooled ratio
    (24 + 4) / (40 + 4) = 0.64, row 0's (20 + 4 * 0.64) / 24 = 0.94, row 1's (4 + 4 * 0.64) / 24 = 0.27. Row 1 alone
    drafting a slot said 0.6 at batch 2 (a slot pays from s >= 0.341 there): 0.6 * 0.64 = 0.38 would be admitted,
    0.6 * 0.27 = 0.16 is not; row 0's is."""
    s = CostSchedule(TABLE)
    s.row_prior = 4.0
    for r in range(40):
        s.observe([[0.5], [0.5]], [r % 2, 1 if r % 10 == 0 else 0])
    assert s.ratio(0) == pytest.approx(28 / 44)
    assert s.row_ratio(0, 1) == pytest.approx((4 + 4 * 28 / 44) / 24)
    c, ones = torch.tensor([0.6, 0.6], dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    for row, admitted in ((1, False), (0, True)):
        only = torch.tensor([b == row for b in range(2)])
        s.begin(only)
        assert bool(s.admit(0, c, ones, only)[row]) is admitted


def test_the_weight_of_a_rows_own_slots_follows_how_far_decoded_rows_differ():
    """`row_weight`, with a pooled ratio of 1 over first slots said 0.25 (chance alone gives a row of predicted
    survival P a variance of P (1 - 0.25) in its accepted count): rows whose accepted counts are exactly their
    predictions (no spread beyond chance) get the largest weight; rows at ratios 0.5 and 1.5 in turn, P = 20 each,
    spread (100 - 15) / 400 = 0.2125 beyond chance, weight 0.75 / 0.2125; fewer than `row_rows` rows: none (the weight
    is `row_prior`).
    A decode's rows are added when the next decode starts."""
    s = CostSchedule(BLOCK_TABLE)  # where a first slot at the mean confidence, 0.25, pays: its rows draft
    s.predicted, s.accepted, s.verified = [100.0], [100.0], [400.0]
    s.decoded = [(20.0, 20.0)] * (s.row_rows - 1)
    assert s.row_weight() is None  # `row_prior` is the weight
    s.decoded = [(20.0, 20.0)] * 40
    assert s.row_weight() == s.row_weight_range[1]
    s.decoded = [(20.0, 10.0), (20.0, 30.0)] * 20
    assert s.row_weight() == pytest.approx(0.75 / 0.2125)
    s.decoded = [(20.0, 0.0), (20.0, 40.0)] * 20  # spread 0.96: bounded below
    assert s.row_weight() == s.row_weight_range[0]
    s.reset()  # the schedule's next decode starts with that weight
    assert s.row_weight_now == s.row_weight_range[0]
    _rows_drafting(s, [0.5, 0.5], [[1, 0, 1, 1], [0, 1, 0, 1]])
    rows = [(predicted[0], accepted[0]) for predicted, accepted in s.row_sums.values()]
    assert len(rows) == 2 and all(p > 0 and a >= 1 for p, a in rows)
    s.reset()
    assert s.decoded[-2:] == rows and not s.row_sums
    s.row_prior = None  # the pooled calibration alone
    assert s.row_weight() is None and s.row_ratio(0, 0) == s.ratio(0)


def _round(s: CostSchedule, conf: float, plain: float, wide: float, draft: float) -> int:
    """One round of one row through the schedule (the decision, the admission, the engine's timings: a pass `plain`
    seconds one slot wide, `wide` two wide, `draft` seconds drafting): the slots it verified."""
    on, c = torch.tensor([True]), torch.tensor([conf], dtype=torch.float64)
    if not s.worth_drafting(c, on):
        s.timed(plain, 0.0)
        return 0
    s.begin(on)
    admitted = int(s.admit(0, c, torch.ones(1, dtype=torch.float64), on).sum())
    s.timed(wide if admitted else plain, draft)
    return admitted


def test_the_schedule_corrects_a_table_that_makes_drafting_look_cheap():
    """The table says a pass two slots wide costs 4% more than a plain one (timing noise), so a first slot at 0.2
    pays ((1 + 0.2) / (0.02 + 1.04) >= 1 / 1); the round that drafts on it takes 1.5 there. Each pair of a plain and a
    wider pass says +0.46, and counts at most `pair_window` (0.2 of a plain pass) off the estimate so far: +0.2, then
    +0.27, +0.32, +0.36, +0.39 (a hiccup of the machine is not the increment). So the schedule drafts 7 of its first
    9 rounds (a pair forms only where a plain round meets a drafted one) and then only to probe, the wider pass priced
    at 1.04 + 5 × 0.313 / 7 = 1.26 (the mean of the five without the lowest and the highest, `pair_trim`): a table this
    wrong costs a few rounds, not the decode (counted at +0.46 in full, as before the window, 2 of 8). With the
    correction off (the mutation) it drafts on every round."""
    cheap = CostTable(verify={1: {1: 1.0, 2: 1.04}}, draft_step={1: 0.01}, draft_round={1: 0.02})
    s = by_last_confidence(cheap)
    rounds = [_round(s, 0.2, 1.0, 1.5, 0.02) for _ in range(16)]
    assert rounds == [1, 0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert s.pairs[1] == pytest.approx([0.2, 0.8 / 3, 0.95 / 3, 1.07 / 3, 0.39])
    assert s.verify_time(2, 1) == pytest.approx(1.04 + 0.94 / 3 * 5 / 7) and s.verify_time(1, 1) == 1.0
    fixed = by_last_confidence(cheap, learn_costs=False)
    assert [_round(fixed, 0.2, 1.0, 1.5, 0.02) for _ in range(20)] == [1] * 20


def test_a_slower_plain_pass_moves_every_width_and_draft_rounds_learn_their_catch_up():
    """Plain passes timed 0.2 above the table raise a wider pass by as much until wider passes are timed (a slower
    machine is slower at every width: the wide increment does not shrink); wider passes timed 0.3 above the table
    then raise it more while no pair of a plain and a wider pass timed a round apart says what the increment is;
    draft rounds timed above the table (the catch-up over skipped rounds, the bookkeeping) raise `round_time`, which
    sets the probe floor. n rounds of each against a prior of n rounds: halfway. Once pairs are timed, they alone
    correct the increment (a plain pass after the wider ones and a wider one after it: two pairs of +0.1 over the
    table's increment, shrunk by 2 pairs)."""
    s = CostSchedule(TABLE)
    n = int(s.cost_prior)
    for _ in range(n):
        s.last = (1, 1, -1)  # a skipped round
        s.timed(1.2, 0.0)
    assert s.verify_time(1, 1) == pytest.approx(1.1) and s.verify_time(2, 1) == pytest.approx(1.3 + 0.1)
    assert s.verify_time(1, 4) == 1.2  # another batch size: its own corrections
    s.previous.clear()  # the wider passes are not timed right after a plain one: no pair
    for _ in range(n):
        s.last = (1, 2, 0)  # a drafted round, one slot verified
        s.timed(1.6, 0.5)  # its pass 0.3 above the table; drafting 0.4 above it
    assert s.verify_time(2, 1) == pytest.approx(1.3 + (n * 0.3 + n * 0.1) / (2 * n))
    assert s.round_time(1) == pytest.approx(0.1 + 0.4 / 2)
    for width in (1, 2):  # a plain pass 0.2 above the table, then a wider one 0.3 above it: two pairs, +0.1 each
        s.last = (1, width, -1 if width == 1 else 0)
        s.timed(1.2 if width == 1 else 1.6, 0.5)
    assert s.verify_time(2, 1) == pytest.approx(s.verify_time(1, 1) + 0.3 + 2 * 0.1 / 4)


def test_a_catch_up_sets_how_long_a_probe_waits_not_what_drafting_costs():
    """A slot at 0.3 pays on a stretch of drafting ((1 + 0.3) / (0.1 + 1.05) >= 1 / 1.0): the table's 0.1 draft round
    is what a round that follows a drafted one takes. The first drafted round of a decode runs the drafter over the
    prompt and takes 1.0 (as a probe after skipped rounds catches up on them; +415 ms on a 13 ms round at 64 rows on
    an AMX Xeon). Counted as a draft round (the mutation), it makes drafting look 0.1 + 0.9 / 3 = 0.4 a round, where
    the slot pays only from 0.45, so the schedule stops drafting after that round. Timed apart (with the rounds after
    the plain rounds it takes to time the plain pass, which catch up on one skipped round and take 0.1), it drafts
    every other round, and the catch-ups lengthen the wait before a probe instead."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.05}}, draft_step={1: 0.01}, draft_round={1: 0.1})
    s = by_last_confidence(table)
    on, c = torch.tensor([True]), torch.tensor([0.3], dtype=torch.float64)
    slots, behind = [], True  # the proposer's rule: behind when the prompt or a skipped round is pending
    for _ in range(13):
        if not s.worth_drafting(c, on):
            s.timed(1.0, 0.0)
            slots.append(0)
            behind = True
            continue
        s.begin(on)
        if behind:
            s.catching_up()
        slots.append(int(s.admit(0, c, torch.ones(1, dtype=torch.float64), on).sum()))
        s.timed(1.05 if slots[-1] else 1.0, 1.0 if not slots[:-1] else 0.1)
        behind = False
    # every round drafts but the plain rounds taken to time the plain pass (the margin is under `check_margin`)
    assert len(slots) - sum(slots) == s.checks[1] == 2, slots  # [1] * 5 + [0] + [1] * 5 + [0] + [1]
    assert s.round_time(1) == pytest.approx(0.1)
    said = s.corrections()[1]
    assert said["catch-up"]["rounds"] == 3 and said["draft"]["rounds"] == 8
    assert s.probe_time(1) == pytest.approx(0.1 + 0.9 / (3 + 2))
    # a drafter that stopped paying is asked again after about 0.28 / 0.02 = 14 skipped rounds (5 by the table alone)
    low = torch.tensor([0.01], dtype=torch.float64)
    waits = [s.worth_drafting(low, on) for _ in range(20)]
    assert waits.index(True) == math.ceil(s.probe_time(1) / (s.probe_share * s.verify_time(1, 1))) >= 14


DEEP_TABLE = CostTable(verify={1: {1: 1.0, 2: 1.05, 3: 1.10}}, draft_step={1: 0.05}, draft_round={1: 0.1})


def deeper_rounds(s: CostSchedule, rounds: int = 6) -> list[int]:
    """`rounds` rounds on `DEEP_TABLE` with both slots at 0.5 confidence, where a round of one depth takes the table's
    0.1 to draft and each further depth 0.35 (the table says 0.05); passes as the table says. Returns the slots each
    round verified (0: a plain round, taken to time the plain pass)."""
    on, half, one = torch.tensor([True]), torch.tensor([0.5], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    depths = []
    for _ in range(rounds):
        if not s.worth_drafting(half, on):
            s.timed(1.0, 0.0)
            depths.append(0)
            continue
        s.begin(on)
        n = int(s.admit(0, half, one, on).sum())
        if n and not s.halted:
            n += int(s.admit(1, half, half, on).sum())
        depths.append(n)
        s.timed(DEEP_TABLE.verify_time(n + 1, 1), 0.1 + 0.35 * (n - 1))
    return depths


def test_deeper_drafts_dearer_than_the_table_stop_being_admitted():
    """The table says a draft round costs 0.1 and each further depth 0.05, so a second slot surviving at 0.25 pays
    ((1.5 + 0.25) / (0.1 + 0.05 + 1.10) = 1.40 against 1.5 / 1.15 = 1.30 with one slot). Each further depth takes
    0.35: after one such round (a step +0.3 over the table, shrunk by 2 rounds to +0.1) the second slot no longer pays,
    and the rounds of one depth, timed as the table says, leave the draft round as it was. With that excess put on the
    draft round instead (the mutation: what the schedule did before), a round of two depths looks as dear as it is but
    the second slot looks as cheap as ever, and it is verified in every round."""
    s = CostSchedule(DEEP_TABLE)
    assert deeper_rounds(s) == [2, 1, 1, 1, 1, 1]
    assert s.step_time(1) == pytest.approx(0.05 + 0.3 / 3) and s.round_time(1) == pytest.approx(0.1)
    said = s.corrections()[1]
    assert said["step"] == {"excess_s": pytest.approx(0.3), "rounds": 1} and said["draft"]["rounds"] == 5


def test_a_new_decode_forgets_a_catch_up_that_was_never_timed():
    """A proposer driven outside the engine may say a round catches up and never report its time: the next decode's
    first timed round is then a plain draft round, not a catch-up (reset clears the flag)."""
    s = CostSchedule(TABLE)
    s.catching_up()
    s.reset()
    s.last = (1, 2, 0)
    s.timed(1.3, 0.2)
    said = s.corrections()[1]
    assert "catch-up" not in said and said["draft"]["rounds"] == 1


def test_a_stalled_round_counts_as_twice_the_table_at_most():
    """A pass the machine stalled in (ten times the table) is held to twice the table: it says little about the next
    round. A draft round is not held (catching up over many skipped rounds is really dear)."""
    s = CostSchedule(TABLE)
    s.last = (1, 1, -1)
    s.timed(10.0, 0.0)
    assert s.corrections()[1]["plain"] == {"excess_s": pytest.approx(1.0), "rounds": 1, "checks": 0}
    s.last = (1, 2, 0)
    s.timed(0.1, 1.0)  # a pass below half the table: held to half
    assert s.corrections()[1]["wide"]["excess_s"] == pytest.approx(0.65 - 1.3)
    assert s.corrections()[1]["draft"]["excess_s"] == pytest.approx(0.9)


def test_wider_passes_timed_below_the_table_never_make_drafting_look_free():
    """The machine now runs faster: wider passes take 0.95 where the table says 1.1, plain ones 0.85 where it says
    1.0, and draft rounds 0.1 where it says 0.02. A schedule that drafts every round times no plain pass (until it
    takes one to time it), so its plain figure stays the table's. Had the wider pass been lowered to that stale plain
    figure, a round would look like 0.1 + 0.95 against 1.15 expected tokens and drafting would go on until the plain
    rounds taken every 4 drafted ones had shown the plain pass (the mutation: it drafts 4 rounds in a row); kept at
    least the table's 0.1 above plain, drafting stops once the draft rounds' cost shows
    (0.02 + 0.08 n / (n + 2) + 1.1 > 1.15 from n = 2)."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.1}}, draft_step={1: 0.01}, draft_round={1: 0.02})
    s = by_last_confidence(table)
    slots = [_round(s, 0.15, 0.85, 0.95, 0.1) for _ in range(6)]
    assert slots == [1, 1, 0, 0, 0, 0], slots
    assert s.verify_time(2, 1) - s.verify_time(1, 1) == pytest.approx(0.1)  # the plain passes since: both lower


def test_a_schedule_that_drafts_every_round_times_the_plain_pass_too():
    """The table was timed in a slow minute: a plain pass 0.817 and a pass two slots wide the same (flat: the
    batch-4 row of an EAGLE-3 table measured on the AMD EPYC while a type check ran). The machine now takes 0.70 for a
    plain pass and 0.78 for a wider one; a draft round 0.05 as the table says. With a first slot at 0.1 the table says
    drafting pays by 4% ((1 + 0.1) / 0.867 against 1 / 0.817) and in truth it loses 7% (1.1 / 0.83 against 1 / 0.70).
    Wider passes timed below the table do not lower the plain figure, so only plain passes can show it: while the
    margin is under `check_margin` the schedule takes a plain round after every `check_every` drafted ones. One is
    enough: it shows the plain pass (0.817 − 0.117 / 3 = 0.778), and with its neighbours two pairs of a plain and a
    wider pass 0.08 apart (+0.16 / 4 on the table's flat increment), so a wider pass is 0.818 and a slot at 0.1 loses
    (1.1 / 0.868 against 1 / 0.778); the round right after the check, its increment known from one pair only, may
    draft once more. After that it drafts only to probe. Without the plain rounds (the mutation) it drafts every
    round."""
    table = CostTable(verify={4: {1: 0.817, 2: 0.817}}, draft_step={4: 0.001}, draft_round={4: 0.05})

    def run(s: CostSchedule, conf: float) -> list[int]:
        return [_round(s, conf, 0.70, 0.78, 0.05) for _ in range(80)]

    s = by_last_confidence(table)
    slots = run(s, 0.1)
    assert s.checks == {1: 1} and slots[:5] == [1, 1, 1, 1, 0] and sum(slots[5:15]) <= 2, slots
    probes = [i for i in range(15, 80) if slots[i]]
    assert len(probes) <= 4 and all(b - a > 4 for a, b in zip(probes, probes[1:])), slots  # the backoff doubles
    assert s.verify_time(1, 1) == pytest.approx(0.70, abs=0.01)  # the skipped rounds since: plain passes too
    unchecked = by_last_confidence(table)
    unchecked.check_every = 10**9
    assert run(unchecked, 0.1) == [1] * 80
    sure = by_last_confidence(table)  # drafting pays by far more than check_margin: no plain round is taken
    assert run(sure, 0.9) == [1] * 80 and not sure.checks


def test_a_machine_that_speeds_up_after_the_plain_passes_were_timed_does_not_make_a_slot_look_free():
    """The table is right: a plain pass 1.0, two slots wide 1.07, a draft round 0.1, so a first slot pays from 17%.
    For 80 rounds the machine runs 10% slow (1.10 and 1.17): a first slot at 0.3 pays, the schedule drafts, and times
    the plain pass in the 16 plain rounds it takes to check it. Then the machine runs 10% fast (0.90 and 0.97) for
    300 drafted rounds; no plain pass is timed any more. A first slot at 0.14 then loses (1.14 / 1.07 against
    1 / 0.90). Compared mean against mean, the plain passes (slow minutes) and the wider ones (mostly fast minutes)
    made a second slot look free, and the schedule drafted every round at 0.14 (the mutation: the unpaired
    difference, as on one AMD EPYC at T = 1, 0.96x of plain decoding); paired a round apart, the increment stays the
    table's 0.07 and it drafts only to probe. (The one pair across the change, −0.2, is the lowest of 32: trimmed
    (`pair_trim`), it moves nothing.)"""
    table = CostTable(verify={1: {1: 1.0, 2: 1.07}}, draft_step={1: 0.05}, draft_round={1: 0.1})
    s = by_last_confidence(table)
    slow = [_round(s, 0.3, 1.10, 1.17, 0.1) for _ in range(80)]
    assert s.checks == {1: 16} and sum(slow) == 64
    assert all(_round(s, 0.3, 0.90, 0.97, 0.1) for _ in range(300))
    # every pair but the one across the change (its plain pass slow, its wider one fast: -0.2, trimmed) shows the
    # table's increment (16 plain rounds, each between two wider ones: 32 pairs)
    said = s.corrections()[1]["increment"]
    gap = s.verify_time(2, 1) - s.verify_time(1, 1)
    late = [_round(s, 0.14, 0.90, 0.97, 0.1) for _ in range(40)]
    assert sum(late) <= 4, late
    assert said["rounds"] == 32 and said["excess_s"] == pytest.approx(0.0, abs=1e-12)
    assert gap == pytest.approx(0.07)


def test_pairs_of_rounds_that_time_a_wider_pass_dearer_than_the_table_raise_its_increment():
    """The table says a pass two slots wide costs what a plain one does (1.0 both; one AMD EPYC's table said 66.3 ms
    for both, where pairs of rounds timed the second slot at +8.9 ms), a draft round 0.05: a first slot pays from 5%.
    For 80 rounds the machine runs slow, a plain pass 1.2 and a wider one 1.3: a slot at 0.3 pays, the schedule drafts
    and takes its 16 plain rounds to time the plain pass, each between two wider ones (32 pairs, +0.1 each). Then it
    runs fast (1.0 for a wider pass) for 300 drafted rounds; no plain pass is timed any more (it would take 0.9). The
    means now put a wider pass (about 1.05) under the plain one (1.18) and say nothing of the increment; the pairs
    (all but the one across the change, its plain pass slow and its wider one fast: −0.2, counted at the window's
    −0.11 and trimmed as the lowest) put it at +0.1 × 32 / 34. A slot
    at 0.08 then loses on the machine (1.08 / 1.05 against 1 / 0.9) and by the corrected table
    (1.08 / (0.05 + 1.26) against 1 / 1.18), so the schedule drafts only to probe. With the pairs taken only to lower
    the increment (the mutation: as it was), the table's flat increment stands and it drafts every round."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.0}}, draft_step={1: 0.05}, draft_round={1: 0.05})
    s = by_last_confidence(table)
    slow = [_round(s, 0.3, 1.2, 1.3, 0.05) for _ in range(80)]
    assert s.checks == {1: 16} and sum(slow) == 64
    assert all(_round(s, 0.3, 0.9, 1.0, 0.05) for _ in range(300))
    said = s.corrections()[1]["increment"]
    # the pair across the change (-0.2) counts at `pair_window` (0.2) under the estimate so far (0.09 by then), and
    # is trimmed as the lowest of the 32 (`pair_trim`)
    assert said["rounds"] == 32 and said["excess_s"] == pytest.approx(0.1)
    assert min(s.pairs[1]) == pytest.approx(0.1 * 31 / 33 - 0.2)
    assert s.verify_time(2, 1) - s.verify_time(1, 1) == pytest.approx(said["excess_s"] * 32 / 34)
    late = [_round(s, 0.08, 0.9, 1.0, 0.05) for _ in range(40)]
    assert sum(late) <= 4, late


def test_one_hiccup_in_a_pair_does_not_price_drafting_out():
    """The table is right (a plain pass 1.0, two slots wide 1.04, a draft round 0.02) and a first slot at 0.2 pays by
    far. The machine hiccups once: the first wider pass after a plain one takes 1.8. Counted as it is, that pair alone
    (+0.76, shrunk by 2 pairs) prices a second slot at 1.29, drafting stops, and only the probes' pairs ever lower it
    again: 5 rounds of 200 drafted. Held within `pair_window` of the estimate so far (+0.2), it stops nothing: 184 of
    200, the rest the plain rounds taken to time the plain pass (on an AMX Xeon one such pair, +32 ms on a 39 ms pass,
    kept EAGLE-3 from drafting for about 450 rounds). Mutation: no window."""
    cheap = CostTable(verify={1: {1: 1.0, 2: 1.04}}, draft_step={1: 0.01}, draft_round={1: 0.02})

    def drafted(s: CostSchedule) -> int:
        plain_timed = hiccup = False
        verified = 0
        for _ in range(200):
            wide = 1.8 if plain_timed and not hiccup else 1.04
            got = _round(s, 0.2, 1.0, wide, 0.02)
            hiccup = hiccup or bool(got and wide == 1.8)
            plain_timed = plain_timed or not got
            verified += got
        return verified

    assert drafted(by_last_confidence(cheap)) >= 180  # (184)
    unbounded = by_last_confidence(cheap)
    unbounded.pair_window = math.inf
    assert drafted(unbounded) <= 10  # (5)


def test_the_increment_is_the_trimmed_mean_of_the_last_pairs_and_its_error_their_spread():
    """Pairs of +1, +2, +3 ms, and one of +40 ms (a pass in a slow moment, within the window of a 400 ms plain pass):
    the estimate leaves the lowest and highest fifth out, so the hiccup moves it by nothing; its standard error is the
    spread of the pairs with those ends pulled in (winsorized) over (1 − 2g)√n. Only the last `pair_memory` count.
    Mutation: no trimming (the plain mean, +5.8 ms)."""
    table = CostTable(verify={1: {1: 0.4, 2: 0.401}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    s = CostSchedule(table)
    assert s.pair_error(1) is None
    for diff in [0.001, 0.002, 0.003] * 3 + [0.040]:
        s._pair(1, diff)
    # two left out at each end (0.001, 0.001 and 0.003, 0.040): the mean of 0.001, 0.002 × 3, 0.003 × 2
    assert s.excess[1]["increment"] == [pytest.approx(0.013 / 6 * 10), 10]
    winsorized = [0.001] * 3 + [0.002] * 3 + [0.003] * 4
    mean = sum(winsorized) / 10
    sd = math.sqrt(sum((x - mean) ** 2 for x in winsorized) / 9)
    assert s.pair_error(1) == pytest.approx(sd / (0.6 * math.sqrt(10)))
    s.pair_memory = 4
    s._pair(1, 0.002)
    assert s.pairs[1] == pytest.approx([0.002, 0.003, 0.040, 0.002])


def test_plain_rounds_go_on_timing_pairs_while_the_decision_hangs_on_the_increment():
    """The table puts a pass two slots wide at a plain one's (1.0), a draft round 0.05: a first slot at 0.08 pays by
    it (1.08 / 1.05 against 1 / 1.0). The machine takes 1.06 for a wider pass, so a drafted round loses 3%
    (1.08 / 1.11). Of the first 16 plain rounds taken to time it, every other one catches the machine in a slow
    moment (1.1): their pairs say −0.04 and +0.06 in turn, +0.01 on average. Stopped at `check_rounds` (the rule
    before, the mutation `check_errors` = 0), the schedule prices a second slot at +0.01, and drafts every round at a
    loss (200 of the last 200). Those pairs are too unsure for a decision that gains at most 0.02 a round: checks go on
    while the gain is within `check_errors` standard errors (`pair_error`), the later pairs say +0.06, and drafting
    stops but for its probes (at most 8 of the last 200)."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.0}}, draft_step={1: 0.01}, draft_round={1: 0.05})

    def last_200(s: CostSchedule) -> int:
        on, c = torch.tensor([True]), torch.tensor([0.08], dtype=torch.float64)
        drafted = []
        for _ in range(400):
            checks = s.checks.get(1, 0)
            if not s.worth_drafting(c, on):
                check = s.checks.get(1, 0)
                slow = check > checks and check <= 16 and check % 2 == 1  # a slow moment, every other early check
                s.timed(1.1 if slow else 1.0, 0.0)
                drafted.append(0)
                continue
            s.begin(on)
            admitted = int(s.admit(0, c, torch.ones(1, dtype=torch.float64), on).sum())
            s.timed(1.06 if admitted else 1.0, 0.05)
            drafted.append(admitted)
        return sum(drafted[200:])

    s = by_last_confidence(table)
    assert last_200(s) <= 8 and s.checks[1] > 16
    assert s.verify_time(2, 1) - s.verify_time(1, 1) > 0.03
    stopped = by_last_confidence(table)
    stopped.check_errors = 0.0
    assert last_200(stopped) == 200 and stopped.checks[1] <= 16


def test_plain_rounds_taken_to_time_pairs_each_pair_with_the_drafted_round_before():
    """A table of a flat pass (1.0 one or two slots wide), a draft round 0.05; the machine's wider pass takes 1.0, 1.05
    and 1.1 by turns. First slots at 0.12 for 100 rounds (drafting pays by a little: the schedule takes its first 16 plain
    rounds to time the plain pass, each between drafted ones, and a few more while the pairs are unsure), at 0.9 for 300 (it pays by far: no plain round), then at
    0.12 again, where what drafting gains is within `check_errors` standard errors of the increment. As in the engine,
    the drafted round after a plain one catches up on it (its pass is not paired). Each plain round now taken must
    come right after a pairable drafted pass, `check_every` drafted rounds after the last: checked against the plain
    passes timed overall (the mutation), the 300 rounds of drafting left a budget of checks, one was taken every other
    round, each after the catch-up of the last, and none made a pair."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.0}}, draft_step={1: 0.01}, draft_round={1: 0.05})
    s = by_last_confidence(table)
    on, state = torch.tensor([True]), {"drafted": 0, "plain_before": False}

    def run(conf: float, rounds: int) -> list[int]:
        c, kinds = torch.tensor([conf], dtype=torch.float64), []
        for _ in range(rounds):
            if not s.worth_drafting(c, on):
                s.timed(1.0, 0.0)
                state["plain_before"] = True
                kinds.append(0)
                continue
            s.begin(on)
            admitted = int(s.admit(0, c, torch.ones(1, dtype=torch.float64), on).sum())
            if state["plain_before"]:
                s.catching_up()  # the drafter runs over the round it skipped
            state["drafted"] += 1
            s.timed((1.0 + 0.05 * (state["drafted"] % 3)) if admitted else 1.0, 0.05)
            state["plain_before"] = not admitted
            kinds.append(1)
        return kinds

    run(0.12, 100)
    first = s.checks[1]
    assert first >= 16
    assert sum(run(0.9, 300)) == 300 and s.checks[1] == first
    pairs = len(s.pairs[1])
    late = run(0.12, 100)
    checks = [i for i, k in enumerate(late) if not k]
    assert len(checks) >= 5 and s.checks[1] == first + len(checks)
    assert len(s.pairs[1]) == pairs + len(checks)  # every check made a pair
    assert all(b - a > s.check_every for a, b in zip(checks, checks[1:])), checks


def test_a_pair_never_spans_two_decodes_nor_takes_the_pass_of_a_round_that_caught_up():
    """A table of a 40 ms plain pass, 42 ms two slots wide. Decode A times a plain pass (40) and a wider one (44): one
    pair, +2 ms over the table. Decode B's first round is plain (40): it is not paired with decode A's last, wider
    pass. Its first drafted round catches up on the prompt and the skipped rounds, and its pass takes 50 ms (a probe's):
    not paired with the plain pass before it, nor with the one after. A wider pass after a drafted round's (44) pairs
    again, with the plain ones on either side. Mutations: `reset` keeping the last pass (4 pairs); a catch-up's pass
    paired with the pass before it (4 pairs, one of +8 ms), or with the pass after it (4)."""
    table = CostTable(verify={1: {1: 0.040, 2: 0.042}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    s = CostSchedule(table)

    def timed(width: int, seconds: float, caught_up: bool = False) -> None:
        s.last = (1, width, -1 if width == 1 else 0)  # as `worth_drafting` / `admit` leave it
        if caught_up:
            s.catching_up()
        s.timed(seconds, 0.0 if width == 1 else 0.004)

    timed(1, 0.040)
    timed(2, 0.044)
    assert s.excess[1]["increment"] == [pytest.approx(0.002), 1]
    s.reset()  # decode B
    timed(1, 0.040)
    timed(2, 0.050, caught_up=True)
    timed(1, 0.040)
    assert s.excess[1]["increment"] == [pytest.approx(0.002), 1]
    timed(2, 0.044)
    timed(1, 0.040)
    assert s.excess[1]["increment"] == [pytest.approx(0.006), 3]
    assert s.verify_time(2, 1) - s.verify_time(1, 1) == pytest.approx(0.002 + 0.006 / 5)


def test_wider_passes_timed_in_a_slow_spell_do_not_keep_drafting_off_once_pairs_time_the_increment():
    """The table is flat (a pass 1.0 one or two slots wide), a draft round 0.1. For 30 rounds the machine runs slow (a
    plain pass 1.3, a wider one 1.45) with first slots at 0.15: the schedule drafts a few times, and some of its wider
    passes follow a plain one (pairs, +0.15 each). Then it runs fast (0.9 and 0.92): 200 rounds at 0.1, where drafting
    does not pay, time the plain pass, then 200 rounds at 0.3, where drafting pays by 15% on the machine
    (1.3 / 1.02 against 1 / 0.9) and by the pairs ((1.3) / (0.1 + 0.95 + 0.07) against 1 / 0.95). With the wider
    passes' own mean as a floor (the mutation: as it was), the slow spell's +0.45 prices a second slot at 1.28 against a
    plain pass at 0.92 and the schedule never drafts again (0 of 200; EAGLE-3 at T = 0 on an AMX Xeon, τ 1.00 over a
    whole bench after a slow first minute); with the pairs alone it drafts in at least 195 of them (all 200 here)."""
    table = CostTable(verify={1: {1: 1.0, 2: 1.0}}, draft_step={1: 0.05}, draft_round={1: 0.1})
    s = by_last_confidence(table)
    slow = [_round(s, 0.15, 1.3, 1.45, 0.1) for _ in range(30)]
    assert 2 <= sum(slow) <= 8 and s.corrections()[1]["increment"]["excess_s"] == pytest.approx(0.15), slow
    assert sum(_round(s, 0.1, 0.9, 0.92, 0.1) for _ in range(200)) <= 8
    assert s.verify_time(1, 1) == pytest.approx(0.95, abs=0.01)
    assert s.verify_time(2, 1) == pytest.approx(s.verify_time(1, 1) + s._paired(1))
    assert sum(_round(s, 0.3, 0.9, 0.92, 0.1) for _ in range(200)) >= 195


def test_a_table_that_makes_a_wider_pass_too_dear_is_corrected_by_timing_one():
    """The table puts a pass two slots wide at 1.12 (a plain one 1.0, a draft round 0.02); the machine runs both at
    1.0, as two tables of one AMD EPYC measured minutes apart disagreed by 12% on a 32 ms pass. A first slot at 0.1
    does not pay by the table ((1 + 0.1) / 1.14 against 1 / 1.0) and does in truth (1.1 / 1.02), so the schedule
    skips and probes, and a probe admits nothing either ((1.1) / 1.14 < 1 / 1.02). So no wider pass would ever be
    timed: while fewer than `explore_rounds` are, a probe verifies its likeliest slot anyway (its rate within
    `explore_margin`). Timed at 1.0, with plain passes timed too, the increment over the plain pass shrinks
    (0.12 − 0.12 n / (n + 2)), drafting pays, and the schedule drafts (a plain round every 4 drafted ones to time the
    plain pass, up to 16). Without the exploring slot (`explore_rounds` 0) it never verifies a slot; without the
    increment's correction (the mutation of `_narrower`) it verifies only the 4 exploring ones.
    With a table that is right (wider passes do take 1.12), one exploring slot shows it and none follows; where the
    slot would cost more than `explore_margin` of the round's rate, none is verified."""
    dear = CostTable(verify={1: {1: 1.0, 2: 1.12}}, draft_step={1: 0.07}, draft_round={1: 0.02})
    s = by_last_confidence(dear)
    slots = [_round(s, 0.1, 1.0, 1.0, 0.02) for _ in range(120)]
    assert s.explores == {1: 1} and sum(slots) >= 90 and slots[-30:] == [1] * 30, slots
    assert s.verify_time(2, 1) == pytest.approx(1.0, abs=0.02)
    assert s.corrections()[1]["wide"]["explores"] == 1
    never = by_last_confidence(dear)
    never.explore_rounds = 0
    assert sum(_round(never, 0.1, 1.0, 1.0, 0.02) for _ in range(120)) == 0
    right = by_last_confidence(dear)
    assert sum(_round(right, 0.1, 1.0, 1.12, 0.02) for _ in range(120)) == 1 and right.explores == {1: 1}
    assert right.verify_time(2, 1) == pytest.approx(1.12)
    # where a second slot costs 62% more (fp32 on an AVX2-only EPYC), verifying one at 0.1 would cost a third of the
    # round's rate ((1.1) / 1.64 against 1 / 1.02): beyond `explore_margin`, so none is verified to time it
    steep = by_last_confidence(CostTable(verify={1: {1: 1.0, 2: 1.62}}, draft_step={1: 0.07}, draft_round={1: 0.02}))
    assert sum(_round(steep, 0.1, 1.0, 1.62, 0.02) for _ in range(120)) == 0 and not steep.explores


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_the_engine_reports_every_round_to_the_schedule(tiny64, family):
    """Every round of a decode is timed to the schedule, as a plain pass or a wider one as it verified (one row:
    rounds it skipped and rounds it drafted), and a drafter update over the prompt as a catch-up."""
    from tests.eval.test_dspark_exactness import _dspark_for

    drafter = _eagle3(tiny64) if family == "eagle3" else _dspark_for(tiny64)
    proposer = Eagle3Proposer(drafter) if family == "eagle3" else DSparkProposer(drafter)
    proposer.schedule = CostSchedule(TABLE)
    res = decode(HFTarget(tiny64, drafter.config.aux_layer_ids), proposer, [[5, 17, 33, 9]], SamplingParams(), 3, 30)
    seen = proposer.schedule.excess[1]
    drafted = [d for d, _ in res[0].rounds]
    assert seen["plain"][1] == sum(d == 0 for d in drafted) and seen["wide"][1] == sum(d > 0 for d in drafted)
    assert seen["draft"][1] + seen["step"][1] + seen["catch-up"][1] >= seen["wide"][1] > 0
    # the first drafted round ran the drafter over the prompt: a catch-up, timed apart from the rounds that follow
    assert seen["catch-up"][1] >= 1


def test_switching_rules_keeps_what_the_cost_schedule_learned(tiny64):
    """The batch curve switches one proposer between fixed γ and the cost schedule for every group of rows: switching
    back resumes the same schedule (its calibration and timings), not a new one that learns from scratch each group.
    A new table gets a new schedule."""
    proposer = Eagle3Proposer(_eagle3(tiny64))
    proposer.use("cost", TABLE)
    learned = proposer.schedule
    assert learned is not None
    learned.observe([[0.5]], [0])
    proposer.use("fixed", TABLE)
    assert proposer.schedule is None
    proposer.use("cost", TABLE)
    assert proposer.schedule is learned and learned.ratio(0) < 1.0
    proposer.use("cost", DIST_TABLE)
    assert proposer.schedule is not learned and proposer.schedule.ratio(0) == 1.0


def test_what_the_rounds_teach_is_kept_per_sampling():
    """Greedy rounds showed first slots at confidence 0.5 never accepted and plain passes 0.2 over the table; sampled
    rounds start again from the table and a calibration taken as right (the drafter's confidences do not know the
    temperature), and learn their own; back to greedy, greedy's is still there. The report sums both; each regime's
    own are there too."""
    s = CostSchedule(TABLE)
    s.regime("greedy")
    for _ in range(20):
        s.observe([[0.5]], [0])
    s.last = (1, 1, -1)
    s.timed(1.2, 0.0)
    greedy = (s.ratio(0), s.verify_time(1, 1))
    assert greedy == (pytest.approx(4 / 14), pytest.approx(1.0 + 0.2 / 3))
    s.regime((1.0, 1.0, 0))
    assert (s.ratio(0), s.verify_time(1, 1)) == (1.0, 1.0)
    s.observe([[0.5]], [1])
    s.last = (1, 1, -1)
    s.timed(0.9, 0.0)
    s.regime("greedy")
    assert (s.ratio(0), s.verify_time(1, 1)) == greedy
    assert s.corrections()[1]["plain"] == {"excess_s": pytest.approx(0.05), "rounds": 2, "checks": 0}
    # each regime's own, for a bench that reports its temperatures apart
    assert s.regime_corrections("greedy")[1]["plain"] == {"excess_s": pytest.approx(0.2), "rounds": 1, "checks": 0}
    assert s.regime_corrections((1.0, 1.0, 0))[1]["plain"]["excess_s"] == pytest.approx(-0.1)
    assert s.regime_corrections((0.7, 1.0, 0)) == {}


def test_a_proposer_tells_its_schedule_the_sampling_of_every_round(tiny64):
    """EAGLE-3 with the cost schedule decodes greedily, then at T = 1: the schedule keeps a regime for each."""
    proposer = Eagle3Proposer(_eagle3(tiny64))
    proposer.use("cost", TABLE)
    schedule = proposer.schedule
    assert schedule is not None
    target = HFTarget(tiny64, proposer.aux_ids)
    decode(target, proposer, [[5, 6, 7]], SamplingParams(), 3, 6)
    assert schedule.sampling == "greedy" and sum(schedule.verified) > 0
    gens = [make_generator(tiny64.device, 0)]
    decode(target, proposer, [[5, 6, 7]], SamplingParams(1.0), 3, 6, generators=gens)
    assert schedule.sampling == (1.0, 1.0, 0) and set(schedule.regimes) >= {"greedy"}
    assert sum(schedule.regimes["greedy"]["verified"]) > 0


def test_pass_times_are_made_nondecreasing_in_the_width():
    """Timing noise that makes a wider pass look cheaper is pooled away (least squares); a monotone row is kept."""
    assert nondecreasing([58.0, 60.0, 65.0, 66.0, 60.0, 62.0]) == [58.0, 60.0, 63.25, 63.25, 63.25, 63.25]
    assert nondecreasing([72.6, 108.3, 75.9]) == pytest.approx([72.6, 92.1, 92.1])
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert nondecreasing([]) == []


# For the tiny DSpark drafter, whose confidences lie between 0.48 and 0.77: slot 0 pays from about 0.62 alone, so
# rounds with no slot, some and all occur, and whole rounds are skipped on a low confidence of the round before.
DIST_TABLE = CostTable(
    verify={1: {1: 1.0, 2: 1.68, 3: 1.9, 4: 2.4}, 4: {1: 1.0, 2: 1.5, 3: 1.7, 4: 2.2}},
    draft_step={1: 0.05, 4: 0.05},
    draft_round={1: 0.1, 4: 0.1},
)


@pytest.mark.parametrize("rows", [1, 3])
def test_sampling_with_the_schedule_emits_the_targets_distribution(rows, test_device):
    """Four emitted tokens per row of a batch of `rows` identical prompts, each row with its own generator: with
    the schedule deciding per round which slots (and whether any) are verified, every row's output is still
    distributed as the target's."""
    proposer = DSparkProposer(_tiny_dspark(device=test_device))
    proposer.schedule = CostSchedule(DIST_TABLE, learn_costs=False)  # made-up seconds: the decisions they script
    target = FeatureBigramTarget(P.to(test_device), 3 * 8)
    gens = [make_generator(test_device, 100 + b) for b in range(rows)]
    counts, drafted, rounds, empty = Counter(), 0, 0, 0
    for _ in range(4000 // rows):
        res = decode(target, proposer, [[0]] * rows, SamplingParams(temperature=1.0), 3, 4, generators=gens)
        for r in res:
            counts[tuple(r.tokens[:4])] += 1
            drafted += sum(d for d, _ in r.rounds)
            rounds += len(r.rounds)
            empty += sum(d == 0 for d, _ in r.rounds)
    assert chi_square_pvalue(counts, _exact()) > 1e-3, counts
    assert 0 < empty < rounds and drafted > rounds - empty  # rounds with none, one and several slots all occurred


class PeekingSchedule(DSparkProposer):
    """Mutant: the schedule admits slot i after x_i is drawn, and not when x_i came out as token 1 (a slot's
    admission reading its own drafted token)."""

    def _chain(self, k, active, params, generators, step):
        B = len(active)
        drafting = torch.tensor(list(active), dtype=torch.bool)
        survival = torch.ones(B, dtype=torch.float64)
        drafts, qs, x = [[] for _ in range(B)], [], None
        self.schedule.begin(drafting)
        for i in range(k):
            logits, conf = step(i, x)
            x, q = self._draw(logits, params, generators, drafting)
            c = conf.double().cpu() * (x != 1)
            drafting = self._admit(i, c, survival, drafting)
            if not drafting.any():
                break
            survival = torch.where(drafting, survival * c, survival)
            qs.append(q)
            for b in drafting.nonzero().flatten().tolist():
                drafts[b].append(int(x[b]))
        return Proposal(drafts, torch.stack(qs, 1) if qs else None)


def test_the_schedule_sampling_test_rejects_a_peeking_schedule(test_device):
    mutant = PeekingSchedule(_tiny_dspark(device=test_device))
    mutant.schedule = CostSchedule(
        TABLE, learn_costs=False
    )  # every slot of this drafter pays there: peeking is the only cut
    counts, _, _ = _emitted_dspark(mutant, n=2000, seed=3)
    assert chi_square_pvalue(counts, _exact()) < 1e-6


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_with_the_schedule_commits_the_targets_greedy_tokens(tiny64, rows):
    """EAGLE-3 with the schedule (rounds where the drafter runs, and rounds where it is skipped and catches up on
    the verified slots later in one pass): every row's tokens are the target's greedy tokens."""
    drafter = _eagle3(tiny64)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(5, 380, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(rows)
    ]
    for table, expect in [(TABLE, "mixed"), (CostTable({1: {1: 1.0, 2: 5.0}, 3: {1: 1.0, 2: 5.0}}, {}, {}), "skips")]:
        proposer = Eagle3Proposer(drafter)
        proposer.schedule = CostSchedule(table)
        res = decode(HFTarget(tiny64, drafter.config.aux_layer_ids), proposer, prompts, SamplingParams(), 3, 30)
        for r, p in zip(res, prompts):
            assert r.tokens == plain_greedy(tiny64, p, 30)
        drafted = [d for r in res for d, _ in r.rounds]
        if expect == "mixed":
            assert any(d > 0 for d in drafted)
            # the engine reported every verified round to the schedule (its online calibration)
            assert proposer.schedule.predicted[0] > 0 and proposer.schedule.accepted[0] == sum(
                a > 0 for r in res for _, a in r.rounds
            )
        else:  # a slot costs 4 more passes: the drafter is only probed, with backoff, and never pays
            assert all(d == 0 for d in drafted) and proposer.schedule.backoff > 1


def test_a_new_decode_predicts_its_first_slot_from_the_first_slots_verified_so_far():
    """A row that has not drafted yet (c0 NaN) is predicted at the mean confidence of the first slots drafted so far
    times the online calibration, not at a confidence of 1: with first slots accepted 15% of the time by a drafter
    that said 0.2 (calibration maps 0.2 to 0.2 · 19/24 = 0.158), a new decode's first round is a plain step under
    TABLE (slot 0 pays from 0.273)."""
    new, on = torch.tensor([float("nan")], dtype=torch.float64), torch.tensor([True])
    s = CostSchedule(TABLE)
    assert s.first_slot_rate() == 1.0 and s.worth_drafting(new, on)  # nothing seen yet: draft, to learn
    for r in range(100):
        s.observe([[0.2]], [1 if r % 20 < 3 else 0])
    assert s.ratio(0) == pytest.approx((15 + 4) / (100 * 0.2 + 4))
    assert s.first_slot_rate() == pytest.approx(0.2 * s.ratio(0))
    s.reset()
    assert not s.worth_drafting(new, on)


def test_first_slots_admission_turns_down_teach_the_rate_a_new_decode_is_predicted_at():
    """A drafter whose every first slot admission declines (confidence 0.05 where slot 0 pays from 0.273) has none
    verified; its declined slots count at their confidence, so once it has a level (`level_slots` first slots) a new
    decode's first round is a plain step, not a draft round that catches up on the prompt only to decline its slot
    again."""
    new, low = (torch.tensor([x], dtype=torch.float64) for x in (float("nan"), 0.05))
    on = torch.tensor([True])
    s = CostSchedule(TABLE)
    for _ in range(s.level_slots):  # drafted rounds (new decodes' first), each slot declined
        assert s.worth_drafting(new, on)  # too few first slots for a level yet: draft, to learn
        s.begin(on)
        assert not s.admit(0, low, torch.ones(1, dtype=torch.float64), on).any()
        s.reset()
    assert not s.worth_drafting(new, on)
    for _ in range(30):  # more drafted rounds (probes, new decodes' first), each slot declined
        s.begin(on)
        assert not s.admit(0, low, torch.ones(1, dtype=torch.float64), on).any()
    assert not s.verified  # nothing verified: the share of accepted first slots alone would still say 1
    assert s.first_slot_rate() == pytest.approx(0.05)  # their confidence, as calibrated (no verified slot: ratio 1)
    s.reset()
    assert not s.worth_drafting(new, on)


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_a_decode_the_schedule_never_drafts_in_costs_the_drafter_nothing(tiny64, family):
    """Where the schedule skips every round (a slot costs 4 more passes, a probe waits the most rounds allowed),
    the drafter runs no forward at all in the decode, not even over the prompt: its time is plain decoding's. The
    tokens are still the target's greedy ones."""
    from tests.eval.test_dspark_exactness import _dspark_for

    drafter = _eagle3(tiny64) if family == "eagle3" else _dspark_for(tiny64)
    calls = []
    for name in ("decode", "extend_context", "draft_block"):
        if hasattr(drafter, name):
            fn = getattr(drafter, name)
            setattr(drafter, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    proposer = Eagle3Proposer(drafter) if family == "eagle3" else DSparkProposer(drafter)
    never = CostTable({1: {1: 1.0, 2: 5.0}}, {1: 0.1}, {1: 10.0})  # a probe would wait max_backoff rounds
    proposer.schedule = CostSchedule(
        never, learn_costs=False
    )  # even a sure first slot would not pay: (1 + 1) / (10 + 5) < 1 / 1
    prompt = [5, 17, 33, 9]
    res = decode(HFTarget(tiny64, drafter.config.aux_layer_ids), proposer, [prompt], SamplingParams(), 3, 20)
    assert res[0].tokens == plain_greedy(tiny64, prompt, 20)
    assert all(d == 0 for d, _ in res[0].rounds) and calls == []


class _Scripted:
    """A schedule that drafts on the rounds `plan` says (cycled) and admits every slot: what a proposer keeps for
    the rounds it skips is all this exercises."""

    halted = False

    def __init__(self, plan):
        self.plan, self.round, self.skipped = plan, 0, 0

    def worth_drafting(self, c0, active):
        self.round += 1
        drafts = self.plan[(self.round - 1) % len(self.plan)]
        self.skipped += not drafts
        return drafts

    def admit(self, i, conf, survival, drafting):
        return drafting

    def regime(self, *a): ...
    def begin(self, *a): ...
    def reset(self, *a): ...
    def observe(self, *a): ...
    def timed(self, *a): ...
    def catching_up(self, *a): ...


@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_a_drafter_that_skipped_rounds_drafts_what_one_started_on_the_whole_text_drafts(tiny64, family):
    """The rounds a schedule skips are kept in Python (`_keep_round`) and run through the drafter in one pass when it
    next drafts. On every round it drafts, each row drafts the tokens, with the confidences, of a fresh proposer
    started on that row's whole text so far as its prompt (the prompt's own path, through the target's prefill): two
    rows of different prompt lengths (left padding), stretches of 1 to 3 skipped rounds, rows keeping different counts of slots."""
    from tests.eval.test_dspark_exactness import _dspark_for

    drafter = _eagle3(tiny64) if family == "eagle3" else _dspark_for(tiny64)
    make = Eagle3Proposer if family == "eagle3" else DSparkProposer
    lazy = make(drafter)
    lazy.schedule = _Scripted([True, False, False, True, True, False, True, False, False, False])
    aux = drafter.config.aux_layer_ids
    compared = []

    def fresh(history, k):
        """What a proposer started on `history` (all but its last token as the prompt) drafts first."""
        target, p = HFTarget(tiny64, aux), make(drafter)
        _, feats, valid = target.prefill([history[:-1]])
        p.start([history[:-1]], [history[-1]], feats, valid)
        return p.propose([history], [True], k, SamplingParams(), [None])

    class Checked:
        aux_ids = lazy.aux_ids

        def start(self, *a):
            lazy.start(*a)

        def propose(self, histories, active, k, params, gens):
            mine = lazy.propose(histories, active, k, params, gens)
            if any(mine.drafts):
                for b, h in enumerate(histories):
                    if active[b]:
                        compared.append((mine.drafts[b], mine.confidences[b], fresh(list(h), k)))
            # verified (on skipped rounds too): one row, in turn, the target's own next tokens, all accepted, so rows keep different
            # counts of slots in a round (the other's padded with holes); the drafter's update reads what was kept
            self.round = getattr(self, "round", 0) + 1
            b = self.round % 2
            if active[b]:
                mine.drafts[b] = plain_greedy(tiny64, histories[b], k)
                if mine.confidences is not None:  # a round the drafter skipped keeps no confidences
                    mine.confidences[b] = [0.5] * k
            return mine

        def commit(self, *a):
            lazy.commit(*a)

        def observe(self, *a): ...
        def timed(self, *a): ...

    prompts = [[5, 17, 33, 9, 41, 2], [7, 3]]
    res = decode(HFTarget(tiny64, aux), Checked(), prompts, SamplingParams(), 3, 30)
    assert len(compared) >= 5 and lazy.schedule.skipped >= 5  # stretches skipped, then caught up
    assert sum(a > 0 for r in res for _, a in r.rounds) >= 5
    for drafts, confs, theirs in compared:
        assert drafts == theirs.drafts[0]
        assert torch.allclose(torch.tensor(confs), torch.tensor(theirs.confidences[0]), atol=1e-7)


def test_the_report_gives_the_acceptance_the_schedule_weighs_a_first_slot_against():
    """The cost table's "a first slot pays from" column is the schedule's own line: a row whose first-slot confidence
    sits just above it is drafted, just below it is not (40 ms plain pass, 42 ms two slots wide, 4 ms draft round:
    (42 + 4) / 40 - 1 = 15%)."""
    from draftsmith.eval.report import break_evens, cost_tables_markdown

    table = CostTable(verify={1: {1: 0.040, 2: 0.042}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    assert break_evens({"eagle3": asdict(table)}, 1) == {"eagle3": (pytest.approx(0.15), None)}
    assert break_evens({"eagle3": asdict(CostTable(verify={1: {1: 0.040}}))}, 1) == {}  # no wider pass: no line
    on = torch.tensor([True])
    for c, drafts in ((0.151, True), (0.149, False)):
        s = by_last_confidence(table, learn_costs=False)
        assert s.worth_drafting(torch.tensor([c], dtype=torch.float64), on) is drafts, c
    md = cost_tables_markdown({"eagle3": {**asdict(table), "cached": False}})
    assert "| a first slot pays from |" in md and "| 15% acceptance |" in md


def test_the_report_gives_the_line_the_eval_timed_as_the_schedule_drew_it():
    """What an eval's rounds timed (`corrections`, as eval.json keeps them: string batch sizes) moves the line: plain
    passes 1 ms dearer, wider ones 3 ms over plain ones, draft rounds 1 ms dearer. The report's "as timed" figure is
    where a schedule holding those timings draws it: a confidence just above drafts, just below does not, and the
    line is well above the table's 15%."""
    from draftsmith.eval.report import break_evens, cost_tables_markdown

    table = CostTable(verify={1: {1: 0.040, 2: 0.042}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    timed = {
        "1": {
            "plain": {"excess_s": 0.001, "rounds": 400.0},
            "increment": {"excess_s": 0.001, "rounds": 100.0},
            "draft": {"excess_s": 0.001, "rounds": 300.0},
        }
    }
    (by_table, as_timed) = break_evens({"eagle3": {**asdict(table), "corrections": timed}}, 1)["eagle3"]
    assert by_table == pytest.approx(0.15) and 0.19 < as_timed < 0.2  # (41 + 2 + 1 + 5) / 41 - 1 = 19.5%, shrunk
    for c, drafts in ((as_timed + 1e-3, True), (as_timed - 1e-3, False)):
        s = CostSchedule.as_timed(table, timed)
        variant(s, "last")  # decided from the row's last confidence at face value: the line itself
        assert s.worth_drafting(torch.tensor([c], dtype=torch.float64), torch.tensor([True])) is drafts, c
    md = cost_tables_markdown({"eagle3": {**asdict(table), "cached": False, "corrections": timed}})
    assert f"| 15% acceptance ({100 * as_timed:.0f}% as timed in eval) |" in md
