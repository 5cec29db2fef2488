"""The confidences a trained proposer drafts with are scaled by the calibration fitted at the temperature it samples
at (`DrafterBase.calibrated`): a head's confidence does not know the temperature, and what it predicts (the chance
its draft is accepted) does."""

import pytest

from draftsmith.eval.engine import decode
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator
from tests.eval.test_batch import _proposer


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_a_proposer_reads_the_calibration_of_its_sampling_temperature(tiny64, kind):
    proposer = _proposer(kind, tiny64)
    drafter = proposer.drafter
    # biases no logit of a random head outweighs: every confidence near 1 at T = 0 and near 0 at T = 1
    drafter.config.sampled_confidence_calibration = {
        "0.0": {"temperatures": [1.0], "biases": [40.0]},
        "1.0": {"temperatures": [1.0], "biases": [-40.0]},
    }
    target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)
    for temperature, near in ((0.0, 1.0), (1.0, 0.0), (0.8, 0.0)):
        params = SamplingParams(temperature=temperature)
        gens = [make_generator(tiny64.device, 0)]
        (r,) = decode(target, proposer, [[5, 6, 7]], params, 3, 8, generators=gens)
        confs = [c for rnd in r.confidences for c in rnd]
        assert confs and all(abs(c - near) < 1e-6 for c in confs), (temperature, confs)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_argmax_drafts_read_the_calibration_fitted_for_them_and_else_the_sampled_one(tiny64, kind):
    """With eval.draft_sample_method = greedy a draft at T > 0 is the drafter's argmax, kept with the target's
    probability of it: its confidence is scaled by the fit on that acceptance where the drafter has one; at T = 0 and
    without one, as a sampled draft's."""
    proposer = _proposer(kind, tiny64)
    proposer.greedy_drafts = True
    drafter = proposer.drafter
    drafter.config.sampled_confidence_calibration = {
        "0.0": {"temperatures": [1.0], "biases": [40.0]},
        "1.0": {"temperatures": [1.0], "biases": [-40.0]},
    }
    drafter.config.greedy_confidence_calibration = {"1.0": {"temperatures": [1.0], "biases": [40.0]}}
    target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)

    def confidences(temperature):
        gens = [make_generator(tiny64.device, 0)]
        (r,) = decode(target, proposer, [[5, 6, 7]], SamplingParams(temperature=temperature), 3, 8, generators=gens)
        return [c for rnd in r.confidences for c in rnd]

    for temperature in (0.0, 1.0):
        assert all(abs(c - 1.0) < 1e-6 for c in confidences(temperature)), temperature
    drafter.config.greedy_confidence_calibration = None
    assert all(abs(c) < 1e-6 for c in confidences(1.0))
