"""Linear layers that take torch's fast CPU matrix products for the shapes decoding hands them.

Decoding multiplies a few rows at a time (one row per batch row and verified slot) by weights that do not fit in the
cache, so a pass is bound by streaming the weights from memory, and the product should cost about the same for 1 to 8
rows. torch's CPU kernels miss that in two places, measured on SmolLM2-135M with 2 threads:

- **A strided 3-D input** (transformers' `generate` hands the head `hidden[:, -1:, :]` at the prefill) goes down a slow
  batched path: SmolLM2's head (49152 x 576, bf16) took 1.9 s for 32 such rows against 9 ms flattened on an AVX-512
  BF16 AMD EPYC (pytorch/pytorch#151934 is the batched-matmul side of this). Flattening the leading dimensions views
  the same memory as one 2-D matrix, which the GEMM takes at full speed: every product here does that (a contiguous
  input in another dtype than fp32 goes to `F.linear` as it is, which folds it the same way, with no Python step more
  than `nn.Linear`'s).
- **fp32 with few rows** (the dtype `auto` picks on AVX2-only machines): `F.linear(x, W)` runs one matrix-vector
  product per row, so each row costs what the whole product should. On an AVX-512 BF16 AMD EPYC, SmolLM2's head took
  11 / 26 / 39 ms for 1 / 2 / 3 rows, and the same product written `W @ x.T` 5 ms for 2 rows. The whole target pass,
  1 / 2 / 3 slots wide, with torch's kernels capped to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
  ONEDNN_MAX_CPU_ISA): 82 / 121 / 152 ms with `F.linear`, 63 / 57 / 75 ms with `W @ x.T`
  (`launch/bench_target_pass.py`). So in fp32, fewer than `FEW_ROWS` rows are multiplied as `W @ x.T`, an odd count
  padded with a zero row (one row alone is a matrix-vector product that way too; two stream the weight at twice its
  speed). bf16 (oneDNN) is flat from 1 to 8 rows already and keeps `F.linear`.

The products are the same sums in another order: results agree with `F.linear` to rounding (tests/eval/
test_cpu_linear.py), the way two widths of one pass already do. Not on CUDA, where cuBLAS takes all of these at speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEW_ROWS = 8
"""fp32 products over fewer rows than this are computed as `W @ x.T` (a whole pass measured 1.3-2.4x faster for 1 to
4 rows; for 6, 1.33x with AVX2 kernels and as fast with AVX-512 ones; from 8 on `F.linear`'s GEMM is as fast, and a
batch's prefill takes that path)."""


def cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over x's leading dimensions flattened, by the fast CPU path for its shape."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if flat.dtype != torch.float32 or rows >= FEW_ROWS or rows == 0:
        out = F.linear(flat, weight, bias)
    else:
        if rows % 2:  # an even count keeps the GEMM's two-column kernel (one row alone is a matrix-vector product)
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], out.shape[-1])


class CpuLinear(torch.nn.Linear):
    """An `nn.Linear` whose product takes the fast CPU path for its input's shape (`cpu_product`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and x.is_contiguous():  # torch's own path is fast: no Python step more than it
            return F.linear(x, self.weight, self.bias)
        return cpu_product(x, self.weight, self.bias)


def use_cpu_linears(model: torch.nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` a `CpuLinear` (a class swap: the same parameters and state, and it
    survives deepcopy and pickling). For a model that computes on the CPU; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CpuLinear
            swapped += 1
    return swapped
