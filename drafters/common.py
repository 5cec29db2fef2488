"""What every drafter family shares: the shape fields it takes from the target's config, fp32 RoPE tables,
and the checkpoint format (model.safetensors + config.json naming the family)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def target_shape_fields(target_config, aux_layer_ids: list[int], draft_vocab_size: int) -> dict[str, Any]:
    """Drafter config fields copied from the target's HF config (the defaults every family starts from)."""
    head_dim = (
        getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    )
    rope = getattr(target_config, "rope_parameters", None) or {}
    return dict(
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=target_config.hidden_size,
        target_hidden_size=target_config.hidden_size,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=target_config.intermediate_size,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        max_position_embeddings=target_config.max_position_embeddings,
    )


class DrafterConfigMixin:
    """Shared by the drafter config dataclasses: the HF Llama config of their decoder layers (for the RoPE,
    MLP and RMSNorm modules) and the dict round trip of config.json."""

    # The fields the mixin reads, declared for the type checker (the subclasses are dataclasses with these
    # fields; bare annotations on this plain class create no attributes and no dataclass fields).
    __dataclass_fields__: ClassVar[dict[str, Any]]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    rope_theta: float
    extra: dict[str, Any]
    confidence_temperatures: list[float] | None
    confidence_biases: list[float] | None
    sampled_confidence_calibration: dict[str, dict[str, list[float]]] | None
    greedy_confidence_calibration: dict[str, dict[str, list[float]]] | None

    def layer_config(self) -> LlamaConfig:
        # rope_theta is a constructor argument in transformers 4.x; 5.x still accepts it (folding it into
        # rope_parameters) but no longer declares it, so it travels with the other version-dependent keywords
        version_dependent: dict[str, Any] = {
            "rope_theta": self.rope_theta,
            **{k: v for k, v in self.extra.items() if k in ("rope_scaling",)},
        }
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            **version_dependent,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**d)


class DrafterBase(torch.nn.Module):
    """Checkpoint I/O and RoPE for drafters with `config` (a dataclass with to_dict/from_dict), a `rotary`
    module and an fp32 `_inv_freq`. Subclasses set `name` and `config_class`."""

    name: str
    config_class: Any
    # set by the subclasses' __init__ (declared so that nn.Module's dynamic attribute lookup is not what types them)
    config: DrafterConfigMixin
    rotary: LlamaRotaryEmbedding
    _inv_freq: torch.Tensor
    d2t: torch.Tensor  # registered buffer: draft id -> target id offset
    t2d: torch.Tensor  # registered buffer: target id -> in the draft vocabulary

    def _rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos/sin of RoPE at `positions`, computed in fp32 and cast to the activations' dtype. The fp32 frequencies
        move to the positions' device once and stay there: a copy from host memory on every forward would make each
        step wait for the device."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.rotary.attention_scaling
        return (emb.cos() * scale).to(like.dtype), (emb.sin() * scale).to(like.dtype)

    def calibrated(
        self, conf_logits: torch.Tensor, slot: int, sampling: float | None = None, greedy_drafts: bool = False
    ) -> torch.Tensor:
        """Confidence probability of draft position `slot` after the fitted scaling σ(z / T + b) (positions past the
        fitted ones take the last), with the scaling fitted at the sampling temperature nearest `sampling` (the one
        drafts are drawn at; None: the training temperature's). What a confidence predicts is the chance its draft is
        accepted, and that depends on the temperature: on the demo's EAGLE-3 holdout, 32% of first slots were
        accepted at T = 0 and 26% (Σ min(p, q)) at T = 1. It depends on how drafts are drawn too: with
        `greedy_drafts` at a temperature above 0 (the drafter's argmax, kept with the target's probability of it), the
        scaling fitted for such drafts where there is one (`greedy_confidence_calibration`), else the sampled one."""
        temps, biases = self.config.confidence_temperatures, self.config.confidence_biases
        fitted = self.config.sampled_confidence_calibration
        if greedy_drafts and sampling and self.config.greedy_confidence_calibration:
            fitted = self.config.greedy_confidence_calibration
        if sampling is not None and fitted:
            nearest = fitted[min(fitted, key=lambda t: abs(float(t) - sampling))]
            temps, biases = nearest["temperatures"], nearest["biases"]
        t = temps[min(slot, len(temps) - 1)] if temps else 1.0
        b = biases[min(slot, len(biases) - 1)] if biases else 0.0
        return torch.sigmoid(conf_logits.float() / t + b)

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """model.safetensors + config.json. `state_dict` overrides the module's own (e.g. gathered under ZeRO-3)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.state_dict()
        state = {k: v.detach().contiguous().cpu() for k, v in state.items() if not k.startswith("rotary.")}
        save_file(state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"drafter": self.name, **self.config.to_dict()}, indent=2))

    @classmethod
    def from_pretrained(cls, directory: str | Path):
        from safetensors.torch import load_file

        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text())
        raw.pop("drafter", None)
        model = cls(cls.config_class.from_dict(raw))
        missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(
                f"{directory}: checkpoint does not match the drafter (missing {missing}, unexpected {unexpected})"
            )
        return model
