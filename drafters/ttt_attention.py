"""EAGLE-3's training-time-test attention for TTT steps i >= 1: exact, with memory linear in sequence length.

What it computes. Query t of step i (q [B, heads, T, d]) attends to two sets of keys:

- the step-0 keys k0/v0 [B, kv_heads, T, d] of slots 0..t (causal), and
- the keys of steps 1..i at its own slot t (the "diagonal": diag_k[j][:, :, t] for j = 0..i-1),

normalized by ONE softmax over both sets, computed in fp32 (or wider). These are exactly the keys a KV cache
holds when the drafter runs autoregressively (drafters/eagle3.py).

Why written by hand. Neither set is a standard attention pattern together with the other: the dense formulation
(`ttt_attention_reference`, the original code, kept as the reference) builds a [B, heads, T, T + i] score
matrix, and autograd keeps its probabilities for backward at every step, so memory is quadratic in T for every
step >= 1 (step 0 is plain causal SDPA, already memory-efficient). Two exact replacements:

- `chunked_ttt_attention` (CPU, and wherever flex_attention is missing): a `torch.autograd.Function` that walks
  the queries in chunks, flash-attention style. Its forward keeps q, the keys/values it was given (which the
  unroll holds anyway) and each row's log-sum-exp; its backward recomputes each chunk's
  probabilities. Peak memory is O(chunk x T) instead of O(T^2), and GQA needs no repeated keys/values (the
  query heads of one kv head are folded into the rows of one matmul).
- `flex_ttt_attention` (CUDA): `torch.nn.attention.flex_attention` over the keys [k0; diag_1; ...; diag_i]
  laid end to end, with a block mask whose mask_mod says which key each query sees (`ttt_mask_mod`); fused
  kernels, no score matrix.

`ttt_attention` chooses among them in one place (`selected_impl`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

IMPLS = ("auto", "flex", "chunked", "reference")
ENV_VAR = "DRAFTSMITH_TTT_ATTENTION"
CHUNK_ELEMENTS = 2**22
"""Score elements per query chunk of the chunked path (B x heads x chunk x T): 16 MiB per fp32 temporary."""

_forced: str | None = None


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, kv_heads * groups, T, d], each kv head repeated for its query heads (GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ------------------------------------------------------------------------------------------ choosing


@contextlib.contextmanager
def use_impl(name: str) -> Iterator[None]:
    """Force one implementation inside the block (tests and benchmarks); `auto` restores the automatic choice."""
    global _forced
    if name not in IMPLS:
        raise ValueError(f"TTT attention implementation must be one of {IMPLS}, got {name!r}")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


@functools.cache
def flex_available() -> bool:
    """Whether this torch has flex_attention (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def selected_impl(q: torch.Tensor) -> str:
    """The implementation a call with these queries uses: `use_impl`, else $DRAFTSMITH_TTT_ATTENTION, else flex on
    CUDA (when this torch has it) and the chunked path everywhere else."""
    name = _forced or os.environ.get(ENV_VAR, "auto")
    if name not in IMPLS:
        raise ValueError(f"{ENV_VAR} must be one of {IMPLS}, got {name!r}")
    if name != "auto":
        return name
    return "flex" if q.is_cuda and flex_available() else "chunked"


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: Sequence[torch.Tensor],
    diag_v: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """TTT attention of step i = len(diag_k) >= 1. q [B, heads, T, d]; k0, v0 the step-0 keys/values and diag_k,
    diag_v those of steps 1..i, each [B, kv_heads, T, d]. Returns [B, heads, T, d] in q's dtype."""
    if not diag_k or len(diag_k) != len(diag_v):
        raise ValueError("TTT attention needs the keys and values of steps 1..i (i >= 1), as many of each")
    impl = selected_impl(q)
    if impl == "flex":
        return flex_ttt_attention(q, k0, v0, diag_k, diag_v, scale)
    if impl == "reference":
        return ttt_attention_reference(q, k0, v0, diag_k, diag_v, scale)
    return chunked_ttt_attention(q, k0, v0, diag_k, diag_v, scale)


# ----------------------------------------------------------------------------------------- reference


def ttt_attention_reference(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: Sequence[torch.Tensor],
    diag_v: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """The dense formulation: a [B, heads, T, T] masked score matrix against step 0, the per-slot diagonal scores
    [B, heads, T, i], one softmax over their concatenation. Memory quadratic in T; the definition the other paths
    are tested against."""
    T = q.shape[2]
    groups = q.shape[1] // k0.shape[1]
    k0, v0 = repeat_kv(k0, groups), repeat_kv(v0, groups)
    keys = torch.stack([repeat_kv(k, groups) for k in diag_k], dim=3)  # [B, h, T, i, d]
    values = torch.stack([repeat_kv(v, groups) for v in diag_v], dim=3)
    causal = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    causal = causal.masked_fill(~mask, torch.finfo(causal.dtype).min)
    diag = torch.einsum("bhtd,bhtjd->bhtj", q, keys) * scale  # [B, h, T, i]
    scores = torch.cat([causal, diag], dim=-1)
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    return torch.matmul(probs[..., :T], v0) + torch.einsum("bhtj,bhtjd->bhtd", probs[..., T:], values)


# ------------------------------------------------------------------------------------------- chunked


def default_chunk(batch: int, heads: int, length: int) -> int:
    """Queries per chunk: as many as keep one chunk's score matrix at CHUNK_ELEMENTS (at least 1, at most T)."""
    return max(1, min(length, CHUNK_ELEMENTS // max(1, batch * heads * length)))


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, heads, T, d] -> [B, kv_heads, groups, T, d]: the query heads that share one kv head (a view where the
    strides allow; an incoming gradient may come with any strides)."""
    B, heads, T, d = x.shape
    return x.reshape(B, kv_heads, heads // kv_heads, T, d)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, kv, g, c, n] -> [B, kv, g * c, n]: a kv head's query heads as rows of one matmul (no repeated K/V)."""
    B, kv, g, c, n = x.shape
    return x.reshape(B, kv, g * c, n)


def _slots(xs: Sequence[torch.Tensor], start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots start..end-1 of each diagonal step's keys (or values), stacked: [B, kv, c, i, d]."""
    return torch.stack([x[:, :, start:end].to(dtype) for x in xs], dim=3)


def _chunk_scores(
    qc: torch.Tensor, k0: torch.Tensor, dk: torch.Tensor, start: int, scale: float, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the query chunk qc [B, kv, g, c, d] (slots start..start+c-1), in `acc`: against step-0 keys
    0..start+c-1, masked causally, [B, kv, g, c, start+c]; against its own diagonal keys dk, [B, kv, g, c, i].
    Keys past the chunk's last query are never read: no query of the chunk may see them."""
    B, kv, g, c, d = qc.shape
    end = start + c
    causal = torch.matmul(_rows(qc), k0[:, :, :end].transpose(-1, -2)).view(B, kv, g, c, end).to(acc) * scale
    seen = torch.arange(end, device=qc.device) <= torch.arange(start, end, device=qc.device)[:, None]
    causal = causal.masked_fill(~seen, -math.inf)  # every row sees key 0 at least, so no row is all -inf
    diag = torch.einsum("bkgcd,bkcjd->bkgcj", qc, dk).to(acc) * scale
    return causal, diag


class ChunkedTTTAttention(torch.autograd.Function):
    """Exact TTT attention, queries in chunks; backward recomputes each chunk's probabilities from the saved
    log-sum-exp (flash-attention's recipe with whole rows per chunk, so no running maximum is needed)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, scale: float, chunk: int, *diag):
        n = len(diag) // 2
        diag_k, diag_v = diag[:n], diag[n:]
        B, heads, T, d = q.shape
        kv = k0.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = _grouped(q, kv)
        out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(qg.shape[:-1], dtype=acc, device=q.device)  # [B, kv, g, T]
        # autocast must not re-cast inside: the matmuls run in the inputs' dtype, as the reference's do
        with torch.autocast(q.device.type, enabled=False):
            for start in range(0, T, chunk):
                end = min(T, start + chunk)
                qc = qg[:, :, :, start:end]
                causal, diag_s = _chunk_scores(qc, k0, _slots(diag_k, start, end, q.dtype), start, scale, acc)
                row = torch.logaddexp(torch.logsumexp(causal, -1), torch.logsumexp(diag_s, -1))
                pc = (causal - row[..., None]).exp().to(q.dtype)
                pd = (diag_s - row[..., None]).exp().to(q.dtype)
                mixed = torch.matmul(_rows(pc), v0[:, :, :end]).view_as(qc)
                out[:, :, :, start:end] = mixed + torch.einsum(
                    "bkgcj,bkcjd->bkgcd", pd, _slots(diag_v, start, end, q.dtype)
                )
                lse[:, :, :, start:end] = row
        ctx.scale, ctx.chunk, ctx.steps = scale, chunk, n
        ctx.save_for_backward(q, k0, v0, lse, *diag)  # not the output: backward needs only the probabilities
        return out.view(B, heads, T, d)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k0, v0, lse, *diag = ctx.saved_tensors
        n, scale, chunk = ctx.steps, ctx.scale, ctx.chunk
        diag_k, diag_v = diag[:n], diag[n:]
        T, kv = q.shape[2], k0.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            # the scores are recomputed exactly as the forward computed them (its lse belongs to those); every
            # other product, and the gradients of k0/v0 summed over the chunks, in `acc`
            qg, dog = _grouped(q, kv), _grouped(grad_out, kv).to(acc)
            k0a, v0a = k0.to(acc), v0.to(acc)
            dq = torch.empty(qg.shape, dtype=acc, device=q.device)
            dk0, dv0 = k0a.new_zeros(k0.shape), v0a.new_zeros(v0.shape)
            dks = [k0a.new_zeros(k.shape) for k in diag_k]
            dvs = [k0a.new_zeros(v.shape) for v in diag_v]
            for start in range(0, T, chunk):
                end = min(T, start + chunk)
                qc, doc = qg[:, :, :, start:end], dog[:, :, :, start:end]
                causal, diag_s = _chunk_scores(qc, k0, _slots(diag_k, start, end, q.dtype), start, scale, acc)
                row = lse[:, :, :, start:end, None]
                pc, pd = (causal - row).exp(), (diag_s - row).exp()
                qc, dkc, dvc = qc.to(acc), _slots(diag_k, start, end, acc), _slots(diag_v, start, end, acc)
                dv0[:, :, :end] += torch.matmul(_rows(pc).transpose(-1, -2), _rows(doc))
                dvd = torch.einsum("bkgcj,bkgcd->bkcjd", pd, doc)
                dpc = torch.matmul(_rows(doc), v0a[:, :, :end].transpose(-1, -2)).view_as(pc)
                dpd = torch.einsum("bkgcd,bkcjd->bkgcj", doc, dvc)
                # softmax backward: dS = P * (dP - sum_k P_k dP_k), the row sum over both key sets; taken from
                # the recomputed P rather than from the (rounded) output, so it matches P exactly
                total = (pc * dpc).sum(-1, keepdim=True) + (pd * dpd).sum(-1, keepdim=True)
                dsc, dsd = pc * (dpc - total) * scale, pd * (dpd - total) * scale
                dq[:, :, :, start:end] = torch.matmul(_rows(dsc), k0a[:, :, :end]).view_as(qc) + torch.einsum(
                    "bkgcj,bkcjd->bkgcd", dsd, dkc
                )
                dk0[:, :, :end] += torch.matmul(_rows(dsc).transpose(-1, -2), _rows(qc))
                dkd = torch.einsum("bkgcj,bkgcd->bkcjd", dsd, qc)
                for j in range(n):
                    dks[j][:, :, start:end] = dkd[:, :, :, j]
                    dvs[j][:, :, start:end] = dvd[:, :, :, j]
        grads_diag = [g.to(x.dtype) for g, x in zip(dks + dvs, diag)]
        return dq.view(q.shape).to(q.dtype), dk0.to(k0.dtype), dv0.to(v0.dtype), None, None, *grads_diag


def chunked_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: Sequence[torch.Tensor],
    diag_v: Sequence[torch.Tensor],
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """TTT attention in query chunks (`default_chunk` unless given): memory O(chunk x T) per step, exact."""
    if q.shape[1] % k0.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k0.shape[1]} kv heads")
    if any(x.dtype != q.dtype for x in (k0, v0, *diag_k, *diag_v)):
        raise ValueError("TTT attention's queries, keys and values must share one dtype")
    chunk = chunk or default_chunk(q.shape[0], q.shape[1], q.shape[2])
    out = ChunkedTTTAttention.apply(q, k0, v0, scale, chunk, *diag_k, *diag_v)
    assert isinstance(out, torch.Tensor)
    return out


# ---------------------------------------------------------------------------------------------- flex


def ttt_mask_mod(length: int) -> Callable[[Any, Any, Any, Any], Any]:
    """flex_attention's mask_mod over the keys [k0; diag_1; ...; diag_i] (each `length` long): query t sees the
    step-0 keys kv <= t, and key length*j + t' of diagonal step j >= 1 exactly when t' == t."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        causal = (kv_idx < length) & (kv_idx <= q_idx)
        diagonal = (kv_idx >= length) & (kv_idx % length == q_idx)
        return causal | diagonal

    return mask_mod


@functools.lru_cache(maxsize=64)
def ttt_block_mask(length: int, steps: int, device: str) -> Any:
    """The block mask of step `steps` (its keys: step 0 and `steps` diagonal steps) for sequences of `length`,
    built once per (length, steps, device). Compiled, so the dense [T, (1 + i) T] mask is never materialized."""
    from torch.nn.attention.flex_attention import create_block_mask

    kv_len = length * (1 + steps)
    return create_block_mask(ttt_mask_mod(length), None, None, length, kv_len, device=device, _compile=True)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """flex_attention compiled once: uncompiled, it computes the dense score matrix (no memory saved)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: Sequence[torch.Tensor],
    diag_v: Sequence[torch.Tensor],
    scale: float,
    compiled: bool = True,
) -> torch.Tensor:
    """TTT attention as one flex_attention call (GQA native): the keys of step 0 and of steps 1..i laid end to
    end (one concatenation per step, linear in T), `ttt_block_mask` picking what each query sees.
    `compiled=False` runs flex_attention eagerly (dense, for tests of the mask on the CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T, steps = q.shape[2], len(diag_k)
    keys = torch.cat([k0, *diag_k], dim=2)
    values = torch.cat([v0, *diag_v], dim=2)
    if compiled:
        mask = ttt_block_mask(T, steps, str(q.device))
        attend = _compiled_flex()
    else:
        mask = create_block_mask(ttt_mask_mod(T), None, None, T, T * (1 + steps), device=str(q.device))
        attend = flex_attention
    groups = q.shape[1] // k0.shape[1]
    out = attend(q, keys, values, block_mask=mask, scale=scale, enable_gqa=groups > 1)
    assert isinstance(out, torch.Tensor)
    return out
