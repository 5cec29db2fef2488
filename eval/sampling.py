"""Turning logits into the distribution a model samples from: temperature, top-k, top-p, applied the same
way to the target and the drafter (the verifier's exactness is about these processed distributions)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.drafters.losses import inverse_cdf


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def regime(self) -> str | tuple[float, float, int]:
        """The key a cost schedule keeps what it learns under (`CostSchedule.regime`): "greedy", or the temperature,
        top-p and top-k (top-p and top-k do not change greedy decoding)."""
        return "greedy" if self.greedy else (self.temperature, self.top_p, self.top_k)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] probabilities after temperature / top-k / top-p (float32 or wider)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def one_hot(tokens: Sequence[int], vocab: int, device) -> torch.Tensor:
    """[len(tokens), vocab]: deterministic (greedy) drafts as the proposal distribution q the verifier reads."""
    q = torch.zeros(len(tokens), vocab, device=device)
    q[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)] = 1.0
    return q


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` [V] (any non-negative weights), by inverting its cumulative sum at one uniform draw; the
    generator must live on the device of `probs` (see `make_generator`).

    Not torch.multinomial: on a CPU it took 1.03-1.29 ms for one draw over SmolLM2's 49,152 tokens (an AMD EPYC),
    2% of a target pass, paid by every sampled token of plain decoding and twice by a drafted slot (its draft and
    its verification); this takes 0.05-0.08 ms. The sum is in float64, and a token of weight 0 is never drawn: its
    interval of the cumulative sum is empty (adding 0 leaves the sum as it was), and the search takes the first
    token whose sum exceeds u * total. u < 1, so u * total < total in float64 (a product by a number below 1 rounds
    below the total): the search never runs past the last token."""
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device)
    return int(inverse_cdf(probs, u))


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw from `generator`, made on the generator's own device (a CUDA generator cannot fill a CPU
    tensor, nor a CPU generator a CUDA one)."""
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, device=device))


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator on `device`: torch.multinomial and torch.rand on CUDA tensors refuse a CPU generator."""
    return torch.Generator(device=device).manual_seed(seed)


def derive_seed(base: int, *tags) -> int:
    """A seed derived from `base` and tags (a chunk index, a prompt id and temperature, ...): stable across runs,
    processes and machines (unlike hash()), and different for different tags."""
    text = ":".join(str(t) for t in (base, *tags))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") & 0x7FFFFFFF
