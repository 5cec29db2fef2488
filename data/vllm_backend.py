"""vLLM generation backend for GPU nodes: same prompts-in / completions-out contract as `HFGenerator`.

vLLM schedules and batches requests itself, so the whole list of prompts is submitted at once. Each request
gets its own seed derived from (seed, index), which makes a chunk's samples reproducible on re-run.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.data.generation import Completion, Sampling, cut_at_stop


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # vLLM raises more than ImportError when its CUDA libraries are missing
        return False
    return True


class VLLMGenerator:
    name = "vllm"

    def __init__(
        self,
        model: str,
        stop_ids: Sequence[int],
        dtype: str = "auto",
        revision: str | None = None,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        from vllm import LLM

        self.stop_ids = list(stop_ids)
        self.llm = LLM(
            model=model,
            revision=revision,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            seed=seed,
        )

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int) -> list[Completion]:
        from vllm import SamplingParams

        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=self.stop_ids,
                skip_special_tokens=False,
                seed=(seed * 1_000_003 + i) % 2**31,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=True)
        results = []
        for o in outputs:
            out = o.outputs[0]
            ids = cut_at_stop(list(out.token_ids), self.stop_ids).token_ids  # drop a trailing stop id if present
            results.append(Completion(ids, "stop" if out.finish_reason == "stop" else "length"))
        return results
