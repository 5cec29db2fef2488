"""What every drafter family shares: the shape fields it takes from the target's config, fp32 RoPE tables,
and the checkpoint format (model.safetensors + config.json naming the family)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig


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

    def layer_config(self) -> LlamaConfig:
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
            rope_theta=self.rope_theta,
            **{k: v for k, v in self.extra.items() if k in ("rope_scaling",)},
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

    def _rope(self, positions: torch.Tensor, like: torch.Tensor):
        """cos/sin of RoPE at `positions`, computed in fp32 and cast to the activations' dtype."""
        freqs = positions[..., None].float() * self._inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.rotary.attention_scaling
        return (emb.cos() * scale).to(like.dtype), (emb.sin() * scale).to(like.dtype)

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
