"""Decodes run side by side a round at a time (eval.engine.interleave, what eval's per-domain speedups are measured
with): each gives exactly what it gives alone, each is timed only over its own steps, and they keep pace in time."""

import pytest

from draftsmith.eval import engine
from draftsmith.eval.engine import decode, decoding, interleave
from draftsmith.eval.proposers import DSparkProposer, Eagle3Proposer, NoDraft
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator
from draftsmith.pipeline.evaluate import Decoder
from tests.eval.test_batch import _dspark, _eagle3

PROMPTS = [[11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 40, 41, 40, 9]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decodes_side_by_side_give_what_each_gives_alone(tiny64, temperature):
    """Plain decoding, two EAGLE-3 proposers sharing one drafter's weights (a cache each) and DSpark, batch 2:
    interleaved, every decode commits the same tokens in the same rounds, with the same drafter confidences, as
    alone, at T = 0 and with its own random streams at T = 1."""
    eagle3, dspark = _eagle3(tiny64), _dspark(tiny64)
    params = SamplingParams(temperature)

    def configs():
        return {
            "none": NoDraft(),
            "eagle3": Eagle3Proposer(eagle3),
            "eagle3 again": Eagle3Proposer(eagle3),
            "dspark": DSparkProposer(dspark),
        }

    def steps(proposer):
        gens = [make_generator(tiny64.device, 5 + b) for b in range(len(PROMPTS))]
        return decoding(HFTarget(tiny64, proposer.aux_ids), proposer, PROMPTS, params, 3, 16, (), gens)

    alone = {name: engine.finish(steps(p)) for name, p in configs().items()}
    together = interleave({name: steps(p) for name, p in configs().items()})
    assert list(together) == list(alone)
    for name in alone:
        assert [r.tokens for r in together[name]] == [r.tokens for r in alone[name]], name
        assert [r.rounds for r in together[name]] == [r.rounds for r in alone[name]], name
        # the drafter's own outputs, which a cache written by another decode would change
        assert [r.confidences for r in together[name]] == [r.confidences for r in alone[name]], name
    assert all(len(c) == 3 for name in ("eagle3", "dspark") for r in together[name] for c in r.confidences)


class Costly(NoDraft):
    """Plain decoding whose every round costs `cost` on the test's clock."""

    def __init__(self, name, cost, now, trace):
        self.name, self.cost, self.now, self.trace = name, cost, now, trace

    def propose(self, histories, active, k, params, generators):
        self.now[0] += self.cost
        self.trace.append(self.name)
        return super().propose(histories, active, k, params, generators)


def test_side_by_side_decodes_keep_pace_and_each_counts_only_its_own_steps(tiny64, monkeypatch):
    """On a clock that moves only when a proposer drafts (10 per round for one, 1 for the other): the slow decode's
    seconds are its own 10 per round and the fast one's its own 1 per round, whatever ran between their steps
    (mutation: timing a decode from its start to its end charges each with the other's rounds); and at every step
    the decode resumed is the one that has spent the least, so their totals never drift apart by more than a round
    (mutation: taking turns round by round lets the slow one run ten times ahead)."""
    now, trace = [0.0], []
    monkeypatch.setattr(engine, "clock", lambda device: now[0])
    slow, fast = Costly("slow", 10.0, now, trace), Costly("fast", 1.0, now, trace)
    ran = interleave(
        {
            name: decoding(HFTarget(tiny64), p, [PROMPTS[0]], SamplingParams(), 1, 40)
            for name, p in (("slow", slow), ("fast", fast))
        }
    )
    (s,), (f,) = ran["slow"], ran["fast"]
    assert len(s.rounds) == len(f.rounds) == 39
    assert s.seconds == 10.0 * 39 and f.seconds == 1.0 * 39
    spent = {"slow": 0.0, "fast": 0.0}
    for name in trace:
        spent[name] += 10.0 if name == "slow" else 1.0
        if spent["fast"] < 39:  # while both run
            assert abs(spent["slow"] - spent["fast"]) <= 10.0, trace
    assert trace[:12] == ["slow"] + ["fast"] * 10 + ["slow"]


def test_eval_refuses_proposers_that_share_a_runner(tiny64):
    """Side by side, two proposers on one runner would write one KV cache: a clear error instead of wrong tokens."""
    runner = HFTarget(tiny64)
    dec = Decoder({"none": runner, "x": runner}, {"none": NoDraft(), "x": NoDraft()}, {"none": 1, "x": 1}, [], None, 0,
                  tiny64.device)  # fmt: skip
    with pytest.raises(ValueError, match="its own runner"):
        dec.temperature([[{"ids": PROMPTS[0], "domain": "d", "id": "p"}]], SamplingParams(), 4, "test")


def test_decode_is_the_step_at_a_time_decode_run_to_its_end(tiny64):
    (a,) = decode(HFTarget(tiny64), NoDraft(), [PROMPTS[1]], SamplingParams(), 1, 8)
    (b,) = engine.finish(decoding(HFTarget(tiny64), NoDraft(), [PROMPTS[1]], SamplingParams(), 1, 8))
    assert a.tokens == b.tokens and len(a.tokens) == 8 and a.seconds > 0
    steps = decoding(HFTarget(tiny64), NoDraft(), [PROMPTS[1]], SamplingParams(), 1, 8)
    spent = [next(steps) for _ in range(8)]  # the prefill, then 7 rounds
    assert spent == sorted(spent)
    with pytest.raises(StopIteration):
        next(steps)
