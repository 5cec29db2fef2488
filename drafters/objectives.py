"""Training objectives: from a batch of target features to (loss, statistics) for each drafter family.

Statistics are returned as sums with their counts so the trainer can add them across micro-batches and
ranks before dividing (per-step accuracy, expected acceptance, simulated acceptance length, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
from torch.nn import functional as F
from typing_extensions import NotRequired  # typing's own from Python 3.11; the project supports 3.10

from draftsmith.drafters.losses import (
    FullVocabStats,
    acceptance,
    draft_distribution,
    pad_end,
    position_losses,
    shift,
    simulated_acceptance_length,
    step_terms,
    teacher_from_final,
)
from draftsmith.drafters.vocab import draft_to_target_ids


class TrainBatch(TypedDict):
    """What every family's objective receives: one padded micro-batch of B sequences of T tokens (a feature source's
    `load_batch`), plus the epoch it is drawn in. Tensors may be on the CPU; objectives move them."""

    input_ids: torch.Tensor
    """[B, T] token ids, right-padded."""
    loss_mask: torch.Tensor
    """[B, T] 1 where the token is an assistant token (supervised)."""
    attention_mask: torch.Tensor
    """[B, T] bool, False on padding."""
    aux: torch.Tensor
    """[B, T, n_aux * H] the target's aux-layer features, concatenated in ascending layer order."""
    final: torch.Tensor
    """[B, T, H] the target's final normed hidden states (the teacher is its LM head over them)."""
    ids: list[str]
    """Record id of each sequence."""
    domains: list[str]
    """Domain label of each sequence."""
    supervised_from: NotRequired[int]
    """The first position whose loss mask is set in any row (T if none), computed where the batch is built, on the
    host: the slots before it are prompt in every row, and EAGLE-3 skips their vocabulary projections. Absent: 0."""
    teacher_argmax: NotRequired[torch.Tensor]
    """[B, T] the target's argmax over its full vocabulary at each position, when the trainer has it (its teacher
    cache, `drafters.teacher_cache`): the objective then computes only the draft-vocab columns of the teacher."""
    teacher_lse: NotRequired[torch.Tensor]
    """[B, T] logsumexp of the full-vocabulary logits / temperature, with `teacher_argmax` at temperature > 0."""
    epoch: int
    """The epoch the batch is drawn in (0 for holdout and calibration batches). An objective that draws at random
    per batch (DSpark's anchors) seeds from (seed, epoch, sequence id): a new draw every epoch, and a resumed run
    draws what the uninterrupted one would have."""


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
    greedy_drafts: bool = False
    """Acceptance of drafts taken as the drafter's argmax at a temperature > 0 (the target's probability of it,
    eval.draft_sample_method = greedy) rather than drawn from its distribution; set only to fit the confidences'
    calibration for such drafts."""


def eagle3_objective(
    model, batch: TrainBatch, head_weight: torch.Tensor, s: ObjectiveSettings, buffers=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TTT loss over one padded batch. `model` may be a DDP/DeepSpeed wrapper (its forward is the TTT unroll);
    `buffers` is the unwrapped drafter, for its d2t buffer."""
    inner = buffers if buffers is not None else model
    device = head_weight.device
    input_ids = batch["input_ids"].to(device)
    loss_mask = (batch["loss_mask"].to(device) > 0) & batch["attention_mask"].to(device)
    draft_ids = draft_to_target_ids(inner.d2t)
    # slots before `lo` are supervised at no step: no teacher, logits or loss for them (the rows from lo on)
    lo = heads_from(batch, s.steps)
    teacher = teacher_from_final(
        batch["final"][:, lo:].to(device), head_weight, draft_ids, s.temperature, known=known_stats(batch, lo)
    )
    outs = model(batch["aux"].to(device), input_ids, s.steps, s.checkpoint, lo)
    loss_mask = loss_mask[:, lo:]

    T = input_ids.shape[1] - lo
    total = torch.zeros((), device=device)
    stats: dict[str, torch.Tensor] = {}
    alphas, valids = [], []
    for i, (logits, conf) in enumerate(outs):
        mask = shift(loss_mask, 2 + i)  # slot t at step i predicts token t+2+i
        # ... whose distribution the target gives at position t+1+i: a view of the teacher computed once for the
        # micro-batch; the last 1+i slots have none (and mask 0), their per-slot values are padded with 0
        t_i = teacher.ahead(1 + i)
        n = mask.sum()
        per_pos, alpha, correct = step_terms(logits, t_i, draft_ids, s.loss, s.temperature)
        bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
        denom = n.clamp_min(1)
        total = total + (s.step_decay**i) * (per_pos * mask).sum() / denom
        total = total + s.confidence_weight * (bce * mask).sum() / denom
        with torch.no_grad():
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
        stats["oov"] = (~teacher.ahead(1).in_vocab & start[:, : T - 1]).sum().float()
        stats["tokens"] = batch["attention_mask"].sum().float().to(device)
    return total, stats


def known_stats(batch: TrainBatch, start: int = 0, positions: torch.Tensor | None = None) -> FullVocabStats | None:
    """The batch's full-vocabulary teacher statistics, when it carries them: at the slots from `start` on, or at
    `positions` [B, N] (gathered per row). None when it does not (the teacher computes them)."""
    if "teacher_argmax" not in batch:
        return None
    argmax, lse = batch["teacher_argmax"], batch.get("teacher_lse")
    if positions is not None:
        return FullVocabStats(
            argmax.gather(1, positions.to(argmax.device)),
            None if lse is None else lse.gather(1, positions.to(lse.device)),
        )
    return FullVocabStats(argmax[:, start:], None if lse is None else lse[:, start:])


def heads_from(batch: TrainBatch, steps: int) -> int:
    """The first slot some TTT step supervises: slot t at step i < steps predicts token t+2+i, so the slots before
    `supervised_from` - steps - 1 never are. A host integer (no read of the device)."""
    T = batch["input_ids"].shape[1]
    return max(0, min(int(batch.get("supervised_from", 0)), T) - steps - 1)


def supervised_from(loss_mask: torch.Tensor) -> int:
    """`TrainBatch.supervised_from` of a [B, T] loss mask on the host (0 for a mask on a device: reading it would
    wait for the device)."""
    if loss_mask.device.type != "cpu":
        return 0
    first = loss_mask.bool().any(0).nonzero()
    return int(first[0, 0]) if len(first) else loss_mask.shape[1]


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


# ------------------------------------------------------------------------------------------- DSpark


@dataclass
class DSparkObjectiveSettings:
    block_size: int = 7
    """γ: slots per block."""
    anchors_per_sequence: int = 32
    """Most anchors drawn per sequence."""
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    bce_weight: float = 1.0
    decay: float | None = None
    """Slot k (0-based) is weighted exp(-k/decay); None = block_size."""
    temperature: float = 1.0
    """Temperature of the teacher / acceptance targets; 0 = greedy."""
    sample_markov_inputs: bool = False
    """Condition the sequential bias on the drafter's own samples (training-time test); a slot is supervised only
    while the samples before it equal the data tokens (the only prefixes whose teacher is known)."""
    seed: int = 0
    """Salt of the per-(epoch, sequence) draws: the anchors, and the sampled Markov inputs."""
    greedy_drafts: bool = False
    """Acceptance of drafts taken as the drafter's argmax at a temperature > 0 (the target's probability of it,
    eval.draft_sample_method = greedy), the Markov inputs the argmax too; set only to fit the confidences'
    calibration for such drafts."""

    @property
    def steps(self) -> int:
        """Positions reported per anchor (the trainer's per-step statistics)."""
        return self.block_size


def sample_anchors(
    loss_mask: torch.Tensor, attention_mask: torch.Tensor, ids: list[str], count: int, seed: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A], valid [B, A]) with A = min(count, T-1): up to `count` distinct positions p per sequence whose
    next token p+1 is supervised, uniformly drawn without replacement. Sorted; padding anchors are 0 and invalid.

    Each sequence ranks its positions by a random permutation from a CPU generator seeded from (seed, epoch, sequence
    id), and its candidates of highest rank are its anchors: a resumed run and every rank draw the same anchors, on
    any device. The ranks are host work that reads nothing from the device, and the choice is made where the masks
    are, so the draw never waits on the device (issue 20); A does not depend on the data for the same reason."""
    B, T = loss_mask.shape
    candidate = shift(loss_mask.bool() & attention_mask.bool(), 1)  # p is a candidate if p+1 is supervised
    ranks = torch.stack([torch.randperm(T, generator=_sequence_generator(seed, epoch, sid)) for sid in ids])
    keys = torch.where(candidate, ranks.to(loss_mask.device, non_blocking=True), -1)
    top = keys.topk(max(1, min(count, T - 1)), dim=1)  # the candidates of highest rank; -1: fewer candidates than A
    # sorted by position, padding last: position T sorts after every real one
    order = torch.where(top.values >= 0, top.indices, T).sort(dim=1).values
    valid = order < T
    return torch.where(valid, order, 0), valid


def _sequence_generator(seed: int, epoch: int, sequence_id: str, stream: str = "") -> torch.Generator:
    """The CPU generator of one sequence's draws in one epoch: the anchors (stream "") and the sampled Markov inputs
    ("markov"). On the CPU, for a draw that is the same on every device, rank count and batch."""
    import zlib

    tag = f"{seed}:{epoch}:{sequence_id}" + (f":{stream}" if stream else "")
    return torch.Generator().manual_seed(zlib.crc32(tag.encode()))


def _markov_uniforms(seed: int, epoch: int, ids: list[str], anchors: int, block_size: int) -> torch.Tensor:
    """[B, anchors, block_size] float64 uniforms of the sampled training-time test: each sequence's from a CPU
    generator seeded from (seed, epoch, sequence id), like its anchors, so a resumed run, any rank count and any
    device draw the same tokens for it (and the holdout and the calibration draw the same at every call)."""
    gens = [_sequence_generator(seed, epoch, sid, "markov") for sid in ids]
    return torch.stack([torch.rand(anchors, block_size, dtype=torch.float64, generator=g) for g in gens])


def _dspark_forward(model, batch, head_weight, s: DSparkObjectiveSettings, inner):
    """Shared by the loss and the calibration data: anchors, teacher at every slot, the forward, slot validity."""
    device = head_weight.device
    input_ids = batch["input_ids"].to(device)
    attention = batch["attention_mask"].to(device).bool()
    loss_mask = (batch["loss_mask"].to(device) > 0) & attention
    B, T = input_ids.shape
    G = s.block_size
    anchors, anchor_valid = sample_anchors(
        loss_mask, attention, list(batch["ids"]), s.anchors_per_sequence, s.seed, int(batch["epoch"])
    )
    pos = anchors[..., None] + torch.arange(G, device=device)  # slot k of anchor p: teacher at p+k, predicts p+k+1
    # a slot counts while every slot before it does: the chain of a block stops at the end of the assistant turn
    nxt = (pos + 1).clamp_max(T - 1)
    ok = anchor_valid[..., None] & (pos + 1 < T) & loss_mask.gather(1, nxt.view(B, -1)).view_as(pos)
    valid = ok.long().cumprod(-1).bool()
    final = batch["final"].to(device)
    at = pos.clamp_max(T - 1).view(B, -1)
    gathered = final.gather(1, at[..., None].expand(-1, -1, final.shape[-1]))
    draft_ids = draft_to_target_ids(inner.d2t)
    known = known_stats(batch, positions=at)
    teacher = teacher_from_final(gathered, head_weight, draft_ids, s.temperature, known=known)  # [B, A*G, ...]
    # drafts taken as the argmax condition the next slot on the argmax (temperature 0 draws nothing)
    sample_t = (0.0 if s.greedy_drafts else s.temperature) if s.sample_markov_inputs else None
    uniforms = None
    if sample_t:  # greedy (0) draws nothing
        uniforms = _markov_uniforms(s.seed, int(batch["epoch"]), list(batch["ids"]), anchors.shape[1], G)
        uniforms = uniforms.to(device, non_blocking=True)
    logits, conf, prev = model(batch["aux"].to(device), input_ids, attention, anchors, sample_t, uniforms)
    if sample_t is not None:
        # Slot k conditioned on the drafter's own samples is supervised only while they equal the data tokens: the
        # teacher at p+k is the target's distribution after the *data* prefix, and after any other prefix the
        # target's distribution is unknown here (it would take a target pass over the drafted tokens).
        data_prev = input_ids.gather(1, at).view_as(pos)
        valid = valid & (prev == data_prev).long().cumprod(-1).bool()
    D = logits.shape[-1]
    return logits.reshape(B, -1, D), conf.reshape(B, -1), teacher, valid.reshape(B, -1), draft_ids


def dspark_objective(
    model, batch: TrainBatch, head_weight: torch.Tensor, s: DSparkObjectiveSettings, buffers=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`ce_weight·CE + tv_weight·TV + bce_weight·BCE` per slot, weighted exp(-k/decay), masked mean over the
    valid slots of every block. TV is against the target's full-vocabulary distribution (at temperature 0:
    against its softmax at temperature 1), so 1 - TV is exactly the acceptance probability the confidence head
    is trained toward."""
    inner = buffers if buffers is not None else model
    G = s.block_size
    logits, conf, teacher, valid, draft_ids = _dspark_forward(model, batch, head_weight, s, inner)
    B = logits.shape[0]
    slot = torch.arange(logits.shape[1], device=logits.device) % G
    weight = torch.exp(-slot.float() / (s.decay or G))[None, :]
    ce = position_losses(logits, teacher, "ce", s.temperature)
    if teacher.exact is not None:
        q = draft_distribution(logits, s.temperature)
        tv = 1.0 - torch.minimum(teacher.exact, q).sum(-1)
    else:
        tv = position_losses(logits, teacher, "tv", s.temperature)
    alpha = acceptance(logits, teacher, draft_ids, s.temperature)
    bce = F.binary_cross_entropy_with_logits(conf.float(), alpha, reduction="none")
    per = s.ce_weight * ce + s.tv_weight * tv + s.bce_weight * bce
    mask = valid.float()
    total = (weight * per * mask).sum() / mask.sum().clamp_min(1)
    stats: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        correct = (draft_ids[logits.argmax(-1)] == teacher.argmax).float()
        by_slot = lambda x: (x * mask).view(B, -1, G).sum((0, 1))  # noqa: E731
        n, l_, a_, al, bc, cf = (
            by_slot(torch.ones_like(mask)),
            by_slot(per),
            by_slot(correct),
            by_slot(alpha),
            by_slot(bce),
            by_slot(torch.sigmoid(conf.float())),
        )
        for k in range(G):
            stats[f"n_{k}"], stats[f"loss_{k}"], stats[f"acc_{k}"] = n[k], l_[k], a_[k]
            stats[f"accept_{k}"], stats[f"bce_{k}"], stats[f"conf_{k}"] = al[k], bc[k], cf[k]
        a3, v3 = alpha.view(B, -1, G), valid.view(B, -1, G)
        tau = simulated_acceptance_length([a3[..., k] for k in range(G)], [v3[..., k] for k in range(G)])
        start = v3[..., 0]
        stats["tau"] = (tau * start).sum()
        stats["tau_n"] = start.sum().float()
        stats["oov"] = (~teacher.in_vocab.view(B, -1, G)[..., 0] & start).sum().float()
        stats["tokens"] = batch["attention_mask"].sum().float().to(logits.device)
    return total, stats


@torch.no_grad()
def eagle3_calibration_data(model, batch: TrainBatch, head_weight: torch.Tensor, s: ObjectiveSettings):
    """(confidence logits, acceptance probabilities, validity), each [chains, steps]: the chain started at slot t
    drafts token t+2+i at TTT step i, exactly as it would be drafted at inference."""
    device = head_weight.device
    input_ids = batch["input_ids"].to(device)
    loss_mask = (batch["loss_mask"].to(device) > 0) & batch["attention_mask"].to(device)
    draft_ids = draft_to_target_ids(model.d2t)
    known = known_stats(batch)
    teacher = teacher_from_final(batch["final"].to(device), head_weight, draft_ids, s.temperature, known=known)
    outs = model.ttt_forward(batch["aux"].to(device), input_ids, s.steps)
    conf = torch.stack([c.float() for _, c in outs], -1)
    T = input_ids.shape[1]
    alpha = torch.stack(
        [
            pad_end(
                acceptance(lg[:, : max(T - 1 - i, 0)], teacher.ahead(1 + i), draft_ids, s.temperature, s.greedy_drafts),
                T,
            )
            for i, (lg, _) in enumerate(outs)
        ],
        -1,
    )
    # a chain reaches step i only while every earlier step had a supervised token
    valid = torch.stack([shift(loss_mask, 2 + i) for i in range(s.steps)], -1).long().cumprod(-1).bool()
    keep = valid[..., 0]
    return conf[keep], alpha[keep], valid[keep]


def dspark_calibration_data(model, batch: TrainBatch, head_weight: torch.Tensor, s: DSparkObjectiveSettings):
    """(confidence logits, acceptance probabilities, validity), each [blocks, γ], for fitting the temperatures."""
    logits, conf, teacher, valid, draft_ids = _dspark_forward(model, batch, head_weight, s, model)
    alpha = acceptance(logits, teacher, draft_ids, s.temperature, s.greedy_drafts)
    G = s.block_size
    keep = valid.view(-1, G)[:, 0]
    return conf.float().view(-1, G)[keep], alpha.view(-1, G)[keep], valid.view(-1, G)[keep]
