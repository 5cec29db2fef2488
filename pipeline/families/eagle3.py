"""EAGLE-3 as a family: the `train.eagle3` section, the drafter built from the target, the TTT objective, the
chain/tree proposer, and the engine layouts.

Export layouts, as vLLM 0.33, SGLang 0.5.23 and speculators 0.9.0 read them (tests/engines/ runs their own code):
- `eagle3/`: `midlayer.*` names, top-level aux ids in vLLM numbering (HF hidden_states indices) and
  `num_aux_hidden_states` (both engines size `fc` from it, not from the id list). When SGLang computes what we
  trained (exactly 1 layer: its later layers norm with `hidden_norm`; norm_before_residual=false: it ignores the
  flag; every aux id >= 1: it numbers layers by output), the architecture is `LlamaForCausalLMEagle3` and a nested
  `eagle_config` holds the ids in SGLang numbering (one lower), so both engines load it. Otherwise it is written for
  vLLM alone, as `Eagle3LlamaForCausalLM`: a name in vLLM's registry and not in SGLang's, so SGLang refuses the
  directory instead of loading it with default aux layers and untrained norms. The embedding is not written: both
  engines share the target's.
- `speculators/`: the vllm-project/speculators layout (`layers.N.*`, `embed_tokens`, `speculators_config`).
  `num_aux_hidden_states` goes inside `transformer_layer_config`, which vLLM's translation starts its config from.
- A full draft vocabulary (draft vocab == target vocab) ships no `d2t`/`t2d`: vLLM creates its draft-to-target
  map only when the vocabularies differ and refuses the tensor otherwise; ours is then the identity (draft ids are
  ordered by target id).
- No engine directory is written for a drafter fusing aux id L (the target's layer count: here the final *normed*
  output, which vLLM captures before the final norm and SGLang never captures) or with aux ids out of ascending
  order (both engines concatenate in layer order): they would load and compute something else.
- EAGLE-3's confidence head is draftsmith's own (adaptive verification in `eval`): neither engine's EAGLE-3 model has
  one, and vLLM refuses a tensor its model lacks. So both directories carry it beside the engines' file, in
  `draftsmith/confidence.safetensors` (`base.CONFIDENCE_FILE`, a subfolder neither engine reads), and its fitted
  scaling as the extra config keys DSpark's export uses (`base.calibration_config`): `draftsmith import` gives back the
  calibrated drafter. An EAGLE-3 directory without that file (another trainer's) imports with an untrained head,
  marked `confidence_trained: false`, which eval drafts at fixed γ.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_calibration_data, eagle3_objective
from draftsmith.eval.proposers import Eagle3Proposer
from draftsmith.pipeline.config import CalibratedSettings
from draftsmith.pipeline.families import register
from draftsmith.pipeline.families.base import (
    CONFIDENCE_FILE,
    ExportContext,
    ExportedDirectory,
    Family,
    TargetParts,
    TrainContext,
    calibrate_confidences,
    calibration_config,
    calibration_fields,
    engine_refusal,
    implied_vocab,
    load_renamed_weights,
    vocab_tensors,
)

log = logging.getLogger(__name__)


class Eagle3Settings(CalibratedSettings):
    """The EAGLE-3 drafter (`train.eagle3`): a fused-feature decoder layer trained with training-time test."""

    num_layers: int = Field(1, ge=1)
    """Drafter decoder layers (SGLang serves only 1)."""
    ttt_steps: int = Field(7, ge=1)
    """Training-time-test unroll length k."""
    step_decay: float = Field(0.8, gt=0.0, le=1.0)
    """Loss weight of TTT step i is step_decay**i."""
    loss: Literal["ce", "tv", "accept"] = "ce"
    """Per-position loss: soft cross-entropy to the teacher (forward KL), total variation, or -log acceptance."""
    confidence_weight: float = Field(1.0, ge=0.0)
    """Weight of the confidence head's BCE loss."""
    init_head_from_target: bool = True
    """Start the (trainable) `lm_head` from the target's LM head rows of the draft vocab instead of random."""


def build(parts: TargetParts, s: Eagle3Settings) -> Eagle3Drafter:
    extra: dict[str, Any] = {"head_weight": parts.head} if s.init_head_from_target else {}
    return Eagle3Drafter.from_target(
        parts.config, parts.aux_ids, parts.draft_vocab_size, parts.embed, parts.d2t, parts.t2d, **extra, **s.shape()
    )


def objective_settings(train: Any, s: Eagle3Settings, seed: int) -> ObjectiveSettings:
    return ObjectiveSettings(
        s.ttt_steps, s.step_decay, s.loss, train.temperature, s.confidence_weight, train.gradient_checkpointing
    )


def calibrate(trainer: TrainContext, directory: Path) -> None:
    calibrate_confidences(trainer, directory, eagle3_calibration_data, "holdout chains")


def proposer(drafter: Eagle3Drafter, e: Any) -> Eagle3Proposer:
    return Eagle3Proposer(drafter, e.confidence_threshold, e.draft_sample_method)


# ------------------------------------------------------------------------------------------ export


def _layer_key(key: str, first: str) -> str | None:
    """Our parameter name -> the exported one; `first` is the name of layer 0 (`midlayer` or `layers.0`).
    Extra layers (our `layers.j`) become layer j+1. None: not exported."""
    if key.startswith("confidence.") or key.startswith("rotary."):
        return None
    if key.startswith("midlayer."):
        return first + key[len("midlayer") :]
    if key.startswith("layers."):
        _, j, rest = key.split(".", 2)
        return f"layers.{int(j) + 1}.{rest}"
    return key


def sglang_refusal(cfg: Eagle3Config) -> str | None:
    """Why SGLang 0.5.23 would not compute this drafter as trained, or None."""
    if cfg.num_layers != 1:
        return (
            f"SGLang's EAGLE-3 drafter norms layers after the first with `hidden_norm`, so only 1 layer computes as "
            f"trained (this one has {cfg.num_layers})"
        )
    if cfg.norm_before_residual:
        return "SGLang ignores norm_before_residual and computes only norm_before_residual=false"
    if min(cfg.aux_layer_ids) < 1:
        return "SGLang numbers aux layers by layer output, so HF index 0 (the embeddings) cannot be expressed"
    return None


def _llama_fields(cfg: Eagle3Config, target_config) -> dict[str, Any]:
    fields = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,  # the TARGET vocabulary, as both engines read it
        "num_hidden_layers": cfg.num_layers,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(target_config, key, None)
        if value is not None:
            fields[key] = value
    return fields


def engine_files(
    model: Eagle3Drafter, target_config, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of the vLLM/SGLang `eagle3` directory."""
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        name = _layer_key(key, "midlayer")
        if name is None or name in ("embed_tokens.weight", "d2t", "t2d"):
            continue
        tensors[name] = value.to(dtype)
    tensors |= vocab_tensors(model)
    sglang = sglang_refusal(cfg) is None
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if sglang else "Eagle3LlamaForCausalLM"],
        **_llama_fields(cfg, target_config),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "num_aux_hidden_states": len(cfg.aux_layer_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if sglang:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]}
    return tensors, config | calibration_config(cfg)


def speculators_files(
    model: Eagle3Drafter, target_config, target_name: str, dtype: torch.dtype, speculative_tokens: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        name = _layer_key(key, "layers.0")
        if name is None or name in ("d2t", "t2d"):
            continue
        tensors[name] = value.to(dtype)
    tensors |= vocab_tensors(model)
    layer_config = _llama_fields(cfg, target_config)
    layer_config["architectures"] = ["LlamaForCausalLM"]
    # vLLM's speculators translation starts the drafter's config from this dict and sizes fc from this key
    layer_config["num_aux_hidden_states"] = len(cfg.aux_layer_ids)
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer_config,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,  # its loader defaults to true when missing
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_name,
                "architectures": list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"]),
            },
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return tensors, config | calibration_config(cfg)


def confidence_sidecar(model: Eagle3Drafter, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """The confidence head's tensors, under our names, as the `CONFIDENCE_FILE` of an engine directory (nothing for a
    drafter whose head was never trained: an export must not pass an initialisation off as a trained head)."""
    if not model.config.confidence_trained:
        return {}
    head = {k: v.to(dtype) for k, v in model.state_dict().items() if k.startswith("confidence.")}
    return {CONFIDENCE_FILE: head}


def export(model: Eagle3Drafter, ctx: ExportContext) -> list[ExportedDirectory]:
    cfg, k = model.config, ctx.draft_length
    refusal = engine_refusal(cfg.aux_layer_ids, ctx.target_config)
    if refusal:
        return [ExportedDirectory("eagle3", {}, {}, [f"EAGLE-3: not exported: {refusal}.", ""], refused=refusal)]
    out, lines = (
        [],
        [
            f"EAGLE-3: {cfg.num_layers} layer(s), draft vocab {cfg.draft_vocab_size}, aux layers "
            f"{cfg.aux_layer_ids} (HF hidden_states indices).",
            "",
        ],
    )
    if "vllm" in ctx.formats or "sglang" in ctx.formats:
        sglang = sglang_refusal(cfg)
        tensors, config = engine_files(model, ctx.target_config, ctx.dtype)
        spec = json.dumps({"method": "eagle3", "model": str(ctx.root / "eagle3"), "num_speculative_tokens": k})
        lines += ["## EAGLE-3 on vLLM", "", "```bash", f"vllm serve {ctx.target_name} --speculative-config '{spec}'"]
        lines += [
            "```",
            "",
            "At T > 0 vLLM drafts the drafter's argmax by default (`draft_sample_method` `greedy`: kept with the "
            "target's probability of it); draftsmith's eval draws each draft from the drafter's distribution unless "
            "`eval.draft_sample_method=greedy`. To serve drafts drawn as eval drew them, add "
            '`"draft_sample_method": "probabilistic"` to the speculative config; which keeps more drafts is the '
            "drafter's (`launch/bench_draft_sampling.py` measures both on the eval prompts).",
            "",
            "## EAGLE-3 on SGLang",
            "",
        ]
        if sglang:
            lines += [f"Not loadable by SGLang (written as a vLLM-only architecture, which SGLang refuses): {sglang}."]
            lines += [""]
        else:
            lines += [
                "```bash",
                f"python -m sglang.launch_server --model-path {ctx.target_name} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {ctx.root / 'eagle3'} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                "```",
                "",
            ]
        notes = [f"eagle3/ is for vLLM only: {sglang}"] if sglang and "sglang" in ctx.formats else []
        out.append(
            ExportedDirectory("eagle3", tensors, config, lines, notes, sidecars=confidence_sidecar(model, ctx.dtype))
        )
        lines = []
    if "speculators" in ctx.formats:
        tensors, config = speculators_files(model, ctx.target_config, ctx.target_name, ctx.dtype, k)
        lines += ["## EAGLE-3, speculators format", "", "```bash"]
        if ctx.hub_target:
            lines += [f"vllm serve {ctx.root / 'speculators'}      # the verifier named in its config"]
        else:
            # vLLM 0.33 serves `vllm serve DIR` only for a verifier that is a hub repository; a local target is named
            # explicitly, with the directory as the speculative model
            spec = json.dumps({"method": "eagle3", "model": str(ctx.root / "speculators"), "num_speculative_tokens": k})
            lines += [f"vllm serve {ctx.target_name} --speculative-config '{spec}'"]
        lines += ["```", ""]
        if not ctx.hub_target:
            lines += ["(`vllm serve DIR` alone refuses a verifier that is a local path.)", ""]
        out.append(
            ExportedDirectory("speculators", tensors, config, lines, sidecars=confidence_sidecar(model, ctx.dtype))
        )
    return out


def import_export(directory: Path, raw: dict[str, Any], embed_weight: torch.Tensor | None) -> Eagle3Drafter | None:
    speculators = raw.get("speculators_model_type") == "eagle3"
    archs = raw.get("architectures", [])
    if not speculators and "LlamaForCausalLMEagle3" not in archs and "Eagle3LlamaForCausalLM" not in archs:
        return None
    lc = raw["transformer_layer_config"] if speculators else raw
    cfg = Eagle3Config(
        vocab_size=lc["vocab_size"],
        draft_vocab_size=raw["draft_vocab_size"],
        hidden_size=lc["hidden_size"],
        target_hidden_size=raw["target_hidden_size"],
        num_attention_heads=lc["num_attention_heads"],
        num_key_value_heads=lc["num_key_value_heads"],
        head_dim=lc.get("head_dim") or lc["hidden_size"] // lc["num_attention_heads"],
        intermediate_size=lc["intermediate_size"],
        aux_layer_ids=raw["eagle_aux_hidden_state_layer_ids"],
        rms_norm_eps=lc["rms_norm_eps"],
        rope_theta=lc.get("rope_theta", 10000.0),
        max_position_embeddings=lc["max_position_embeddings"],
        num_layers=lc["num_hidden_layers"],
        norm_before_residual=raw["norm_before_residual"],
        hidden_act=lc.get("hidden_act", "silu"),
        **(calibration_fields(raw) | _confidence_shape(directory)),
    )
    first = "layers.0" if speculators else "midlayer"
    # the engines' names -> ours: the first layer is our `midlayer`, later ones shift down by one
    renames = {first + ".": "midlayer."} | {f"layers.{j}.": f"layers.{j - 1}." for j in range(1, cfg.num_layers)}
    extra = implied_vocab(directory, cfg.vocab_size, cfg.draft_vocab_size)
    return load_renamed_weights(Eagle3Drafter(cfg), directory, embed_weight, renames, extra)


def _confidence_shape(directory: Path) -> dict[str, Any]:
    """The config fields of the confidence head an export carries (`CONFIDENCE_FILE`): its width, read off its first
    layer; without the file, an untrained head (`confidence_trained` false) and no scaling to read."""
    from safetensors import safe_open

    if not (directory / CONFIDENCE_FILE).is_file():
        log.warning(
            "%s carries no EAGLE-3 confidence head (%s): the imported drafter's head is untrained, and eval drafts it "
            "at fixed γ",
            directory,
            CONFIDENCE_FILE,
        )
        return {"confidence_trained": False} | dict.fromkeys(calibration_fields({}))
    with safe_open(str(directory / CONFIDENCE_FILE), "pt") as f:
        return {"confidence_hidden": f.get_slice("confidence.0.weight").get_shape()[0]}


FAMILY = register(
    Family(
        name="eagle3",
        settings=Eagle3Settings,
        model_class=Eagle3Drafter,
        build=build,
        objective=eagle3_objective,
        objective_settings=objective_settings,
        proposer=proposer,
        export=export,
        import_export=import_export,
        after_training=calibrate,
        trees=True,
    )
)
