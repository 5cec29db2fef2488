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

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.drafters.common import DrafterBase, DrafterConfigMixin, target_shape_fields
from draftsmith.drafters.eagle3 import KVCache, repeat_kv


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
    extra: dict[str, Any] = field(default_factory=dict)
    """Target config fields kept for export (e.g. rope scaling)."""


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, heads, T, d] with cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


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

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: torch.Tensor | None):
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        groups = self.heads // self.kv_heads
        keys = repeat_kv(torch.cat([ctx_k, k], dim=2), groups)
        values = repeat_kv(torch.cat([ctx_v, v], dim=2), groups)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
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
        generator: torch.Generator | None = None,
    ):
        """Packed training forward (what DDP / DeepSpeed wrap): every anchor's block in one pass.

        aux [B, T, F] target features, input_ids / attention_mask [B, T], anchors [B, A] positions (any value
        for padding anchors; their outputs are masked by the objective). Returns (logits [B, A, γ, D] with the
        sequential bias, confidence logits [B, A, γ], previous tokens [B, A, γ]).

        The bias is teacher-forced (slot k conditions on the data token x_{p+k}) unless `sample_temperature`
        is given: then slot k >= 1 conditions on a token sampled from slot k-1's own biased distribution (greedy at
        0), the training-time test of the sequential head.
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
        ctx_mask = (torch.arange(T, device=device)[None, None, :] < anchors[..., None]) & attention_mask.bool()[
            :, None, :
        ]
        ctx_mask = ctx_mask.repeat_interleave(G, dim=1)  # [B, A*G, T]
        blocks = torch.arange(A, device=device).repeat_interleave(G)
        blk_mask = (blocks[:, None] == blocks[None, :]).expand(B, A * G, A * G)
        mask = torch.cat([ctx_mask, blk_mask], dim=-1)[:, None]
        h = self.backbone(block_tokens, positions, ctx_kv, mask).view(B, A, G, -1)
        base = self.lm_head(h)
        if sample_temperature is None:
            prev = input_ids.gather(1, positions.clamp_max(T - 1)).view(B, A, G)
            logits, conf = self.heads(h, prev, base)
            return logits, conf, prev
        # training-time test of the sequential bias: left to right, each slot conditioned on the previous sample
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
                    probs = torch.softmax(logits_k.float() / sample_temperature, dim=-1).view(-1, logits_k.shape[-1])
                    choice = torch.multinomial(probs, 1, generator=generator).view(B, A)
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
