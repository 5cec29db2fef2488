"""The target side of decoding: an HF causal LM with a KV cache, rollback, and aux-feature capture.

One `step` call is one target forward pass over the given new tokens (a prefill, a verification of a
drafted chain, or a plain decoding step); `rollback` trims the cache after rejected drafts.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from data.features import AuxHooks, decoder_of


class HFTarget:
    def __init__(self, model, aux_ids: Sequence[int] | None = None):
        from transformers import DynamicCache

        self.model = model
        self.device = next(model.parameters()).device
        self.aux_ids = list(aux_ids) if aux_ids else []
        self.base = decoder_of(model)
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache = None
        self.passes = 0

    def reset(self) -> None:
        try:
            self.cache = self._cache_cls(config=self.model.config)
        except TypeError:  # older transformers
            self.cache = self._cache_cls()
        self.passes = 0

    @property
    def length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] (float32) for n new tokens, and their aux features [n, n_aux*H] when asked for."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        hooks = AuxHooks(self.base, self.aux_ids)
        with hooks:
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: self.cache})
        self.passes += 1
        feats = hooks.concat()[0] if self.aux_ids else None
        return out.logits[0].float(), feats

    def rollback(self, length: int) -> None:
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)  # negative = drop that many; transformers 5 refuses a positive length
