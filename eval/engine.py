"""The decoding engine: prefill, then rounds of draft -> one target pass -> verify -> commit -> rollback.

τ (acceptance length) = tokens committed per verification pass, the correction/bonus token included;
the prefill pass (which yields the first token) is not a verification pass and is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.eval.sampling import SamplingParams, probs_from_logits, sample
from draftsmith.eval.verify import end_round, greedy_verify, sampling_verify


def clock(device: torch.device | None) -> float:
    """perf_counter once the device has finished its queued work (CUDA runs asynchronously: without the
    synchronize, a timer read after a launch measures the launch, not the work)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
    draft_seconds: float = 0.0
    """Wall time spent drafting over all rounds: proposing, and updating the drafter with what was verified."""
    verify_seconds: float = 0.0
    """Wall time of the verification passes (the target forward and the acceptance rule of each round)."""

    @property
    def tau(self) -> float:
        return sum(a + 1 for _, a in self.rounds) / len(self.rounds) if self.rounds else float("nan")


def _one_hot(drafts: Sequence[int], vocab: int, device) -> torch.Tensor:
    q = torch.zeros(len(drafts), vocab, device=device)
    q[torch.arange(len(drafts)), torch.tensor(list(drafts), dtype=torch.long)] = 1.0
    return q


@dataclass(frozen=True)
class TreeSpec:
    depth: int = 5
    """Deepest draft position."""
    top_k: int = 4
    """Children per expanded node, and frontier nodes expanded per depth."""
    total: int = 32
    """Nodes verified per round."""


def decode(
    target,
    proposer,
    prompt: Sequence[int],
    params: SamplingParams,
    gamma: int,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    verify: Callable = sampling_verify,
    tree: TreeSpec | None = None,
    tree_verify: Callable | None = None,
) -> DecodeResult:
    """Speculative decoding of one prompt. `target` has reset/step/rollback/length (eval.runner.HFTarget);
    `proposer` is one of eval.proposers. With `tree`, each round drafts a token tree (the proposer needs
    `propose_tree`) and verifies it in one pass. `verify` / `tree_verify` are the sampling rules (swappable
    for tests)."""
    from draftsmith.eval.tree import greedy_tree_verify, sampling_tree_verify

    tree_verify = tree_verify or sampling_tree_verify
    stops = set(stop_ids)
    device = getattr(target, "device", None)
    started = clock(device)
    target.reset()
    logits, feats = target.step(prompt)
    first = int(logits[-1].argmax()) if params.greedy else sample(probs_from_logits(logits[-1], params), generator)
    out = [first]
    result = DecodeResult(tokens=out)
    proposer.start(prompt, first, feats)
    history = list(prompt) + out
    stopped = first in stops
    while len(out) < max_new_tokens and not stopped:
        t0 = clock(device)
        if tree is not None:
            t = proposer.propose_tree(tree.depth, tree.top_k, tree.total)
            t1 = clock(device)
            past = target.length
            logits, feats = target.step_tree(out[-1], t)
            if params.greedy:
                path, new = greedy_tree_verify(t, logits)
            else:
                path, new = tree_verify(t, probs_from_logits(logits, params), generator)
            target.keep_path(past, path)
            t2 = clock(device)
            committed, _, accepted, stopped = end_round([t.tokens[i] for i in path], len(path), new, stops)
            result.rounds.append((max(t.depths, default=0), accepted))
            result.confidences.append([])
            rows = torch.tensor([0] + [1 + i for i in path])
            proposer.commit_path([t.tokens[i] for i in path], new, feats[rows] if feats is not None else None)
        else:
            drafts, q, confs = proposer.propose(history, gamma, params, generator)
            t1 = clock(device)
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
            t2 = clock(device)
            committed, drafted, accepted, stopped = end_round(drafts, n, new, stops)
            result.rounds.append((drafted, accepted))
            result.confidences.append(list(confs)[:drafted])
            # EAGLE-3 runs its drafter over the verified tokens here: part of the cost of drafting
            proposer.commit(drafts, n, new, feats[: n + 1] if feats is not None else None)
        out += committed
        history += committed
        result.verify_seconds += t2 - t1
        result.draft_seconds += (t1 - t0) + (clock(device) - t2)
    cut = len(out)
    for i, t in enumerate(out[:max_new_tokens]):
        if t in stops:
            cut = i + 1
            break
    result.tokens = out[: min(cut, max_new_tokens)]
    result.target_passes = target.passes
    result.seconds = clock(device) - started
    return result
