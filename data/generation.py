"""On-policy generation backends: prompts (token ids) in, completions (token ids) out.

Two backends share one interface: `HFGenerator` (transformers `generate`, batched with left padding; CPU or
GPU) and `VLLMGenerator` (GPU nodes, in data/vllm_backend.py). Completions exclude the stop token and say
whether the model stopped by itself (`stop`) or hit the length limit (`length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_new_tokens: int = 512


@dataclass
class Completion:
    token_ids: list[int]
    """Generated ids, without the stop token."""
    finish_reason: str
    """`stop` (a stop token ended it) or `length` (max_new_tokens reached)."""


class Generator(Protocol):
    name: str

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int) -> list[Completion]: ...


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> Completion:
    stops = set(stop_ids)
    for j, t in enumerate(ids):
        if t in stops:
            return Completion(list(ids[:j]), "stop")
    return Completion(list(ids), "length")


class HFGenerator:
    """Batched `model.generate` with left padding. Prompts are sorted by length so batches pad little;
    results come back in input order."""

    name = "hf"

    def __init__(self, model, pad_id: int, stop_ids: Sequence[int], batch_size: int = 16, progress: bool = False):
        self.model = model
        self.pad_id = pad_id
        self.stop_ids = list(stop_ids)
        self.batch_size = batch_size
        self.progress = progress

    def _config(self, sampling: Sampling):
        from transformers import GenerationConfig

        sample = sampling.temperature > 0
        return GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            top_k=(sampling.top_k or None) if sample else None,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int) -> list[Completion]:
        device = next(self.model.parameters()).device
        gen_config = self._config(sampling)
        torch.manual_seed(seed)  # seeds CPU and every CUDA device: a chunk re-run reproduces its samples
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="generate", unit="batch", leave=False, disable=not self.progress):
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                p = prompts[i]
                if len(p) == 0:
                    raise ValueError("empty prompt")
                ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config
            )
            for row, i in enumerate(batch):
                results[i] = cut_at_stop(out[row, width:].tolist(), self.stop_ids)
        return results  # type: ignore[return-value]
