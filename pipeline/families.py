"""What differs per drafter family in training (objective settings, constructor shape, fused aux layers,
optimizer overrides), read from the run config: shared by `train` and the budget's training probe."""

from __future__ import annotations

from typing import Any

from draftsmith.drafters.objectives import DSparkObjectiveSettings, ObjectiveSettings
from draftsmith.pipeline.config import RunConfig


def family_settings(cfg: RunConfig, family: str) -> dict[str, Any]:
    """What differs per family: the objective settings, the constructor's shape arguments, the aux layers it
    fuses (None: all captured), and its optimizer overrides."""
    t = cfg.train
    if family == "eagle3":
        return {
            "objective": ObjectiveSettings(
                t.ttt_steps, t.step_decay, t.loss, t.temperature, t.confidence_weight, t.gradient_checkpointing
            ),
            "shape": dict(
                num_layers=t.num_layers,
                intermediate_size=t.intermediate_size,
                num_attention_heads=t.num_attention_heads,
                num_key_value_heads=t.num_key_value_heads,
                head_dim=t.head_dim,
            ),
            "aux": None,
            "lr": t.lr,
            "epochs": t.epochs,
            "max_steps": t.max_steps,
        }
    d = t.dspark
    return {
        "objective": DSparkObjectiveSettings(
            d.block_size,
            d.anchors_per_sequence,
            d.ce_weight,
            d.tv_weight,
            d.bce_weight,
            d.decay,
            t.temperature,
            d.sample_markov_inputs,
            cfg.seed,
        ),
        "shape": dict(
            num_layers=d.num_layers,
            intermediate_size=d.intermediate_size,
            num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
            block_size=d.block_size,
            markov_rank=d.markov_rank,
            mask_token_id=d.mask_token_id,
        ),
        "aux": d.aux_layer_ids,
        "lr": d.lr or t.lr,
        "epochs": d.epochs or t.epochs,
        "max_steps": d.max_steps or t.max_steps,
    }
