"""DSpark as a family: the `train.dspark` section, the block drafter built from the target, its objective, the
block proposer, confidence calibration after training, and the engine layout.

Export layout: `dspark/`, a DSpark drafter in the speculators DSpark layout (the DFlash-style backbone plus
`markov_head.markov_w1/w2` and `confidence_head.proj`), which vLLM 0.33 translates to `method: dspark`
(`Qwen3DSparkForCausalLM`). Our parameter names are already that layout; the embedding is left out (loaded from the
target); a full draft vocabulary ships no `d2t`/`t2d` (vLLM refuses them then). SGLang 0.5.23 has a DSpark drafter
too, but it reads its own flat config, not this layout. The fitted confidence scaling has no field in the
layout: it travels as the extra config keys `draftsmith_confidence_temperatures`, `draftsmith_confidence_biases` and,
per sampling temperature, `draftsmith_sampled_confidence_calibration` (speculators' configs keep unknown keys; engines
ignore them), so `draftsmith import` restores the calibrated drafter; vLLM's adaptive verification reads
the head uncalibrated (one projection for every position: per-position temperatures cannot be folded into it). Aux
id L and unsorted ids are refused as for EAGLE-3 (`base.engine_refusal`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from draftsmith.drafters.dspark import DSparkConfig, DSparkDrafter
from draftsmith.drafters.objectives import DSparkObjectiveSettings, dspark_calibration_data, dspark_objective
from draftsmith.eval.proposers import DSparkProposer
from draftsmith.pipeline.config import CalibratedSettings
from draftsmith.pipeline.families import register
from draftsmith.pipeline.families.base import (
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


class DSparkSettings(CalibratedSettings):
    """The DSpark-style block drafter (`train.dspark`): one backbone pass drafts a block of γ tokens."""

    block_size: int = Field(7, ge=1)
    """γ: tokens drafted per block; the block input is [anchor, MASK × (γ−1)] and slot k predicts the token
    k+1 after the anchor."""
    num_layers: int = Field(3, ge=1)
    """Backbone decoder layers (the target's features are injected into every layer's keys/values)."""
    markov_rank: int = Field(256, ge=0)
    """Rank r of the sequential bias W1[x_{k-1}] W2 (0 disables it: a plain parallel block drafter)."""
    mask_token_id: int | None = None
    """Token whose (frozen) embedding fills the MASK slots; None = the last id of the target vocabulary."""
    anchors_per_sequence: int = Field(32, ge=1)
    """Most anchors (blocks) drawn per training sequence; re-drawn every epoch."""
    ce_weight: float = Field(0.1, ge=0.0)
    """Weight of the soft cross-entropy to the teacher."""
    tv_weight: float = Field(0.9, ge=0.0)
    """Weight of the total-variation distance to the teacher (1 − acceptance probability)."""
    bce_weight: float = Field(1.0, ge=0.0)
    """Weight of the confidence head's BCE toward the exact acceptance probability."""
    decay: float | None = Field(None, gt=0.0)
    """Slot k (1-based) is weighted exp(−(k−1)/decay); None = block_size."""
    sample_markov_inputs: bool = False
    """Training-time test for the sequential bias: condition slot k on the token the drafter itself sampled at
    slot k−1 (instead of the data token). A slot is then supervised only while the samples before it equal the
    data tokens: the teacher is the target's distribution after the data prefix, unknown after any other."""


def build(parts: TargetParts, s: DSparkSettings) -> DSparkDrafter:
    return DSparkDrafter.from_target(
        parts.config,
        parts.aux_ids,
        parts.draft_vocab_size,
        parts.embed,
        parts.d2t,
        parts.t2d,
        head_weight=parts.head,  # DSpark always uses the target's head rows, frozen
        block_size=s.block_size,
        markov_rank=s.markov_rank,
        mask_token_id=s.mask_token_id,
        **s.shape(),
    )


def objective_settings(train: Any, s: DSparkSettings, seed: int) -> DSparkObjectiveSettings:
    return DSparkObjectiveSettings(
        s.block_size,
        s.anchors_per_sequence,
        s.ce_weight,
        s.tv_weight,
        s.bce_weight,
        s.decay,
        train.temperature,
        s.sample_markov_inputs,
        seed,
    )


def proposer(drafter: DSparkDrafter, e: Any) -> DSparkProposer:
    return DSparkProposer(
        drafter, e.confidence_threshold, draft_length=e.block_draft_length, draft_sample_method=e.draft_sample_method
    )


def calibrate(trainer: TrainContext, directory: Path) -> None:
    calibrate_confidences(trainer, directory, dspark_calibration_data, "holdout blocks")


# ------------------------------------------------------------------------------------------ export


def files(
    model: DSparkDrafter, target_config, target_name: str, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of a DSpark drafter in the speculators `dspark` layout."""
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        if key.startswith("rotary.") or key in ("embed_tokens.weight", "d2t", "t2d"):
            continue
        tensors[key] = value.to(dtype)
    tensors |= vocab_tensors(model)
    layer_config = {
        "model_type": "qwen3",  # the speculators DFlash backbone is Qwen3-style (per-head q/k RMSNorm)
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    if cfg.extra.get("rope_scaling"):
        layer_config["rope_scaling"] = cfg.extra["rope_scaling"]
    config = {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer_config,
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),  # HF hidden_states indices, as speculators reads them
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": True,  # slot 0 predicts the token after the anchor: block_size drafted tokens
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": cfg.markov_rank > 0,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_name,
                "architectures": list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"]),
            },
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return tensors, config | calibration_config(cfg)


def export(model: DSparkDrafter, ctx: ExportContext) -> list[ExportedDirectory]:
    if "vllm" not in ctx.formats and "speculators" not in ctx.formats:
        return []
    cfg = model.config
    refusal = engine_refusal(cfg.aux_layer_ids, ctx.target_config)
    if refusal:
        return [ExportedDirectory("dspark", {}, {}, [f"DSpark: not exported: {refusal}.", ""], refused=refusal)]
    tensors, config = files(model, ctx.target_config, ctx.target_name, ctx.dtype)
    spec = {"method": "dspark", "model": str(ctx.root / "dspark"), "num_speculative_tokens": cfg.block_size}
    readme = [
        "## DSpark block drafter (speculators DSpark layout, vLLM `method: dspark`)",
        "",
        f"{cfg.num_layers} backbone layers, block {cfg.block_size}, sequential-bias rank "
        f"{cfg.markov_rank}, draft vocab {cfg.draft_vocab_size}, aux layers {cfg.aux_layer_ids}.",
        "",
        "```bash",
        f"vllm serve {ctx.target_name} --speculative-config '{json.dumps(spec)}'",
        "```",
        "",
        "SGLang's DSpark drafter reads another config layout: this directory is for vLLM.",
        "",
        'vLLM reads the confidence head only with `"enable_adaptive_verification": true` in the speculative '
        "config, and as a plain sigmoid: the per-position scaling draftsmith fitted "
        "(`draftsmith_confidence_temperatures` and `_biases` in config.json) is not applied there (vLLM 0.33).",
        "",
    ]
    return [ExportedDirectory("dspark", tensors, config, readme)]


def import_export(directory: Path, raw: dict[str, Any], embed_weight: torch.Tensor | None) -> DSparkDrafter | None:
    """Our DSpark drafter from a speculators `dspark` directory, refusing variants it does not compute."""
    if raw.get("speculators_model_type") != "dspark":
        return None
    unsupported = {
        "sample_from_anchor": (raw.get("sample_from_anchor"), True),
        "markov_head_type": (raw.get("markov_head_type", "vanilla"), "vanilla"),
        "enable_confidence_head": (raw.get("enable_confidence_head", True), True),
        "confidence_head_with_markov": (raw.get("confidence_head_with_markov"), raw.get("markov_rank", 0) > 0),
    }
    wrong = {k: have for k, (have, want) in unsupported.items() if have != want}
    if wrong:
        raise ValueError(
            f"{directory}: a DSpark variant draftsmith does not compute ({wrong}); it needs "
            "sample_from_anchor=true, a vanilla Markov head and a confidence head reading it when present"
        )
    lc = raw["transformer_layer_config"]
    cfg = DSparkConfig(
        vocab_size=lc["vocab_size"],
        draft_vocab_size=raw["draft_vocab_size"],
        hidden_size=lc["hidden_size"],
        target_hidden_size=raw["target_hidden_size"],
        num_attention_heads=lc["num_attention_heads"],
        num_key_value_heads=lc["num_key_value_heads"],
        head_dim=lc.get("head_dim") or lc["hidden_size"] // lc["num_attention_heads"],
        intermediate_size=lc["intermediate_size"],
        aux_layer_ids=raw["aux_hidden_state_layer_ids"],
        mask_token_id=raw["mask_token_id"],
        block_size=raw["block_size"],
        num_layers=lc["num_hidden_layers"],
        markov_rank=raw.get("markov_rank", 0),
        rms_norm_eps=lc["rms_norm_eps"],
        rope_theta=lc.get("rope_theta", 10000.0),
        max_position_embeddings=lc["max_position_embeddings"],
        hidden_act=lc.get("hidden_act", "silu"),
        **calibration_fields(raw),
        extra={"rope_scaling": lc["rope_scaling"]} if lc.get("rope_scaling") else {},
    )
    extra = implied_vocab(directory, cfg.vocab_size, cfg.draft_vocab_size)
    return load_renamed_weights(DSparkDrafter(cfg), directory, embed_weight, {}, extra)


FAMILY = register(
    Family(
        name="dspark",
        settings=DSparkSettings,
        model_class=DSparkDrafter,
        build=build,
        objective=dspark_objective,
        objective_settings=objective_settings,
        proposer=proposer,
        export=export,
        import_export=import_export,
        after_training=calibrate,
    )
)
