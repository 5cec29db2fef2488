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


@torch.no_grad()
def teacher_from_final(
    final: torch.Tensor, head_weight: torch.Tensor, draft_ids: torch.Tensor, temperature: float, chunk: int = 2048
) -> Teacher:
    """Teacher from final normed hidden states [B,T,H] and the target's lm_head weight [V,H].

    The full-vocabulary logits are computed in chunks of `chunk` positions (for the argmax and the
    normalizer) and never kept whole. Greedy (temperature 0) soft labels use temperature 1.
    """
    B, T, H = final.shape
    # fp32 logits even inside a bf16 autocast region: rounded to bf16, logits of ~20 move by ~0.1 and the
    # probabilities the drafter is trained toward by ~10%
    weight = head_weight.float()
    flat = final.reshape(-1, H).float()
    t_soft = temperature if temperature > 0 else 1.0
    probs, exact, argmax = [], [], []
    for start in range(0, flat.shape[0], chunk):
        with torch.autocast(final.device.type, enabled=False):
            logits = flat[start : start + chunk] @ weight.T
        argmax.append(logits.argmax(-1))
        cols = logits[:, draft_ids]
        probs.append(torch.softmax(cols / t_soft, dim=-1))
        if temperature > 0:
            exact.append(torch.exp(cols / temperature - torch.logsumexp(logits / temperature, dim=-1, keepdim=True)))
    argmax_t = torch.cat(argmax).view(B, T)
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
def acceptance(logits: torch.Tensor, teacher: Teacher, draft_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] exact probability that the drafted token is accepted: Σ_x min(p(x), q(x)) with p the target's
    full-vocabulary distribution; at temperature 0, whether the draft argmax is the target argmax."""
    if temperature == 0 or teacher.exact is None:
        return (draft_ids[logits.argmax(-1)] == teacher.argmax).float()
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
