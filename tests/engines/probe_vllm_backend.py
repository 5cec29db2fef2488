"""draftsmith's vLLM generate backend (data/vllm_backend.py) against vLLM 0.33.0's own classes (a subprocess of
tests/engines/test_vllm_backend.py; PYTHONPATH=.engines).

usage: python probe_vllm_backend.py WORK   (writes WORK/results.json)

The backend runs unchanged on the real `vllm` module, except that `vllm.LLM` is a subclass of vLLM's LLM whose
__init__ and generate do not start an engine (there is no GPU): __init__ binds the backend's arguments to the real
`LLM.__init__` signature (an argument it does not name must be an `EngineArgs` field, where its **kwargs go), and
generate binds to the real `LLM.generate` signature, checks each request against `TokensPrompt`'s keys and each
sampling parameter object is vLLM's own `SamplingParams` (constructed for real by the backend, so vLLM validated
every field), and answers with vLLM's own `RequestOutput` / `CompletionOutput`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import traceback
from pathlib import Path


def main(work: Path) -> None:
    results: dict = {"problems": []}
    problems = results["problems"]
    try:
        import vllm
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.outputs import CompletionOutput, RequestOutput

        results["vllm"] = vllm.__version__
        real_llm = vllm.LLM
        init_sig = inspect.signature(real_llm.__init__)
        generate_sig = inspect.signature(real_llm.generate)
        engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
        token_keys = set(TokensPrompt.__annotations__)
        seen: dict = {}

        class CheckedLLM(real_llm):
            def __init__(self, **kwargs):
                init_sig.bind(self, **kwargs)
                for key in kwargs:
                    if key not in init_sig.parameters and key not in engine_fields:
                        problems.append(f"LLM(**{{{key!r}: ...}}): neither an LLM parameter nor an EngineArgs field")
                seen["init"] = sorted(kwargs)

            def generate(self, *args, **kwargs):
                bound = generate_sig.bind(self, *args, **kwargs)
                prompts, params = bound.arguments["prompts"], bound.arguments["sampling_params"]
                for p in prompts:
                    extra = set(p) - token_keys
                    if extra:
                        problems.append(f"request keys {sorted(extra)} are not TokensPrompt keys")
                for sp in params:
                    if type(sp) is not SamplingParams:
                        problems.append(f"sampling params of type {type(sp)}")
                seen["params"] = [
                    {f: getattr(sp, f) for f in ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids",
                                                 "skip_special_tokens", "seed")}
                    for sp in params
                ]  # fmt: skip
                outs = []
                for i, p in enumerate(prompts):
                    stop = i % 2 == 0
                    completion = CompletionOutput(
                        index=0,
                        text="",
                        token_ids=[7, 8, 2] if stop else [7, 8, 9],
                        cumulative_logprob=None,
                        logprobs=None,
                        finish_reason="stop" if stop else "length",
                    )
                    outs.append(
                        RequestOutput(
                            request_id=str(i),
                            prompt=None,
                            prompt_token_ids=p["prompt_token_ids"],
                            prompt_logprobs=None,
                            outputs=[completion],
                            finished=True,
                        )
                    )
                return outs

        vllm.LLM = CheckedLLM
        from draftsmith.data.generation import Sampling
        from draftsmith.data.vllm_backend import VLLMGenerator, vllm_available

        results["vllm_available"] = vllm_available()
        gen = VLLMGenerator("org/model", stop_ids=[2], dtype="bfloat16", max_model_len=512, seed=3)
        runs = []
        for sampling in (
            Sampling(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=3),
            Sampling(temperature=0.5, top_p=1.0, top_k=5, max_new_tokens=3),
            Sampling(temperature=0.0, max_new_tokens=3),
        ):
            out = gen.generate([[1, 2], [3]], sampling, seed=11)
            runs.append({"completions": [[c.token_ids, c.finish_reason] for c in out], "params": seen["params"]})
        results["runs"] = runs
        results["init"] = seen["init"]
    except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
        results["error"] = f"{type(exc).__name__}: {exc}"
        results["traceback"] = traceback.format_exc()[-3000:]
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
