"""launch/bench_gpu.py at tiny sizes on the CPU: every benchmark runs, and the JSON + markdown report come out."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_gpu_runs_tiny_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # tiny ops: threads only add sync cost
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "bench_gpu.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    train, collect, verify = result["train"], result["collect"], result["verify"]
    assert train["tokens_per_s"] > 0 and train["flops_per_token"] > 0
    assert train["trainable_params"] == train["trainable_params_formula"]  # pipeline.plan counts the real module
    assert train["mfu"] is None and train["peak_memory_mib"] is None  # no GPU: no peak to divide by, no CUDA memory
    assert collect["tokens"] > 0 and collect["collect_tokens_per_s"] > 0 and collect["aux_layer_ids"] == [2, 4, 5]
    assert verify["eagle3"]["rounds"] > 0 and verify["plain"]["tokens"] > 0
    md = (tmp_path / "bench_gpu.md").read_text()
    assert "tokens/s" in md and "rounds/s" in md and "tiny sizes" in md
