"""Distillation math shared by drafters: the teacher from the target's final hidden states, the per-position
losses (soft cross-entropy, total variation, acceptance), acceptance probabilities and the simulated
acceptance length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class Teacher:
    """The target's next-token distribution at every position of a batch, seen through the draft vocab."""

    probs: torch.Tensor
    """[B, T, D] teacher distribution renormalized over the draft vocab (the soft labels)."""
    exact: torch.Tensor | None
    """[B, T, D] full-vocabulary probabilities on the draft columns (sum <= 1): acceptance is Σ min(exact, q).
    None for greedy (temperature 0), where acceptance is argmax agreement."""
    argmax: torch.Tensor
    """[B, T] the target's argmax over the full vocabulary (target ids)."""
    in_vocab: torch.Tensor
    """[B, T] whether that argmax is in the draft vocab."""

    def ahead(self, n: int) -> Teacher:
        """The teacher at position t+n for the slots t < T-n that have one: views of this teacher, no copy. A TTT
        unroll takes the teacher n ahead at every step; `shifted` would copy the [B, T, D] distributions each time.
        Pair it with the first T-n slots of the drafter's logits and `pad_end` the per-slot results."""
        return Teacher(
            self.probs[:, n:],
            self.exact[:, n:] if self.exact is not None else None,
            self.argmax[:, n:],
            self.in_vocab[:, n:],
        )

    def shifted(self, n: int) -> Teacher:
        """The teacher at position t+n for every slot t (zeros / False past the end). Copies; see `ahead`."""
        return Teacher(
            shift(self.probs, n),
            shift(self.exact, n) if self.exact is not None else None,
            shift(self.argmax, n),
            shift(self.in_vocab, n),
        )


def pad_end(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, t, ...] zero-padded at the end of dim 1 to `length` slots: per-slot results of `Teacher.ahead` back in
    the shape of the whole sequence (the padded slots have no teacher; their loss mask is 0)."""
    missing = length - x.shape[1]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], missing, *x.shape[2:]))], dim=1)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t+n] at slot t, zero-padded at the end (dim 1 is time)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class FullVocabStats:
    """What the teacher needs from the target's full-vocabulary logits, beyond the draft-vocab columns: two numbers
    per position instead of V. A trainer keeps them between epochs (`drafters.teacher_cache`), since they depend only
    on the record and the target, and computing them is the one full-vocabulary product of a training step."""

    argmax: torch.Tensor
    """[B, T] the target's argmax over the full vocabulary (target ids)."""
    lse: torch.Tensor | None
    """[B, T] fp32 logsumexp of the full-vocabulary logits / temperature; None at temperature 0 (not needed)."""


@torch.no_grad()
def full_vocab_stats(
    final: torch.Tensor, head_weight: torch.Tensor, temperature: float, chunk: int = 2048
) -> FullVocabStats:
    """`FullVocabStats` of final normed hidden states [B, T, H] under the target's lm_head weight [V, H]. The
    logits are computed in chunks of `chunk` positions and never kept whole."""
    B, T, H = final.shape
    # fp32 logits even inside a bf16 autocast region: rounded to bf16, logits of ~20 move by ~0.1 and the
    # probabilities the drafter is trained toward by ~10%
    weight = head_weight.float()
    flat = final.reshape(-1, H).float()
    argmax, lse = [], []
    for start in range(0, flat.shape[0], chunk):
        with torch.autocast(final.device.type, enabled=False):
            logits = flat[start : start + chunk] @ weight.T
        top, norm = _stats_of(logits, temperature)
        argmax.append(top)
        lse.append(norm)
    return FullVocabStats(argmax=torch.cat(argmax).view(B, T), lse=_cat_or_none(lse, B, T))


def _stats_of(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax, logsumexp(logits / temperature) or None at temperature 0) of fp32 logits [n, V]."""
    return logits.argmax(-1), torch.logsumexp(logits / temperature, dim=-1) if temperature > 0 else None


def _cat_or_none(parts: list, B: int, T: int) -> torch.Tensor | None:
    return None if not parts or parts[0] is None else torch.cat(parts).view(B, T)


@torch.no_grad()
def teacher_from_final(
    final: torch.Tensor,
    head_weight: torch.Tensor,
    draft_ids: torch.Tensor,
    temperature: float,
    chunk: int = 2048,
    known: FullVocabStats | None = None,
) -> Teacher:
    """Teacher from final normed hidden states [B,T,H] and the target's lm_head weight [V,H].

    Computed in chunks of `chunk` positions, never keeping a chunk's full-vocabulary logits beyond it. The
    full-vocabulary statistics (argmax, normalizer) are `known` when the caller has them for these positions (a
    trainer's teacher cache): then only the draft-vocab columns of the logits are computed, a D/V share of the
    product. Greedy (temperature 0) soft labels use temperature 1.
    """
    B, T, H = final.shape
    if known is not None and temperature > 0 and known.lse is None:
        raise ValueError("teacher_from_final: a temperature > 0 needs the known full-vocabulary logsumexp")
    # fp32 logits even inside a bf16 autocast region (see full_vocab_stats)
    weight = head_weight.float() if known is None else head_weight[draft_ids].float()
    flat = final.reshape(-1, H).float()
    known_lse = known.lse.reshape(-1) if known is not None and known.lse is not None else None
    t_soft = temperature if temperature > 0 else 1.0
    probs, exact, argmax = [], [], []
    for start in range(0, flat.shape[0], chunk):
        with torch.autocast(final.device.type, enabled=False):
            logits = flat[start : start + chunk] @ weight.T
        if known is None:
            top, lse = _stats_of(logits, temperature)
            argmax.append(top)
            cols = logits[:, draft_ids]
        else:
            lse, cols = (known_lse[start : start + chunk] if known_lse is not None else None), logits
        probs.append(torch.softmax(cols / t_soft, dim=-1))
        if temperature > 0:
            assert lse is not None
            exact.append(torch.exp(cols / temperature - lse[:, None]))
    argmax_t = torch.cat(argmax).view(B, T) if known is None else known.argmax.to(final.device, torch.long)
    in_vocab = torch.zeros(head_weight.shape[0], dtype=torch.bool, device=final.device)
    in_vocab[draft_ids] = True
    return Teacher(
        probs=torch.cat(probs).view(B, T, -1),
        exact=torch.cat(exact).view(B, T, -1) if temperature > 0 else None,
        argmax=argmax_t,
        in_vocab=in_vocab[argmax_t],
    )


def draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


def position_losses(logits: torch.Tensor, teacher: Teacher, kind: str, temperature: float) -> torch.Tensor:
    """[B, T] loss per position: `ce` soft cross-entropy (= forward KL + const), `tv` total variation,
    `accept` -log Σ min(p, q).

    `tv` and `accept` compare q with the target's full-vocabulary p (its mass on the draft columns, `exact`), so
    1 - tv and exp(-accept) are the acceptance probability itself; the draft-vocab renormalized p would overstate
    it by the mass outside the draft vocab. At temperature 0 there is no such p, and the soft labels are used."""
    logq = F.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    if kind == "ce":
        return -(teacher.probs * logq).sum(-1)
    q = logq.exp()
    overlap = torch.minimum(teacher.exact if teacher.exact is not None else teacher.probs, q).sum(-1)
    if kind == "tv":
        return 1.0 - overlap  # = ½‖p − q‖₁ over the full vocabulary (q is 0 outside the draft vocab)
    if kind == "accept":
        return -torch.log(overlap.clamp_min(1e-9))
    raise ValueError(f"unknown loss {kind!r} (choose ce, tv or accept)")


@torch.no_grad()
def acceptance(
    logits: torch.Tensor, teacher: Teacher, draft_ids: torch.Tensor, temperature: float, greedy_draft: bool = False
) -> torch.Tensor:
    """[B, T] exact probability that the drafted token is accepted: Σ_x min(p(x), q(x)) with p the target's
    full-vocabulary distribution, for a draft drawn from q; p(argmax q) with `greedy_draft` (the drafter's argmax,
    verified as a one-hot q); at temperature 0, whether the draft argmax is the target argmax."""
    if temperature == 0 or teacher.exact is None:
        return (draft_ids[logits.argmax(-1)] == teacher.argmax).float()
    if greedy_draft:
        return teacher.exact.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1).float()
    q = draft_distribution(logits, temperature)
    return torch.minimum(teacher.exact, q).sum(-1)


def simulated_acceptance_length(alphas: list[torch.Tensor], valid: list[torch.Tensor]) -> torch.Tensor:
    """[B, T] expected tokens per verification pass for a chain of len(alphas) drafts starting at each slot:
    1 + Σ_i Π_{j<=i} α_j, where a step that is not valid (past the end, or not an assistant token) stops the chain."""
    survive = torch.ones_like(alphas[0])
    tau = torch.ones_like(alphas[0])
    for a, v in zip(alphas, valid):
        survive = survive * a * v.float()
        tau = tau + survive
    return tau


# --------------------------------------------------------------------------------- fused per-step terms
#
# A TTT step's logits are [B, T, D] with D the draft vocab (32k): every pass over them streams hundreds of MB. The
# unfused terms (`position_losses`, `acceptance`, the argmax statistic) take about a dozen such passes forward and
# backward (temperature division, log-softmax, products, softmax again, minimum, their backward) and keep the
# [B, T, D] log-probabilities for backward. `step_terms` computes the same values in chunks of rows, each chunk
# small enough to stay in cache: forward reads the logits once and keeps only each row's log-sum-exp (and, for
# `tv`/`accept`, its overlap); backward recomputes a chunk's probabilities and writes the logits' gradient once.
# Written by hand because no library fuses a loss against a *distribution* (the teacher's soft labels, Σ min(p, q))
# rather than a class index. The unfused functions above stay as the reference the tests compare with.

CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 26}
"""Logit elements per chunk (B x rows x D): about L2-sized in fp32 on a CPU; on CUDA, large enough that launches
are few (rows are independent, so any chunk gives the same values)."""


def _rows_per_chunk(logits: torch.Tensor) -> int:
    B, _, D = logits.shape
    return max(1, CHUNK_ELEMENTS.get(logits.device.type, 1 << 26) // max(1, B * D))


def _tempered(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x in fp32 divided by the temperature (1 for greedy); no division by 1 (the same values, one pass fewer)."""
    x = x.float()
    t = temperature if temperature > 0 else 1.0
    return x if t == 1.0 else x / t


class _StepTerms(torch.autograd.Function):
    """(loss [B, T], acceptance [B, T], argmax agreement [B, T]) of logits [B, T, D] against a teacher of the first
    N <= T slots; slots past N get 0 in all three and no gradient. Only the loss is differentiable. Per chunk, in
    place where it can: one max (the stabilizer and the argmax), exp, sum, the normalization, the kind's terms."""

    @staticmethod
    def forward(ctx, logits, probs, exact, teacher_argmax, draft_ids, kind: str, temperature: float):
        B, T, _ = logits.shape
        N = probs.shape[1]
        rows = _rows_per_chunk(logits)
        loss, alpha, correct, lse, overlap_of = (
            torch.zeros(B, T, dtype=torch.float32, device=logits.device) for _ in range(5)
        )
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, N, rows):
                e = min(N, s + rows)
                x = _tempered(logits[:, s:e], temperature)
                top, arg = x.max(dim=-1, keepdim=True)  # the argmax of x is the logits' argmax (t > 0)
                q = (x - top).exp_()
                total = q.sum(-1, keepdim=True)
                q.div_(total)
                lse[:, s:e] = (top + total.log())[..., 0]
                correct[:, s:e] = (draft_ids[arg[..., 0]] == teacher_argmax[:, s:e]).float()
                p = probs[:, s:e]
                if exact is not None:
                    alpha[:, s:e] = torch.minimum(exact[:, s:e], q).sum(-1)
                else:
                    alpha[:, s:e] = correct[:, s:e]
                if kind == "ce":
                    # -Σ p log q with log q = x - lse and Σ p = 1 (the soft labels are a distribution)
                    loss[:, s:e] = lse[:, s:e] - (p * x).sum(-1)
                else:
                    # tv / accept compare q with the full-vocabulary p (the soft labels at temperature 0)
                    overlap = alpha[:, s:e] if exact is not None else torch.minimum(p, q).sum(-1)
                    overlap_of[:, s:e] = overlap
                    loss[:, s:e] = 1.0 - overlap if kind == "tv" else -torch.log(overlap.clamp_min(1e-9))
        ctx.kind, ctx.temperature, ctx.rows = kind, temperature, rows
        ctx.save_for_backward(logits, probs, exact if exact is not None else probs, lse, overlap_of)
        ctx.mark_non_differentiable(alpha, correct)
        return loss, alpha, correct

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_alpha, _grad_correct):
        logits, probs, exact, lse, overlap = ctx.saved_tensors
        kind, temperature, rows = ctx.kind, ctx.temperature, ctx.rows
        t = temperature if temperature > 0 else 1.0
        N = probs.shape[1]
        grad = torch.empty_like(logits)
        grad[:, N:] = 0
        with torch.autocast(logits.device.type, enabled=False):
            for s in range(0, N, rows):
                e = min(N, s + rows)
                x = _tempered(logits[:, s:e], temperature)
                fp32 = grad.dtype == torch.float32
                # q written straight into the gradient's rows when they are fp32 (no temporary)
                q = torch.sub(x, lse[:, s:e, None], out=grad[:, s:e]) if fp32 else x - lse[:, s:e, None]
                q.exp_()
                g = grad_loss[:, s:e, None].float() / t
                if kind == "ce":
                    # d/dx of -Σ p log softmax(x/t) = (q - p) / t
                    dx = q.sub_(probs[:, s:e]).mul_(g)
                else:
                    # overlap O = Σ min(p, q); dO/dq_j = [q_j < p_j]; through the softmax: q (d - Σ q d)
                    d = (q < exact[:, s:e]).float()
                    d.sub_((q * d).sum(-1, keepdim=True))
                    scale = g.neg() if kind == "tv" else g.neg() / overlap[:, s:e, None].clamp_min(1e-9)
                    dx = q.mul_(d).mul_(scale)
                if not fp32:
                    grad[:, s:e] = dx
        return grad, None, None, None, None, None, None


def step_terms(
    logits: torch.Tensor, teacher: Teacher, draft_ids: torch.Tensor, kind: str, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-slot terms of one training step, fused (see above): (loss, acceptance probability, argmax agreement),
    each [B, T] fp32. `logits` [B, T, D] of every slot; `teacher` for the first N <= T of them (`Teacher.ahead`);
    slots past N get 0 (their loss mask is 0). Equal to `pad_end` of `position_losses(logits[:, :N], ...)`,
    `acceptance(...)` and `draft_ids[argmax] == teacher.argmax`, which stay as the reference."""
    if kind not in ("ce", "tv", "accept"):
        raise ValueError(f"unknown loss {kind!r} (choose ce, tv or accept)")
    exact = teacher.exact if temperature > 0 else None
    loss, alpha, correct = _StepTerms.apply(logits, teacher.probs, exact, teacher.argmax, draft_ids, kind, temperature)
    return loss, alpha, correct


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The tokens [...] drawn from `probs` [..., V] (any non-negative weights, a distribution per leading index) at
    the uniform draws `u` [...] in [0, 1): the first token whose cumulative sum exceeds u times the total.
    `eval.sampling.sample` draws one token with it, and DSpark's sampled training-time test a token per slot of a
    whole batch (so it lives here, in the layer both may import)."""
    cdf = probs.double().cumsum(-1)
    at = (u.to(cdf) * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, at, right=True).squeeze(-1)
