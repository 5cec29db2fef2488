"""vLLM 0.33.0's own code on draftsmith's exports (a subprocess of tests/engines/test_vllm.py; PYTHONPATH=.engines).

usage: python probe_vllm.py WORK   (WORK/manifest.json in, WORK/results.json and WORK/<variant>.<dir>.pt out)

Per exported engine directory (eagle3/, speculators/, dspark/):
1. The serve command of export/README.md for it is parsed and fed to what `vllm serve` runs first
   (engine/arg_utils.py): `maybe_override_with_speculators(model, ..., vllm_speculative_config=<the JSON>)`, then
   `ModelConfig` of the resulting target and `SpeculativeConfig(**speculative_config)`: vLLM's config translation
   (EAGLEConfig for eagle3/, the speculators translation `update_eagle3` / `update_dspark` otherwise).
2. `get_eagle3_aux_layers_from_config` (the layers the target will capture), the registry's class for the draft
   architecture, the class built in a gloo world of size 1, `load_weights` on model.safetensors, and where every
   exported tensor landed (q/k/v and gate/up are fused by vLLM).
3. EAGLE-3 only: forward. vLLM's target model (Llama or Qwen3 class of vLLM, the target's safetensors through its
   load_weights) runs on the reference token ids with `set_aux_hidden_state_layers(<the ids of 2.>)`; its aux
   states go through the drafter's `combine_hidden_states`, forward and `compute_logits`, with the target's
   embedding shared as vLLM's runner shares it. Emulated: (a) linear layers use `F.linear` (vLLM's own fallback in
   layers/utils.py; the prepacked CPU paths need vllm._C, only in vLLM's CPU wheel), (b) every CustomOp runs its
   `forward_native` (forward_cpu calls torch.ops._C kernels), (c) `Attention` is replaced by causal SDPA over the
   same q/k/v (vLLM's attention needs a forward context, a KV cache and a backend).
"""

from __future__ import annotations

import json
import shlex
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


def serve_commands(readme: str) -> list[tuple[str, dict | None]]:
    """(model, --speculative-config JSON or None) of every `vllm serve` line of export/README.md."""
    out = []
    for line in readme.splitlines():
        if not line.strip().startswith("vllm serve "):
            continue
        argv = shlex.split(line)
        spec = None
        if "--speculative-config" in argv:
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
        out.append((argv[2], spec))
    return out


class SDPA(torch.nn.Module):
    """Causal attention over vLLM's q/k/v (flattened [T, heads*head_dim]), in place of `Attention`."""

    def __init__(self, attn, scale):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_size, scale

    def forward(self, q, k, v, *args, **kwargs):
        T = q.shape[0]
        q = q.view(T, self.nh, self.hd).transpose(0, 1)
        k = k.view(T, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        v = v.view(T, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(T, -1)


def cpu_patches(model) -> None:
    from vllm.model_executor.custom_op import CustomOp

    for m in model.modules():
        if hasattr(m, "quant_method"):
            m.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
        if isinstance(m, CustomOp):
            m._forward_method = m.forward_native
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.attn = SDPA(layer.self_attn.attn, layer.self_attn.scaling)


FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def placement(model, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """Exported tensor -> problem, for every tensor not found verbatim in vLLM's parameters (fused ones as
    their slice of the fused parameter; `t2d` is dropped by vLLM's loader by design)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    problems = {}
    for name, tensor in weights.items():
        if name == "t2d":
            continue
        key = "draft_id_to_target_id" if name == "d2t" else name.replace("midlayer.", "layers.0.")
        part = next((p for p in FUSED if f".{p}." in key), None)
        if part:
            fused, index = FUSED[part]
            key = key.replace(part, fused)
        found = next((params[c] for c in (key, "model." + key) if c in params), None)
        if found is None:
            problems[name] = f"no vLLM parameter {key}"
            continue
        found = found.detach()
        if part:
            sizes = [tensor.shape[0]] * 2 if fused == "gate_up_proj" else None
            if fused == "qkv_proj":  # q then k then v, k and v of equal size
                q = weights[name.replace(part, "q_proj")].shape[0]
                kv = weights[name.replace(part, "k_proj")].shape[0]
                sizes = [q, kv, kv]
            found = torch.split(found, sizes, dim=0)[index]
        if found.shape[0] > tensor.shape[0] and found.shape[1:] == tensor.shape[1:]:
            found = found[: tensor.shape[0]]  # vocabulary-parallel layers pad the vocabulary to a multiple of 64
        if found.shape != tensor.shape or not torch.equal(found.to(tensor.dtype), tensor):
            problems[name] = f"differs from vLLM's {key} {tuple(found.shape)}"
    return problems


def main(work: Path) -> None:
    from safetensors.torch import load_file
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    manifest = json.loads((work / "manifest.json").read_text())
    torch.set_num_threads(2)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist_ready = False
    results: dict[str, dict] = {}
    for name, v in manifest.items():
        export = Path(v["export"])
        readme = (export / "README.md").read_text() if (export / "README.md").is_file() else ""
        commands = serve_commands(readme)
        for sub in ("eagle3", "speculators", "dspark"):
            d = export / sub
            if not d.is_dir():
                continue
            r: dict = {"variant": name, "dir": sub}
            results[f"{name}/{sub}"] = r
            try:
                # 1. the README's command, through vLLM's own argument handling
                mine = [(m, sc) for m, sc in commands if Path(m) == d or (sc and Path(sc.get("model", "")) == d)]
                if not mine:
                    r["error"] = f"export/README.md has no `vllm serve` command for {sub}/"
                    continue
                model_arg, spec_arg = mine[0]
                r["command"] = {"model": model_arg, "speculative_config": spec_arg}
                model_arg, _tok, spec = maybe_override_with_speculators(
                    model=model_arg, tokenizer=None, trust_remote_code=False, vllm_speculative_config=spec_arg
                )
                r["served_model"] = model_arg
                if spec is None:
                    r["error"] = "the command gives vLLM no speculative config"
                    continue
                target = ModelConfig(
                    model=model_arg, skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True
                )
                spec = SpeculativeConfig(**spec, target_model_config=target, target_parallel_config=ParallelConfig())
                hf = spec.draft_model_config.hf_config
                r["method"] = spec.method
                r["num_speculative_tokens"] = spec.num_speculative_tokens
                r["draft_architectures"] = list(spec.draft_model_config.architectures)
                aux = get_eagle3_aux_layers_from_config(spec)
                r["capture"] = list(aux) if aux is not None else None
                for key in (
                    "num_aux_hidden_states",
                    "eagle_aux_hidden_state_layer_ids",
                    "target_layer_ids",
                    "draft_vocab_size",
                    "block_size",
                    "markov_rank",
                    "mask_token_id",
                    "dspark_bonus_anchor",
                    "norm_before_residual",
                ):
                    value = getattr(hf, key, None)
                    r["hf_" + key] = list(value) if isinstance(value, tuple) else value
                r["parallel_drafting"] = getattr(spec, "parallel_drafting", None)

                # 2. the registry's class, built and loaded
                vc = VllmConfig(model_config=target, speculative_config=spec, device_config=DeviceConfig(device="cpu"))
                with set_current_vllm_config(vc):
                    if not dist_ready:
                        init_distributed_environment(
                            world_size=1,
                            rank=0,
                            local_rank=0,
                            distributed_init_method=f"tcp://127.0.0.1:{port}",
                            backend="gloo",
                        )
                        initialize_model_parallel(1, 1)
                        dist_ready = True
                    cls, _ = ModelRegistry.resolve_model_cls(
                        spec.draft_model_config.architectures, spec.draft_model_config
                    )
                    r["draft_class"] = f"{cls.__module__}.{cls.__name__}"
                    draft = cls(vllm_config=vc, prefix="")
                    weights = load_file(str(d / "model.safetensors"))
                    try:
                        draft.load_weights(list(weights.items()))
                    except Exception as exc:  # noqa: BLE001 - the message is the result
                        r["load_error"] = f"{type(exc).__name__}: {exc}"[:600]
                        continue
                    r["loaded"] = True
                    r["placement_problems"] = placement(draft, weights)
                    r["fc_in_features"] = draft.model.fc.weight.shape[1]
                    r["has_draft_id_to_target_id"] = getattr(draft, "draft_id_to_target_id", None) is not None
                    r["has_own_embed_tokens"] = getattr(draft, "has_own_embed_tokens", None)
                    if v["family"] != "eagle3":
                        continue

                    # 3. forward: vLLM's target captures the aux states, vLLM's drafter computes the logits
                    ref = torch.load(v["reference"])
                    tcls, _ = ModelRegistry.resolve_model_cls(target.architectures, target)
                    tmodel = tcls(vllm_config=vc, prefix="")
                    tmodel.load_weights(list(load_file(str(Path(model_arg) / "model.safetensors")).items()))
                    cpu_patches(tmodel)
                    cpu_patches(draft)
                    tmodel.set_aux_hidden_state_layers(tuple(aux))
                    if not r["has_own_embed_tokens"]:
                        draft.model.embed_tokens = tmodel.model.embed_tokens  # as vLLM's runner shares it
                    ids = ref["input_ids"]
                    T = ids.shape[0]
                    with torch.no_grad():
                        _, captured = tmodel.model(ids, torch.arange(T), None)
                        h = draft.combine_hidden_states(torch.cat(captured, dim=-1))
                        tokens = F.pad(ids[1:], (0, 1), value=0)  # the drafter at t reads token t+1
                        hs, _ = draft(tokens, torch.arange(T), h)
                        logits = draft.compute_logits(hs)  # target vocabulary, -inf off the draft vocab
                        if r["has_draft_id_to_target_id"]:
                            D = draft.draft_id_to_target_id.shape[0]
                            logits = logits[:, torch.arange(D) + draft.draft_id_to_target_id]
                    torch.save(logits, work / f"{name}.{sub}.pt")
                    r["logits"] = str(work / f"{name}.{sub}.pt")
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                r["error"] = f"{type(exc).__name__}: {exc}"[:1500]
                r["traceback"] = traceback.format_exc()[-3000:]
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
