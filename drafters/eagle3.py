"""EAGLE-3 drafter: architecture, the training-time-test (TTT) unroll, and cached step-by-step decoding.

Parameter names follow the checkpoints vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`, `embed_tokens`). Extra layers (num_layers > 1) are `layers.{i}` for i >= 1.

Positions: the drafter entry built from the target's features at token position t (and the embedding of
token t+1) sits at position t and predicts token t+2. TTT step i at slot t stands for inference position
t+i: its input is the step i-1 output at slot t (the drafter's own pre-norm hidden state) and token
t+1+i; it attends to the step-0 keys of slots 0..t (causal) and to the keys of steps 1..i at slot t
(the diagonal), exactly the keys a KV cache holds when the drafter runs autoregressively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.drafters.common import DrafterBase, DrafterConfigMixin, target_shape_fields
from draftsmith.drafters.ttt_attention import repeat_kv, ttt_attention


@dataclass
class Eagle3Config(DrafterConfigMixin):
    vocab_size: int
    """Target vocabulary size (embedding rows; engines read it as the target vocab)."""
    draft_vocab_size: int
    """Rows of `lm_head`."""
    hidden_size: int
    """Drafter hidden size."""
    target_hidden_size: int
    """Hidden size of the target's features (fc input is n_aux * this)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    aux_layer_ids: list[int]
    """HF hidden_states indices of the target features `fc` fuses (vLLM numbering)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_layers: int = 1
    """Decoder layers; the first takes the 2H-wide [embedding; hidden] input."""
    norm_before_residual: bool = False
    """Use hidden_norm(h) instead of h as the first residual (speculators option; vLLM/SGLang default False)."""
    hidden_act: str = "silu"
    confidence_hidden: int = 256
    """Width of the confidence head's hidden layer."""
    confidence_temperatures: list[float] | None = None
    """Per-step temperatures of the confidence logits fitted on held-out data (None: uncalibrated)."""
    confidence_biases: list[float] | None = None
    """Per-step biases added to the confidence logits after their temperature (None: 0)."""
    sampled_confidence_calibration: dict[str, dict[str, list[float]]] | None = None
    """Per sampling temperature served at (its decimal text, e.g. "1.0"), the per-step `temperatures` and `biases`
    fitted on the acceptance at that temperature (None: only the fields above, fitted at the training temperature)."""
    greedy_confidence_calibration: dict[str, dict[str, list[float]]] | None = None
    """The same, fitted on the acceptance of drafts taken as the drafter's argmax at that temperature (the target's
    probability of it: eval.draft_sample_method = greedy), per sampling temperature above 0 (None: not fitted)."""
    confidence_trained: bool = True
    """False for a drafter imported from an engine export that carried no confidence head (another trainer's, or one
    written before draftsmith exported the head): its head is freshly initialised, so eval drafts it at fixed γ."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Target config fields kept for export (e.g. rope scaling, bos/eos ids)."""


class KVCache:
    """Per-layer keys/values for cached decoding, with rollback (`crop`) after rejected drafts.
    Written here rather than using transformers' Cache classes because eval also needs to gather accepted
    tree branches into consecutive slots, which those classes do not do."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def length(self, layer: int = 0) -> int:
        k = self.k[layer]
        return 0 if k is None else k.shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a layer's keys and values are set together, so they are None together
        past_k, past_v = self.k[layer], self.v[layer]
        if past_k is not None and past_v is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k is not None and v is not None:
                self.k[i], self.v[i] = k[:, :, :length], v[:, :, :length]


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, input_size: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(input_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def ttt(self, x, cos, sin, past: list[tuple[torch.Tensor, torch.Tensor]]):
        """One TTT step over all slots. `past` holds (k, v) of steps 0..i-1; returns output and this step's (k, v).

        Step 0 is plain causal attention. Step i > 0: scores against step-0 keys (causal) and, per slot, against
        the same slot's keys of steps 1..i, normalized by one softmax over both (drafters/ttt_attention.py: exact,
        memory linear in T; the earlier steps' keys are passed as they are, never re-stacked or repeated for GQA).
        """
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if not past:
            groups = self.heads // self.kv_heads
            out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        else:
            diag_k = [kj for kj, _ in past[1:]] + [k]
            diag_v = [vj for _, vj in past[1:]] + [v]
            out = ttt_attention(q, past[0][0], past[0][1], diag_k, diag_v, 1.0 / math.sqrt(self.head_dim))
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        return self.o_proj(out), (k, v)

    def cached(
        self,
        x,
        cos,
        sin,
        cache: KVCache,
        layer: int,
        key_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ):
        """Causal attention of new entries over the cache plus themselves (inference). `key_mask` [B, total]
        marks valid cache slots (batched decoding leaves padding and rejected drafts as masked holes)."""
        B, n, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        past_len = cache.length(layer)
        keys, values = cache.append(layer, k, v)
        groups = self.heads // self.kv_heads
        total = past_len + n
        mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(diagonal=past_len)
        if attn_mask is not None:  # tree drafting: each new entry sees the context and its own ancestors
            mask = attn_mask.to(x.device)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :]
            # a query whose every key is masked (padding) would give NaN; let it see itself instead
            own = torch.zeros(n, total, dtype=torch.bool, device=x.device)
            own[torch.arange(n), past_len + torch.arange(n)] = True
            mask = mask | (~mask.any(-1, keepdim=True) & own)
        out = F.scaled_dot_product_attention(q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.heads * self.head_dim))


class Eagle3Layer(nn.Module):
    """A Llama decoder layer; the first one takes cat(input_layernorm(embedding), hidden_norm(hidden))."""

    def __init__(self, cfg: Eagle3Config, first: bool):
        super().__init__()
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        lcfg = cfg.layer_config()
        width = 2 * cfg.hidden_size if first else cfg.hidden_size
        if first:
            self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, width)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(lcfg)

    def _attn_input(self, hidden, embeds):
        if self.first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), residual
        return self.input_layernorm(hidden), hidden

    def _mlp(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))

    def ttt(self, hidden, embeds, cos, sin, past):
        x, residual = self._attn_input(hidden, embeds)
        attn, kv = self.self_attn.ttt(x, cos, sin, past)
        return self._mlp(residual + attn), kv

    def cached(self, hidden, embeds, cos, sin, cache, layer, key_mask=None, attn_mask=None):
        x, residual = self._attn_input(hidden, embeds)
        return self._mlp(residual + self.self_attn.cached(x, cos, sin, cache, layer, key_mask, attn_mask))


class Eagle3Drafter(DrafterBase):
    name = "eagle3"
    config_class = Eagle3Config
    config: Eagle3Config

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target and frozen
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3Layer(cfg, first=True)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, first=False) for _ in range(cfg.num_layers - 1)])
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # confidence head: P(this drafted position is accepted | the previous ones were), from the normed
        # hidden state and the embedding of the token the position conditions on (a small MLP; serving
        # engines ignore it, draftsmith's eval uses it for adaptive verification)
        self.confidence = nn.Sequential(
            nn.Linear(2 * H, cfg.confidence_hidden), nn.SiLU(), nn.Linear(cfg.confidence_hidden, 1)
        )
        self.rotary = LlamaRotaryEmbedding(cfg.layer_config())
        # An fp32 copy outside the module's buffers: casting the drafter to bf16 must not round the RoPE
        # frequencies (a 0.1% frequency error shifts attention at long positions).
        self._inv_freq = self.rotary.inv_freq.detach().float().clone()
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    # ------------------------------------------------------------------------------------ building blocks

    def all_layers(self) -> list[Eagle3Layer]:
        return [self.midlayer, *self.layers]

    def heads(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocab logits, confidence logit) from pre-norm hidden states and the input tokens."""
        normed = self.norm(hidden)
        conf_in = torch.cat([normed.detach(), self.embed_tokens(tokens).detach()], dim=-1)
        return self.lm_head(normed), self.confidence(conf_in).squeeze(-1)

    # ----------------------------------------------------------------------------------------- training

    def forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, checkpoint: bool = False, heads_from: int = 0
    ):
        """The training forward (what DDP / DeepSpeed wrap): the TTT unroll."""
        return self.ttt_forward(aux, input_ids, steps, checkpoint, heads_from)

    def ttt_forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, checkpoint: bool = False, heads_from: int = 0
    ):
        """Unroll `steps` TTT steps. Returns, per step i, (logits [B,T',D], confidence logits [B,T']) of the slots
        t = heads_from..T-1 (T' = T - heads_from), where slot t predicts token t+2+i from input token t+1+i; slots
        whose input token is past the end see token 0. `heads_from` skips the vocabulary projection of slots no
        loss reads (a prompt every row of the batch starts with); the layers still run over every slot."""
        B, T = input_ids.shape
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        base = torch.arange(T, device=input_ids.device).unsqueeze(0)
        pasts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.all_layers()]
        outputs = []
        for i in range(steps):
            tokens = F.pad(input_ids[:, 1 + i :], (0, 1 + i), value=0)
            embeds = self.embed_tokens(tokens).to(hidden.dtype)
            cos, sin = self._rope(base + i, hidden)
            h = hidden
            for li, layer in enumerate(self.all_layers()):
                if checkpoint and self.training:
                    h, kv = torch.utils.checkpoint.checkpoint(
                        layer.ttt, h, embeds, cos, sin, list(pasts[li]), use_reentrant=False
                    )
                else:
                    h, kv = layer.ttt(h, embeds, cos, sin, pasts[li])
                pasts[li].append(kv)
            logits, conf = self.heads(h[:, heads_from:], tokens[:, heads_from:])
            outputs.append((logits, conf))
            hidden = h
        return outputs

    # ---------------------------------------------------------------------------------------- inference

    def new_cache(self) -> KVCache:
        return KVCache(len(self.all_layers()))

    @torch.no_grad()
    def decode(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        from_target: bool,
        key_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        heads_at: torch.Tensor | None = None,
    ):
        """Cached forward of n new entries. `hidden` is target aux features (from_target) or the drafter's own
        pre-norm output; `tokens` the next tokens; `key_mask` [B, cache+n] the valid slots (batched decoding).
        Returns (logits, confidence logits, pre-norm hidden [B, n, H]). With `heads_at` [B] (one slot per row), the
        logits and confidences are of that slot only ([B, 1, D], [B, 1]): catching up on many verified slots needs
        the heads of the last one, and the vocabulary projection of every slot would cost more than the layers."""
        h = self.fc(hidden.to(self.fc.weight.dtype)) if from_target else hidden
        embeds = self.embed_tokens(tokens).to(h.dtype)
        cos, sin = self._rope(positions, h)
        for li, layer in enumerate(self.all_layers()):
            h = layer.cached(h, embeds, cos, sin, cache, li, key_mask, attn_mask)
        if heads_at is None:
            logits, conf = self.heads(h, tokens)
        else:
            rows = torch.arange(h.shape[0], device=h.device)
            logits, conf = self.heads(h[rows, heads_at][:, None], tokens[rows, heads_at][:, None])
        return logits, conf, h

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
        num_layers: int = 1,
        head_weight: torch.Tensor | None = None,
        **overrides,
    ) -> Eagle3Drafter:
        """A drafter shaped like the target's layers (overridable), with the target's embedding copied in. With
        `head_weight` (the target's LM head [V, H]), `lm_head` starts from its draft-vocab rows (and stays
        trainable): with little data, a head learned from scratch is what limits acceptance."""
        fields = {**target_shape_fields(target_config, aux_layer_ids, draft_vocab_size), "num_layers": num_layers}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        if fields["hidden_size"] != target_config.hidden_size:
            raise ValueError(
                "the drafter shares the target's (frozen) embedding, so its hidden size must equal the target's"
            )
        model = cls(Eagle3Config(**fields))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_weight)
            model.d2t.copy_(d2t)
            model.t2d.copy_(t2d)
            if head_weight is not None:
                rows = (torch.arange(draft_vocab_size) + d2t).to(head_weight.device)
                model.lm_head.weight.copy_(head_weight.detach()[rows].to(model.lm_head.weight.dtype))
        return model
