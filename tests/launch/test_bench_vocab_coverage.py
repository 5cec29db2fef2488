"""launch/bench_vocab_coverage.py: per domain, the share of the target's answer tokens seen among the training answers
and the share inside the draft vocabulary, pooled over the domains as `all`; and the share at other vocabulary sizes,
chosen from the training counts as training chooses them."""

import runpy
from pathlib import Path

import pytest
import torch

from draftsmith.drafters.vocab import select_draft_vocab

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_vocab_coverage.py"
BENCH = runpy.run_path(str(SCRIPT))  # not run as __main__: nothing loads or decodes


def test_seen_and_in_vocab_shares_per_domain_and_pooled():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[1, 2, 3]] = torch.tensor([5, 1, 2])
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 3, 7]] = True  # 7 is in the vocabulary but never seen (a fill); 2 is seen but left out
    answers = {"code": [1, 2, 2, 9], "chat": [7, 7, 3]}
    c = BENCH["coverage"](answers, counts, t2d)
    assert c["code"] == {"seen": 3 / 4, "in_vocab": 1 / 4, "tokens": 4.0}
    assert c["chat"] == {"seen": 1 / 3, "in_vocab": 3 / 3, "tokens": 3.0}
    assert c["all"] == {"seen": 4 / 7, "in_vocab": 4 / 7, "tokens": 7.0}  # pooled by token, not a mean of domains
    assert list(c) == ["code", "chat", "all"]


def test_a_domain_without_answer_tokens_is_refused():
    with pytest.raises(ValueError, match="'code' has no answer tokens"):
        BENCH["coverage"]({"code": []}, torch.ones(4), torch.ones(4, dtype=torch.bool))


def test_each_size_chooses_its_vocabulary_as_training_does():
    counts = torch.tensor([0, 9, 0, 4, 7, 0, 1, 0])
    answers = {"a": [4, 4, 3, 6], "b": [0, 2]}
    by_size = BENCH["coverage_by_size"](answers, counts, [1, 2, 4, 8])
    for size, share in by_size.items():
        t2d = select_draft_vocab(counts, size)[1]
        assert share == pytest.approx(sum(bool(t2d[t]) for t in [4, 4, 3, 6, 0, 2]) / 6)
    # by hand: size 1 holds {1}; 2 {1, 4}; 4 {1, 4, 3, 6}; 8 everything
    assert by_size == pytest.approx({1: 0.0, 2: 2 / 6, 4: 4 / 6, 8: 1.0})
