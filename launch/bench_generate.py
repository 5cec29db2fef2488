"""Benchmark `generate` throughput (tokens/s) at batch 1 vs batch 16 on the default target, side by side.

    python launch/bench_generate.py                        # SmolLM2-135M-Instruct, bf16, 16 MT-Bench prompts
    python launch/bench_generate.py --dtype float32 --max-new-tokens 64

It runs the same code path as `draftsmith generate` (HFGenerator over chat-template prompt ids, greedy),
pins the thread count, and counts only generated tokens (padding and prompt tokens excluded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=16, help="number of MT-Bench first-turn prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument(
        "--attn", default=None, choices=["sdpa", "eager"], help="attention implementation (default: the model's)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs per batch size; the median is reported")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from collections import Counter

    from draftsmith.data.chat import prompt_ids, stop_token_ids
    from draftsmith.data.generation import HFGenerator, Sampling
    from draftsmith.data.sources import iter_conversations
    from draftsmith.pipeline.config import ModelConfig, SourceConfig
    from draftsmith.pipeline.target import load_target

    target = load_target(ModelConfig(target=args.target, dtype=args.dtype, attn_implementation=args.attn))
    tok, model = target.tokenizer, target.model
    convs = list(iter_conversations(SourceConfig(builtin="mtbench", limit=args.prompts), Counter()))
    prompts = [prompt_ids(tok, c["messages"][:1]) for c in convs]
    stops = stop_token_ids(tok, model)
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    HFGenerator(model, tok.pad_token_id, stops, 4).generate(prompts[:4], Sampling(max_new_tokens=8), 0)  # warm-up

    device = target.device
    print(
        f"target={args.target} dtype={args.dtype} device={device} threads={torch.get_num_threads()} "
        f"prompts={len(prompts)} max_new_tokens={args.max_new_tokens}"
    )
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        rates, tokens = [], 0
        for _ in range(args.repeats):
            gen = HFGenerator(model, tok.pad_token_id, stops, batch_size=bs)
            t0 = time.perf_counter()
            out = gen.generate(prompts, sampling, seed=0)
            dt = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) + (c.finish_reason == "stop") for c in out)
            rates.append(tokens / dt)
        rows.append((bs, tokens, statistics.median(rates)))
    base = rows[0][2]
    print(f"{'batch':>5} {'tokens':>7} {'tok/s':>8} {'vs batch ' + str(rows[0][0]):>12}")
    for bs, tokens, rate in rows:
        print(f"{bs:>5} {tokens:>7} {rate:>8.1f} {rate / base:>11.2f}x")


if __name__ == "__main__":
    main()
