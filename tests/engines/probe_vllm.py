"""vLLM 0.33.0's own code on draftsmith's exports (a subprocess of tests/engines/test_vllm.py; PYTHONPATH=.engines).

usage: python probe_vllm.py WORK   (WORK/manifest.json in, WORK/results.json and WORK/<variant>.<dir>.pt out)

Per exported engine directory (eagle3/, speculators/, dspark/):
1. The serve command of export/README.md for it is parsed and fed to what `vllm serve` runs first
   (engine/arg_utils.py): `maybe_override_with_speculators(model, ..., vllm_speculative_config=<the JSON>)`, then
   `ModelConfig` of the resulting target and `SpeculativeConfig(**speculative_config)`: vLLM's config translation
   (EAGLEConfig for eagle3/, the speculators translation `update_eagle3` / `update_dspark` otherwise).
2. `get_eagle3_aux_layers_from_config` (the layers the target will capture), the registry's class for the draft
   architecture, the class built in a gloo world of size 1, `load_weights` on every weight file vLLM's own loader
   finds in the directory (`DefaultModelLoader._prepare_weights`, recorded as `weight_files`), and where every
   exported tensor landed (q/k/v and gate/up are fused by vLLM).
3. EAGLE-3 only: forward. vLLM's target model (Llama or Qwen3 class of vLLM, the target's safetensors through its
   load_weights) runs on the reference token ids with `set_aux_hidden_state_layers(<the ids of 2.>)`; its aux
   states go through the drafter's `combine_hidden_states`, forward and `compute_logits`, with the target's
   embedding shared as vLLM's runner shares it. Emulated: (a) linear layers use `F.linear` (vLLM's own fallback in
   layers/utils.py; the prepacked CPU paths need vllm._C, only in vLLM's CPU wheel), (b) every CustomOp runs its
   `forward_native` (forward_cpu calls torch.ops._C kernels), (c) `Attention` is replaced by causal SDPA over the
   same q/k/v (vLLM's attention needs a forward context, a KV cache and a backend).
4. DSpark only: one draft block, through vLLM's V2 proposer itself (`dspark_block`). vLLM's target (as in 3) runs
   the prefill of the manifest's `context_ids` with the aux layers of 2. and gives the bonus token (greedy on its
   own logits). A `DSparkSpeculator` is built (vLLM's __init__: mask token id from `get_parallel_drafting_token_id`,
   `sample_from_anchor`, block width, greedy drafting) and its `load_draft_model` runs `load_dspark_model` (target
   embedding / head shared as the runner shares them), with `get_model` answering the drafter of 2. Then, as
   `DFlashSpeculator.propose` does for one request after a prefill: `prepare_dflash_inputs` (vLLM's Triton kernel,
   run by Triton's interpreter on CPU: query ids [bonus, mask...], positions, context positions, slots, sample
   indices, seq_lens), `_store_hidden_states` (the drafter's `combine_hidden_states`: fc over the captured aux
   states), `_precompute_context_kv` (`precompute_and_store_context_kv`: hidden_norm, the fused K/V projection,
   grouped K-norm, RoPE, written into each layer's cache), `_generate_draft` (`_run_model`: the query block through
   vLLM's decoder layers and norm under `set_forward_context`; `_sample_sequential`: `compute_draft_logits`, the
   Markov head's `markov_embed` / `markov_bias` left to right from the bonus token, greedy `_sample_logits` with
   `map_draft_to_target`, `compute_confidence`). Saved: the biased draft-vocab logits of every position (a
   recorder wraps `_sample_logits`; it only looks), the draft tokens (target ids), the confidences, the aux
   states vLLM's target captured, and the prepared inputs. Emulated, beyond 3's (a) and (b): (c') each draft layer's `Attention` is `PagedAttention`
   below (the KV cache, its writes at vLLM's slots, and the attention a backend computes from the metadata:
   every query of the block sees all context keys, and the block's own keys non-causally unless vLLM's
   `get_draft_attn_causal` says causal), with the attention metadata vLLM's backend builder would make
   (query_start_loc, seq_lens from the kernel, the block table, per-layer causality) handed over in the forward
   context; (d) the two CUDA kernels of the context-K/V precompute, `ops.rms_norm` and `ops.rotary_embedding`, by
   `KERNELS` below (vLLM's IR `rms_norm` and `RotaryEmbedding.forward_static`); (e) the per-request state the
   runner passes to `propose` (block table, num_sampled 1, num_rejected 0, last sampled = the bonus token), a
   one-request `InputBatch` with the fields the kernel reads, and `enable_adaptive_verification` set on the
   speculator so that `load_draft_model` turns the confidence head on, as that speculative-config flag does.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

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


def cpu_patches(model, attention=SDPA) -> None:
    from vllm.model_executor.custom_op import CustomOp

    for m in model.modules():
        if hasattr(m, "quant_method"):
            m.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
        if isinstance(m, CustomOp):
            m._forward_method = m.forward_native
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.attn = attention(layer.self_attn.attn, layer.self_attn.scaling)


# the emulated paged KV cache of the DSpark block (4.): vLLM's null block 0, then the request's blocks
KV_BLOCK_SIZE = 16
KV_BLOCKS = 17


class PagedAttention(torch.nn.Module):
    """A DFlash/DSpark draft layer's `Attention` on CPU, in place of vLLM's (4.). The KV cache is one flat
    [2, KV_BLOCKS * KV_BLOCK_SIZE, kv heads, head_dim] tensor (`kv_cache`); `impl.do_kv_cache_update(layer, k, v,
    cache, slot_mapping)` writes k/v at the given slots (PAD_SLOT_ID -1: none), which is how
    `precompute_and_store_context_kv` stores the context K/V. forward(q, k, v) of the query block: first the
    block's own k/v are written at the forward context's `slot_mapping[layer_name]` (as the backends' forward
    writes them), then request r's queries (`query_start_loc`) attend to the keys at positions 0..seq_lens[r]-1,
    read through its block table: every context key, and the whole block, non-causally; a causal layer lets query
    i of n see positions <= seq_lens[r] - n + i (the bottom-right alignment of FlashAttention's causal mask).
    Sliding windows, attention sinks and value scales are not emulated: such a layer is refused."""

    def __init__(self, attn, scale):
        super().__init__()
        self.layer_name = attn.layer_name
        self.nh, self.nkv, self.hd, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_size, scale
        if attn.sliding_window is not None or getattr(attn, "sinks", None) is not None:
            raise NotImplementedError(f"{self.layer_name}: sliding window / sinks are not emulated")
        self.kv_cache = torch.zeros(2, KV_BLOCKS * KV_BLOCK_SIZE, self.nkv, self.hd, dtype=torch.get_default_dtype())
        self.impl = self

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        keep = slot_mapping >= 0
        kv_cache[0, slot_mapping[keep]] = key.reshape(-1, self.nkv, self.hd)[keep].to(kv_cache.dtype)
        kv_cache[1, slot_mapping[keep]] = value.reshape(-1, self.nkv, self.hd)[keep].to(kv_cache.dtype)

    def forward(self, q, k, v, *args, **kwargs):
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        meta = context.attn_metadata[self.layer_name]
        self.do_kv_cache_update(self, k, v, self.kv_cache, context.slot_mapping[self.layer_name])
        out = torch.zeros(q.shape[0], self.nh * self.hd, dtype=q.dtype)
        bounds = meta.query_start_loc.tolist()
        for r, seq_len in enumerate(meta.seq_lens.tolist()):
            start, end = bounds[r], bounds[r + 1]
            n = end - start
            pos = torch.arange(seq_len)
            slots = meta.block_table[r, pos // meta.block_size].long() * meta.block_size + pos % meta.block_size
            keys = self.kv_cache[0, slots].transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
            values = self.kv_cache[1, slots].transpose(0, 1).repeat_interleave(self.nh // self.nkv, 0)
            mask = None
            if meta.causal:
                mask = pos[None, :] <= (seq_len - n + torch.arange(n))[:, None]
            qr = q[start:end].view(n, self.nh, self.hd).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qr, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=self.scale
            )
            out[start:end] = o.transpose(0, 1).reshape(n, -1)
        return out


def _rms_norm_kernel(out, x, weight, epsilon) -> None:
    """`ops.rms_norm` (torch.ops._C.rms_norm, CUDA) by vLLM's IR `rms_norm` (the native RMSNorm). A 2-D weight
    [L, d] is DFlash's grouped K-norm: row i normalizes the i-th slice of x's outermost (layer) dimension."""
    from vllm import ir

    if weight.dim() == 1:
        out.copy_(ir.ops.rms_norm(x, weight, epsilon))
        return
    for i in range(weight.shape[0]):
        out[i].copy_(ir.ops.rms_norm(x[i], weight[i], epsilon))


def _rotary_embedding_kernel(positions, query, key, head_size, cos_sin_cache, is_neox) -> None:
    """`ops.rotary_embedding` (torch.ops._C, CUDA; in place) by vLLM's native `RotaryEmbedding.forward_static`, the
    rotary dimension being the cache's width, as the kernel takes it."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    q, k = RotaryEmbedding.forward_static(
        positions, query, key, head_size, cos_sin_cache.shape[-1], cos_sin_cache, is_neox
    )
    query.copy_(q)
    if key is not None:
        key.copy_(k)


KERNELS = SimpleNamespace(rms_norm=_rms_norm_kernel, rotary_embedding=_rotary_embedding_kernel)


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


def vllm_target(vc, target, model_arg: str):
    """vLLM's target class (the registry's, for the target's architecture) with the target's safetensors, on CPU."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.registry import ModelRegistry

    tcls, _ = ModelRegistry.resolve_model_cls(target.architectures, target)
    tmodel = tcls(vllm_config=vc, prefix="")
    tmodel.load_weights(list(load_file(str(Path(model_arg) / "model.safetensors")).items()))
    cpu_patches(tmodel)
    return tmodel


def dspark_block(draft, vc, tmodel, aux: list[int], context_ids: list[int]) -> dict:
    """Step 4 of the docstring: vLLM's DSpark proposer drafts one block after a prefill of `context_ids`. Returns
    results, with the tensors to save under "tensors"."""
    import numpy as np
    import vllm.model_executor.model_loader as model_loader
    import vllm.model_executor.models.qwen3_dflash as qwen3_dflash
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    ids = torch.tensor(context_ids)
    T = ids.shape[0]
    tmodel.set_aux_hidden_state_layers(tuple(aux))
    with torch.no_grad():
        target_hidden, captured = tmodel.model(ids, torch.arange(T), None)
        bonus = int(tmodel.compute_logits(target_hidden[-1:]).argmax(-1))  # the target's greedy next token

    spec = DSparkSpeculator(vc, torch.device("cpu"))
    spec.enable_adaptive_verification = True  # (e): load_draft_model turns the confidence head on
    get_model = model_loader.get_model
    model_loader.get_model = lambda **_kwargs: draft  # load_dspark_model's get_model: the drafter of step 2
    try:
        spec.model = spec.load_draft_model(tmodel, set())
    finally:
        model_loader.get_model = get_model
    assert spec.model is draft
    cpu_patches(draft, attention=PagedAttention)
    draft.model._build_fused_kv_buffers()  # re-collects the attention layers the context K/V is written through
    qwen3_dflash.ops = KERNELS  # (d)

    # (e) the runner's state for one request after its prefill, then vLLM's own input preparation (Triton kernel)
    n_query = spec.num_query_per_req
    block_table = torch.zeros(spec.max_num_reqs, KV_BLOCKS - 1, dtype=torch.int32)
    block_table[0] = torch.arange(1, KV_BLOCKS)  # block 0 is vLLM's null block
    query_slots = torch.full((spec.max_num_tokens,), -1, dtype=torch.int64)
    context_slots = torch.full((1, spec.max_num_tokens), -1, dtype=torch.int64)
    batch = SimpleNamespace(
        num_reqs=1,
        num_scheduled_tokens=np.array([T], dtype=np.int32),
        positions=torch.arange(T),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        idx_mapping=torch.zeros(1, dtype=torch.int32),
    )
    last_sampled = torch.zeros(spec.max_num_reqs, dtype=torch.int64)
    last_sampled[0] = bonus
    per_req = spec.max_num_reqs
    prepare_dflash_inputs(
        spec.input_buffers,
        query_slots,
        spec.context_positions,
        context_slots[0],
        spec.sample_indices,
        spec.sample_pos,
        spec.sample_idx_mapping,
        spec.temperature,
        spec.seeds,
        batch,
        torch.ones(1, dtype=torch.int32),  # num_sampled
        torch.zeros(1, dtype=torch.int32),  # num_rejected
        last_sampled,
        torch.zeros(per_req, dtype=torch.int64),  # next_prefill_tokens
        torch.zeros(per_req, dtype=torch.float32),  # temperature (greedy)
        torch.zeros(per_req, dtype=torch.int64),  # seeds
        block_table,
        KV_BLOCK_SIZE,
        0,  # cp rank
        spec.dcp_size,
        1,  # cp interleave
        spec.parallel_drafting_token_id,
        n_query,
        spec.num_speculative_steps,
        spec.max_num_reqs,
        spec.max_num_tokens,
        spec.max_model_len,
        spec.sample_from_anchor,
        1,
    )

    # the context: combine_hidden_states over the captured aux states, then the context K/V into every layer's cache
    names = draft.get_draft_kv_cache_layer_names()
    causal = draft.get_draft_attn_causal()
    spec._context_slot_mappings = context_slots  # what set_attn allocates: one row per KV-cache group (one here)
    spec._layer_group_idx = [0] * len(names)
    seen = []
    sample_logits = spec._sample_logits

    def recorded(logits, *args, **kwargs):
        seen.append(logits.detach().clone())
        return sample_logits(logits, *args, **kwargs)

    spec._sample_logits = recorded  # (an instance attribute: _sample_sequential calls self._sample_logits)
    with torch.no_grad():
        spec._store_hidden_states(T, target_hidden, captured)
        spec.prepare_context_anchor(1, batch.query_start_loc, torch.zeros(1, dtype=torch.int32))
        spec._precompute_context_kv(0, T)
        # the attention metadata a backend's builder would make for this step, per draft layer (c')
        metadata = {
            name: SimpleNamespace(
                query_start_loc=spec.input_buffers.query_start_loc[:2],
                seq_lens=spec.input_buffers.seq_lens[:1],
                block_table=block_table[:1],
                block_size=KV_BLOCK_SIZE,
                causal=layer_causal,
            )
            for name, layer_causal in zip(names, causal)
        }
        slots = {name: query_slots[:n_query] for name in names}
        spec._generate_draft(1, n_query, metadata, slots, None, CUDAGraphMode.NONE)

    d2t = draft.draft_id_to_target_id
    return {
        "bonus": bonus,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "mask_token_id": spec.parallel_drafting_token_id,
        "sample_from_anchor": spec.sample_from_anchor,
        "num_query_per_req": n_query,
        "use_confidence_head": spec.use_confidence_head,
        "attn_causal": list(causal),
        "shares_target_embed": draft.model.embed_tokens is tmodel.model.embed_tokens,
        "shares_target_lm_head": draft.lm_head is tmodel.lm_head,
        "tensors": {
            "aux": torch.cat(captured, dim=-1),  # [T, n_aux * H]: what vLLM's target captured
            "logits": torch.cat(seen),  # [block, draft vocab]: the logits each token was chosen from
            "tokens": spec.draft_tokens[0].clone(),  # target ids (map_draft_to_target)
            "confidence": spec.draft_token_confidence_probs[0].clone(),
            "input_ids": spec.input_buffers.input_ids[:n_query].clone(),
            "positions": spec.input_buffers.positions[:n_query].clone(),
            "seq_len": spec.input_buffers.seq_lens[0].clone(),
            "sample_indices": spec.sample_indices[:n_query].clone(),
            "sample_pos": spec.sample_pos[:n_query].clone(),
            "context_positions": spec.context_positions[:T].clone(),
            "context_slots": context_slots[0, :T].clone(),
            "d2t": d2t.detach().clone() if d2t is not None else None,
        },
    }


def main(work: Path) -> None:
    # vLLM's Triton kernels run in Triton's interpreter (CPU); step 4 runs one. Set before vLLM is imported:
    # triton.jit decides at decoration whether a kernel is interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from safetensors.torch import load_file
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.config.load import LoadConfig
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.utils.torch_utils import set_default_torch_dtype
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
                dtype = v.get("dtype", "float32")
                target = ModelConfig(
                    model=model_arg, skip_tokenizer_init=True, dtype=dtype, max_model_len=256, enforce_eager=True
                )
                asked = dict(spec)
                spec = SpeculativeConfig(**asked, target_model_config=target, target_parallel_config=ParallelConfig())
                # how vLLM draws drafts at T > 0 as the command leaves it, and whether it takes drafts drawn from the
                # drafter (what eval does by default) for this drafter: eval.draft_sample_method names both
                r["draft_sample_method"] = spec.draft_sample_method
                try:
                    drawn = {**asked, "draft_sample_method": "probabilistic"}
                    r["probabilistic"] = SpeculativeConfig(
                        **drawn, target_model_config=target, target_parallel_config=ParallelConfig()
                    ).draft_sample_method
                except Exception as e:  # noqa: BLE001 -- what vLLM said is the result
                    r["probabilistic"] = f"refused: {e}"
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
                with set_current_vllm_config(vc), set_default_torch_dtype(getattr(torch, dtype)):
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
                    # the weight files vLLM's own loader finds in the directory (its glob), all of them loaded
                    _, files, _, _ = DefaultModelLoader(LoadConfig())._prepare_weights(str(d), None, None, True, None)
                    r["weight_files"] = sorted(str(Path(f).relative_to(d)) for f in files)
                    weights = {k: t for f in files for k, t in load_file(f).items()}
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
                    if v["family"] == "dspark":
                        # 4. one draft block through vLLM's DSpark proposer (its failure is its own result)
                        try:
                            block = dspark_block(draft, vc, vllm_target(vc, target, model_arg), aux, v["context_ids"])
                        except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                            r["block_error"] = f"{type(exc).__name__}: {exc}"[:1500]
                            r["block_traceback"] = traceback.format_exc()[-3000:]
                            continue
                        torch.save(block.pop("tensors"), work / f"{name}.{sub}.pt")
                        r["block"] = {**block, "tensors": str(work / f"{name}.{sub}.pt")}
                    if v["family"] != "eagle3":
                        continue

                    # 3. forward: vLLM's target captures the aux states, vLLM's drafter computes the logits
                    ref = torch.load(v["reference"])
                    tmodel = vllm_target(vc, target, model_arg)
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
