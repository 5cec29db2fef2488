"""SGLang 0.5.23's own code on draftsmith's eagle3/ exports (a subprocess of tests/engines/test_sglang.py;
PYTHONPATH=.engines).

usage: python probe_sglang.py WORK   (WORK/manifest.json in, WORK/results.json and WORK/<variant>.pt out)

Per eagle3/ directory:
1. SGLang's `ModelConfig(dir, is_draft_model=True, speculative_algorithm="EAGLE3")` reads config.json and
   `get_model_architecture` picks the class, or refuses (model_loader/utils.py): what `--speculative-draft-model-path`
   goes through. Only the registry is narrowed: `SGLANG_DISABLED_MODEL_ARCHS` (SGLang's own switch) skips importing
   the 250 other model modules; no module of sglang/srt registers an `Eagle3LlamaForCausalLM`.
2. Which target layers feed the drafter: the ids as SGLang reads them (`eagle_config.eagle_aux_hidden_state_layer_ids`,
   spec_aux_hidden_state.py; None when absent), then the target class's own `set_eagle3_layers_to_capture` (run on a
   stand-in holding only `pp_group`, `config` and `model`), which gives `layers_to_capture`. Emulated: the capture
   itself, i.e. the input of each of those decoder layers, in layer order (llama.py's layer loop), taken from the
   HF target's layer inputs that the test passes in; a layer >= L is never reached, so it is never captured.
3. The class built in a single-process gloo world (`sglang.test.layer_ut_utils.init_single_process_dist`),
   `load_weights` on every weight file SGLang's own loader finds in the directory (`DefaultModelLoader.
   _prepare_weights`, recorded as `weight_files`; SGLang skips unknown names silently, so every parameter it did
   not fill is listed), and forward: `model.model(tokens, positions, forward_batch)` then `lm_head`. Emulated: RadixAttention
   replaced by causal SDPA over the same q/k/v (it needs a KV pool and an attention backend), every CustomOp on its
   `forward_native`, a stand-in ForwardBatch carrying only what the drafter reads (`spec_info.hidden_states`,
   `forward_mode.is_extend()`, `mm_input_embeds=None`, `contains_mm_inputs()`), the target's embedding copied in
   (SGLang shares it), and a stub `torchvision` (torchvision_stub.py).
"""

from __future__ import annotations

import json
import os
import pkgutil
import socket
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision_stub

torchvision_stub.install()


class SDPA(torch.nn.Module):
    def __init__(self, nh, nkv, hd, scale):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale = nh, nkv, hd, scale

    def forward(self, q, k, v, forward_batch=None, **kwargs):
        T = q.shape[0]
        q = q.view(T, self.nh, self.hd).transpose(0, 1)
        k = k.view(T, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        v = v.view(T, self.nkv, self.hd).transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).reshape(T, -1)


def main(work: Path) -> None:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":  # sglang.test.test_utils indexes its first character
        del os.environ["CUDA_VISIBLE_DEVICES"]
    import sglang.srt.models as models

    keep = {"llama", "llama_eagle3", "transformers"}
    os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(
        n for _, n, _ in pkgutil.iter_modules(models.__path__) if n not in keep
    )
    import sglang.srt.model_loader.loader as loader_module
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.test.layer_ut_utils import init_single_process_dist

    torch.set_num_threads(2)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_single_process_dist(master_port=port)
    # SGLang's weight-file discovery reads the server args only to gate a checksum check; no server runs here
    loader_module.get_server_args = lambda: None
    target_classes = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}

    manifest = json.loads((work / "manifest.json").read_text())
    results: dict[str, dict] = {}
    for name, v in manifest.items():
        d = Path(v["export"]) / "eagle3"
        if v["family"] != "eagle3" or not d.is_dir():
            continue
        r: dict = {"variant": name}
        results[name] = r
        try:
            mc = ModelConfig(str(d), is_draft_model=True, speculative_algorithm="EAGLE3", dtype="float32")
            try:
                cls, arch = get_model_architecture(mc)
            except ValueError as exc:
                r["refused"] = str(exc)[:600]
                continue
            r["class"] = f"{cls.__module__}.{cls.__name__}"
            config = mc.hf_config
            eagle_config = getattr(config, "eagle_config", None)
            ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
            r["eagle_ids"] = ids
            target_config = json.loads((Path(v["target_dir"]) / "config.json").read_text())
            target_cls = target_classes[target_config["architectures"][0]]
            holder = types.SimpleNamespace(
                pp_group=types.SimpleNamespace(is_last_rank=True),
                config=types.SimpleNamespace(num_hidden_layers=target_config["num_hidden_layers"]),
                model=types.SimpleNamespace(),
            )
            target_cls.set_eagle3_layers_to_capture(holder, ids)
            capture = holder.model.layers_to_capture
            r["layers_to_capture"] = list(capture)

            model = cls(config)
            # the weight files SGLang's own loader finds in the directory (its glob), all of them loaded
            _, files, _ = loader_module.DefaultModelLoader(LoadConfig())._prepare_weights(str(d), None, True)
            r["weight_files"] = sorted(str(Path(f).relative_to(d)) for f in files)
            weights = {k: t for f in files for k, t in load_file(f).items()}
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            model.load_weights(list(weights.items()))
            r["not_loaded"] = [
                n for n, p in model.named_parameters() if torch.equal(before[n], p.detach()) and "embed_tokens" not in n
            ]
            r["fc_in_features"] = model.model.fc.weight.shape[1]
            if "d2t" in weights:
                hot = weights["d2t"] + torch.arange(weights["d2t"].numel())
                r["hot_token_id_is_d2t"] = bool(torch.equal(model.hot_token_id.cpu(), hot))

            # forward, on the layers SGLang captures
            ref = torch.load(v["reference"])
            layer_inputs = ref["layer_inputs"]  # [L, T, H]: the input of each target decoder layer
            missing = [j for j in capture if j >= layer_inputs.shape[0]]
            if missing:
                r["never_captured"] = missing
                continue
            aux = torch.cat([layer_inputs[j] for j in sorted(capture)], dim=-1)
            for m in model.modules():
                if hasattr(m, "forward_native") and hasattr(m, "_forward_method"):
                    m._forward_method = m.forward_native
            for layer in model.model.layers:
                a = layer.self_attn
                a.attn = SDPA(a.num_heads, a.num_kv_heads, a.head_dim, a.scaling)
            tokens = ref["input_ids"]
            T = tokens.shape[0]
            mode = types.SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
            batch = types.SimpleNamespace(
                spec_info=types.SimpleNamespace(hidden_states=aux),
                forward_mode=mode,
                mm_input_embeds=None,
                contains_mm_inputs=lambda: False,
            )
            with torch.no_grad():
                model.model.embed_tokens.weight.copy_(ref["embed"])
                h, _ = model.model(F.pad(tokens[1:], (0, 1), value=0), torch.arange(T), batch)
                D = config.draft_vocab_size
                logits = (h @ model.lm_head.weight.T)[:, :D]
            torch.save(logits, work / f"{name}.pt")
            r["logits"] = str(work / f"{name}.pt")
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
            r["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            r["traceback"] = traceback.format_exc()[-3000:]
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
