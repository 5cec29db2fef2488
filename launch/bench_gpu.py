"""GPU benchmark of the three hot loops, sized to finish in a few minutes on one H100/H200:

1. training: tokens/s, MFU and peak memory of the EAGLE-3 trainer objective (drafters.objectives.eagle3_objective
   on drafters.eagle3.Eagle3Drafter + backward + AdamW) for a real-size drafter (hidden 4096, Llama-3.1-8B
   layer shapes, 32k draft vocabulary over a 128k target vocabulary, TTT 7) on synthetic target features;
2. collection: tokens/s of feature capture (data.features.FeatureCapture: aux + final hidden states, copied to
   host memory as `collect` does) on a ~1.2B random-weight Llama, against the bare forward;
3. verification: rounds/s of the exact decoding engine (eval.engine.decode with eval.runner.HFTarget) on the
   same 1B target, drafting with a random EAGLE-3 drafter (rounds are what is timed, so the drafter needs no
   training), plus plain decoding tokens/s.

    python launch/bench_gpu.py                          # real sizes, CUDA, bf16 -> runs/bench_gpu/bench_gpu.{json,md}
    python launch/bench_gpu.py --tiny --device cpu      # seconds on a CPU (what the tests run)

Every size is a flag. FLOPs per token come from pipeline.plan's formulas, so MFU and `draftsmith plan` agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# bf16 dense peak TFLOP/s by device name (no sparsity): what MFU divides by
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


@dataclass
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    draft_vocab: int
    ttt_steps: int
    batch_tokens: int
    seq_len: int
    train_steps: int
    collect_hidden: int
    collect_layers: int
    collect_heads: int
    collect_intermediate: int
    collect_tokens: int
    collect_batches: int
    prompts: int
    prompt_len: int
    max_new_tokens: int
    gamma: int


REAL = Sizes(
    hidden=4096,
    heads=32,
    kv_heads=8,
    intermediate=14336,
    vocab=128256,
    draft_vocab=32000,
    ttt_steps=7,
    batch_tokens=8192,
    seq_len=2048,
    train_steps=12,
    collect_hidden=2048,
    collect_layers=16,
    collect_heads=32,
    collect_intermediate=8192,
    collect_tokens=16384,
    collect_batches=6,
    prompts=4,
    prompt_len=256,
    max_new_tokens=128,
    gamma=5,
)
TINY = Sizes(
    hidden=64,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=512,
    draft_vocab=128,
    ttt_steps=3,
    batch_tokens=128,
    seq_len=64,
    train_steps=2,
    collect_hidden=64,
    collect_layers=8,
    collect_heads=4,
    collect_intermediate=128,
    collect_tokens=256,
    collect_batches=2,
    prompts=2,
    prompt_len=16,
    max_new_tokens=8,
    gamma=3,
)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _llama_config(hidden, layers, heads, kv_heads, intermediate, vocab):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


# ------------------------------------------------------------------------------------------- training


def bench_train(s: Sizes, device, dtype, peak_tflops: float | None) -> dict[str, Any]:
    import torch

    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_objective
    from draftsmith.drafters.vocab import select_draft_vocab
    from draftsmith.pipeline.plan import DrafterShape, TargetShape, eagle3_flops, eagle3_params

    torch.manual_seed(0)
    aux_ids = [2, 16, 29]  # only their count matters for the drafter's shapes
    config = _llama_config(s.hidden, 32, s.heads, s.kv_heads, s.intermediate, s.vocab)
    embed = torch.randn(s.vocab, s.hidden) * 0.02
    counts = torch.randint(0, 1000, (s.vocab,))
    d2t, t2d = select_draft_vocab(counts, s.draft_vocab)
    with torch.device(device):
        drafter = Eagle3Drafter.from_target(config, aux_ids, s.draft_vocab, embed, d2t, t2d)
    drafter.to(device).train()
    head = (torch.randn(s.vocab, s.hidden, device=device) * 0.02).to(dtype)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
    settings = ObjectiveSettings(steps=s.ttt_steps)
    rows = max(1, s.batch_tokens // s.seq_len)
    tokens = rows * s.seq_len

    def batch() -> dict[str, Any]:
        ids = torch.randint(0, s.vocab, (rows, s.seq_len))
        mask = torch.ones(rows, s.seq_len, dtype=torch.uint8)
        mask[:, : s.seq_len // 4] = 0  # a prompt part without loss, as in chat data
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "attention_mask": torch.ones(rows, s.seq_len, dtype=torch.bool),
            "aux": torch.randn(rows, s.seq_len, len(aux_ids) * s.hidden, device=device, dtype=dtype),
            "final": torch.randn(rows, s.seq_len, s.hidden, device=device, dtype=dtype),
        }

    batches = [batch() for _ in range(2)]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    _reset_peak(device)
    times = []
    for step in range(s.train_steps + 2):  # two warm-up steps (allocator, kernels)
        b = batches[step % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            loss, _ = eagle3_objective(drafter, b, head, settings)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    shape = DrafterShape(
        "eagle3",
        s.hidden,
        1,
        s.heads,
        s.kv_heads,
        s.hidden // s.heads,
        s.intermediate,
        len(aux_ids),
        s.draft_vocab,
        s.vocab,
    )
    params = eagle3_params(shape)
    target = TargetShape(s.hidden, 32, s.heads, s.kv_heads, s.hidden // s.heads, s.intermediate, s.vocab, 0, 0)
    flops = sum(eagle3_flops(shape, params, target, s.ttt_steps, s.seq_len).values())
    tok_s = tokens / step_s
    counted = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return {
        "trainable_params": counted,
        "trainable_params_formula": params.trainable,
        "ttt_steps": s.ttt_steps,
        "draft_vocab": s.draft_vocab,
        "target_vocab": s.vocab,
        "batch": f"{rows} x {s.seq_len}",
        "step_ms": step_s * 1e3,
        "tokens_per_s": tok_s,
        "flops_per_token": flops,
        "achieved_tflops": tok_s * flops / 1e12,
        "mfu": tok_s * flops / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_mib": _peak_mib(device),
    }


# ----------------------------------------------------------------------------------------- collection


def _random_llama(s: Sizes, device, dtype):
    import torch
    from transformers import LlamaForCausalLM

    config = _llama_config(
        s.collect_hidden,
        s.collect_layers,
        s.collect_heads,
        max(1, s.collect_heads // 4),
        s.collect_intermediate,
        s.vocab,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialize on the GPU directly: a 1B model's CPU init takes a minute
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def bench_collect(s: Sizes, model, device) -> dict[str, Any]:
    import torch

    from draftsmith.data.features import FeatureCapture

    capture = FeatureCapture(model, None)
    rows = max(1, s.collect_tokens // s.seq_len)
    batches = [torch.randint(0, s.vocab, (rows, s.seq_len), device=device) for _ in range(s.collect_batches)]

    def timed(fn) -> float:
        fn(batches[0])  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for ids in batches:
            fn(ids)
        _sync(device)
        return time.perf_counter() - t0

    @torch.no_grad()
    def bare(ids):
        capture.base(input_ids=ids, use_cache=False)

    def collect(ids):
        aux, final = capture(ids)
        aux.to("cpu"), final.to("cpu")  # what `collect` hands to its shard writer

    _reset_peak(device)
    t_bare, t_collect = timed(bare), timed(collect)
    n = rows * s.seq_len * len(batches)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "aux_layer_ids": capture.aux_ids,
        "tokens": n,
        "bare_forward_tokens_per_s": n / t_bare,
        "collect_tokens_per_s": n / t_collect,
        "collect_vs_bare": t_bare / t_collect,
        "peak_memory_mib": _peak_mib(device),
    }


# --------------------------------------------------------------------------------------- verification


def bench_verify(s: Sizes, model, device, dtype) -> dict[str, Any]:
    import torch

    from draftsmith.data.features import default_aux_ids
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab
    from draftsmith.eval.engine import decode
    from draftsmith.eval.proposers import Eagle3Proposer, NoDraft
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams

    torch.manual_seed(0)
    aux = default_aux_ids(model.config.num_hidden_layers)
    d2t, t2d = select_draft_vocab(torch.randint(0, 1000, (s.vocab,)), min(s.draft_vocab, s.vocab))
    with torch.device(device):
        drafter = Eagle3Drafter.from_target(
            model.config, aux, d2t.numel(), model.get_input_embeddings().weight.float().cpu(), d2t, t2d
        )
    drafter = drafter.to(device, dtype).eval()
    prompts = [torch.randint(0, s.vocab, (s.prompt_len,)).tolist() for _ in range(s.prompts)]
    greedy = SamplingParams()
    out: dict[str, Any] = {}
    for name, proposer, runner in [
        ("plain", NoDraft(), HFTarget(model)),
        ("eagle3", Eagle3Proposer(drafter), HFTarget(model, aux)),
    ]:
        decode(runner, proposer, prompts[:1], greedy, s.gamma, 4)  # warm-up
        _sync(device)
        rounds = tokens = 0
        t0 = time.perf_counter()
        for p in prompts:
            (r,) = decode(runner, proposer, [p], greedy, s.gamma, s.max_new_tokens)
            rounds += len(r.rounds)
            tokens += len(r.tokens)
        _sync(device)
        dt = time.perf_counter() - t0
        out[name] = {"rounds": rounds, "tokens": tokens, "rounds_per_s": rounds / dt, "tokens_per_s": tokens / dt}
    out["gamma"] = s.gamma
    return out


# ---------------------------------------------------------------------------------------------- report


def _count(n: float) -> str:
    """1.23B / 427M / 107k: parameter counts at any size."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def markdown(result: dict[str, Any]) -> str:
    t, c, v = result.get("train", {}), result.get("collect", {}), result.get("verify", {})
    env = result["environment"]
    lines = [
        f"# bench_gpu ({env['device_name']}, {env['dtype']}, {env['sizes']} sizes)",
        "",
        "| benchmark | figure |",
        "|---|---|",
    ]
    if t:
        mfu = f", MFU {t['mfu']:.1%}" if t.get("mfu") is not None else ""
        mem = f", peak {t['peak_memory_mib'] / 1024:.1f} GiB" if t.get("peak_memory_mib") else ""
        lines.append(
            f"| train: EAGLE-3 objective, {_count(t['trainable_params'])} trainable, draft vocab {t['draft_vocab']:,}, "
            f"TTT {t['ttt_steps']}, batch {t['batch']} | {t['tokens_per_s']:,.0f} tokens/s "
            f"({t['achieved_tflops']:.3g} TFLOP/s{mfu}{mem}) |"
        )
    if c:
        lines.append(
            f"| collect: {_count(c['params'])}-parameter random Llama, aux {c['aux_layer_ids']} | "
            f"{c['collect_tokens_per_s']:,.0f} tokens/s (bare forward {c['bare_forward_tokens_per_s']:,.0f}; "
            f"{c['collect_vs_bare']:.0%}) |"
        )
    if v:
        lines.append(
            f"| verify: engine + random EAGLE-3 drafter, γ={v['gamma']} | {v['eagle3']['rounds_per_s']:,.1f} rounds/s "
            f"(plain decoding {v['plain']['tokens_per_s']:,.1f} tokens/s) |"
        )
    lines += [
        "",
        (
            f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}; "
            f"{result['seconds']:.0f} s in all."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU tests); flags below override either preset")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--out", default="runs/bench_gpu", help="directory for bench_gpu.json and bench_gpu.md")
    ap.add_argument("--only", default="train,collect,verify", help="comma list of benchmarks to run")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (default: from the GPU name)")
    for f in Sizes.__dataclass_fields__:
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    args = ap.parse_args(argv)

    import torch
    import transformers

    preset = TINY if args.tiny else REAL
    s = Sizes(
        **{
            f: getattr(args, f) if getattr(args, f) is not None else getattr(preset, f)
            for f in Sizes.__dataclass_fields__
        }
    )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    result: dict[str, Any] = {
        "environment": {
            "device_name": name,
            "dtype": str(dtype).removeprefix("torch."),
            "peak_tflops": peak,
            "sizes": "tiny" if args.tiny else "real",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        },
        "sizes": s.__dict__,
    }
    wanted = set(args.only.split(","))
    if "train" in wanted:
        result["train"] = bench_train(s, device, dtype, peak)
        print(f"train: {result['train']['tokens_per_s']:,.0f} tokens/s", flush=True)
    if wanted & {"collect", "verify"}:
        model = _random_llama(s, device, dtype)
        if "collect" in wanted:
            result["collect"] = bench_collect(s, model, device)
            print(f"collect: {result['collect']['collect_tokens_per_s']:,.0f} tokens/s", flush=True)
        if "verify" in wanted:
            result["verify"] = bench_verify(s, model, device, dtype)
            print(f"verify: {result['verify']['eagle3']['rounds_per_s']:,.1f} rounds/s", flush=True)
    result["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=2))
    (out / "bench_gpu.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
