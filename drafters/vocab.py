"""The draft vocabulary: the most frequent target tokens among assistant tokens of the training data.

`d2t[i] = target_id(i) - i` (an offset, as vLLM and SGLang read it) and `t2d` is a bool mask over the
target vocabulary. Draft ids are ordered by target id, so `arange(D) + d2t` is strictly increasing and
equals `t2d.nonzero()`.
"""

from __future__ import annotations

import torch


def select_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [size], t2d bool [V]) for the `size` most frequent ids in `counts` (ties: lower id first)."""
    vocab = counts.numel()
    if size > vocab:
        raise ValueError(f"draft vocab size {size} is larger than the target vocabulary ({vocab})")
    if size < 1:
        raise ValueError("draft vocab size must be at least 1")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts.to(torch.float64), stable=True).indices[:size]
    target_ids = torch.sort(order).values.to(torch.int64)
    d2t = target_ids - torch.arange(size, dtype=torch.int64, device=counts.device)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=counts.device)
    t2d[target_ids] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.numel(), device=d2t.device) + d2t
