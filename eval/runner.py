"""The target side of decoding: an HF causal LM over a batch of rows, with a KV cache, aux-feature capture, and
the rule for what a round keeps.

Rows advance at different speeds, so a round appends the same number of slots to every row and each row keeps
some of them; the slots a row does not keep (left padding, rejected drafts, tree branches off the accepted path)
stay in the cache as *holes*: a 2-D key mask hides them and explicit position ids give each row its own true
positions, so every row computes exactly what it would alone. After each round the slots that are holes in every
row are removed (`compact`): with one row that is every hole, so a batch of one keeps a dense cache.

One `prefill`/`step` call is one target forward pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from draftsmith.data.features import AuxHooks, decoder_of


class HFTarget:
    def __init__(self, model, aux_ids: Sequence[int] | None = None, pad_id: int = 0):
        from transformers import DynamicCache

        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.aux_ids = list(aux_ids) if aux_ids else []
        self.base = decoder_of(model)
        self._cache_cls = DynamicCache
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.passes = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        hooks = AuxHooks(self.base, self.aux_ids)
        with hooks:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask,
                position_ids=positions.to(self.device),
                use_cache=True,
                **{self._cache_kw: self.cache},
            )
        self.passes += 1
        return out.logits.float(), (hooks.concat() if self.aux_ids else None)

    @property
    def length(self) -> int:
        """Slots in the cache (holes included)."""
        return self.key_mask.shape[1]

    @torch.no_grad()  # not inference_mode: the key mask is edited in place between passes
    def prefill(self, prompts: Sequence[Sequence[int]]):
        """Left-padded prefill. Returns (logits [B,P,V], feats [B,P,F] or None, valid [B,P])."""
        try:
            self.cache = self._cache_cls(config=self.model.config)
        except TypeError:  # older transformers
            self.cache = self._cache_cls()
        self.passes = 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(list(p))
            valid[b, width - len(p) :] = True
        self.key_mask = valid.to(self.device)
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.next_pos = torch.tensor([len(p) for p in prompts])
        logits, feats = self._forward(ids, positions, self.key_mask.long())
        return logits, feats, valid

    @torch.no_grad()
    def step(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        depths: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
    ):
        """One pass over n new slots per row (tokens [B,n], valid [B,n]); positions continue each row's own.

        Chains: slot j sits at position next_pos + j and sees the row's cache and the slots before it. Trees: slot j
        sits at next_pos + depths[b, j] and sees the row's cache and the slots `visible` [B,n,n] marks (its
        ancestors and itself), passed to the model as an additive 4-D mask (transformers hands a custom 4-D mask to
        the kernel as it is, and the eager kernel *adds* it to the scores, so a boolean one would hide nothing)."""
        self.key_mask = torch.cat([self.key_mask, valid.to(self.device)], dim=1)
        offsets = torch.arange(tokens.shape[1])[None, :] if depths is None else depths.cpu()
        positions = self.next_pos[:, None] + offsets
        if visible is None:
            return self._forward(tokens, positions, self.key_mask.long())
        B, n = tokens.shape
        past = self.length - n
        see = self.key_mask[:, None, :].expand(B, n, self.length).clone()
        see[:, :, past:] &= visible.to(self.device)
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(see.shape, dtype=dtype, device=self.device).masked_fill(~see, torch.finfo(dtype).min)
        return self._forward(tokens, positions, additive[:, None])

    def keep(self, b: int, n_new: int, kept: Sequence[int]) -> None:
        """Of the last `n_new` slots of row b, keep those at offsets `kept` (consecutive positions from the row's
        next position: a chain's first slots, or a tree's root and accepted path); the rest become holes."""
        start = self.length - n_new
        keep = torch.zeros(n_new, dtype=torch.bool, device=self.device)
        keep[list(kept)] = True
        self.key_mask[b, start:] &= keep
        self.next_pos[b] += len(kept)

    def compact(self) -> None:
        """Drop the cache slots that are holes in every row: a crop when they are all at the end (a batch of one's
        rejected drafts), a gather otherwise (a tree's branches)."""
        used = self.key_mask.any(0)
        if bool(used.all()):
            return
        keep = used.nonzero().squeeze(1)
        if int(keep[-1]) + 1 == len(keep):  # only trailing holes
            self.cache.crop(-(self.length - len(keep)))  # negative: remove that many (transformers 4.5x and 5)
        else:
            for layer in self.cache.layers:
                kv: Any = layer  # only attention layers hold per-slot keys/values (not linear-attention ones)
                if getattr(kv, "keys", None) is None or getattr(kv, "values", None) is None:
                    raise NotImplementedError(f"cannot drop cache slots of a {type(layer).__name__}")
                kv.keys = kv.keys.index_select(2, keep)
                kv.values = kv.values.index_select(2, keep)
        self.key_mask = self.key_mask[:, keep]
