"""vLLM 0.33.0's own code on draftsmith's exports: config translation, the drafter classes, load_weights, the
EAGLE-3 drafter's logits and a DSpark draft block (vLLM's DSpark proposer) against draftsmith's.

One subprocess (tests/engines/probe_vllm.py, PYTHONPATH=.engines) checks every exported directory of every variant
(tests/engines/exports.py) and writes its results; the tests below assert on them. What runs is vLLM's code; what is
emulated is listed in the probe's docstring: for EAGLE-3 the 3 CPU patches of the forward (F.linear for linear
layers, CustomOps on forward_native, Attention -> causal SDPA); for the DSpark block the same first two, the draft
layers' Attention -> `PagedAttention` (a paged KV cache and the backend's non-causal block attention over it, fed
the metadata a backend builder would make), the context-K/V precompute's two CUDA kernels (rms_norm, RoPE) by
vLLM's native implementations, and the runner state `propose` receives (one request after its prefill).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engines.exports import (
    BF16_DSPARK,
    DSPARK,
    EAGLE3,
    ENGINE_RTOL,
    NUM_TARGET_LAYERS,
    VARIANTS,
    WRITTEN_EAGLE3,
    target_features,
)
from tests.engines.probe import run_probe

DIRS = ["eagle3", "speculators"]
# bfloat16 on both sides (vLLM's target and drafter built in bfloat16, ours cast to it), rounded after every matmul,
# norm and residual add in a different order on each side: as tests/engines/test_speculators.py's BF16_RTOL
BF16_RTOL = 0.05


@pytest.fixture(scope="module")
def vllm_results(engines, exported, tmp_path_factory):
    # every float32 export, and the bfloat16 DSpark ones for the DSpark block
    manifest = {k: v for k, v in exported.items() if v["dtype"] == "float32" or k in [n + "@bf16" for n in BF16_DSPARK]}
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
    # at T > 0 the command serves vLLM's default, the argmax drafted (eval.draft_sample_method=greedy measures it),
    # and vLLM takes drafts drawn from the drafter for it too (eval's default, `probabilistic`)
    assert r["draft_sample_method"] == "greedy"
    assert r["probabilistic"] == "probabilistic"


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
    layers, CustomOps on forward_native, Attention -> causal SDPA. The weights are every file vLLM's own loader finds in
    the directory (its file discovery): model.safetensors alone, not the confidence head draftsmith keeps in
    draftsmith/ (whose names vLLM's loader would refuse); the calibration's extra config keys are read past."""
    v = VARIANTS[name]
    r = _result(vllm_results, name, sub)
    assert r["draft_class"] == "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
    assert "load_error" not in r, r["load_error"]
    assert r["weight_files"] == ["model.safetensors"]
    assert (Path(exported[name]["export"]) / sub / "draftsmith" / "confidence.safetensors").is_file()
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
    reduced vocabulary). What it computes: test_vllm_dspark_block_matches_ours."""
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


@pytest.mark.parametrize(
    "key", [v.name for v in DSPARK] + [n + "@bf16" for n in BF16_DSPARK], ids=lambda k: k.replace("@", "-")
)
def test_vllm_dspark_block_matches_ours(vllm_results, exported, key):
    """One draft block of dspark/ through vLLM's V2 DSpark proposer (probe step 4): after a prefill of
    DSPARK_CONTEXT tokens, vLLM's target (its Llama / Qwen3 class) captures the aux states and gives the bonus
    token; `DSparkSpeculator` (built by its own __init__, the drafter loaded through `load_dspark_model`) prepares
    the block with its Triton kernel (interpreted), fuses the aux states with `combine_hidden_states`, stores the
    context K/V with `precompute_and_store_context_kv`, runs the query block through its decoder layers and
    samples left to right with the Markov head (`_sample_sequential`, greedy), with confidences from
    `compute_confidence`. Emulated (exactly, in the probe's docstring): F.linear, CustomOps on forward_native, the
    draft Attention by `PagedAttention` (context keys visible to every query, the block non-causal, as vLLM marks
    these layers), the precompute's rms_norm / RoPE CUDA kernels by vLLM's native ones, the runner's per-request
    state.

    vLLM's inputs are ours: query ids [bonus, mask_token_id x (block-1)] at positions T..T+block-1 (anchor as the
    first prediction), context positions 0..T-1, every layer non-causal, the confidence head on. Ours: the source
    drafter through eval's `DSparkProposer` (start on the context, one greedy round of a whole block) for the tokens
    and confidences; its `draft_block` + `heads` for each position's biased logits, conditioned on vLLM's previous
    token (so they are comparable past a differing token). float32: on draftsmith's feature capture of the HF
    target (`target_features`, checked equal to vLLM's capture to ENGINE_RTOL of its scale, with the same next
    token), the draft tokens (target ids) equal exactly, the logits agree to ENGINE_RTOL of their scale, the
    confidences to ENGINE_RTOL. bfloat16: on the aux states vLLM's bfloat16 target captured (its drift from the
    float32 target is not the drafter's), logits and confidences to BF16_RTOL, and every token vLLM picked is
    within BF16_RTOL x scale of our best logit at that position (a near tie, not a different distribution)."""
    from draftsmith.drafters.dspark import DSparkDrafter
    from draftsmith.eval.proposers import DSparkProposer
    from draftsmith.eval.sampling import SamplingParams

    entry = exported[key]
    dtype = getattr(torch, entry["dtype"])
    r = _result(vllm_results, key, "dspark")
    assert "load_error" not in r, r["load_error"]
    assert "block_error" not in r, f"{r['block_error']}\n{r['block_traceback']}"
    block_info = r["block"]
    theirs = torch.load(block_info["tensors"])
    ours = DSparkDrafter.from_pretrained(entry["drafter"]).to(dtype).eval()
    cfg = ours.config
    # the export carried the fitted confidence scaling as extra config keys, and vLLM loaded it (above); its adaptive
    # verification reads the head as a plain sigmoid, so ours is compared uncalibrated
    assert cfg.sampled_confidence_calibration, "tests/engines/exports.py calibrates every DSpark variant"
    cfg.confidence_temperatures = cfg.confidence_biases = cfg.sampled_confidence_calibration = None
    ids = torch.tensor(entry["context_ids"])
    T, G = ids.shape[0], cfg.block_size
    bonus = block_info["bonus"]

    assert block_info["dtype"] == entry["dtype"]  # what vLLM computed in
    # the block vLLM's own preparation made
    assert block_info["sample_from_anchor"] is True and block_info["num_query_per_req"] == G
    assert block_info["mask_token_id"] == cfg.mask_token_id
    assert theirs["input_ids"].tolist() == [bonus] + [cfg.mask_token_id] * (G - 1)
    assert theirs["positions"].tolist() == list(range(T, T + G))
    assert theirs["sample_indices"].tolist() == list(range(G)) and int(theirs["seq_len"]) == T + G
    assert theirs["context_positions"].tolist() == list(range(T))
    assert block_info["attn_causal"] == [False] * cfg.num_layers
    assert block_info["use_confidence_head"] is True
    assert block_info["shares_target_embed"] is True

    if dtype == torch.float32:
        # draftsmith's capture on the HF target: equal to what vLLM's target captured, and the same next token
        features, _last, target_logits = target_features(entry["target_dir"], list(cfg.aux_layer_ids), ids)
        aux_scale = features.abs().max().item()
        torch.testing.assert_close(theirs["aux"], features, atol=ENGINE_RTOL * aux_scale, rtol=0)
        assert bonus == int(target_logits[-1].argmax()), "vLLM's target and the HF target disagree on the next token"
    else:
        # vLLM's bfloat16 target drifts from the float32 one through its 8 layers by far more than the drafter's own
        # rounding (here up to ~15 in absolute value; its bonus token can differ): the drafter is compared on the
        # features vLLM gave its drafter
        features = theirs["aux"]

    proposer = DSparkProposer(ours)
    proposer.start([ids.tolist()], [bonus], features[None], torch.ones(1, T, dtype=torch.bool))
    proposal = proposer.propose([ids.tolist() + [bonus]], [True], G, SamplingParams(), [None])

    tokens = theirs["tokens"].tolist()
    with torch.no_grad():
        cache = ours.new_cache()
        ours.extend_context(cache, features[None], torch.arange(T)[None])
        h, base = ours.draft_block(cache, torch.tensor([bonus]), torch.tensor([T]))
        prev = [bonus] + tokens[:-1]
        mine = torch.cat([ours.heads(h[:, i], torch.tensor([prev[i]]), base[:, i])[0] for i in range(G)])
    theirs_logits = theirs["logits"].float()
    assert theirs_logits.shape == mine.shape, (theirs_logits.shape, mine.shape)

    rtol = ENGINE_RTOL if dtype == torch.float32 else BF16_RTOL
    scale = mine.float().abs().max().item()
    diff = (theirs_logits - mine.float()).abs().max().item()
    assert diff <= rtol * scale, f"logits: max |vLLM - ours| {diff:.3g} > {rtol} x scale {scale:.3g}"
    conf_diff = (theirs["confidence"] - torch.tensor(proposal.confidences[0])).abs().max().item()
    assert len(proposal.confidences[0]) == G and conf_diff <= rtol, f"confidences differ by {conf_diff:.3g}"
    if dtype == torch.float32:
        assert tokens == proposal.drafts[0], f"vLLM drafted {tokens}, draftsmith {proposal.drafts[0]}"
    else:
        ids_map = torch.arange(cfg.draft_vocab_size) + ours.d2t
        picked = theirs_logits.argmax(-1)
        assert ids_map[picked].tolist() == tokens  # vLLM's tokens are the target ids of its logits' argmax
        gap = (mine.float().max(-1).values - mine.float().gather(1, picked[:, None])[:, 0]).max().item()
        assert gap <= rtol * scale, f"vLLM picked a token {gap:.3g} below our best logit (scale {scale:.3g})"
