"""Training objectives: from a batch of target features to (loss, statistics) for each drafter family.

Statistics are returned as sums with their counts so the trainer can add them across micro-batches and
ranks before dividing (per-step accuracy, expected acceptance, simulated acceptance length, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from drafters.losses import acceptance, position_losses, shift, simulated_acceptance_length, teacher_from_final
from drafters.vocab import draft_to_target_ids


@dataclass
class ObjectiveSettings:
    steps: int = 7
    """TTT unroll length k."""
    step_decay: float = 0.8
    """Loss weight of step i is step_decay**i."""
    loss: str = "ce"
    """ce | tv | accept."""
    temperature: float = 1.0
    """Temperature of the teacher / acceptance targets; 0 = greedy (argmax agreement)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE."""
    checkpoint: bool = False
    """Gradient checkpointing of each TTT step's layers."""


def eagle3_objective(model, batch: dict[str, Any], head_weight: torch.Tensor, s: ObjectiveSettings,
                     buffers=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TTT loss over one padded batch. `model` may be a DDP/DeepSpeed wrapper (its forward is the TTT unroll);
    `buffers` is the unwrapped drafter, for its d2t buffer."""
    inner = buffers if buffers is not None else model
    device = head_weight.device
    input_ids = batch["input_ids"].to(device)
    loss_mask = (batch["loss_mask"].to(device) > 0) & batch["attention_mask"].to(device)
    draft_ids = draft_to_target_ids(inner.d2t)
    teacher = teacher_from_final(batch["final"].to(device), head_weight, draft_ids, s.temperature)
    outs = model(batch["aux"].to(device), input_ids, s.steps, s.checkpoint)

    total = torch.zeros((), device=device)
    stats: dict[str, torch.Tensor] = {}
    alphas, valids = [], []
    for i, (logits, conf) in enumerate(outs):
        mask = shift(loss_mask, 2 + i)  # slot t at step i predicts token t+2+i
        t_i = teacher.shifted(1 + i)  # ... whose distribution the target gives at position t+1+i
        n = mask.sum()
        per_pos = position_losses(logits, t_i, s.loss, s.temperature)
        alpha = acceptance(logits, t_i, draft_ids, s.temperature)
        bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
        denom = n.clamp_min(1)
        total = total + (s.step_decay ** i) * (per_pos * mask).sum() / denom
        total = total + s.confidence_weight * (bce * mask).sum() / denom
        with torch.no_grad():
            correct = (draft_ids[logits.argmax(-1)] == t_i.argmax).float()
            stats[f"n_{i}"] = n.float()
            stats[f"loss_{i}"] = (per_pos * mask).sum().detach()
            stats[f"acc_{i}"] = (correct * mask).sum()
            stats[f"accept_{i}"] = (alpha * mask).sum()
            stats[f"bce_{i}"] = (bce * mask).sum().detach()
            stats[f"conf_{i}"] = (torch.sigmoid(conf.float()) * mask).sum()
        alphas.append(alpha)
        valids.append(mask)
    with torch.no_grad():
        start = valids[0]
        tau = simulated_acceptance_length(alphas, valids)
        stats["tau"] = (tau * start).sum()
        stats["tau_n"] = start.sum().float()
        stats["oov"] = (~teacher.shifted(1).in_vocab & start).sum().float()
        stats["tokens"] = batch["attention_mask"].sum().float().to(device)
    return total, stats


def summarize(stats: dict[str, float], steps: int) -> dict[str, float]:
    """Ratios from summed statistics: per-step loss/accuracy/acceptance/confidence, τ, OOV fraction."""
    out = {}
    for i in range(steps):
        n = max(stats.get(f"n_{i}", 0.0), 1.0)
        for key in ("loss", "acc", "accept", "bce", "conf"):
            out[f"{key}_{i}"] = stats.get(f"{key}_{i}", 0.0) / n
    out["tau"] = stats.get("tau", 0.0) / max(stats.get("tau_n", 0.0), 1.0)
    out["oov_frac"] = stats.get("oov", 0.0) / max(stats.get("tau_n", 0.0), 1.0)
    return out
