"""One engine serves every batch size: a row decodes exactly the same tokens, rounds and confidences alone as in a
ragged batch, greedy and sampled (each row draws from its own generator), for every proposer, with adaptive length
on and off."""

import pytest
import torch

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer, Eagle3Proposer, NoDraft, PromptLookup
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator
from tests.eval.test_batch import _dspark, _eagle3

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 9, 10], [40, 41, 40, 41], [77]]


def _proposer(kind, model, threshold):
    if kind == "none":
        return NoDraft()
    if kind == "prompt_lookup":
        return PromptLookup()
    if kind == "eagle3":
        return Eagle3Proposer(_eagle3(model), threshold)
    return DSparkProposer(_dspark(model), threshold, draft_length=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "kind, threshold",
    [("none", None), ("prompt_lookup", None), ("eagle3", None), ("eagle3", 0.3), ("dspark", None), ("dspark", 0.3)],
)
def test_a_row_decodes_the_same_alone_and_in_a_batch(tiny64, kind, threshold, temperature):
    params = SamplingParams(temperature, top_p=0.9)
    proposer = _proposer(kind, tiny64, threshold)

    def run(rows):
        gens = [make_generator(tiny64.device, 100 + b) for b in rows]
        target = HFTarget(tiny64, proposer.aux_ids)
        return decode(target, proposer, [PROMPTS[b] for b in rows], params, 3, 14, (), gens)

    batched = run(range(len(PROMPTS)))
    for b, row in enumerate(batched):
        (alone,) = run([b])
        assert alone.tokens == row.tokens, (kind, b)
        assert alone.rounds == row.rounds, (kind, b)
        torch.testing.assert_close(alone.confidences, row.confidences, rtol=1e-9, atol=0)
    if threshold is not None:  # adaptive length did cut some rounds short, in some rows
        drafted = [d for r in batched for d, _ in r.rounds]
        assert min(drafted) < 3 and len(set(drafted)) > 1, drafted
