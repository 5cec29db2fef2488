"""SGLang 0.5.23's own code on draftsmith's eagle3/ exports: which class it picks (or that it refuses), which
target layers it captures, load_weights, and its drafter's logits against draftsmith's.

One subprocess (tests/engines/probe_sglang.py, PYTHONPATH=.engines) checks every eagle3/ directory and writes its
results; the tests below assert on them. What runs is SGLang's code (ModelConfig, get_model_architecture,
set_eagle3_layers_to_capture, LlamaForCausalLMEagle3 with its load_weights and forward); emulated, as the probe's
docstring details: the capture of the target's layer inputs, RadixAttention -> causal SDPA, CustomOps on
forward_native, a stand-in ForwardBatch, the shared embedding copied in, and a stub torchvision.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engines.exports import EAGLE3, ENGINE_RTOL, VARIANTS, WRITTEN_EAGLE3
from tests.engines.probe import run_probe


@pytest.fixture(scope="module")
def sglang_results(engines, exported, tmp_path_factory):
    manifest = {k: v for k, v in exported.items() if v["dtype"] == "float32" and v["family"] == "eagle3"}
    return run_probe("probe_sglang.py", manifest, tmp_path_factory.mktemp("probe-sglang"))


def _result(results, name):
    r = results.get(name)
    assert r is not None, f"{name}: no eagle3/ directory was exported"
    assert "error" not in r, f"{name}: {r['error']}\n{r.get('traceback', '')}"
    return r


@pytest.mark.parametrize("name", [v.name for v in WRITTEN_EAGLE3 if v.sglang])
def test_sglang_loads_and_computes_ours(sglang_results, exported, name):
    """A drafter SGLang can compute (1 layer, norm after the residual, aux ids >= 1; 3, 4 or 5 aux layers; draft
    vocab < or == target vocab; Llama or Qwen3 target): `get_model_architecture` picks LlamaForCausalLMEagle3,
    `set_eagle3_layers_to_capture` on SGLang's ids gives our aux layers, `load_weights` fills every parameter but the
    (shared) embedding and turns d2t into hot_token_id, and the logits equal draftsmith's step-0 logits on the layer
    inputs SGLang captures (float32). The weights are what SGLang's own loader finds in the directory (its file
    discovery): model.safetensors alone, not the confidence head draftsmith keeps in draftsmith/ (SGLang would drop
    its names silently), and the calibration's extra config keys do not stop the config from loading."""
    v = VARIANTS[name]
    r = _result(sglang_results, name)
    assert "refused" not in r, f"SGLang refuses a directory it can serve: {r['refused']}"
    assert r["weight_files"] == ["model.safetensors"]
    assert (Path(exported[name]["export"]) / "eagle3" / "draftsmith" / "confidence.safetensors").is_file()
    assert r["class"] == "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3"
    assert r["layers_to_capture"] == list(v.aux)
    assert r["not_loaded"] == []
    assert r["fc_in_features"] == len(v.aux) * 64
    assert r.get("hot_token_id_is_d2t", True)
    ours = torch.load(exported[name]["reference"])["logits"]
    theirs = torch.load(r["logits"])
    torch.testing.assert_close(theirs, ours, atol=ENGINE_RTOL * ours.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", [v.name for v in WRITTEN_EAGLE3 if not v.sglang])
def test_sglang_refuses_the_vllm_only_directory(sglang_results, exported, name):
    """A drafter SGLang would compute differently (2 layers: its layers >= 1 normalise with hidden_norm, not
    input_layernorm; norm_before_residual, which it ignores; aux id 0, which its numbering cannot express): the
    eagle3/ directory must not load there. SGLang's own `get_model_architecture` refuses it (the architecture is
    vLLM's `Eagle3LlamaForCausalLM`, not in SGLang's registry nor in transformers) instead of loading it with
    default aux layers and untrained norms. If it loads anyway, the probe ran it: the message says how far off."""
    r = sglang_results.get(name)
    assert r is not None, f"{name}: no eagle3/ directory was exported"
    if "class" in r and "logits" not in r:
        pytest.fail(f"SGLang loads {name}'s eagle3/ ({r['class']}, capturing {r.get('layers_to_capture')}): {r}")
    assert "error" not in r, r["error"]
    if "logits" in r:
        ours = torch.load(exported[name]["reference"])["logits"]
        diff = (torch.load(r["logits"]) - ours).abs().max().item()
        pytest.fail(f"SGLang loads {name}'s eagle3/ ({r['class']}); its logits differ from ours by {diff:.3g}")
    assert "refused" in r, f"SGLang loads {name}'s eagle3/: {r}"
    assert "Eagle3LlamaForCausalLM" in r["refused"]


@pytest.mark.parametrize("name", [v.name for v in EAGLE3 if v.refused])
def test_refused_eagle3_has_no_sglang_directory(sglang_results, exported, name):
    """Aux id L and unsorted aux ids are refused at export (no eagle3/). Were the directory written, the probe ran
    it through SGLang: with id L its `layers_to_capture` names layer L, which the target's layer loop never reaches
    (so SGLang never captures it); with unsorted ids SGLang captures in layer order, and its logits are not ours."""
    r = sglang_results.get(name)
    if r is not None:
        assert "error" not in r, r["error"]
        if "never_captured" in r:
            pytest.fail(f"{name}: eagle3/ was written; SGLang never captures target layer(s) {r['never_captured']}")
        if "logits" in r:
            ours = torch.load(exported[name]["reference"])["logits"]
            diff = (torch.load(r["logits"]) - ours).abs().max().item()
            pytest.fail(f"{name}: eagle3/ was written; SGLang loads it and its logits differ from ours by {diff:.3g}")
        pytest.fail(f"{name}: eagle3/ was written ({r})")
    assert not (Path(exported[name]["export"]) / "eagle3").exists()
