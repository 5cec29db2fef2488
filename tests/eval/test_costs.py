"""The cost table's measurement (eval.costs): what it times, and that a machine whose speed drifts while it measures
does not bend the table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from draftsmith.eval import engine
from draftsmith.eval.costs import Rotation, Round, cached_costs, cost_key, fit, measure_costs
from draftsmith.eval.proposers import Eagle3Proposer
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.schedule import CostTable
from tests.eval.test_exactness import _eagle3


def test_the_cost_table_times_the_same_rounds_for_every_chain_length(tiny64):
    """Every timed decode of `measure_costs` runs exactly `rounds` rounds (target passes after the prefill), however
    few drafts the drafter gets accepted (a weak drafter used to decode up to (rounds + 1)(γ + 1) tokens a round at a
    time, so the table took (γ + 1) times longer for it: minutes at batch 64), every chain length gets the same
    number of rounds, and the timed decodes take the prompts in turn (what a wider pass adds depends on the context)."""
    drafter = _eagle3(tiny64)  # untrained: its drafts are almost never accepted
    runner = HFTarget(tiny64, drafter.config.aux_layer_ids)
    widths, step = [], runner.step

    def counted(tokens, *a, **k):
        widths.append(tokens.shape[1])
        return step(tokens, *a, **k)

    prompts, prefill = [], runner.prefill

    def logged(rows):
        prompts.append([list(r) for r in rows])
        return prefill(rows)

    runner.step, runner.prefill = counted, logged  # type: ignore[method-assign]
    proposer = Eagle3Proposer(drafter)
    table = measure_costs(runner, proposer, [[5, 17, 33, 9], [7, 3], [11]], [1, 2], 3, rounds=4, repeats=2)
    assert all(sorted(table.verify[b]) == [1, 2, 3, 4] and table.draft_round[b] >= 0.0 for b in (1, 2))
    # per batch size, an untimed warm-up cycle of the four lengths, then 2 x 4 decodes of 4 rounds: 8 rounds of each
    for at in (widths[:36], widths[36:]):
        assert sorted(at[:4]) == [1, 2, 3, 4] and len(at) == 4 + 2 * 4 * 4
        assert all(at[4:].count(w) == 8 for w in (1, 2, 3, 4))
    # each timed decode on the next prompts, in turn
    a, b, c = [5, 17, 33, 9], [7, 3], [11]
    assert prompts[:4] == [[a], [a], [b], [c]] and prompts[9:12] == [[a, b], [a, b], [c, a]]
    assert proposer.schedule is None  # its own rule put back


def test_a_machine_that_slows_down_while_the_table_is_measured_does_not_bend_it(tiny64, monkeypatch):
    """A fake clock: a target pass w slots wide costs base + 4 ms * (w - 1), and base grows by 0.2 ms every pass (the
    machine slowing by half over the measurement); a draft round 3 ms plus 1 ms per further depth. Each wider pass is
    priced against the plain round of its own cycle, at most γmax = 3 rounds away, so no increment is off by more than
    3 * 0.2 ms, whatever the shuffled order (whole decodes of each length one after another put the widest 48 passes
    after the plain ones: 9.6 ms too dear). The drafting fit is exact."""
    now = [0.0]
    monkeypatch.setattr(engine, "clock", lambda device: now[0])
    drafter = _eagle3(tiny64)
    runner = HFTarget(tiny64, drafter.config.aux_layer_ids)
    proposer = Eagle3Proposer(drafter)
    passes, step, propose = [0], runner.step, proposer.propose

    def slowing(tokens, *a, **k):
        passes[0] += 1
        now[0] += 0.040 + 0.0002 * passes[0] + 0.004 * (tokens.shape[1] - 1)
        return step(tokens, *a, **k)

    def drafting(*a, **k):
        proposal = propose(*a, **k)
        depth = max(len(d) for d in proposal.drafts)
        now[0] += 0.003 + 0.001 * (depth - 1) if depth else 0.0
        return proposal

    runner.step, proposer.propose = slowing, drafting  # type: ignore[method-assign]
    table = measure_costs(runner, proposer, [[5, 17, 33, 9]], [1], 3, rounds=16, repeats=3)
    row = table.verify[1]
    for w in (2, 3, 4):
        assert abs(row[w] - row[1] - 0.004 * (w - 1)) <= 3 * 0.0002 + 1e-9, (w, row)
    assert abs(table.draft_round[1] - 0.003) < 1e-9 and abs(table.draft_step[1] - 0.001) < 1e-9


def test_the_fit_pairs_each_wider_pass_with_the_plain_round_of_its_cycle():
    """Three cycles at three speeds of the machine, one wider pass timed in a slow moment (+15 ms): each width's
    median alone would take that moment for its price; the median of the paired differences does not. A round that
    caught up on skipped slots is left out of the drafting fit."""
    rounds = [
        Round(0, 0, 0.040, 0.0, False), Round(0, 1, 0.042, 0.010, True), Round(0, 2, 0.047, 0.005, False),
        Round(1, 2, 0.087, 0.005, False), Round(1, 0, 0.080, 0.0, False), Round(1, 1, 0.082, 0.003, False),
        Round(2, 1, 0.075, 0.005, False), Round(2, 0, 0.060, 0.0, False), Round(2, 2, 0.067, 0.005, False),
    ]  # fmt: skip
    verify, step, round_ = fit(rounds, 2)
    # plain: median 0.060; width 2: +2, +2, +15 ms -> +2 ms (alone its median is 0.075); width 3: +7 ms in each
    assert verify == pytest.approx({1: 0.060, 2: 0.062, 3: 0.067}, abs=1e-12)
    # drafting: γ = 1 -> 4 ms (3 and 5; with the catch-up, 5), γ = 2 -> 5 ms
    assert round_ == pytest.approx(0.004, abs=1e-12) and step == pytest.approx(0.001, abs=1e-12)


def test_a_proposer_that_drafts_fewer_than_asked_is_timed_at_the_width_it_verified(tiny64):
    """A family's proposer may draft without asking the schedule whether to (no `worth_drafting`), and fewer slots
    than the round's length: the round's length is then set when it begins drafting, and the round is timed at the
    width it verified (here one slot at most: widths 1 and 2 only, the rounds of length 0 plain ones)."""

    class OneSlot(Eagle3Proposer):
        def _skip_round(self, active, params):
            return False

        def propose(self, histories, active, k, params, generators):
            return super().propose(histories, active, min(k, 1), params, generators)

    drafter = _eagle3(tiny64)
    runner = HFTarget(tiny64, drafter.config.aux_layer_ids)
    widths, step = [], runner.step

    def counted(tokens, *a, **k):
        widths.append(tokens.shape[1])
        return step(tokens, *a, **k)

    runner.step = counted  # type: ignore[method-assign]
    table = measure_costs(runner, OneSlot(drafter), [[5, 17, 33, 9], [7, 3]], [1], 3, rounds=4, repeats=2)
    assert sorted(table.verify[1]) == [1, 2] and table.verify[1][2] >= table.verify[1][1]
    assert set(widths) == {1, 2} and widths[4:].count(1) == 8  # one round in four a plain one


def test_a_table_is_measured_once_per_key_and_the_benches_key_apart_from_eval(tmp_path):
    """`cost_key` is the one key eval and the benches cache tables under: the same key reuses the table measured, and
    another drafter architecture (of one family, at one run), another chain length, or a bench's own run measures
    again. A family name alone is refused: keyed by it, a bench reused a two-layer DSpark's table for the one-layer
    drafter trained in the same run directory after it."""
    target = SimpleNamespace(identity={"name": "t"}, model=SimpleNamespace(dtype=torch.bfloat16), device="cpu")
    measured = []

    def measure():
        measured.append(1)
        return CostTable({1: {1: 0.01 * len(measured)}})

    eagle3 = {"hidden_size": 64, "num_layers": 1}
    two, one = {"block_size": 7, "num_layers": 2}, {"block_size": 7, "num_layers": 1}
    key = cost_key(target, eagle3, [1, 4], 5, 16)
    assert key["dtype"] == "torch.bfloat16" and key["batches"] == [1, 4] and "run" not in key
    first, cached = cached_costs(tmp_path, key, measure)
    again, cached_again = cached_costs(tmp_path, cost_key(target, dict(eagle3), [1, 4], 5, 16), measure)
    assert (cached, cached_again, len(measured)) == (False, True, 1)
    assert again.verify == first.verify and again.key["drafter"] == json.dumps(eagle3, sort_keys=True)
    assert cached_costs(tmp_path, cost_key(target, two, [1, 4], 7, 16, run="runs/demo"), measure)[1] is False
    for other in (
        cost_key(target, one, [1, 4], 7, 16, run="runs/demo"),
        cost_key(target, eagle3, [1, 4], 3, 16),
        cost_key(target, eagle3, [1, 4], 5, 16, run="runs/demo"),
    ):
        assert cached_costs(tmp_path, other, measure)[1] is False
    assert len(measured) == 5
    with pytest.raises(TypeError, match="drafter's config"):
        cost_key(target, "dspark", [1, 4], 7, 16, run="runs/demo")


def test_every_timed_decode_is_whole_cycles_of_the_chain_lengths(tiny64):
    """A wider pass is priced against the plain round of its cycle, so a cycle must not run on from one decode into
    the next (another prompt, another context length): each timed decode starts a new cycle and runs whole ones. 5
    rounds over 3 lengths become decodes of 6 rounds, each length twice in each, and as many decodes (5) as give
    every length the 2 x 5 rounds asked for."""
    drafter = _eagle3(tiny64)
    runner = HFTarget(tiny64, drafter.config.aux_layer_ids)
    decodes: list[list[int]] = []
    step, prefill = runner.step, runner.prefill

    def counted(tokens, *a, **k):
        decodes[-1].append(tokens.shape[1])
        return step(tokens, *a, **k)

    def started(rows):
        decodes.append([])
        return prefill(rows)

    runner.step, runner.prefill = counted, started  # type: ignore[method-assign]
    measure_costs(runner, Eagle3Proposer(drafter), [[5, 17, 33, 9], [7, 3], [11]], [1], 2, rounds=5, repeats=2)
    timed = decodes[1:]  # after the untimed warm-up
    assert len(timed) == 5
    assert all(sorted(d) == [1, 1, 2, 2, 3, 3] for d in timed), timed


def test_a_new_decode_starts_a_new_cycle_of_the_rotation():
    """A decode that ends mid-cycle (fewer rounds than asked) leaves the rest of its cycle behind: the next decode
    starts a fresh one, every length in it."""
    rotation = Rotation(2, seed=0)
    rotation.worth_drafting(None, None)
    rotation.timed(0.0, 0.0)
    rotation.reset()
    lengths = []
    for _ in range(3):
        rotation.worth_drafting(None, None)
        lengths.append(rotation.gamma)
        rotation.timed(0.0, 0.0)
    assert sorted(lengths) == [0, 1, 2] and {r.cycle for r in rotation.rounds[1:]} == {1}
