"""Attention that reads a grouped-query target's key/value heads where they are, on the CPU.

Most targets share each key/value head among several query heads (grouped-query attention: SmolLM2-135M has 9 query
heads over 3 key/value heads, Llama 3 8B 32 over 8). transformers' `sdpa` attention, given a pass over more than one
new slot and a mask (a verify pass over the last committed token and its drafts; a left-padded batch's prefill),
first copies the key/value cache out to one head per query head (`repeat_kv`), then calls torch's kernel: CUDA's fast
kernels take no mask with grouped heads. So every layer of every wider pass copied the row's whole cache: on SmolLM2
in bf16 with 128 prompt tokens, that copy made a pass 2 slots wide cost 3.1 ms more than a plain one (36.6 against
39.7 ms on an Intel Xeon with AMX), against 1.9 ms without it, and it grows with the context (`launch/
bench_target_pass.py`). A plain pass (one slot) never copies: transformers folds its query heads onto the groups.

torch's CPU kernel takes grouped heads with a mask (`enable_gqa`, torch >= 2.5), so on the CPU a masked pass over
several slots goes to it with the heads as they are. It computes the same sums as over the copied heads (tests/eval/
test_cpu_attention.py). Every other call (a plain pass, no mask, no grouping, another device, a position bias or
softcap) goes to transformers' own function unchanged. Registered under `NAME` with transformers' attention and mask
interfaces (the way a model is given a custom attention function), with the `sdpa` mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "draftsmith_cpu_sdpa"

_transformers_sdpa: Any = None
"""transformers' own `sdpa` attention function, which every other call goes to: imported by `use_cpu_attention`, not
at import (transformers' attention and masking modules take ~1.8 s to import, and every CLI command imports
pipeline.target, which imports this module)."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, KV, k, D] (KV divides H)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    other = any(kwargs.get(k) is not None for k in ("position_bias", "softcap")) or kwargs.get("output_attentions")
    if attention_mask is None or query.shape[2] == 1 or not grouped or query.device.type != "cpu" or other:
        return _transformers_sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # a mask is given, so the pass is not `is_causal` (transformers' rule too): the mask says what each slot sees
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def supported() -> bool:
    """torch's SDPA takes grouped heads (`enable_gqa`) from 2.5 on."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.5"


def use_cpu_attention(model: Any) -> bool:
    """Make a model that uses transformers' `sdpa` attention use `grouped_sdpa` (`NAME`); returns whether it did. A
    model on another attention implementation (eager, flash, a user's choice in `model.attn_implementation`), or a
    torch without grouped SDPA, is left as it is."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not supported():
        return False
    global _transformers_sdpa
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    _transformers_sdpa = sdpa_attention_forward
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
