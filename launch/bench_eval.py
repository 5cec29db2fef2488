"""Benchmark the decoding engine on the default target: plain decoding and prompt lookup, each against
`transformers` generate on the same prompts, side by side in one process (greedy, batch 1).

    python launch/bench_eval.py                                 # SmolLM2-135M-Instruct bf16, 8 MT-Bench first turns
    python launch/bench_eval.py --drafter runs/x/train/best     # add a trained EAGLE-3 drafter

Reports tokens/s, τ, speedup over plain decoding, and how many greedy outputs differ from plain decoding
(floating-point near-ties between differently shaped kernels; 0 in exact arithmetic).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns, spread over the 8 categories")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from collections import Counter

    from transformers import GenerationConfig

    from draftsmith.data.chat import prompt_ids, stop_token_ids
    from draftsmith.data.sources import iter_conversations
    from draftsmith.eval.engine import decode
    from draftsmith.eval.proposers import Eagle3Proposer, NoDraft, PromptLookup
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.config import ModelConfig, SourceConfig
    from draftsmith.pipeline.target import load_target

    target = load_target(ModelConfig(target=args.target, dtype=args.dtype))
    model, tok = target.model, target.tokenizer
    convs = list(iter_conversations(SourceConfig(builtin="mtbench"), Counter()))
    step = max(1, len(convs) // args.prompts)
    prompts = [prompt_ids(tok, c["messages"][:1]) for c in convs[::step][: args.prompts]]
    stops = stop_token_ids(tok, model)
    greedy = SamplingParams()

    def hf(**extra):
        cfg = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
            **extra,
        )
        outs, t0 = [], time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p], device=target.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            outs.append(out[0, len(p) :].tolist())
        return outs, time.perf_counter() - t0

    def engine(proposer, runner):
        outs, rounds, t0 = [], [], time.perf_counter()
        for p in prompts:
            (r,) = decode(runner, proposer, [p], greedy, args.gamma, args.max_new_tokens, stops)
            outs.append(r.tokens)
            rounds += r.rounds
        return outs, time.perf_counter() - t0, sum(a + 1 for _, a in rounds) / len(rounds)

    plain_runner = HFTarget(model)
    hf(), engine(NoDraft(), plain_runner)  # warm-up
    rows = []
    base_out, base_t, _ = engine(NoDraft(), plain_runner)
    n_base = sum(len(o) for o in base_out)
    rows.append(("engine, plain decoding", n_base, base_t, 1.0, 0))
    out, t = hf()
    rows.append(
        ("transformers generate, plain", sum(len(o) for o in out), t, None, sum(o != b for o, b in zip(out, base_out)))
    )
    out, t, tau = engine(PromptLookup(), plain_runner)
    rows.append(
        (
            f"engine, prompt lookup (γ={args.gamma})",
            sum(len(o) for o in out),
            t,
            tau,
            sum(o != b for o, b in zip(out, base_out)),
        )
    )
    out, t = hf(prompt_lookup_num_tokens=args.gamma)
    rows.append(
        (
            f"transformers generate, prompt_lookup_num_tokens={args.gamma}",
            sum(len(o) for o in out),
            t,
            None,
            sum(o != b for o, b in zip(out, base_out)),
        )
    )
    if args.drafter:
        from draftsmith.pipeline.families import load_drafter

        d = load_drafter(args.drafter).to(target.device, model.dtype)
        out, t, tau = engine(Eagle3Proposer(d), HFTarget(model, aux_ids=d.config.aux_layer_ids))
        rows.append(
            (
                f"engine, EAGLE-3 (γ={args.gamma})",
                sum(len(o) for o in out),
                t,
                tau,
                sum(o != b for o, b in zip(out, base_out)),
            )
        )

    base_rate = n_base / base_t
    print(
        f"target={args.target} dtype={args.dtype} device={target.device} threads={torch.get_num_threads()} "
        f"prompts={len(prompts)} max_new_tokens={args.max_new_tokens} greedy"
    )
    print(f"{'method':<52} {'tokens':>6} {'tok/s':>7} {'τ':>5} {'speedup':>8} {'differs':>8}")
    for name, n, t, tau, diff in rows:
        tau_s = f"{tau:.2f}" if tau else "-"
        print(f"{name:<52} {n:>6} {n / t:>7.1f} {tau_s:>5} {n / t / base_rate:>7.2f}x {diff:>4}/{len(prompts)}")


if __name__ == "__main__":
    main()
