"""Which floating-point format to compute in: `auto` picks bf16 only where the hardware runs it natively.

On a CPU, bf16 is only fast where the instructions exist: with AVX-512 BF16 or AMX a bf16 matmul runs
~1.5-4x faster than fp32, while on an AVX2-only CPU torch emulates it and it runs ~30x *slower*. So `auto`
(for `model.dtype` and for `train.mixed_precision`) asks three things, each of which a user can also force:
the CPU's own flags (cpuinfo, as torch reports them), the kernels torch dispatches to
(`ATEN_CPU_CAPABILITY` can pin them to AVX2), and oneDNN's bf16 support (`ONEDNN_MAX_CPU_ISA` can cap it).
`DRAFTSMITH_CPU_BF16=0|1` overrides the answer outright (the test suite sets 0, so that its numbers do not
depend on which CPU runs it).

Nothing in torch, transformers or accelerate makes this choice (their `auto` means "the checkpoint's dtype"
or "fp32 on CPU"), so it is written here.
"""

from __future__ import annotations

import logging
import os
from functools import cache

import torch

log = logging.getLogger(__name__)

ENV = "DRAFTSMITH_CPU_BF16"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _cpu_has(feature: str) -> bool:
    probe = getattr(torch.cpu, f"_is_{feature}_supported", None)  # private, but the only per-feature query torch has
    return bool(probe()) if probe is not None else False


def cpu_bf16() -> tuple[bool, str]:
    """(native bf16 on this CPU?, why): the answer `auto` uses, with a reason fit to log."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return False, f"{ENV}={forced} forces fp32 on CPU"
    if forced in ("1", "true", "yes", "on"):
        return True, f"{ENV}={forced} forces bf16 on CPU"
    if forced not in ("", "auto"):
        raise ValueError(f"{ENV}={forced!r}: use 0 (fp32), 1 (bf16) or auto")
    capability = torch.backends.cpu.get_cpu_capability()
    native = [name for name, feature in (("AVX-512 BF16", "avx512_bf16"), ("AMX", "amx_tile")) if _cpu_has(feature)]
    if not native:
        return False, (
            f"the CPU has no native bf16 instructions (no AVX-512 BF16, no AMX; torch runs {capability} "
            "kernels), where bf16 runs ~30x slower than fp32"
        )
    if not capability.startswith("AVX512"):
        return (
            False,
            f"the CPU has {' and '.join(native)}, but torch is pinned to {capability} kernels (ATEN_CPU_CAPABILITY)",
        )
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, f"the CPU has {' and '.join(native)}, but oneDNN's bf16 kernels are off (ONEDNN_MAX_CPU_ISA)"
    return True, f"the CPU runs bf16 natively ({' and '.join(native)}, {capability} kernels)"


@cache
def _log_once(level: int, message: str) -> None:
    log.log(level, message)


def resolve_dtype(name: str, device: torch.device, field: str = "model.dtype") -> torch.dtype:
    """The compute dtype for `name` on `device`; `auto` is bf16 on CUDA (where supported) and on CPUs with native
    bf16, fp32 elsewhere. The choice is logged once with its reason."""
    if name != "auto":
        dtype = DTYPES[name]
        if dtype == torch.bfloat16 and device.type == "cpu":
            native, why = cpu_bf16()
            if not native:
                _log_once(
                    logging.WARNING,
                    f"{field}=bfloat16 on a CPU without native bf16: {why}; `{field}=auto` would pick float32",
                )
        return dtype
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        why = "CUDA device with bf16 support" if bf16 else "CUDA device without bf16 support"
    elif device.type == "cpu":
        bf16, why = cpu_bf16()
    else:
        bf16, why = False, f"{device.type} device"
    dtype = torch.bfloat16 if bf16 else torch.float32
    _log_once(logging.INFO, f"{field}=auto -> {str(dtype).removeprefix('torch.')}: {why}")
    return dtype


def resolve_mixed_precision(name: str, cuda: bool) -> str:
    """accelerate's `mixed_precision` for `train.mixed_precision`: `auto` is bf16 autocast where bf16 is native
    (CUDA with bf16, or a CPU with AVX-512 BF16 / AMX), `no` (fp32) elsewhere. Logged once with its reason."""
    device = torch.device("cuda" if cuda else "cpu")
    if name != "auto":
        if name == "bf16":
            resolve_dtype("bfloat16", device, "train.mixed_precision")  # warns on a CPU without native bf16
        return name
    dtype = resolve_dtype("auto", device, "train.mixed_precision")
    return "bf16" if dtype == torch.bfloat16 else "no"
