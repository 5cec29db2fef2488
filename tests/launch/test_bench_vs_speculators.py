"""launch/bench_vs_speculators.py --tiny: both EAGLE-3 training steps (draftsmith's and speculators') build and run
side by side, and the bench prints each one's tokens/s and the ratio (issue 20)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_bench_vs_speculators_tiny_prints_both_figures():
    pytest.importorskip("speculators", reason="installed by `make` from requirements-external.txt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # tiny ops: threads only add sync cost
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "bench_vs_speculators.py"), "--tiny"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    rows = {}
    for name in ("draftsmith", "speculators"):
        match = re.search(rf"^{name}\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)", out, re.MULTILINE)
        assert match, out
        seconds, tokens_per_s = float(match[1]), float(match[2])
        assert seconds > 0 and tokens_per_s > 0
        assert tokens_per_s == pytest.approx(64 / seconds, rel=0.01)  # T=64 positions per step in --tiny
        rows[name] = tokens_per_s
    ratio = re.search(r"^ratio \(draftsmith tokens/s / speculators tokens/s\): ([\d.]+)x", out, re.MULTILINE)
    assert ratio, out
    assert float(ratio[1]) == pytest.approx(rows["draftsmith"] / rows["speculators"], rel=0.02)
    assert "draft vocab 128" in out and "TTT steps 7" in out and "T=64" in out
    assert "attention 'sdpa'" in out  # speculators' attention implementation is named
