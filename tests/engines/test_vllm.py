"""vLLM 0.33.0's own code on draftsmith's exports: config translation, the drafter classes, load_weights, and the
EAGLE-3 drafter's logits against draftsmith's.

One subprocess (tests/engines/probe_vllm.py, PYTHONPATH=.engines) checks every exported directory of every variant
(tests/engines/exports.py) and writes its results; the tests below assert on them. What runs is vLLM's code; what is
emulated is listed in the probe's docstring: the 3 CPU patches of the forward (F.linear for linear layers, CustomOps
on forward_native, Attention -> causal SDPA) and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engines.exports import DSPARK, EAGLE3, ENGINE_RTOL, NUM_TARGET_LAYERS, VARIANTS, WRITTEN_EAGLE3
from tests.engines.probe import run_probe

DIRS = ["eagle3", "speculators"]


@pytest.fixture(scope="module")
def vllm_results(engines, exported, tmp_path_factory):
    manifest = {k: v for k, v in exported.items() if v["dtype"] == "float32"}
    return run_probe("probe_vllm.py", manifest, tmp_path_factory.mktemp("probe-vllm"))


def _result(results, name, sub):
    r = results.get(f"{name}/{sub}")
    assert r is not None, f"{name}: no {sub}/ directory was exported"
    assert "error" not in r, f"{name}/{sub}: {r['error']}\n{r.get('traceback', '')}"
    return r


@pytest.mark.parametrize("sub", DIRS)
@pytest.mark.parametrize("name", [v.name for v in WRITTEN_EAGLE3])
def test_vllm_config_translation_eagle3(vllm_results, exported, name, sub):
    """The export README's serve command for eagle3/ or speculators/, through what `vllm serve` runs first:
    `maybe_override_with_speculators` (which refuses a speculators dir whose verifier is a local path, so
    `vllm serve DIR` for a local target fails here), then `ModelConfig` + `SpeculativeConfig` (EAGLEConfig for
    eagle3/, the speculators translation `update_eagle3` for speculators/). The target vLLM serves is ours, the
    method is eagle3, and `get_eagle3_aux_layers_from_config` gives our aux ids, ascending."""
    v = VARIANTS[name]
    r = _result(vllm_results, name, sub)
    assert Path(r["served_model"]) == Path(exported[name]["target_dir"])
    assert r["method"] == "eagle3"
    assert r["capture"] == list(v.aux) == sorted(v.aux)
    assert r["hf_draft_vocab_size"] == (384 if v.full_vocab else 200)
    assert r["hf_norm_before_residual"] is v.norm_before_residual


@pytest.mark.parametrize("sub", DIRS)
@pytest.mark.parametrize("name", [v.name for v in WRITTEN_EAGLE3])
def test_vllm_eagle3_loads_and_computes_ours(vllm_results, exported, name, sub):
    """vLLM's `Eagle3LlamaForCausalLM` (the registry's class for the translated config) built on CPU in a gloo world
    of size 1; `load_weights` takes model.safetensors (with d2t/t2d for a full draft vocabulary it raises: vLLM has
    no draft_id_to_target_id then); every exported tensor is in its parameters (q/k/v and gate/up as slices of
    the fused ones), fc is n_aux * H wide. Then forward: vLLM's target class (Llama / Qwen3, head_dim 32 != H/heads)
    captures the aux states at the layers of `get_eagle3_aux_layers_from_config`, the drafter's
    combine_hidden_states + forward + compute_logits give logits equal to draftsmith's `ttt_forward` step 0 on
    draftsmith's own feature capture (float32; only the operation order differs). Emulated: F.linear for linear
    layers, CustomOps on forward_native, Attention -> causal SDPA."""
    v = VARIANTS[name]
    r = _result(vllm_results, name, sub)
    assert r["draft_class"] == "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
    assert "load_error" not in r, r["load_error"]
    assert r["placement_problems"] == {}
    assert r["fc_in_features"] == len(v.aux) * 64
    assert r["has_draft_id_to_target_id"] is not v.full_vocab
    ours = torch.load(exported[name]["reference"])["logits"]
    theirs = torch.load(r["logits"])
    scale = ours.abs().max().item()
    torch.testing.assert_close(theirs, ours, atol=ENGINE_RTOL * scale, rtol=0)
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.99


@pytest.mark.parametrize("name", [v.name for v in EAGLE3 if v.refused])
def test_refused_eagle3_has_no_vllm_directory(vllm_results, exported, name):
    """Aux id L (draftsmith's final normed state; vLLM captures layer L's output before the final norm) and unsorted
    aux ids (vLLM captures in ascending order) would load in vLLM and compute something else: the export writes
    neither eagle3/ nor speculators/ and records the refusal in export/manifest.json. Were a directory written, the
    probe ran it like any other, and its logits must then still equal ours (they do not: that is the defect)."""
    out = Path(exported[name]["export"])
    manifest = json.loads((out / "manifest.json").read_text())
    for sub in DIRS:
        r = vllm_results.get(f"{name}/{sub}")
        if r is not None and "logits" in r:
            ours = torch.load(exported[name]["reference"])["logits"]
            diff = (torch.load(r["logits"]) - ours).abs().max().item()
            pytest.fail(f"{name}: {sub}/ was written; vLLM loads it and its logits differ from ours by {diff:.3g}")
        assert not (out / sub).exists(), f"{name}: {sub}/ written"
    assert manifest.get("refused"), "the refusal is not recorded in export/manifest.json"
    assert any(str(NUM_TARGET_LAYERS) in why or "ascending" in why for why in manifest["refused"].values())


@pytest.mark.parametrize("name", [v.name for v in DSPARK])
def test_vllm_dspark_translation_and_load(vllm_results, exported, name):
    """dspark/: the README's `vllm serve TARGET --speculative-config {"method": "dspark", ...}` through
    `maybe_override_with_speculators`, `SpeculativeConfig` and the speculators translation `update_dspark`
    (architecture Qwen3DSparkModel, target_layer_ids = aux - 1, block size = speculative tokens, parallel
    drafting), `get_eagle3_aux_layers_from_config` = our aux ids; vLLM's `Qwen3DSparkForCausalLM` built on CPU and
    `load_weights` takes every exported tensor (Markov head, confidence head, Qwen3 q/k norms, d2t only for a
    reduced vocabulary). Its forward is not driven: the DFlash block attention (context K/V injected from the
    target features into every layer, non-causal within the block) runs only inside vLLM's V2 DSpark proposer
    with its attention metadata and KV cache, which have no CPU path; draftsmith's block math is compared with
    speculators' modules in tests/pipeline/test_export.py instead."""
    v = VARIANTS[name]
    r = _result(vllm_results, name, "dspark")
    assert Path(r["served_model"]) == Path(exported[name]["target_dir"])
    assert r["method"] == "dspark" and r["num_speculative_tokens"] == 4 and r["parallel_drafting"] is True
    assert r["draft_architectures"] == ["Qwen3DSparkModel"]
    assert r["draft_class"] == "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM"
    assert r["capture"] == list(v.aux)
    assert r["hf_target_layer_ids"] == [i - 1 for i in v.aux]
    assert r["hf_block_size"] == 4 and r["hf_markov_rank"] == 16 and r["hf_dspark_bonus_anchor"] is False
    assert "load_error" not in r, r["load_error"]
    assert r["placement_problems"] == {}
    assert r["fc_in_features"] == len(v.aux) * 64
    assert r["has_draft_id_to_target_id"] is not v.full_vocab
