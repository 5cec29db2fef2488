"""launch/bench_probe_acceptance.py drafts one slot on a decode's first round and every n-th round after it, the rounds
between caught up on as the cost schedule's skipped rounds are, and counts the first slots it drafted and had accepted
from the engine's own record of the rounds; the text stays the target's greedy one."""

import runpy
from pathlib import Path

import pytest

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams
from tests.eval.test_dspark_exactness import _dspark_for
from tests.eval.test_exactness import plain_greedy

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_probe_acceptance.py"
BENCH = runpy.run_path(str(SCRIPT))  # not run as __main__: nothing loads or decodes


@pytest.mark.parametrize("n", [1, 3])
def test_every_nth_round_drafts_one_slot_and_the_counts_are_the_engines(tiny64, n):
    drafter = _dspark_for(tiny64)
    proposer = DSparkProposer(drafter)
    proposer.schedule = BENCH["EveryNth"](n)
    prompt = [5, 17, 33, 9]
    result = decode(HFTarget(tiny64, drafter.config.aux_layer_ids), proposer, [prompt], SamplingParams(), 3, 14)[0]
    assert result.tokens == plain_greedy(tiny64, prompt, 14)
    drafted_rounds = [j for j, (d, _) in enumerate(result.rounds) if d]
    assert drafted_rounds == [j for j in range(len(result.rounds)) if j % n == 0]
    assert all(d == 1 for d, _ in result.rounds if d)  # one slot a drafted round, though γ is 3
    drafted, accepted, drafted0, accepted0 = BENCH["first_slots"](result.rounds)
    assert (drafted, drafted0) == (len(drafted_rounds), 1)
    assert accepted == sum(a > 0 for _, a in result.rounds) and accepted0 == (result.rounds[0][1] > 0)


def test_a_decode_starts_a_new_count_and_n_must_be_positive():
    every = BENCH["EveryNth"](4)
    assert [every.worth_drafting(None, None) for _ in range(6)] == [True, False, False, False, True, False]
    every.reset()
    assert every.worth_drafting(None, None)
    with pytest.raises(ValueError, match="n >= 1"):
        BENCH["EveryNth"](0)
