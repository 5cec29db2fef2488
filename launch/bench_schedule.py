"""Tokens/s of a run's trained drafters against plain decoding, per verification schedule and batch size, measured
side by side in one process (eval.schedule: fixed γ, the confidence threshold, the cost-based schedule).

    python launch/bench_schedule.py runs/demo/config.yaml [--batches 1,4,16] [--per-domain 2] [--max-new-tokens 96]
        [--temperatures 0,1] [--threshold 0.5] [--out DIR]

For every batch size, the eval prompts (the first `--per-domain` of each domain, repeated to fill the batch) are
decoded in batches of that size by plain decoding and by each trained drafter under each schedule; tokens/s is new
tokens over wall time, summed over the batches. The cost tables are measured first (and cached like eval's). Prints
a table per temperature, the cost tables, the verified slots per row and round, writes OUT/bench_schedule.json and
a plot of tokens/s against batch size (OUT/bench_schedule.png).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from itertools import zip_longest
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from draftsmith.data.chat import stop_token_ids
    from draftsmith.eval.costs import cached_costs, measure_costs
    from draftsmith.eval.engine import decode
    from draftsmith.eval.proposers import NoDraft
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
    from draftsmith.eval.schedule import CostSchedule
    from draftsmith.pipeline.config import load_config
    from draftsmith.pipeline.evaluate import eval_prompts
    from draftsmith.pipeline.families import get_family, load_drafter
    from draftsmith.pipeline.inputs import trained_drafter
    from draftsmith.pipeline.target import cache_root, load_target

    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    cfg = load_config(args.config, [*args.overrides, f"eval.max_prompts_per_domain={args.per_domain}"])
    out = args.out or cfg.run_path / "bench_schedule"
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.model)
    tok, model = target.tokenizer, target.model
    stops = stop_token_ids(tok, model)
    prompts = eval_prompts(cfg, tok)
    gamma = cfg.eval.draft_length
    by_domain = defaultdict(list)
    for p in prompts:
        by_domain[p["domain"]].append(p)
    mixed = [p for group in zip_longest(*by_domain.values()) for p in group if p is not None]
    drafters = {}
    for family in cfg.train.drafters:
        d = load_drafter(trained_drafter(cfg, target.identity, None, family)).to(target.device, model.dtype)
        drafters[family] = get_family(family).proposer(d, cfg.eval)
    cache = cache_root() / "costs"
    print(
        f"{len(prompts)} prompts, drafters {list(drafters)}, γ {gamma}, {args.max_new_tokens} new tokens, "
        f"{model.dtype}, {torch.get_num_threads()} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}"
    )

    runners = {name: HFTarget(model, p.aux_ids, tok.pad_token_id) for name, p in drafters.items()}
    runners["plain"] = HFTarget(model, None, tok.pad_token_id)
    costs = {}
    for name, proposer in drafters.items():
        key = {
            "target": json.dumps(target.identity, sort_keys=True),
            "dtype": str(model.dtype),
            "device": str(target.device),
            "drafter": name,
            "batches": batches,
            "gamma": gamma,
            "rounds": 6,
            "run": str(cfg.run_path),
        }
        table, cached = cached_costs(
            cache,
            key,
            lambda p=proposer, n=name: measure_costs(runners[n], p, [q["ids"] for q in prompts], batches, gamma),
        )
        costs[name] = table
        print(
            f"cost table {name} ({'cached' if cached else 'measured'}): verify (batch -> width -> ms) "
            + "; ".join(
                f"{b}: " + " ".join(f"{w}:{1e3 * s:.0f}" for w, s in sorted(row.items()))
                for b, row in sorted(table.verify.items())
            )
            + f" | round ms {dict((b, round(1e3 * s, 1)) for b, s in table.draft_round.items())}"
            + f" | step ms {dict((b, round(1e3 * s, 1)) for b, s in table.draft_step.items())}"
        )

    def configure(proposer, mode, name):
        proposer.schedule, proposer.threshold = None, None
        if mode == "threshold":
            proposer.threshold = args.threshold
        elif mode == "cost":
            proposer.schedule = CostSchedule(costs[name])

    results: dict = defaultdict(dict)
    for temperature in temperatures:
        params = SamplingParams(temperature, cfg.eval.top_p, cfg.eval.top_k)
        for B in batches:
            # max(B, 8) rows, the domains taken in turn, decoded B at a time
            rows = [mixed[i % len(mixed)] for i in range(max(B, 8))]
            groups = [rows[i : i + B] for i in range(0, len(rows), B)]
            runs = [("plain", "-", NoDraft())] + [
                (n, m, p) for n, p in drafters.items() for m in ("fixed", "threshold", "cost")
            ]
            for name, mode, proposer in runs:
                if name != "plain":
                    configure(proposer, mode, name)
                tokens = seconds = slots = rounds = 0.0
                for group in groups:
                    gens = [
                        make_generator(target.device, derive_seed(0, p["id"] + str(j), temperature))
                        for j, p in enumerate(group)
                    ]
                    t0 = time.perf_counter()
                    res = decode(
                        runners[name],
                        proposer,
                        [p["ids"] for p in group],
                        params,
                        gamma,
                        args.max_new_tokens,
                        stops,
                        gens,
                    )
                    seconds += time.perf_counter() - t0
                    tokens += sum(len(r.tokens) for r in res)
                    slots += sum(d for r in res for d, _ in r.rounds)
                    rounds += sum(len(r.rounds) for r in res)
                results[temperature][(B, name, mode)] = {
                    "tokens_per_s": tokens / seconds,
                    "slots_per_row_round": slots / max(rounds, 1),
                    "tau": tokens / max(rounds, 1),
                }
            base = results[temperature][(B, "plain", "-")]["tokens_per_s"]
            line = " | ".join(
                f"{n}/{m} {r['tokens_per_s'] / base:.2f}x ({r['slots_per_row_round']:.2f} slots)"
                for (b, n, m), r in results[temperature].items()
                if b == B and n != "plain"
            )
            print(f"T={temperature} batch {B}: plain {base:.1f} tok/s | {line}", flush=True)

    record = {str(t): {f"{b}/{n}/{m}": r for (b, n, m), r in res.items()} for t, res in results.items()}
    (out / "bench_schedule.json").write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        res = results[temperature]
        for name, mode in sorted({(n, m) for _, n, m in res}):
            ax.plot(
                batches, [res[(b, name, mode)]["tokens_per_s"] for b in batches], marker="o", label=f"{name} {mode}"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"T = {temperature}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_schedule.png", dpi=120)
    print(f"wrote {out / 'bench_schedule.json'} and {out / 'bench_schedule.png'}")


if __name__ == "__main__":
    main()
