"""Draft vocabulary: most frequent tokens, offset mapping invariants, size checks."""

import pytest
import torch

from draftsmith.drafters.vocab import draft_to_target_ids, select_draft_vocab


def test_mapping_invariants(test_device):
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (500,), generator=g)
    d2t, t2d = select_draft_vocab(counts, 100)  # token counts are on the CPU (train.token_counts): so is the choice
    ids = draft_to_target_ids(d2t.to(test_device))  # the mapping, as drafters use it: on their buffers' device
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (ids[1:] > ids[:-1]).all()  # strictly increasing
    assert torch.equal(ids, t2d.to(test_device).nonzero().squeeze(1))
    assert t2d.sum() == 100
    # they are the most frequent ones: every selected count >= every unselected count
    assert counts[t2d].min() >= counts[~t2d].max()


def test_ties_prefer_lower_ids_and_size_checks(test_device):
    counts = torch.tensor([0, 5, 5, 5, 1], device=test_device)  # the choice is made where the counts are
    d2t, t2d = select_draft_vocab(counts, 2)
    assert draft_to_target_ids(d2t).tolist() == [1, 2]
    assert select_draft_vocab(counts, 5)[1].all()
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        select_draft_vocab(counts, 6)
