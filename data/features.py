"""Target feature capture and the batching shared by the offline store and the online source.

Aux layer ids are HF `output_hidden_states` indices: with decoder layers 0..L-1, index 0 is
the input of layer 0 (the embeddings), index i < L the input of layer i, and index L the final normed
output. They are captured with forward pre-hooks on the decoder layers, which is exactly that definition
and keeps only the requested layers alive; the final normed state is the base model's output. The
full-vocabulary `lm_head` is never run here: the teacher distribution is recomputed from the final state.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class FeatureError(ValueError):
    """Bad feature-capture settings (e.g. aux layer ids out of range)."""


def decoder_of(model):
    """The base decoder (embeddings + layers + final norm) of a *ForCausalLM model."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise FeatureError(f"{type(model).__name__}: no `layers`/`norm` on its decoder; unsupported architecture")
    return base


def default_aux_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: low, middle and high layers, `[2, L//2, L-3]` (vLLM's numbering)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 0:
        raise FeatureError(
            f"the EAGLE-3 default aux layers [2, L//2, L-3] are not three distinct layers for L={num_layers}; "
            f"set collect.aux_layer_ids"
        )
    return ids


def resolve_aux_ids(aux_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    ids = list(aux_ids) if aux_ids is not None else default_aux_ids(num_layers)
    if not ids:
        raise FeatureError("collect.aux_layer_ids is empty")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise FeatureError(
            f"collect.aux_layer_ids {bad} out of range: valid HF hidden_states indices are 0..{num_layers}"
        )
    if len(set(ids)) != len(ids):
        raise FeatureError(f"collect.aux_layer_ids {ids} has duplicates")
    if ids != sorted(ids):  # the engines concatenate captured layers in ascending layer order
        raise FeatureError(
            f"collect.aux_layer_ids {ids} must be ascending (serving engines concatenate in layer order)"
        )
    return ids


class AuxHooks:
    """Context manager that records the hidden states at `aux_ids` during any forward of the model's decoder
    (index i < L: the input of layer i, via a pre-hook; index L: the final norm's output)."""

    def __init__(self, base, aux_ids: Sequence[int]):
        self.base, self.aux_ids = base, list(aux_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> dict[int, torch.Tensor]:
        L = len(self.base.layers)
        for i in self.aux_ids:
            if i < L:

                def hook(_module, args, kwargs, i=i):
                    self.captured[i] = args[0] if args else kwargs["hidden_states"]

                self._handles.append(self.base.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(
                    self.base.norm.register_forward_hook(lambda _m, _a, out, i=i: self.captured.__setitem__(i, out))
                )
        return self.captured

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def concat(self) -> torch.Tensor:
        # with model.device_map the layers live on different GPUs; gather onto the first captured one
        first = self.captured[self.aux_ids[0]].device
        return torch.cat([self.captured[i].to(first) for i in self.aux_ids], dim=-1)


class FeatureCapture:
    """Runs the target's decoder once and returns (aux, final): aux = the concatenated hidden states at
    `aux_ids` [B, T, n_aux*H], final = the last normed hidden state [B, T, H]."""

    def __init__(self, model, aux_ids: Sequence[int] | None):
        self.model = model
        self.base = decoder_of(model)
        self.num_layers = len(self.base.layers)
        self.aux_ids = resolve_aux_ids(aux_ids, self.num_layers)
        self.hidden_size = model.config.hidden_size

    @torch.no_grad()  # not inference_mode: online training feeds these tensors into autograd
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hooks = AuxHooks(self.base, self.aux_ids)
        with hooks:
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return hooks.concat(), out.last_hidden_state


# ------------------------------------------------------------------------------------------- batching


def length_batches(lengths: Sequence[int], batch_tokens: int, shuffle: bool = False, seed: int = 0) -> list[list[int]]:
    """Group sample indices into batches of similar length whose padded size (B x max_len) stays within
    `batch_tokens` (a longer sample gets a batch of its own). With `shuffle`, ties are broken and batch
    order is drawn from `seed`, so each epoch sees different batches."""
    rng = random.Random(seed)
    keys = [(n, rng.random() if shuffle else 0.0, i) for i, n in enumerate(lengths)]
    batches: list[list[int]] = []
    current: list[int] = []
    for n, _, i in sorted(keys):
        if current and (len(current) + 1) * n > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def shard_for_rank(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """Rank r's batches (r, r+W, ...), the same number on every rank so data-parallel steps stay in lockstep."""
    usable = len(batches) // world * world
    if usable < len(batches) and rank == 0:
        log.info(
            "data-parallel: %d of %d batches left out this epoch so %d ranks get equal counts",
            len(batches) - usable,
            len(batches),
            world,
        )
    return batches[rank:usable:world]


def right_pad(seqs: Sequence[torch.Tensor], value=0) -> torch.Tensor:
    """[B, T, ...] from B tensors of shape [T_b, ...], padded at the end (causal models never look right)."""
    width = max(s.shape[0] for s in seqs)
    out = seqs[0].new_full((len(seqs), width, *seqs[0].shape[1:]), value)
    for b, s in enumerate(seqs):
        out[b, : s.shape[0]] = s
    return out


class FeatureSource(Protocol):
    """What `train` reads: the offline store and the online source both implement it."""

    lengths: list[int]
    meta: list[dict[str, Any]]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def load_batch(self, indices: Sequence[int]) -> dict[str, Any]: ...


def plan_batches(
    source: FeatureSource,
    batch_tokens: int,
    split: str | None = "train",
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world: int = 1,
    shuffle: bool = True,
) -> list[list[int]]:
    """This rank's batches (lists of sample indices) of one epoch: length-bucketed within `batch_tokens`,
    reshuffled per (seed, epoch), sharded across data-parallel ranks. Cheap: no features are read."""
    pool = [i for i, m in enumerate(source.meta) if split is None or m["split"] == split]
    batches = length_batches([source.lengths[i] for i in pool], batch_tokens, shuffle, seed * 100_003 + epoch)
    return [[pool[j] for j in b] for b in shard_for_rank(batches, rank, world)]


def iterate_batches(
    source: FeatureSource,
    batch_tokens: int,
    split: str | None = "train",
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world: int = 1,
    shuffle: bool = True,
) -> Iterator[dict[str, Any]]:
    """The padded batches of `plan_batches`, loaded one at a time."""
    for indices in plan_batches(source, batch_tokens, split, seed, epoch, rank, world, shuffle):
        yield source.load_batch(indices)


class OnlineFeatureSource:
    """Features computed by the target inside the training process (no disk), batch by batch.

    `records` are tokenized conversation records (prepare/generate rows). Padded positions are zeroed so a
    batch is the same tensor the offline store would give for the same samples.
    """

    def __init__(self, model, records: Sequence[dict[str, Any]], aux_ids: Sequence[int] | None):
        self.capture = FeatureCapture(model, aux_ids)
        self.aux_ids = self.capture.aux_ids
        self.records = [r for r in records if r["num_supervised"] > 0]
        self.lengths = [r["num_tokens"] for r in self.records]
        self.meta = [{"id": r["id"], "domain": r["domain"], "split": r["split"]} for r in self.records]

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of sample i, without running the target."""
        return torch.tensor(self.records[i]["input_ids"]), torch.tensor(self.records[i]["loss_mask"], dtype=torch.uint8)

    def load_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        device = next(self.capture.model.parameters()).device
        ids = right_pad([torch.tensor(self.records[i]["input_ids"], dtype=torch.long) for i in indices])
        mask = right_pad([torch.tensor(self.records[i]["loss_mask"], dtype=torch.uint8) for i in indices])
        valid = right_pad([torch.ones(self.lengths[i], dtype=torch.bool) for i in indices], False)
        aux, final = self.capture(ids.to(device))
        keep = valid.to(device).unsqueeze(-1)
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "attention_mask": valid,
            "aux": torch.where(keep, aux, 0),
            "final": torch.where(keep, final, 0),
            "ids": [self.meta[i]["id"] for i in indices],
            "domains": [self.meta[i]["domain"] for i in indices],
        }
