"""Eval's confidence metrics: the ranking AUC (does a confidence tell an accepted slot from a rejected one) next to
the ECE (does it mean what it says on the mean)."""

import random

import pytest

from draftsmith.eval.engine import DecodeResult
from draftsmith.eval.metrics import calibration, ranking_auc


def _pairwise(pairs):
    """The definition, counted over every (accepted, rejected) pair: ties half."""
    pos = [c for c, y in pairs if y]
    neg = [c for c, y in pairs if not y]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def test_the_ranking_auc_is_the_pairwise_count_with_ties_half():
    """On 400 pairs with confidences from a coarse grid (many ties) and outcomes that depend on them, the rank formula
    gives the pairwise count exactly; a perfect ranking is 1, a reversed one 0, one outcome only None."""
    rng = random.Random(0)
    pairs = []
    for _ in range(400):
        c = rng.randint(0, 10) / 10
        pairs.append((c, float(rng.random() < c)))
    assert ranking_auc(pairs) == pytest.approx(_pairwise(pairs), abs=1e-12)
    assert ranking_auc([(0.1, 0.0), (0.2, 0.0), (0.8, 1.0), (0.9, 1.0)]) == 1.0
    assert ranking_auc([(0.1, 1.0), (0.9, 0.0)]) == 0.0
    assert ranking_auc([(0.5, 0.0), (0.5, 1.0)]) == 0.5
    assert ranking_auc([(0.3, 1.0), (0.7, 1.0)]) is None


def test_a_confidence_calibrated_on_the_mean_that_ranks_nothing_has_an_auc_of_one_half():
    """Every position at confidence 0.2 and one in five accepted: calibrated (ECE 0) and no use for choosing slots
    (AUC 0.5). A confidence that follows the outcomes ranks them: AUC 1. Only positions reached (every earlier draft
    accepted) count, as for the ECE."""
    flat = [DecodeResult(tokens=[], rounds=[(1, int(i % 5 == 0))], confidences=[[0.2]]) for i in range(50)]
    said = calibration(flat)
    assert said is not None and said["ece"] == pytest.approx(0.0) and said["auc"] == 0.5
    sharp = [DecodeResult(tokens=[], rounds=[(1, i % 2)], confidences=[[0.9 if i % 2 else 0.1]]) for i in range(50)]
    said = calibration(sharp)
    assert said is not None and said["auc"] == 1.0
    # the second position of a round whose first draft was rejected is not reached: not counted
    unreached = [DecodeResult(tokens=[], rounds=[(2, 0)], confidences=[[0.1, 0.99]]), *sharp]
    assert calibration(unreached)["auc"] == 1.0
