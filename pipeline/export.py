"""`draftsmith export` / `draftsmith import`: drafters in the layouts serving engines load as they are.

Formats (each checked against the engines' loaders; README's export section states them):
- `eagle3/`: one directory both vLLM (`method: eagle3`) and SGLang (`EAGLE3`) load: `midlayer.*` names,
  `LlamaForCausalLMEagle3`, top-level aux ids in vLLM numbering (HF hidden_states indices) and a nested
  `eagle_config` copy in SGLang numbering (one lower). SGLang takes exactly 1 layer, 3 aux layers and
  norm_before_residual=false; a drafter outside that is written for vLLM only, and the SGLang refusal is
  reported. The embedding is not written: both engines share the target's.
- `speculators/`: the vllm-project/speculators layout (`Eagle3Speculator`, `layers.N.*`, `embed_tokens`,
  `t2d`, `d2t`, `speculators_config`), which `vllm serve DIR` serves directly.
- `dspark/`: a DSpark drafter in the speculators DSpark layout (`DSparkSpeculator`: the DFlash-style
  backbone plus `markov_head.markov_w1/w2` and `confidence_head.proj`), for vLLM's `method: dspark`. Our
  parameter names are already that layout; the embedding is left out (loaded from the target). SGLang has no
  DSpark drafter.
EAGLE-3's confidence head is draftsmith's own (adaptive verification in `eval`) and is not exported; DSpark's
is part of the layout. DSpark's fitted confidence temperatures have no field in the layout: they travel as the
extra config key `draftsmith_confidence_temperatures` (speculators' configs keep unknown keys; engines ignore
it), so `draftsmith import` restores the calibrated drafter.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from draftsmith.data.artifacts import write_manifest
from draftsmith.drafters.common import DrafterBase
from draftsmith.drafters.dspark import DSparkConfig, DSparkDrafter
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.drafters.registry import load_drafter
from draftsmith.pipeline.completion import stage_inputs
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console
from draftsmith.pipeline.dist import single_writer
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.inputs import trained_drafter
from draftsmith.pipeline.layout import MANIFEST, RunLayout
from draftsmith.pipeline.target import load_config_of, load_head_weights, resolve_target

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------------------------ names


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
    """Why SGLang cannot load this drafter, or None."""
    if cfg.num_layers != 1:
        return f"SGLang's EAGLE-3 drafter has exactly 1 layer (this one has {cfg.num_layers})"
    if len(cfg.aux_layer_ids) != 3:
        return f"SGLang reads exactly 3 aux layers (this drafter uses {len(cfg.aux_layer_ids)})"
    if cfg.norm_before_residual:
        return "SGLang implements only norm_before_residual=false"
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


def eagle3_engine_files(
    model: Eagle3Drafter, target_config, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of the vLLM/SGLang `eagle3` directory."""
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        name = _layer_key(key, "midlayer")
        if name is None or name == "embed_tokens.weight":
            continue
        tensors[name] = value if key in ("d2t", "t2d") else value.to(dtype)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(cfg, target_config),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if len(cfg.aux_layer_ids) != 3:
        config["num_aux_hidden_states"] = len(cfg.aux_layer_ids)
    if sglang_refusal(cfg) is None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids]}
    return tensors, config


def speculators_files(
    model: Eagle3Drafter, target_config, target_name: str, dtype: torch.dtype, speculative_tokens: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        name = _layer_key(key, "layers.0")
        if name is None:
            continue
        tensors[name] = value if key in ("d2t", "t2d") else value.to(dtype)
    layer_config = _llama_fields(cfg, target_config)
    layer_config["architectures"] = ["LlamaForCausalLM"]
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
    return tensors, config


def dspark_files(
    model, target_config, target_name: str, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of a DSpark drafter in the speculators `dspark` layout."""
    cfg = model.config
    tensors = {}
    for key, value in model.state_dict().items():
        if key.startswith("rotary.") or key == "embed_tokens.weight":
            continue
        tensors[key] = value if key in ("d2t", "t2d") else value.to(dtype)
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
    if cfg.confidence_temperatures:
        config["draftsmith_confidence_temperatures"] = list(cfg.confidence_temperatures)
    return tensors, config


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------------------- import


def import_drafter(directory: str | Path, embed_weight: torch.Tensor | None = None) -> DrafterBase:
    """Load an exported directory (eagle3, speculators or dspark layout, or a draftsmith checkpoint) as our drafter
    class. The engine layouts carry no embedding: pass the target's (`embed_weight`)."""
    directory = Path(directory)
    raw = json.loads((directory / "config.json").read_text())
    if "drafter" in raw:
        return load_drafter(directory)
    if raw.get("speculators_model_type") == "dspark":
        return _load_weights(_dspark_from_config(directory, raw), directory, embed_weight, {})
    speculators = raw.get("speculators_model_type") == "eagle3"
    if not speculators and "LlamaForCausalLMEagle3" not in raw.get("architectures", []):
        raise StageError(f"{directory}: not an EAGLE-3 or DSpark export (architectures {raw.get('architectures')})")
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
    )
    first = "layers.0" if speculators else "midlayer"
    # the engines' names -> ours: the first layer is our `midlayer`, later ones shift down by one
    renames = {first + ".": "midlayer."} | {f"layers.{j}.": f"layers.{j - 1}." for j in range(1, cfg.num_layers)}
    return _load_weights(Eagle3Drafter(cfg), directory, embed_weight, renames)


def _dspark_from_config(directory: Path, raw: dict[str, Any]) -> DSparkDrafter:
    """Our DSpark drafter shaped by a speculators `dspark` config.json, refusing variants it does not compute."""
    unsupported = {
        "sample_from_anchor": (raw.get("sample_from_anchor"), True),
        "markov_head_type": (raw.get("markov_head_type", "vanilla"), "vanilla"),
        "enable_confidence_head": (raw.get("enable_confidence_head", True), True),
        "confidence_head_with_markov": (raw.get("confidence_head_with_markov"), raw.get("markov_rank", 0) > 0),
    }
    wrong = {k: have for k, (have, want) in unsupported.items() if have != want}
    if wrong:
        raise StageError(
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
        confidence_temperatures=raw.get("draftsmith_confidence_temperatures"),
        extra={"rope_scaling": lc["rope_scaling"]} if lc.get("rope_scaling") else {},
    )
    return DSparkDrafter(cfg)


def _load_weights(
    model: DrafterBase, directory: Path, embed_weight: torch.Tensor | None, renames: dict[str, str]
) -> DrafterBase:
    """Fill `model` from DIRECTORY/model.safetensors (names renamed by prefix), the embedding from the target when
    the export has none; refuses missing or unexpected tensors. Keeps the export's dtype."""
    ours = {}
    for key, value in load_file(str(directory / "model.safetensors")).items():
        prefix = next((p for p in renames if key.startswith(p)), None)
        ours[renames[prefix] + key[len(prefix) :] if prefix else key] = value
    if "embed_tokens.weight" not in ours:
        if embed_weight is None:
            raise StageError(f"{directory} has no embedding (engines share the target's); pass the target to import it")
        ours["embed_tokens.weight"] = embed_weight
    state = model.state_dict()
    missing = [k for k in state if k not in ours and not k.startswith(("confidence.", "rotary."))]
    unexpected = [k for k in ours if k not in state]
    if missing or unexpected:
        raise StageError(f"{directory}: weights do not match the drafter (missing {missing}, unexpected {unexpected})")
    dtype = ours["fc.weight"].dtype
    model.load_state_dict({**state, **{k: v.to(state[k].dtype) for k, v in ours.items()}})
    return model.to(dtype) if dtype != torch.float32 else model


# ------------------------------------------------------------------------------------------ stage


def _readme(
    formats: dict[str, Path], cfg: RunConfig, models: dict[str, Any], target_name: str, refusal: str | None, k: int
) -> str:
    lines = [f"# Drafters for `{target_name}`", ""]
    if "eagle3" in models:
        m = models["eagle3"]
        lines += [
            f"EAGLE-3: {m.config.num_layers} layer(s), draft vocab {m.config.draft_vocab_size}, aux layers "
            f"{m.config.aux_layer_ids} (HF hidden_states indices).",
            "",
        ]
    if "eagle3" in formats:
        d = formats["eagle3"]
        lines += [
            "## EAGLE-3 on vLLM",
            "",
            "```bash",
            f"vllm serve {target_name} --speculative-config '{json.dumps({'method': 'eagle3', 'model': str(d), 'num_speculative_tokens': k})}'",
            "```",
            "",
            "## EAGLE-3 on SGLang",
            "",
        ]
        if refusal:
            lines += [f"Not loadable by SGLang: {refusal}.", ""]
        else:
            lines += [
                "```bash",
                f"python -m sglang.launch_server --model-path {target_name} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {d} --speculative-num-steps {k} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {k + 1}",
                "```",
                "",
            ]
    if "speculators" in formats:
        lines += [
            "## EAGLE-3, speculators format (vLLM serves it directly)",
            "",
            "```bash",
            f"vllm serve {formats['speculators']}",
            "```",
            "",
        ]
    if "dspark" in formats:
        m = models["dspark"]
        lines += [
            "## DSpark block drafter (speculators DSpark layout, vLLM `method: dspark`)",
            "",
            f"{m.config.num_layers} backbone layers, block {m.config.block_size}, sequential-bias rank "
            f"{m.config.markov_rank}, draft vocab {m.config.draft_vocab_size}, aux layers {m.config.aux_layer_ids}.",
            "",
            "```bash",
            f"vllm serve {target_name} --speculative-config '{json.dumps({'method': 'dspark', 'model': str(formats['dspark']), 'num_speculative_tokens': m.config.block_size})}'",
            "```",
            "",
            "SGLang has no DSpark drafter.",
            "",
        ]
    layout = RunLayout.of(cfg)
    for family in models:
        train_manifest = layout.train(family).manifest
        if train_manifest.is_file():
            tm = json.loads(train_manifest.read_text())
            lines += [
                f"## Training ({family})",
                "",
                f"{tm.get('steps')} optimizer steps, best holdout simulated τ "
                f"{tm.get('best_holdout_tau')}; features from `{layout.features}`.",
                "",
            ]
    feats = layout.features / MANIFEST
    if feats.is_file():
        fm = json.loads(feats.read_text())
        lines += [
            f"Training data: {fm['counts']['samples']} conversations, {fm['counts']['tokens']} tokens "
            f"({fm['counts']['supervised_tokens']} assistant tokens).",
            "",
        ]
    eval_json = layout.eval_json
    if eval_json.is_file():
        ev = json.loads(eval_json.read_text())
        lines += [
            "## Measured acceptance length (draftsmith eval)",
            "",
            "| T | drafter | domain | τ | speedup |",
            "|---|---|---|---|---|",
        ]
        for run in ev["runs"]:
            for name in [d for d in run["drafters"] if d in models]:
                for domain, row in run["domains"].items():
                    st = row[name]
                    lines.append(
                        f"| {run['temperature']} | {name} | {domain} | {st['tau']:.2f} | {st.get('speedup', 0):.2f}x |"
                    )
        lines.append("")
    return "\n".join(lines)


@single_writer
def run_export(cfg: RunConfig, drafter: str | None = None) -> Path:
    """Export the trained drafter(s): `drafter` (a directory), else every family of train.drafters."""
    x = cfg.export
    spec = resolve_target(cfg.model)
    sources = (
        [trained_drafter(cfg, spec.identity(), drafter)]
        if drafter
        else [trained_drafter(cfg, spec.identity(), None, family) for family in cfg.train.drafters]
    )
    models = {}
    for source in sources:
        model = load_drafter(source)
        models[model.name] = model
    target_config = load_config_of(cfg.model, spec)
    target_name = spec.location if spec.kind != "gguf" else spec.name
    dtype = DTYPES[x.dtype]
    layout = RunLayout.of(cfg)
    out = layout.export
    if out.exists():
        shutil.rmtree(out)
    written: dict[str, Path] = {}
    refusal = None
    if "eagle3" in models:
        model = models["eagle3"]
        refusal = sglang_refusal(model.config)
        if "vllm" in x.formats or "sglang" in x.formats:
            if "sglang" in x.formats and refusal:
                console.print(f"[yellow]export: not writing an SGLang-loadable directory: {refusal}[/]")
            tensors, config = eagle3_engine_files(model, target_config, dtype)
            _write(layout.export_format("eagle3"), tensors, config)
            written["eagle3"] = layout.export_format("eagle3")
        if "speculators" in x.formats:
            tensors, config = speculators_files(model, target_config, target_name, dtype, cfg.eval.draft_length)
            _write(layout.export_format("speculators"), tensors, config)
            written["speculators"] = layout.export_format("speculators")
    if "dspark" in models and ("vllm" in x.formats or "speculators" in x.formats):
        tensors, config = dspark_files(models["dspark"], target_config, target_name, dtype)
        _write(layout.export_format("dspark"), tensors, config)
        written["dspark"] = layout.export_format("dspark")
    (out / "README.md").write_text(_readme(written, cfg, models, spec.name, refusal, cfg.eval.draft_length))
    write_manifest(
        out,
        "export",
        inputs=stage_inputs(cfg, "export", identity=spec.identity(), drafter=drafter),
        target=spec.identity(),
        sources={n: str(s) for n, s in zip(models, sources)},
        dtype=x.dtype,
        formats={k: str(v.relative_to(out)) for k, v in written.items()},
        sglang_refusal=refusal,
    )
    console.print(f"export -> {out}: " + ", ".join(f"{k}/" for k in written), highlight=False)
    return out


def run_import(cfg: RunConfig, source: str) -> Path:
    """Load an exported directory back into draftsmith's drafter class and save it as RUN_DIR/imported/."""
    _, _, embed = load_head_weights(cfg.model)
    model = import_drafter(source, embed)
    out = RunLayout.of(cfg).imported
    model.float().save_pretrained(out)
    console.print(f"import: {source} -> {out}", highlight=False)
    return out
