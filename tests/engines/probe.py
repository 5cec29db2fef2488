"""Running an engine probe: a script of this folder in a subprocess with PYTHONPATH=.engines, so the engines and
their pinned dependencies never enter the test process. A probe reads the exports' manifest and writes one JSON
object of results (and tensors beside it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = HERE.parents[1] / ".engines"


def run_probe(script: str, manifest: dict, work: Path, timeout: float = 300) -> dict:
    """Run tests/engines/<script> on `manifest`; returns its results (the probe writes work/results.json)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "manifest.json").write_text(json.dumps(manifest))
    env = {
        **os.environ,
        "PYTHONPATH": str(ENGINES),
        "VLLM_TARGET_DEVICE": "cpu",  # vLLM's CPU platform: no CUDA is looked for
        "VLLM_USE_V2_MODEL_RUNNER": "1",  # vLLM refuses method dspark on the V1 runner (config/vllm.py)
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(HERE / script), str(work)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = f"{script} exited {proc.returncode} after {time.time() - start:.1f}s\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    (work / "log.txt").write_text(log)
    if proc.returncode != 0 or not (work / "results.json").is_file():
        raise RuntimeError(log)
    return json.loads((work / "results.json").read_text())
