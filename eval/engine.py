"""The decoding engine: prefill, then rounds of draft -> one target pass -> verify -> commit, for a batch of prompts.

Every eval configuration runs here: a batch of one is the same code as a batch of many, and chains (plain decoding,
prompt lookup, EAGLE-3, DSpark blocks) and trees are proposals of one interface (`eval.proposers`). Each rule is
written once: verification and the stop rule in `eval.verify` / `eval.tree`, adaptive length in the proposers, what
a row keeps of a round in `eval.runner`.

τ (acceptance length) = tokens committed per verification pass, the correction/bonus token included; the prefill
pass (which yields the first token) is not a verification pass and is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.eval.sampling import SamplingParams, one_hot, probs_from_logits, sample
from draftsmith.eval.tree import greedy_tree_verify, sampling_tree_verify, tree_mask
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


@dataclass(frozen=True)
class TreeSpec:
    depth: int = 5
    """Deepest draft position."""
    top_k: int = 4
    """Children per expanded node, and frontier nodes expanded per depth."""
    total: int = 32
    """Nodes verified per round."""


def decode(*args, **kwargs) -> list[DecodeResult]:
    """Speculative decoding of a batch of prompts, one result per prompt: `decoding` (same arguments) run to its
    end."""
    return finish(decoding(*args, **kwargs))


def finish(steps: Generator[float, None, list[DecodeResult]]) -> list[DecodeResult]:
    """A step-at-a-time decode (`decoding`) run to its end: its results."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def interleave(decodes: Mapping[str, Generator[float, None, list[DecodeResult]]]) -> dict[str, list[DecodeResult]]:
    """Several decodes (`decoding`) run side by side, a step (the prefill, then a round) at a time: the next step is
    always the one of the decode that has spent the least time so far (ties to the earlier in `decodes`' order).

    They keep pace in time, so a slow or fast spell of the machine (a neighbour on a shared CPU, a clock change) falls
    on all of them alike instead of on whichever ran then: the ratio of two decodes' speeds is measured with the
    noise that speed has over a round (tens of milliseconds), not over a whole decode (seconds). Each decode's timers
    run only during its own steps. Every decode needs its own target and proposer (each holds a cache); they may
    share the model and the drafter's weights."""
    spent = {name: 0.0 for name in decodes}
    results: dict[str, list[DecodeResult]] = {}
    while spent:
        name = min(spent, key=spent.__getitem__)
        try:
            spent[name] = next(decodes[name])
        except StopIteration as done:
            results[name] = done.value
            del spent[name]
    return {name: results[name] for name in decodes}


def decoding(
    target,
    proposer,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    gamma: int,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generators: Sequence[torch.Generator | None] | None = None,
    tree: TreeSpec | None = None,
    verify: Callable = sampling_verify,
    tree_verify: Callable = sampling_tree_verify,
    max_rounds: int | None = None,
) -> Generator[float, None, list[DecodeResult]]:
    """Speculative decoding of a batch of prompts, one step at a time: yields after the prefill and after every round
    the seconds this decode has spent so far, and returns one result per prompt (`decode` runs it to its end,
    `interleave` runs several side by side). A result's seconds are the sum of this decode's steps: time spent
    elsewhere between two of them is not counted.

    `target` is an `eval.runner.HFTarget` (or anything with its prefill/step/keep/compact); `proposer` one of
    `eval.proposers`; `gamma` the chain length. `generators` has one generator per row, on the target's device
    (needed when sampling): row b draws only from its own, so its output does not depend on the batch it is in.
    With `tree` (one prompt, a proposer with `propose_tree`), each round drafts a token tree and verifies it in one
    pass. `verify` / `tree_verify` are the sampling rules (swappable for tests). `max_rounds` ends every row after that
    many verification rounds, whatever it has committed (a timing run: `eval.costs`)."""
    B = len(prompts)
    gens = list(generators) if generators is not None else [None] * B
    if len(gens) != B:
        raise ValueError(f"decode: {len(gens)} generators for {B} prompts (one per row)")
    if tree is not None and B != 1:
        raise ValueError("tree decoding runs one prompt at a time")
    stops = set(stop_ids)
    device = getattr(target, "device", None)
    started = clock(device)
    seconds = draft_seconds = verify_seconds = 0.0
    logits, feats, valid = target.prefill(prompts)
    firsts = [
        int(logits[b, -1].argmax()) if params.greedy else sample(probs_from_logits(logits[b, -1], params), gens[b])
        for b in range(B)
    ]
    results = [DecodeResult(tokens=[f]) for f in firsts]
    history = [list(p) + [f] for p, f in zip(prompts, firsts)]
    active = [len(r.tokens) < max_new_tokens and r.tokens[-1] not in stops for r in results]
    proposer.start(prompts, firsts, feats, valid)
    seconds += clock(device) - started
    yield seconds
    rounds = 0
    while any(active) and (max_rounds is None or rounds < max_rounds):
        rounds += 1
        t0 = clock(device)
        if tree is not None:
            proposal = proposer.propose_tree(tree.depth, tree.top_k, tree.total)
        else:
            proposal = proposer.propose(history, active, gamma, params, gens)
        t1 = clock(device)
        if proposal.tree is not None:
            drafts, accepted, news, feats, drafted = _verify_tree(
                target, proposal, history[0][-1], params, gens[0], tree_verify
            )
        else:
            drafts, accepted, news, feats = _verify_chains(target, proposal, history, active, params, gens, verify)
            drafted = [len(d) for d in drafts]
            proposer.observe(proposal, accepted)  # before the next round's admission: outcomes one round old
        target.compact()
        t2 = clock(device)
        for b in range(B):
            if not active[b]:
                history[b].append(history[b][-1])  # the dummy slot a finished row keeps
                continue
            committed, n_drafted, kept, stopped = end_round(drafts[b], accepted[b], news[b], stops)
            if kept == accepted[b]:  # no accepted draft was a stop: the round drafted what was proposed
                n_drafted = drafted[b]  # (a tree records its depth)
            results[b].tokens += committed
            history[b] += committed
            results[b].rounds.append((n_drafted, kept))
            conf = proposal.confidences[b][:n_drafted] if proposal.confidences else []
            results[b].confidences.append(conf)
            active[b] = len(results[b].tokens) < max_new_tokens and not stopped
        # EAGLE-3 runs its drafter over the verified tokens here: part of the cost of drafting
        proposer.commit(drafts, accepted, news, feats)
        t3 = clock(device)
        verify_seconds += t2 - t1
        draft_seconds += (t1 - t0) + (t3 - t2)
        proposer.timed(t2 - t1, (t1 - t0) + (t3 - t2))  # a schedule corrects its cost table with what rounds cost
        seconds += t3 - t0
        yield seconds
    for r in results:
        cut = len(r.tokens)
        for i, t in enumerate(r.tokens[:max_new_tokens]):
            if t in stops:
                cut = i + 1
                break
        r.tokens = r.tokens[: min(cut, max_new_tokens)]
        r.target_passes = 1 + len(r.rounds)
        # the batch's rounds are shared by its rows: each row is charged an equal share
        r.seconds, r.draft_seconds, r.verify_seconds = seconds / B, draft_seconds / B, verify_seconds / B
    return results


def _verify_chains(target, proposal, history, active, params, gens, verify):
    """One target pass over every row's last committed token and its drafts; each row keeps its accepted slots.
    Returns (drafts, accepted, news, feats [B, k+1, F] or None)."""
    B = len(history)
    drafts = [d if active[b] else [] for b, d in enumerate(proposal.drafts)]
    k = max(len(d) for d in drafts)
    tokens = torch.full((B, k + 1), target.pad_id, dtype=torch.long)
    ok = torch.zeros(B, k + 1, dtype=torch.bool)
    for b in range(B):
        row = [history[b][-1]] + drafts[b]
        tokens[b, : len(row)] = torch.tensor(row)
        ok[b, : len(row)] = True
    logits, feats = target.step(tokens, ok)
    accepted, news = [], []
    for b in range(B):
        d = drafts[b]
        if params.greedy:
            n, new = greedy_verify(d, logits[b, : len(d) + 1])
        else:
            p = probs_from_logits(logits[b, : len(d) + 1], params)
            q = proposal.q[b, : len(d)] if proposal.q is not None else one_hot(d, p.shape[-1], p.device)
            n, new = verify(d, q, p, gens[b]) if active[b] else (0, 0)
        target.keep(b, k + 1, range(n + 1 if active[b] else 1))
        accepted.append(n if active[b] else 0)
        news.append(new)
    return drafts, accepted, news, feats


def _verify_tree(target, proposal, root, params, gen, tree_verify):
    """One target pass over the root (the last committed token) and every node of the proposal's tree, each seeing
    its ancestors; the row keeps the root and the accepted path. Returns, as a chain would, (drafts = [path tokens],
    accepted, news, feats of the root and path [1, 1+len(path), F] or None, drafted = [tree depth])."""
    t = proposal.tree
    n = 1 + len(t)
    tokens = torch.tensor([[root] + list(t.tokens)])
    depths = torch.tensor([[0] + list(t.depths)])
    logits, feats = target.step(tokens, torch.ones(1, n, dtype=torch.bool), depths, tree_mask(t, 0)[None])
    if params.greedy:
        path, new = greedy_tree_verify(t, logits[0])
    else:
        path, new = tree_verify(t, probs_from_logits(logits[0], params), gen)
    slots = [0] + [1 + i for i in path]
    target.keep(0, n, slots)
    kept = feats[:, torch.tensor(slots, device=feats.device)] if feats is not None else None
    return [[t.tokens[i] for i in path]], [len(path)], [new], kept, [max(t.depths, default=0)]
