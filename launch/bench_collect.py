"""Benchmark `collect`: feature-collection tokens/s against a bare target forward over the same batches.

    python launch/bench_collect.py                     # SmolLM2-135M-Instruct, bf16 features, 64 samples
    python launch/bench_collect.py --dtype float32 --samples 128

The bare forward is `model.model(input_ids)` (decoder only, no lm_head), batch by batch. Collection runs
the stage's own code over the same batches: hooks for the aux layers, cast + copy to CPU, per-sample
slicing, shard packing and the background safetensors writer (to a temp dir), writer drain included.
Runs alternate and the median of --repeats is reported.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="feature storage dtype")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--shard-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from collections import Counter

    from draftsmith.data.chat import prompt_ids
    from draftsmith.data.feature_store import DTYPES, ShardWriter, bytes_per_token, pack_shard
    from draftsmith.data.features import FeatureCapture, length_batches, right_pad
    from draftsmith.data.sources import iter_conversations
    from draftsmith.pipeline.collect import collect_samples, shard_plan
    from draftsmith.pipeline.config import ModelConfig, SourceConfig
    from draftsmith.pipeline.target import load_target

    target = load_target(ModelConfig(target=args.target, dtype=args.model_dtype))
    tok, model = target.tokenizer, target.model
    rng = random.Random(0)
    prompts = [
        prompt_ids(tok, c["messages"][:1]) for c in iter_conversations(SourceConfig(builtin="mtbench"), Counter())
    ]
    records = []
    for i in range(args.samples):
        p = prompts[i % len(prompts)]
        n = rng.randint(max(args.min_len, len(p) + 1), args.max_len)
        ids = p + [rng.randrange(100, 20000) for _ in range(n - len(p))]
        mask = [0] * len(p) + [1] * (n - len(p))
        records.append(
            {
                "id": f"b{i}",
                "domain": "bench",
                "split": "train",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": n,
                "num_supervised": n - len(p),
            }
        )
    tokens = sum(r["num_tokens"] for r in records)
    shards = shard_plan([r["num_tokens"] for r in records], args.shard_tokens)
    capture = FeatureCapture(model, None)
    device = target.device

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for shard in shards:
                chunk = [records[i] for i in shard]
                for batch in length_batches([r["num_tokens"] for r in chunk], args.batch_tokens):
                    ids = right_pad([torch.tensor(chunk[i]["input_ids"]) for i in batch]).to(device)
                    model.model(input_ids=ids, use_cache=False)
        return tokens / (time.perf_counter() - t0)

    def collect() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            writer = ShardWriter(tmp)
            for k, shard in enumerate(shards):
                chunk = [records[i] for i in shard]
                samples = collect_samples(capture, chunk, args.batch_tokens, DTYPES[args.dtype])
                writer.submit(k, pack_shard(samples), [{"id": r["id"]} for r in chunk], {"shard": k})
            writer.close()
            return tokens / (time.perf_counter() - t0)

    bare(), collect()  # warm-up
    bare_rates, collect_rates = [], []
    for _ in range(args.repeats):
        bare_rates.append(bare())
        collect_rates.append(collect())
    b, c = statistics.median(bare_rates), statistics.median(collect_rates)
    bpt = bytes_per_token(len(capture.aux_ids), capture.hidden_size, args.dtype)
    print(
        f"target={args.target} model_dtype={args.model_dtype} feature_dtype={args.dtype} device={device} "
        f"threads={torch.get_num_threads()} samples={len(records)} tokens={tokens} aux_ids={capture.aux_ids}"
    )
    print(f"bare forward (model.model): {b:8.1f} tok/s   runs: {', '.join(f'{x:.0f}' for x in bare_rates)}")
    print(f"collect (capture + store):  {c:8.1f} tok/s   runs: {', '.join(f'{x:.0f}' for x in collect_rates)}")
    print(
        f"collect / bare: {c / b:.1%}   bytes/token: {bpt} ({bpt * tokens / 2**20:.1f} MiB for these {tokens} tokens)"
    )


if __name__ == "__main__":
    main()
