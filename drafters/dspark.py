"""DSpark-style block drafter: one backbone pass drafts a whole block, a rank-r sequential bias corrects it
token by token, and a confidence head predicts which drafted positions the target will accept.

Parameter names follow the speculators DSpark layout (a DFlash-style backbone: `fc`, `hidden_norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.*`, `norm`, `lm_head`; plus
`markov_head.markov_w1` / `markov_w2` and `confidence_head.proj`), so export is a rename-free copy.

Positions. A block is anchored at position p, the last committed token x_p, whose target features do not
exist yet (the target has only run up to p-1). The block input is [x_p, MASK × (γ-1)] at positions
p..p+γ-1, and slot k (0-based) predicts token x_{p+k+1}. Every layer's queries (the block) attend to
(a) the context: keys/values projected from the fused target features of positions 0..p-1, and
(b) the whole block, bidirectionally. The context keys/values do not depend on the block, so inference
caches them and appends each round's verified positions; training packs several anchors per sequence with
a mask giving each block exactly its own prefix, which computes the same numbers (tested).

Sequential bias: slot k's logits get `W2 · W1[x_{p+k}]` added, where x_{p+k} is the token at the position
before the predicted one: the anchor for slot 0, the token sampled at slot k-1 after that. The confidence
head reads `[h_k ; W1[x_{p+k}]]`, so it sees the previous token but never the token it judges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.drafters import ttt_attention
from draftsmith.drafters.common import DrafterBase, DrafterConfigMixin, target_shape_fields
from draftsmith.drafters.eagle3 import KVCache, repeat_kv
from draftsmith.drafters.losses import inverse_cdf
from draftsmith.drafters.ttt_attention import selected_impl


@dataclass
class DSparkConfig(DrafterConfigMixin):
    vocab_size: int
    """Target vocabulary (embedding rows, Markov W1 rows)."""
    draft_vocab_size: int
    """Rows of `lm_head` (the target's head restricted to the draft vocab) and columns of the bias."""
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    aux_layer_ids: list[int]
    """HF hidden_states indices of the fused target features."""
    mask_token_id: int
    """Token whose embedding fills the MASK slots of a block."""
    block_size: int = 7
    num_layers: int = 3
    markov_rank: int = 256
    """Rank of the sequential bias (0: none)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    confidence_temperatures: list[float] | None = None
    """Per-slot temperatures of the confidence logits fitted on held-out data (None: uncalibrated)."""
    confidence_biases: list[float] | None = None
    """Per-slot biases added to the confidence logits after their temperature (None: 0)."""
    sampled_confidence_calibration: dict[str, dict[str, list[float]]] | None = None
    """Per sampling temperature served at (its decimal text, e.g. "1.0"), the per-slot `temperatures` and `biases`
    fitted on the acceptance at that temperature (None: only the fields above, fitted at the training temperature)."""
    greedy_confidence_calibration: dict[str, dict[str, list[float]]] | None = None
    """The same, fitted on the acceptance of drafts taken as the drafter's argmax at that temperature (the target's
    probability of it: eval.draft_sample_method = greedy), per sampling temperature above 0 (None: not fitted)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Target config fields kept for export (e.g. rope scaling)."""


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, d] with cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


# ------------------------------------------------------------------------------ packed training attention
#
# Every layer of the packed training forward lets block slot (a, k) attend to (a) the context keys before its
# anchor (real tokens only) and (b) the G keys of its own block. The dense formulation
# (`packed_attention_reference`, the original code, kept as the reference) scores every slot against the keys of
# every block, A*G x A*G, although only the G x G diagonal is allowed, and builds a [B, 1, A*G, T + A*G] mask:
# quadratic in the number of anchors. Two exact replacements, chosen in one place (`packed_block_attention`) by
# the same switch as EAGLE-3's TTT attention (drafters/ttt_attention.py: `use_impl`, $DRAFTSMITH_TTT_ATTENTION):
#
# - `chunked_packed_attention` (CPU, and wherever flex_attention is missing): a `torch.autograd.Function` that
#   walks the anchors in chunks; per chunk the context scores [.., c*G, T] (masked on device: no read-back of the anchors) and
#   the own-block scores [.., c, G, G] share one fp32 softmax. Forward keeps only its inputs and each row's
#   log-sum-exp, backward recomputes each chunk's probabilities; GQA without repeated K/V. Block-vs-block work
#   and memory are linear in A; the context part is O(chunk x T) at a time.
# - `flex_packed_attention` (CUDA): flex_attention over the keys [context; blocks] with a block mask built per
#   batch from `packed_mask_mod` (fused kernels, no score matrix; the compiled function is cached, the mask is not).


@dataclass(eq=False)
class PackedBlocks:
    """Which keys the slots of the packed training forward see. anchors [B, A] (any value in 0..T-1 for padding
    anchors), real [B, T] (True for real tokens), block_size G. Slot q = a*G + k of row b sees context key t
    when t < anchors[b, a] and real[b, t], and block key a'*G + k' when a' == a. Built once per forward: the
    masks every layer shares are made on first use and kept here (not across batches: the anchors change)."""

    anchors: torch.Tensor
    real: torch.Tensor
    block_size: int
    _made: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.real = self.real.bool()

    @property
    def context_length(self) -> int:
        return self.real.shape[1]

    @property
    def slots(self) -> int:
        return self.anchors.shape[1] * self.block_size

    def dense_mask(self) -> torch.Tensor:
        """The reference's boolean mask [B, 1, A*G, T + A*G] (True: attend)."""
        if "dense" not in self._made:
            B, A = self.anchors.shape
            T, G, device = self.context_length, self.block_size, self.anchors.device
            ctx = (torch.arange(T, device=device)[None, None, :] < self.anchors[..., None]) & self.real[:, None, :]
            ctx = ctx.repeat_interleave(G, dim=1)  # [B, A*G, T]
            blocks = torch.arange(A, device=device).repeat_interleave(G)
            own = (blocks[:, None] == blocks[None, :]).expand(B, A * G, A * G)
            self._made["dense"] = torch.cat([ctx, own], dim=-1)[:, None]
        return self._made["dense"]

    def mask_mod(self) -> Callable[[Any, Any, Any, Any], Any]:
        return packed_mask_mod(self.anchors, self.real, self.block_size)

    def block_mask(self, compiled: bool = True) -> Any:
        """flex_attention's block mask of this batch (heads broadcast), built on first use."""
        if ("block", compiled) not in self._made:
            from torch.nn.attention.flex_attention import create_block_mask

            B, T, Q = self.anchors.shape[0], self.context_length, self.slots
            self._made["block", compiled] = create_block_mask(
                self.mask_mod(), B, None, Q, T + Q, device=str(self.anchors.device), _compile=compiled
            )
        return self._made["block", compiled]


def packed_mask_mod(anchors: torch.Tensor, real: torch.Tensor, block_size: int) -> Callable[[Any, Any, Any, Any], Any]:
    """flex_attention's mask_mod over the keys [context (T); block slots (A*G)]: slot q sees context key kv < T
    when kv is before its block's anchor and a real token, and block key kv >= T when both are in one block."""
    T, G = real.shape[1], block_size
    row_anchor = anchors.repeat_interleave(G, dim=1)  # [B, A*G]: each slot's anchor
    # real tokens padded over the block keys, so that indexing with any key index stays in bounds
    real_keys = torch.cat([real, real.new_zeros(real.shape[0], anchors.shape[1] * G)], dim=1)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        context = (kv_idx < T) & (kv_idx < row_anchor[b, q_idx]) & real_keys[b, kv_idx]
        own = (kv_idx >= T) & ((kv_idx - T) // G == q_idx // G)
        return context | own

    return mask_mod


def packed_block_attention(
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    packed: PackedBlocks,
    scale: float,
) -> torch.Tensor:
    """Attention of the packed block slots q [B, heads, A*G, d] over the context keys/values ctx_k/ctx_v
    [B, kv_heads, T, d] and the slots' own keys/values blk_k/blk_v [B, kv_heads, A*G, d], as `packed` says.
    Returns [B, heads, A*G, d] in q's dtype. The path: `selected_impl` (drafters/ttt_attention.py)."""
    impl = selected_impl(q)
    if impl == "flex":
        return flex_packed_attention(q, ctx_k, ctx_v, blk_k, blk_v, packed, scale)
    if impl == "reference":
        return packed_attention_reference(q, ctx_k, ctx_v, blk_k, blk_v, packed, scale)
    return chunked_packed_attention(q, ctx_k, ctx_v, blk_k, blk_v, packed, scale)


def packed_attention_reference(q, ctx_k, ctx_v, blk_k, blk_v, packed: PackedBlocks, scale: float) -> torch.Tensor:
    """The dense formulation: SDPA over every key [context; all blocks] with the [B, 1, A*G, T + A*G] mask."""
    groups = q.shape[1] // ctx_k.shape[1]
    keys = repeat_kv(torch.cat([ctx_k, blk_k], dim=2), groups)
    values = repeat_kv(torch.cat([ctx_v, blk_v], dim=2), groups)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=packed.dense_mask(), scale=scale)


def default_anchor_chunk(batch: int, heads: int, block: int, length: int, anchors: int) -> int:
    """Anchors per chunk of the chunked path: as many as keep one chunk's context scores (B x heads x chunk x G
    x T) at ttt_attention.CHUNK_ELEMENTS (at least 1, at most A)."""
    per_anchor = max(1, batch * heads * block * length)
    return max(1, min(anchors, ttt_attention.CHUNK_ELEMENTS // per_anchor))


def _packed_scores(
    qc: torch.Tensor,
    ctx_k: torch.Tensor,
    kb: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of one chunk of c anchors, all tensors in the accumulation dtype: qc [B, kv, g, c, G, d] against
    the context keys ctx_k [B, kv, T, d] where `seen` [B, c, T] allows (else -inf), [B, kv, g, c, G, T]; and
    against its own blocks' keys kb [B, kv, c, G, d], [B, kv, g, c, G, G]."""
    B, kv, g, c, G, d = qc.shape
    T = ctx_k.shape[2]
    context = torch.matmul(qc.reshape(B, kv, g * c * G, d), ctx_k.transpose(-1, -2)).view(B, kv, g, c, G, T)
    context = (context * scale).masked_fill(~seen[:, None, None, :, None, :], -math.inf)
    own = torch.einsum("bkgcid,bkcjd->bkgcij", qc, kb) * scale  # a row always sees its own block: never all -inf
    return context, own


class ChunkedPackedAttention(torch.autograd.Function):
    """Exact packed block attention, anchors in chunks, fp32 (or wider) throughout; backward recomputes each
    chunk's probabilities from the saved log-sum-exp (drafters/ttt_attention.py's ChunkedTTTAttention, with
    the own-block keys in place of the TTT diagonal)."""

    @staticmethod
    def forward(ctx: Any, q, ctx_k, ctx_v, blk_k, blk_v, anchors, real, scale: float, block: int, chunk: int):
        B, heads, Q, d = q.shape
        kv, G, T = ctx_k.shape[1], block, ctx_k.shape[2]
        g, A = heads // kv, Q // G
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.empty(B, kv, g, Q, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, kv, g, Q, dtype=acc, device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            qa = q.to(acc).view(B, kv, g, A, G, d)
            cka, cva = ctx_k.to(acc), ctx_v.to(acc)
            bka, bva = blk_k.to(acc).view(B, kv, A, G, d), blk_v.to(acc).view(B, kv, A, G, d)
            for a0 in range(0, A, chunk):
                a1 = min(A, a0 + chunk)
                c = a1 - a0
                seen = _context_seen(anchors[:, a0:a1], real)
                context, own = _packed_scores(qa[:, :, :, a0:a1], cka, bka[:, :, a0:a1], seen, scale)
                row = torch.logaddexp(torch.logsumexp(context, -1), torch.logsumexp(own, -1))  # [B, kv, g, c, G]
                pc, po = (context - row[..., None]).exp(), (own - row[..., None]).exp()
                mixed = torch.matmul(pc.view(B, kv, g * c * G, T), cva).view(B, kv, g, c, G, d)
                mixed = mixed + torch.einsum("bkgcij,bkcjd->bkgcid", po, bva[:, :, a0:a1])
                out[:, :, :, a0 * G : a1 * G] = mixed.reshape(B, kv, g, c * G, d)
                lse[:, :, :, a0 * G : a1 * G] = row.reshape(B, kv, g, c * G)
        ctx.scale, ctx.block, ctx.chunk = scale, block, chunk
        ctx.save_for_backward(q, ctx_k, ctx_v, blk_k, blk_v, anchors, real, lse)
        return out.view(B, heads, Q, d)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, ctx_k, ctx_v, blk_k, blk_v, anchors, real, lse = ctx.saved_tensors
        scale, G, chunk = ctx.scale, ctx.block, ctx.chunk
        B, heads, Q, d = q.shape
        kv, T = ctx_k.shape[1], ctx_k.shape[2]
        g, A = heads // kv, Q // G
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            qa = q.to(acc).view(B, kv, g, A, G, d)
            do = grad_out.to(acc).reshape(B, kv, g, A, G, d)
            cka, cva = ctx_k.to(acc), ctx_v.to(acc)
            bka, bva = blk_k.to(acc).view(B, kv, A, G, d), blk_v.to(acc).view(B, kv, A, G, d)
            lse = lse.view(B, kv, g, A, G)
            dq = torch.empty_like(qa)
            dck, dcv = torch.zeros_like(cka), torch.zeros_like(cva)
            dbk, dbv = torch.empty_like(bka), torch.empty_like(bva)
            for a0 in range(0, A, chunk):
                a1 = min(A, a0 + chunk)
                c = a1 - a0
                qc, doc, kb, vb = qa[:, :, :, a0:a1], do[:, :, :, a0:a1], bka[:, :, a0:a1], bva[:, :, a0:a1]
                seen = _context_seen(anchors[:, a0:a1], real)
                context, own = _packed_scores(qc, cka, kb, seen, scale)
                row = lse[:, :, :, a0:a1, :, None]
                pc, po = (context - row).exp(), (own - row).exp()
                pc_rows, do_rows = pc.view(B, kv, g * c * G, T), doc.reshape(B, kv, g * c * G, d)
                dcv += torch.matmul(pc_rows.transpose(-1, -2), do_rows)
                dbv[:, :, a0:a1] = torch.einsum("bkgcij,bkgcid->bkcjd", po, doc)
                dpc = torch.matmul(do_rows, cva.transpose(-1, -2)).view_as(pc)
                dpo = torch.einsum("bkgcid,bkcjd->bkgcij", doc, vb)
                # softmax backward over both key sets: dS = P * (dP - sum_k P_k dP_k)
                total = (pc * dpc).sum(-1, keepdim=True) + (po * dpo).sum(-1, keepdim=True)
                dsc, dso = pc * (dpc - total) * scale, po * (dpo - total) * scale
                dsc_rows = dsc.view(B, kv, g * c * G, T)
                dq[:, :, :, a0:a1] = torch.matmul(dsc_rows, cka).view_as(qc) + torch.einsum(
                    "bkgcij,bkcjd->bkgcid", dso, kb
                )
                dck += torch.matmul(dsc_rows.transpose(-1, -2), qc.reshape(B, kv, g * c * G, d))
                dbk[:, :, a0:a1] = torch.einsum("bkgcij,bkgcid->bkcjd", dso, qc)
        return (
            dq.view(q.shape).to(q.dtype),
            dck.to(ctx_k.dtype),
            dcv.to(ctx_v.dtype),
            dbk.view(blk_k.shape).to(blk_k.dtype),
            dbv.view(blk_v.shape).to(blk_v.dtype),
            *([None] * 5),
        )


def _context_seen(anchors: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, c, T]: context key t is visible to the slots of anchor a when t < anchors[:, a] and real[:, t]."""
    keys = torch.arange(real.shape[1], device=anchors.device)
    return (keys < anchors[..., None]) & real[:, None, :]


def chunked_packed_attention(
    q, ctx_k, ctx_v, blk_k, blk_v, packed: PackedBlocks, scale: float, chunk: int | None = None
) -> torch.Tensor:
    """Packed block attention in chunks of anchors (`default_anchor_chunk` unless given): exact, memory linear in
    A and T (plus one chunk's O(chunk x G x T) temporaries), no repeated K/V for GQA."""
    B, heads, Q, _ = q.shape
    G, T = packed.block_size, packed.context_length
    if heads % ctx_k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {ctx_k.shape[1]} kv heads")
    if Q != packed.slots or ctx_k.shape[2] != T or blk_k.shape[2] != Q:
        raise ValueError(f"{Q} slots and {ctx_k.shape[2]} context keys do not fit {packed.slots} slots over {T}")
    A = Q // G
    chunk = chunk or default_anchor_chunk(B, heads, G, T, A)
    real = packed.real.bool()
    out = ChunkedPackedAttention.apply(q, ctx_k, ctx_v, blk_k, blk_v, packed.anchors, real, scale, G, chunk)
    assert isinstance(out, torch.Tensor)
    return out


def flex_packed_attention(
    q, ctx_k, ctx_v, blk_k, blk_v, packed: PackedBlocks, scale: float, compiled: bool = True
) -> torch.Tensor:
    """Packed block attention as one flex_attention call (GQA native) over the keys [context; blocks], with this
    batch's block mask (`PackedBlocks.block_mask`). `compiled=False` runs flex_attention eagerly (dense: for
    tests of the mask on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    keys, values = torch.cat([ctx_k, blk_k], dim=2), torch.cat([ctx_v, blk_v], dim=2)
    attend = cast(Callable[..., Any], ttt_attention._compiled_flex() if compiled else flex_attention)
    groups = q.shape[1] // ctx_k.shape[1]
    out = attend(q, keys, values, block_mask=packed.block_mask(compiled), scale=scale, enable_gqa=groups > 1)
    assert isinstance(out, torch.Tensor)
    return out


# ------------------------------------------------------------------------------------------------ modules


class DSparkAttention(nn.Module):
    """Attention whose keys/values are [context (from target features) ; block (from the layer input)].
    q/k are RMS-normalized per head before RoPE (Qwen3-style, as the speculators DFlash backbone does)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        H, self.heads, self.kv_heads, self.head_dim = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, kv_heads, T, d] of inputs x [B, T, H]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor | PackedBlocks | None):
        """mask: the packed training forward's PackedBlocks, or inference's boolean mask over [context; block]
        (None: everything visible)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        scale = 1.0 / math.sqrt(self.head_dim)
        if isinstance(mask, PackedBlocks):
            out = packed_block_attention(q, ctx_k, ctx_v, k, v, mask, scale)
        else:
            groups = self.heads // self.kv_heads
            keys = repeat_kv(torch.cat([ctx_k, k], dim=2), groups)
            values = repeat_kv(torch.cat([ctx_v, v], dim=2), groups)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.layer_config())

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """The sequential bias W1[x] W2: W1 indexes the target vocabulary, W2 maps rank -> draft vocab."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)

    def forward(self, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(prev_emb)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DrafterBase):
    name = "dspark"
    config_class = DSparkConfig
    config: DSparkConfig

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DSparkLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's head rows of the draft vocab, frozen
        self.markov_head = (
            MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank) if cfg.markov_rank > 0 else None
        )
        self.confidence_head = ConfidenceHead(H + cfg.markov_rank)
        self.rotary = LlamaRotaryEmbedding(cfg.layer_config())
        # fp32 RoPE frequencies outside the buffers, so casting the drafter to bf16 does not round them
        self._inv_freq = self.rotary.inv_freq.detach().float().clone()
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # ------------------------------------------------------------------------------------ building blocks

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Fused, normalized target features [B, T, H] (what every layer projects its context K/V from)."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self._rope(positions, ctx)
        # (an nn.ModuleList iterates as plain Modules; these are the DSparkLayers built in __init__)
        return [cast(DSparkLayer, layer).self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[..., γ] block token ids: the anchor, then MASK."""
        block = torch.full(
            (*anchor_tokens.shape, self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_tokens.device,
        )
        block[..., 0] = anchor_tokens
        return block

    def backbone(self, block_tokens, block_positions, ctx_kv, mask) -> torch.Tensor:
        """Normed hidden states [B, Q, H] of the block slots."""
        x = self.embed_tokens(block_tokens).to(self.fc.weight.dtype)
        cos, sin = self._rope(block_positions, x)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        return self.markov_head.markov_w1(prev_tokens) if self.markov_head is not None else None

    def heads(self, h: torch.Tensor, prev_tokens: torch.Tensor, base: torch.Tensor | None = None):
        """(biased logits, raw confidence logits) of slots with normed hidden h and previous tokens prev_tokens."""
        base = self.lm_head(h) if base is None else base
        prev = self.prev_embedding(prev_tokens)
        if prev is None or self.markov_head is None:  # (None together: prev comes from the Markov head)
            return base, self.confidence_head(h)
        prev = prev.to(h.dtype)
        return base + self.markov_head(prev), self.confidence_head(torch.cat([h, prev], dim=-1))

    # ----------------------------------------------------------------------------------------- training

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        anchors: torch.Tensor,
        sample_temperature: float | None = None,
        uniforms: torch.Tensor | None = None,
    ):
        """Packed training forward (what DDP / DeepSpeed wrap): every anchor's block in one pass.

        aux [B, T, F] target features, input_ids / attention_mask [B, T], anchors [B, A] positions (any value
        for padding anchors; their outputs are masked by the objective). Returns (logits [B, A, γ, D] with the
        sequential bias, confidence logits [B, A, γ], previous tokens [B, A, γ]).

        The bias is teacher-forced (slot k conditions on the data token x_{p+k}) unless `sample_temperature`
        is given: then slot k >= 1 conditions on a token sampled from slot k-1's own biased distribution (greedy at
        0), the training-time test of the sequential head. At a temperature above 0, slot k's token is drawn at the
        uniform `uniforms[b, a, k]` (in [0, 1), [B, A, γ], any device): the caller owns the randomness, so a draw
        depends on the sequence and not on the batch, the rank or the global generator's state.
        """
        B, T = input_ids.shape
        A, G = anchors.shape[1], self.config.block_size
        device = input_ids.device
        ctx = self.context(aux)
        ctx_kv = self.context_kv(ctx, torch.arange(T, device=device).expand(B, T))
        block_tokens = self.block_inputs(input_ids.gather(1, anchors)).view(B, A * G)
        offsets = torch.arange(G, device=device)
        positions = (anchors[..., None] + offsets).view(B, A * G)
        # block (a, k) sees context positions < anchor a (and real tokens only), and all of block a
        packed = PackedBlocks(anchors, attention_mask.bool(), G)
        h = self.backbone(block_tokens, positions, ctx_kv, packed).view(B, A, G, -1)
        base = self.lm_head(h)
        if sample_temperature is None:
            prev = input_ids.gather(1, positions.clamp_max(T - 1)).view(B, A, G)
            logits, conf = self.heads(h, prev, base)
            return logits, conf, prev
        # training-time test of the sequential bias: left to right, each slot conditioned on the previous sample
        if sample_temperature > 0 and (uniforms is None or uniforms.shape != (B, A, G)):
            got = None if uniforms is None else tuple(uniforms.shape)
            raise ValueError(f"sampling at T = {sample_temperature} needs uniforms of shape {(B, A, G)}, got {got}")
        u = None if uniforms is None else uniforms.to(device)
        draft_ids = torch.arange(self.config.draft_vocab_size, device=device) + self.d2t
        prev_k = block_tokens.view(B, A, G)[..., 0]
        outs, confs, prevs = [], [], []
        for k in range(G):
            logits_k, conf_k = self.heads(h[:, :, k], prev_k, base[:, :, k])
            outs.append(logits_k)
            confs.append(conf_k)
            prevs.append(prev_k)
            with torch.no_grad():
                if sample_temperature == 0:
                    choice = logits_k.argmax(-1)
                else:
                    probs = torch.softmax(logits_k.float() / sample_temperature, dim=-1)
                    choice = inverse_cdf(probs, cast(torch.Tensor, u)[:, :, k])
                prev_k = draft_ids[choice]
        return torch.stack(outs, 2), torch.stack(confs, 2), torch.stack(prevs, 2)

    # ---------------------------------------------------------------------------------------- inference

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    @torch.no_grad()
    def extend_context(self, cache: KVCache, aux: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the context keys/values of newly verified positions (aux [B, n, F], positions [B, n])."""
        for i, (k, v) in enumerate(self.context_kv(self.context(aux), positions)):
            cache.append(i, k, v)

    @torch.no_grad()
    def draft_block(
        self,
        cache: KVCache,
        anchor_tokens: torch.Tensor,
        anchor_positions: torch.Tensor,
        context_mask: torch.Tensor | None = None,
    ):
        """One backbone pass for blocks anchored after the cached context. anchor_tokens / anchor_positions [B];
        context_mask [B, cached] marks the context slots each row may see (batched decoding keeps padding and
        unverified slots as masked holes; None: all). Returns (normed hidden [B, γ, H], unbiased logits
        [B, γ, D]); the bias is added slot by slot as tokens are sampled (`heads`)."""
        G = self.config.block_size
        block = self.block_inputs(anchor_tokens)
        positions = anchor_positions[:, None] + torch.arange(G, device=anchor_tokens.device)
        c = self.config
        empty = torch.zeros(
            len(anchor_tokens),
            c.num_key_value_heads,
            0,
            c.head_dim,
            dtype=self.fc.weight.dtype,
            device=anchor_tokens.device,
        )
        ctx_kv = [
            (cache.k[i], cache.v[i]) if cache.k[i] is not None else (empty, empty) for i in range(len(self.layers))
        ]
        mask = None
        if context_mask is not None:
            if context_mask.shape != (len(anchor_tokens), cache.length()):
                raise ValueError(
                    f"context_mask has shape {tuple(context_mask.shape)}, expected "
                    f"{(len(anchor_tokens), cache.length())} (rows x cached context slots)"
                )
            whole_block = torch.ones(len(anchor_tokens), G, dtype=torch.bool, device=context_mask.device)
            mask = torch.cat([context_mask, whole_block], dim=1)[:, None, None, :].to(anchor_tokens.device)
        h = self.backbone(block, positions, ctx_kv, mask)
        return h, self.lm_head(h)

    # ------------------------------------------------------------------------------------ construction

    @classmethod
    def from_target(
        cls,
        target_config,
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        embed_weight: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        head_weight: torch.Tensor,
        **overrides,
    ) -> DSparkDrafter:
        """A drafter shaped like the target's layers (overridable), with the target's embedding and the draft-vocab
        rows of its LM head copied in."""
        fields = {
            **target_shape_fields(target_config, aux_layer_ids, draft_vocab_size),
            "mask_token_id": target_config.vocab_size - 1,
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if fields["hidden_size"] != target_config.hidden_size:
            raise ValueError(
                "the drafter shares the target's (frozen) embedding and head, so its hidden size must equal the target's"
            )
        if not 0 <= fields["mask_token_id"] < target_config.vocab_size:
            raise ValueError(
                f"mask_token_id {fields['mask_token_id']} is outside the target vocabulary (0..{target_config.vocab_size - 1})"
            )
        model = cls(DSparkConfig(**fields))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_weight)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
            ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t
            model.lm_head.weight.copy_(
                head_weight.detach().to(model.lm_head.weight.device, torch.float32)[ids.to(head_weight.device)]
            )
        return model
