"""Eval's confidence metrics: the ranking AUC (does a confidence tell an accepted slot from a rejected one) next to
the ECE (does it mean what it says on the mean)."""

import random

import pytest

from draftsmith.eval.engine import DecodeResult
from draftsmith.eval.metrics import calibration, rank_correlation, ranking_auc


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


def test_the_rank_correlation_is_pearson_over_tie_averaged_ranks():
    """Spearman's rank correlation: +1 for any rising relation (not only a linear one), -1 for a falling one, the
    textbook 1 - 6 Σd² / (n (n² - 1)) where there are no ties, and ties sharing their mean rank (checked against
    Pearson's correlation of ranks counted pair by pair). None where it is undefined."""
    xs = [0.1, 0.4, 0.2, 0.9, 0.5]
    assert rank_correlation(xs, [x**3 for x in xs]) == pytest.approx(1.0)
    assert rank_correlation(xs, [-x for x in xs]) == pytest.approx(-1.0)
    ys = [3.0, 1.0, 2.0, 5.0, 4.0]
    d2 = sum((a - b) ** 2 for a, b in zip([1, 3, 2, 5, 4], [3, 1, 2, 5, 4]))  # the ranks of xs and ys
    assert rank_correlation(xs, ys) == pytest.approx(1 - 6 * d2 / (5 * 24))
    rng = random.Random(1)
    xs = [rng.randint(0, 4) for _ in range(60)]  # many ties on both sides
    ys = [x + rng.randint(0, 3) for x in xs]

    def ranks(v):  # 1 + (values below) + (ties, self included, - 1) / 2: the mean rank of a tie, counted directly
        return [1 + sum(w < a for w in v) + (sum(w == a for w in v) - 1) / 2 for a in v]

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    pearson = (
        sum((a - mx) * (b - my) for a, b in zip(rx, ry))
        / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    )
    assert rank_correlation(xs, ys) == pytest.approx(pearson, abs=1e-12)
    assert 0.5 < pearson < 1.0
    assert rank_correlation([1.0, 2.0], [2.0, 1.0]) is None
    assert rank_correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    with pytest.raises(ValueError, match="3 values against 2"):
        rank_correlation([1.0, 2.0, 3.0], [1.0, 2.0])


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
