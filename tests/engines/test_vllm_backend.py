"""The `generate` stage's vLLM backend (data/vllm_backend.py) against vLLM 0.33.0's own classes, on CPU.

tests/data/test_vllm_backend.py checks the backend's request mapping against a stand-in `vllm` module, and its
real-engine test needs CUDA. Here the backend runs on the released `vllm` (tests/engines/probe_vllm_backend.py, a
subprocess with PYTHONPATH=.engines): every argument it passes to `LLM(...)` and `LLM.generate(...)` is bound to
vLLM's real signatures (or must be an EngineArgs field), its `SamplingParams` are vLLM's (so vLLM validated them:
top_k=-1 for "no top-k", temperature 0), and it reads vLLM's real `RequestOutput.outputs[0].token_ids` /
`.finish_reason`. Emulated: only the engine start and the generation (LLM's __init__ and generate bodies).
"""

from __future__ import annotations

import pytest

from tests.engines.probe import run_probe


@pytest.fixture(scope="module")
def backend_results(engines, tmp_path_factory):
    return run_probe("probe_vllm_backend.py", {}, tmp_path_factory.mktemp("probe-vllm-backend"))


def test_vllm_backend_matches_vllm_0_33_api(backend_results):
    r = backend_results
    assert "error" not in r, f"{r['error']}\n{r.get('traceback', '')}"
    assert r["vllm"] == "0.33.0"
    assert r["problems"] == []
    assert r["vllm_available"] is True  # `import vllm` succeeds on CPU; only an engine start needs CUDA
    assert r["init"] == ["dtype", "max_model_len", "model", "revision", "seed", "tensor_parallel_size"]
    for run in r["runs"]:
        # finish reasons read from vLLM's CompletionOutput; a trailing stop id is cut
        assert run["completions"] == [[[7, 8], "stop"], [[7, 8, 9], "length"]]
        assert len({p["seed"] for p in run["params"]}) == 2
    first, top_k, greedy = (run["params"][0] for run in r["runs"])
    assert first["top_k"] in (-1, 0) and first["top_p"] == 0.9 and first["max_tokens"] == 3  # vLLM: 0/-1 = no top-k
    assert top_k["top_k"] == 5 and top_k["temperature"] == 0.5
    assert greedy["temperature"] == 0.0  # vLLM accepts T=0 (greedy) and normalises the rest itself
    assert first["stop_token_ids"] == [2] and first["skip_special_tokens"] is False
