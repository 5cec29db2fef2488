"""The target side of decoding: an HF causal LM with a KV cache, rollback, and aux-feature capture.

One `step` call is one target forward pass over the given new tokens (a prefill, a verification of a
drafted chain, or a plain decoding step); `rollback` trims the cache after rejected drafts.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from draftsmith.data.features import AuxHooks, decoder_of


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

    @torch.inference_mode()
    def step_tree(self, root: int, tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over the root (last committed token) and every tree node, with the tree attention mask and
        depth-based positions. Returns logits [1+N, V] and features [1+N, F]."""
        from draftsmith.eval.tree import tree_mask

        past = self.length
        # An additive float mask (0 = visible, dtype min = hidden): transformers hands a custom 4-D mask to the
        # kernel as it is, and the eager kernel *adds* it to the scores, so a boolean mask would hide nothing there.
        dtype = next(self.model.parameters()).dtype
        visible = tree_mask(tree, past)[None, None].to(self.device)
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill(~visible, torch.finfo(dtype).min)
        positions = torch.tensor([[past] + [past + d for d in tree.depths]], device=self.device)
        ids = torch.tensor([[root] + list(tree.tokens)], device=self.device)
        hooks = AuxHooks(self.base, self.aux_ids)
        with hooks:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kw: self.cache},
            )
        self.passes += 1
        return out.logits[0].float(), (hooks.concat()[0] if self.aux_ids else None)

    def keep_path(self, past: int, path: list[int]) -> None:
        """Gather the root and the accepted path's entries into consecutive cache slots after the context."""
        keep = torch.tensor(list(range(past + 1)) + [past + 1 + i for i in path], device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(2, keep)
            layer.values = layer.values.index_select(2, keep)

    def rollback(self, length: int) -> None:
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)  # negative = drop that many; transformers 5 refuses a positive length
