"""The verification rules (one round of a chain): greedy and speculative sampling.

Sampling follows the rejection rule: a drafted token x drawn from q is kept with probability
min(1, p(x)/q(x)); at the first rejection the round ends with a token drawn from the residual
norm(max(0, p - q)); when every draft is kept, a bonus token is drawn from p at the next position.
The output of a round is then distributed exactly as the target's own sampling (see the reference chapter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.eval.sampling import sample, uniform


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


def sampling_verify(
    drafts: Sequence[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """(number kept, next token). q: [k, V] the distributions the drafts were sampled from; p: [k+1, V] target."""
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        u = uniform(generator)
        if qx > 0 and u < min(1.0, px / qx):
            continue
        return i, sample(residual(p[i], q[i]), generator)
    return len(drafts), sample(p[len(drafts)], generator)


def end_round(drafts: Sequence[int], n: int, new: int, stops: set[int]) -> tuple[list[int], int, int, bool]:
    """(committed tokens, drafted, accepted, stop) for a round that kept `n` of `drafts` and then produced `new`.

    A round commits its accepted drafts and the target's token, and the answer ends at the first stop token
    among them, whether the stop was drafted and accepted or is the target's own token: nothing after it is
    output, counted, or decoded further. When an accepted draft is the stop, the round is recorded as if the
    drafts had ended just before it and the pass had produced it (drafted = accepted = its index), so τ counts
    exactly the tokens this pass produced and no accepted draft is ever counted as rejected."""
    for i, token in enumerate(drafts[:n]):
        if token in stops:
            return list(drafts[: i + 1]), i, i, True
    return list(drafts[:n]) + [new], len(drafts), n, new in stops
