"""launch/bench_round_pairs.py drafts the rounds its cycle marks, one slot each, from the cycle's start at every decode,
keeps each round's target pass with how many plain rounds came right before it, and sorts neighbouring rounds into
kinds of pairs without pairing rounds of two decodes."""

import runpy
from pathlib import Path

import pytest

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams
from tests.eval.test_dspark_exactness import _dspark_for
from tests.eval.test_exactness import plain_greedy

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_round_pairs.py"
BENCH = runpy.run_path(str(SCRIPT))  # not run as __main__: nothing loads or decodes


def test_the_cycle_drafts_its_rounds_and_restarts_at_every_decode(tiny64):
    drafter = _dspark_for(tiny64)
    proposer = DSparkProposer(drafter)
    proposer.schedule = cycle = BENCH["Cycle"]("PPDDP")
    runner = HFTarget(tiny64, drafter.config.aux_layer_ids)
    prompts = [[5, 17, 33, 9], [7, 3, 11]]
    for prompt in prompts:
        result = decode(runner, proposer, [prompt], SamplingParams(), 3, 12)[0]
        assert result.tokens == plain_greedy(tiny64, prompt, 12)  # the target's text whatever the cycle drafts
        assert [d > 0 for d, _ in result.rounds] == [c == "D" for c in ("PPDDP" * 3)[: len(result.rounds)]]
        assert all(d == 1 for d, _ in result.rounds if d)  # one slot a drafted round, though γ is 3
    assert [r[0] for r in cycle.rounds] == sorted(r[0] for r in cycle.rounds) and cycle.rounds[-1][0] == 1
    first = [r for r in cycle.rounds if r[0] == 0]
    assert [(k, before) for _, k, before, _ in first[:6]] == [
        ("P", 0),
        ("P", 1),
        ("D", 2),
        ("D", 0),
        ("P", 0),
        ("P", 1),
    ]
    assert all(seconds > 0 for *_, seconds in cycle.rounds)


def test_pairs_are_sorted_by_kind_and_never_span_two_decodes():
    rounds = [
        (0, "P", 0, 0.040),
        (0, "P", 1, 0.041),
        (0, "D", 2, 0.044),  # after 2 plain: +3 ms
        (0, "D", 0, 0.045),  # drafted after drafted: no pair
        (0, "P", 0, 0.040),  # plain after drafted: +5 ms
        (1, "D", 0, 0.050),  # a new decode: not paired with the round before
        (1, "P", 0, 0.041),  # plain after drafted: +9 ms
    ]
    said = BENCH["pairs"](rounds)
    assert said.keys() == {"drafted after 2 plain", "plain after drafted", "plain after plain"}
    assert said["drafted after 2 plain"] == [pytest.approx(0.003)]
    assert said["plain after drafted"] == [pytest.approx(0.005), pytest.approx(0.009)]
    assert said["plain after plain"] == [pytest.approx(0.001)]
    by_kind = BENCH["passes"](rounds)
    assert by_kind["plain"] == [0.040, 0.041, 0.040, 0.041]
    assert by_kind["drafted after 2 plain"] == [0.044] and by_kind["drafted after drafted"] == [0.045]
    assert "drafted after 0 plain" not in by_kind  # a decode's first round drafted follows its prefill


def test_a_cycle_is_plain_and_drafted_rounds_only():
    for bad in ("", "PDX"):
        with pytest.raises(ValueError, match="P \\(plain\\) and D \\(drafted\\)"):
            BENCH["Cycle"](bad)
