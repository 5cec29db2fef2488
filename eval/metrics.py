"""Acceptance metrics from per-round logs: τ, per-position acceptance, survival, calibration (ECE); the interval of a
speedup measured over a few prompts; and, where a greedy output departs from plain decoding's, by how much the target
preferred plain decoding's token there."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from draftsmith.eval.engine import DecodeResult


def acceptance_stats(results: Sequence[DecodeResult], gamma: int) -> dict[str, Any]:
    rounds = [r for res in results for r in res.rounds]
    tokens = sum(len(res.tokens) for res in results)
    seconds = sum(res.seconds for res in results)
    out: dict[str, Any] = {
        "prompts": len(results),
        "rounds": len(rounds),
        "tau": sum(a + 1 for _, a in rounds) / len(rounds) if rounds else None,
        "drafted": sum(d for d, _ in rounds),
        "drafted_rounds": sum(1 for d, _ in rounds if d),
        "accepted": sum(a for _, a in rounds),
        "target_passes": sum(res.target_passes for res in results),
        "new_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
    }
    draft = sum(res.draft_seconds for res in results)
    verify = sum(res.verify_seconds for res in results)
    if rounds and verify > 0:
        # what one round's drafting costs, in units of one target verification pass
        out["draft_ms_per_round"] = 1000 * draft / len(rounds)
        out["verify_ms_per_pass"] = 1000 * verify / len(rounds)
        out["draft_cost_vs_target_pass"] = draft / verify
    # position i (1-based) is reached when i-1 drafts were accepted and at least i were drafted
    per_pos, survival = [], []
    for i in range(1, gamma + 1):
        reached = sum(1 for d, a in rounds if d >= i and a >= i - 1)
        kept = sum(1 for d, a in rounds if a >= i)
        per_pos.append(kept / reached if reached else None)
        survival.append(kept / len(rounds) if rounds else None)
    out["acceptance_by_position"] = per_pos
    out["survival"] = survival
    return out


def _mean_ranks(values: Sequence[float]) -> list[float]:
    """The 1-based rank of each value in ascending order, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda k: values[k])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and values[order[j]] == values[order[i]]:
            j += 1
        for k in order[i:j]:
            ranks[k] = (i + 1 + j) / 2
        i = j
    return ranks


def ranking_auc(pairs: Sequence[tuple[float, float]]) -> float | None:
    """How well confidences rank outcomes: the chance that an accepted position's confidence is above a rejected
    one's (ties count half), over (confidence, accepted 0/1) pairs; 0.5 is no better than chance. None without both
    outcomes. Calibration (ECE) says whether a confidence means what it says on the mean; this says whether it tells
    one slot from another, which is what choosing slots needs (a head calibrated on the mean can rank no better than
    chance). The Mann-Whitney count over ranks, written out: O(n log n)."""
    positives = sum(1 for _, y in pairs if y > 0.5)
    negatives = len(pairs) - positives
    if not positives or not negatives:
        return None
    ranks = _mean_ranks([c for c, _ in pairs])
    rank_sum = sum(r for r, (_, y) in zip(ranks, pairs) if y > 0.5)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of paired values (ties share their mean rank): +1 when ys rise with xs, 0 when
    the order of one says nothing of the other. None with fewer than 3 pairs or a constant side. Written out (scipy
    is not a dependency)."""
    if len(xs) != len(ys):
        raise ValueError(f"rank_correlation: {len(xs)} values against {len(ys)}")
    if len(xs) < 3:
        return None
    rx, ry = _mean_ranks(xs), _mean_ranks(ys)
    mean = (len(xs) + 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    vx, vy = sum((a - mean) ** 2 for a in rx), sum((b - mean) ** 2 for b in ry)
    if not vx or not vy:
        return None
    return cov / (vx * vy) ** 0.5


def calibration(results: Sequence[DecodeResult], bins: int = 10) -> dict[str, Any] | None:
    """ECE of per-position confidences against acceptance (given the previous drafts were accepted), and of
    the cumulative survival Π c_j against 'all drafts up to i accepted'; the per-position confidences' ranking AUC
    (`ranking_auc`). None when the drafter has no confidences."""
    pos_pairs, surv_pairs = [], []
    for res in results:
        for confs, (_, a) in zip(res.confidences, res.rounds):
            s = 1.0
            for i, c in enumerate(confs, start=1):
                if i - 1 <= a:  # reached: every earlier draft was accepted
                    pos_pairs.append((c, float(a >= i)))
                s *= c
                surv_pairs.append((s, float(a >= i)))
    if not pos_pairs:
        return None

    def ece(pairs):
        table = []
        total = 0.0
        for b in range(bins):
            lo, hi = b / bins, (b + 1) / bins
            inside = [(c, y) for c, y in pairs if lo <= c < hi or (b == bins - 1 and c == 1.0)]
            if not inside:
                continue
            conf = sum(c for c, _ in inside) / len(inside)
            acc = sum(y for _, y in inside) / len(inside)
            total += len(inside) / len(pairs) * abs(conf - acc)
            table.append({"bin": [lo, hi], "count": len(inside), "confidence": conf, "accuracy": acc})
        return total, table

    e, table = ece(pos_pairs)
    se, stable = ece(surv_pairs)
    return {
        "ece": e,
        "auc": ranking_auc(pos_pairs),
        "reliability": table,
        "survival_ece": se,
        "survival_reliability": stable,
        "positions": len(pos_pairs),
    }


def speedup_interval(
    results: Sequence[DecodeResult],
    plains: Sequence[Sequence[DecodeResult]],
    level: float = 0.95,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A bootstrap percentile interval (`level`) of the speedup of `results` over plain decoding, the statistic the
    tables show: Σ tokens / Σ seconds of `results` over the same of the plain runs `plains` pooled (one list per plain
    run: plain decoding before, and again after). Prompts are resampled with their pairs: `results[i]` and every
    `plain[i]` decoded the same prompt one right after another, so a prompt that is slow for every configuration (a
    long answer, a slow minute of the machine) moves both sides of its ratio, and only what differs between them is
    the noise. None when there are fewer than 2 prompts or the lists do not pair up. Rows decoded in one batch
    (eval.batch_size > 1) share its time equally, so they are not independent and the interval is too narrow there;
    the speedup tables that matter for latency run at batch 1.

    Written by hand (no SciPy here): a few lines, seeded, so the same results give the same interval."""
    n = len(results)
    if n < 2 or not plains or any(len(p) != n for p in plains):
        return None
    tokens = [len(r.tokens) for r in results]
    seconds = [r.seconds for r in results]
    plain_tokens = [sum(len(p[i].tokens) for p in plains) for i in range(n)]
    plain_seconds = [sum(p[i].seconds for p in plains) for i in range(n)]
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        t, s = sum(tokens[i] for i in pick), sum(seconds[i] for i in pick)
        pt, ps = sum(plain_tokens[i] for i in pick), sum(plain_seconds[i] for i in pick)
        if s > 0 and ps > 0 and pt > 0:
            ratios.append((t / s) / (pt / ps))
    if not ratios:
        return None
    ratios.sort()
    tail = (1 - level) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int(round((1 - tail) * (len(ratios) - 1)))]
    return lo, hi


@torch.no_grad()
def first_difference_margin(model, prompt: Sequence[int], ref: Sequence[int], other: Sequence[int]) -> float | None:
    """Where a greedy output `other` first departs from plain decoding's `ref` (both continuing `prompt`), by how many
    logits the target's choice there, ref's token, led other's token, from one forward over the prompt and ref up to
    that point (logits in float32). A floating-point near-tie (a pass of another width rounding the other way, which
    in bf16 happens on a CPU and a GPU alike) leads by about the rounding of the logits; a verifier that kept a token
    the target did not pick would lead by whole logits. None where neither departs (one is a prefix of the other)."""
    j = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)
    if j is None:
        return None
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(ref[:j])], device=device)
    logits = model(input_ids=ids).logits[0, -1].float()
    return float(logits[ref[j]] - logits[other[j]])
