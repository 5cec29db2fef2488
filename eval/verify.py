"""The verification rules (one round of a chain): greedy and speculative sampling.

Sampling follows the rejection rule: a drafted token x drawn from q is kept with probability
min(1, p(x)/q(x)); at the first rejection the round ends with a token drawn from the residual
norm(max(0, p - q)); when every draft is kept, a bonus token is drawn from p at the next position.
The output of a round is then distributed exactly as the target's own sampling (see the reference chapter).
"""

from __future__ import annotations

from typing import Sequence

import torch

from eval.sampling import sample


def greedy_verify(drafts: Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(number of drafts kept, the target's token after them). target_logits: [len(drafts)+1, V]."""
    choices = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == choices[n]:
        n += 1
    return n, choices[n]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    # q == p exactly leaves nothing to resample from; rejection then has probability 0, so any choice is fine
    return r / total if total > 0 else p


def sampling_verify(drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """(number kept, next token). q: [k, V] the distributions the drafts were sampled from; p: [k+1, V] target."""
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            continue
        return i, sample(residual(p[i], q[i]), generator)
    return len(drafts), sample(p[len(drafts)], generator)
