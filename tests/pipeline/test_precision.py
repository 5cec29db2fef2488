"""`auto` dtypes: bf16 only where the hardware runs it natively, for the target's dtype and for autocast alike,
with the reason logged; each of torch's own switches (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) is honoured."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from draftsmith.pipeline import precision
from draftsmith.pipeline.precision import cpu_bf16, resolve_dtype, resolve_mixed_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def cpu_kind(monkeypatch):
    """`cpu_kind(flags, capability, onednn)`: pretend to be a CPU with those bf16 features and dispatch."""
    monkeypatch.delenv(precision.ENV, raising=False)
    precision._log_once.cache_clear()

    def pretend(flags=(), capability="AVX512", onednn=True):
        monkeypatch.setattr(precision, "_cpu_has", lambda feature: feature in flags)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)

    return pretend


@pytest.mark.parametrize(
    "flags, capability, onednn, native",
    [
        ((), "AVX2", False, False),  # AMD EPYC / older Intel: AVX2 only
        ((), "AVX512", True, False),  # Skylake-SP: AVX-512 but no bf16 instructions
        (("avx512_bf16",), "AVX512", True, True),  # Cooper Lake / Zen 4
        (("avx512_bf16", "amx_tile"), "AVX512", True, True),  # Sapphire Rapids
        (("avx512_bf16", "amx_tile"), "AVX2", True, False),  # ATEN_CPU_CAPABILITY=avx2
        (("avx512_bf16", "amx_tile"), "AVX512", False, False),  # ONEDNN_MAX_CPU_ISA=AVX2
    ],
)
def test_auto_is_bf16_only_on_cpus_with_native_bf16(cpu_kind, caplog, flags, capability, onednn, native):
    cpu_kind(flags, capability, onednn)
    expected = torch.bfloat16 if native else torch.float32
    with caplog.at_level(logging.INFO, logger="draftsmith.pipeline.precision"):
        assert resolve_dtype("auto", CPU) == expected
        assert resolve_mixed_precision("auto", cuda=False) == ("bf16" if native else "no")
    reasons = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"model.dtype=auto -> {str(expected)[6:]}: ") for m in reasons), reasons
    assert any(m.startswith("train.mixed_precision=auto -> ") for m in reasons), reasons
    assert cpu_bf16()[0] is native


def test_explicit_choices_are_kept_and_slow_bf16_is_warned_about(cpu_kind, caplog):
    cpu_kind((), "AVX2", False)
    with caplog.at_level(logging.INFO, logger="draftsmith.pipeline.precision"):
        assert resolve_dtype("float64", CPU) == torch.float64
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
        assert resolve_mixed_precision("bf16", cuda=False) == "bf16"
        assert resolve_mixed_precision("no", cuda=False) == "no"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("model.dtype=bfloat16" in m and "30x slower" in m for m in warnings), warnings
    assert any("train.mixed_precision=bfloat16" in m for m in warnings), warnings


def test_cuda_auto_follows_the_devices_bf16_support(cpu_kind, monkeypatch):
    cpu_kind((), "AVX2", False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", CUDA) == torch.bfloat16 and resolve_mixed_precision("auto", cuda=True) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", CUDA) == torch.float32 and resolve_mixed_precision("auto", cuda=True) == "no"


def test_the_environment_switch_overrides_detection(cpu_kind, monkeypatch):
    cpu_kind(("avx512_bf16", "amx_tile"), "AVX512", True)
    monkeypatch.setenv(precision.ENV, "0")
    assert resolve_dtype("auto", CPU) == torch.float32
    cpu_kind((), "AVX2", False)
    monkeypatch.setenv(precision.ENV, "1")
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setenv(precision.ENV, "maybe")
    with pytest.raises(ValueError, match="DRAFTSMITH_CPU_BF16"):
        resolve_dtype("auto", CPU)


def test_torchs_own_switches_are_read_for_real():
    """Not a pretend CPU: a fresh interpreter with torch pinned to AVX2 kernels must never pick bf16."""
    env = {k: v for k, v in os.environ.items() if k != precision.ENV}
    env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run(
        [sys.executable, "-c", "from draftsmith.pipeline.precision import cpu_bf16; print(cpu_bf16())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("(False, "), out


def test_the_demo_and_recipes_use_auto():
    from pathlib import Path

    from draftsmith.pipeline.config import load_config

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert cfg.model.dtype == "auto", path
        assert cfg.train.mixed_precision == "auto", path
