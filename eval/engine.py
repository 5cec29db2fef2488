"""The decoding engine: prefill, then rounds of draft -> one target pass -> verify -> commit -> rollback.

τ (acceptance length) = tokens committed per verification pass, the correction/bonus token included;
the prefill pass (which yields the first token) is not a verification pass and is not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from eval.sampling import SamplingParams, probs_from_logits, sample
from eval.verify import greedy_verify, sampling_verify


@dataclass
class DecodeResult:
    tokens: list[int]
    """New tokens (after the prompt), cut after the first stop token / at max_new_tokens."""
    rounds: list[tuple[int, int]] = field(default_factory=list)
    """(drafted, accepted) per verification round."""
    confidences: list[list[float]] = field(default_factory=list)
    """Per round, the drafter's confidence for each drafted position (empty when it has none)."""
    target_passes: int = 0
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(a + 1 for _, a in self.rounds) / len(self.rounds) if self.rounds else float("nan")


def _one_hot(drafts: Sequence[int], vocab: int, device) -> torch.Tensor:
    q = torch.zeros(len(drafts), vocab, device=device)
    q[torch.arange(len(drafts)), torch.tensor(list(drafts), dtype=torch.long)] = 1.0
    return q


def decode(target, proposer, prompt: Sequence[int], params: SamplingParams, gamma: int, max_new_tokens: int,
           stop_ids: Sequence[int] = (), generator: torch.Generator | None = None,
           verify: Callable = sampling_verify) -> DecodeResult:
    """Speculative decoding of one prompt. `target` has reset/step/rollback/length (eval.runner.HFTarget);
    `proposer` is one of eval.proposers. `verify` is the sampling rule (swappable for tests)."""
    stops = set(stop_ids)
    started = time.perf_counter()
    target.reset()
    logits, feats = target.step(prompt)
    first = int(logits[-1].argmax()) if params.greedy else sample(probs_from_logits(logits[-1], params), generator)
    out = [first]
    result = DecodeResult(tokens=out)
    proposer.start(prompt, first, feats)
    history = list(prompt) + out
    while len(out) < max_new_tokens and out[-1] not in stops:
        drafts, q, confs = proposer.propose(history, gamma, params, generator)
        context = target.length
        logits, feats = target.step([out[-1]] + list(drafts))
        if params.greedy:
            n, new = greedy_verify(drafts, logits)
        else:
            p = probs_from_logits(logits, params)
            if q is None:  # deterministic proposals: q puts all mass on the drafted token
                q = _one_hot(drafts, p.shape[-1], p.device)
            n, new = verify(drafts, q, p, generator)
        target.rollback(context + 1 + n)
        committed = list(drafts[:n]) + [new]
        out += committed
        history += committed
        result.rounds.append((len(drafts), n))
        result.confidences.append(list(confs))
        proposer.commit(drafts, n, new, feats[: n + 1] if feats is not None else None)
    cut = len(out)
    for i, t in enumerate(out[:max_new_tokens]):
        if t in stops:
            cut = i + 1
            break
    result.tokens = out[: min(cut, max_new_tokens)]
    result.target_passes = target.passes
    result.seconds = time.perf_counter() - started
    return result
