"""The vLLM backend: its request mapping is checked against a stand-in `vllm` module on CPU; the real
engine is compared with the HF backend where vLLM and CUDA exist (that one test skips elsewhere)."""

import sys
import types

import pytest
import torch

from draftsmith.data.generation import Sampling


class _FakeParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fake_vllm(monkeypatch, outputs):
    mod = types.ModuleType("vllm")
    calls = {}

    class LLM:
        def __init__(self, **kw):
            calls["init"] = kw

        def generate(self, requests, params, use_tqdm=True):
            calls["requests"], calls["params"] = requests, params
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=fr)])
                for ids, fr in outputs
            ]

    mod.LLM, mod.SamplingParams = LLM, _FakeParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return calls


def test_request_mapping_and_finish_reasons(monkeypatch):
    from draftsmith.data.vllm_backend import VLLMGenerator, vllm_available

    calls = _fake_vllm(monkeypatch, [([5, 6, 2], "stop"), ([7, 8, 9], "length"), ([4], "stop")])
    assert vllm_available()
    gen = VLLMGenerator("some/model", stop_ids=[2, 3], dtype="bfloat16", seed=1)
    out = gen.generate([[1, 2], [3], [4, 4]], Sampling(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=3), seed=11)
    assert [(c.token_ids, c.finish_reason) for c in out] == [([5, 6], "stop"), ([7, 8, 9], "length"), ([4], "stop")]
    assert calls["init"]["model"] == "some/model" and calls["init"]["dtype"] == "bfloat16"
    assert calls["requests"] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [4, 4]}]
    p = calls["params"]
    assert all(x.top_k == -1 and x.top_p == 0.9 and x.temperature == 0.7 and x.max_tokens == 3 for x in p)
    assert all(x.stop_token_ids == [2, 3] and x.skip_special_tokens is False for x in p)
    assert len({x.seed for x in p}) == 3  # one reproducible seed per request


def test_auto_backend_choice(tiny_target_dir):
    from draftsmith.data.vllm_backend import vllm_available
    from draftsmith.pipeline.config import load_config
    from draftsmith.pipeline.dist import dist_state
    from draftsmith.pipeline.generate import make_generator
    from draftsmith.pipeline.target import load_tokenizer

    cfg = load_config(None, [f"model.target={tiny_target_dir}"])
    gen, model = make_generator(cfg, load_tokenizer(cfg.model), dist_state())
    expected = "vllm" if torch.cuda.is_available() and vllm_available() else "hf"
    assert gen.name == expected and (model is None) == (expected == "vllm")


def test_real_vllm_matches_hf_greedy(tiny_target_dir):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs CUDA")
    from draftsmith.data.chat import prompt_ids, stop_token_ids
    from draftsmith.data.generation import HFGenerator
    from draftsmith.data.vllm_backend import VLLMGenerator
    from draftsmith.pipeline.config import ModelConfig
    from draftsmith.pipeline.target import load_target

    t = load_target(ModelConfig(target=str(tiny_target_dir), dtype="float32"))
    prompts = [prompt_ids(t.tokenizer, [{"role": "user", "content": q}]) for q in ["What is the sum?", "Write a poem."]]
    stops = stop_token_ids(t.tokenizer, t.model)
    s = Sampling(max_new_tokens=16)
    hf = HFGenerator(t.model, t.tokenizer.pad_token_id, stops).generate(prompts, s, 0)
    vl = VLLMGenerator(str(tiny_target_dir), stops, dtype="float32").generate(prompts, s, 0)
    assert [c.token_ids for c in hf] == [c.token_ids for c in vl]
