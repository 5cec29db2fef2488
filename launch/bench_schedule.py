"""Speedup of a run's trained drafters over plain decoding under each verification schedule (eval.schedule: fixed γ,
the confidence threshold, the cost schedule), measured side by side in one process: per domain at batch 1, and
against batch size (the batch curve).

    python launch/bench_schedule.py runs/demo/config.yaml [--per-domain 2] [--repeats 1] [--max-new-tokens 64]
        [--temperatures 0,1] [--batches 1,4,16,64] [--curve-temperatures 0] [--curve-repeats 1]
        [--curve-schedules fixed,threshold,cost] [--schedules fixed,threshold,cost] [--threshold 0.5] [--out DIR]

A schedule is one of eval's (fixed, threshold, cost) or a variant of the cost schedule, `cost-NAME` for each rule in
`eval.schedule.VARIANTS` (`VARIANTS`).

Per domain: every eval prompt (the first `--per-domain` of each domain) is decoded alone by plain decoding, by every
(drafter, schedule) and by plain decoding again (the A/A column: the noise of a ratio measured this way), side by side
a round at a time (eval's own `Decoder.temperature`, `eval.engine.interleave`: the configuration that has spent the
least time goes next, so a slow spell of the machine falls on all of them), `--repeats` times; ties go in order, in
reverse every other prompt and repeat. A domain's tokens/s is its tokens over its configuration's own decode time.
The batch curve is eval's own (eval.batch_curve, `eval.curve`, which reverses the order every other group), with
plain decoding again as one more configuration (A/A, the schedule "again"), summed over `--curve-repeats` runs of it
(the second reversed). The cost tables are measured first (cached like eval's, per run and batch sizes). Prints the
per-domain tables, the cost tables (again at the end, with what the curve's schedules timed against them) and the
curve as Markdown, and writes OUT/bench_schedule.json and OUT/batch_curve.png.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

from draftsmith.eval import schedule

AGAIN = "none/again"
"""Plain decoding run a second time, after every other configuration of the prompt (an A/A comparison)."""
VARIANTS = {f"cost-{name}": ("cost", name) for name in schedule.VARIANTS}
"""Schedules of this bench only, for a side-by-side comparison: `cost-NAME` -> ("cost", NAME) for each rule NAME in
`eval.schedule.VARIANTS` (which says what each one is), so a rule added there is a schedule here."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1", help="per-domain tables at these temperatures ('' for none)")
    ap.add_argument("--batches", default="1,4,16,64", help="batch curve sizes ('' for none)")
    ap.add_argument("--curve-temperatures", default="0")
    ap.add_argument("--curve-repeats", type=int, default=1, help="batch curve runs summed (each one all sizes)")
    ap.add_argument("--curve-schedules", default="fixed,threshold,cost", help="schedules on the batch curve")
    ap.add_argument("--schedules", default="fixed,threshold,cost", help="schedules in the per-domain tables")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument(
        "--table-batches",
        default="",
        help="batch sizes to measure the cost tables at (default: 1 and --batches); a superset of --batches reuses "
        "the tables a wider run cached",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from draftsmith.data.chat import stop_token_ids
    from draftsmith.eval.costs import cached_costs, cost_key, measure_costs
    from draftsmith.eval.curve import MIN_ROWS, batch_curve, curve_points
    from draftsmith.eval.proposers import NoDraft
    from draftsmith.eval.report import cost_tables_markdown, curve_plot, curve_table
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.evaluate import Decoder, bench_inputs, summarize
    from draftsmith.pipeline.families import get_family
    from draftsmith.pipeline.target import cache_root

    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    batches = [int(b) for b in args.batches.split(",") if b]
    inputs = bench_inputs(args.config, args.overrides, args.per_domain)
    cfg, target, prompts, families = inputs.cfg, inputs.target, inputs.prompts, inputs.drafters
    tok, model = target.tokenizer, target.model
    out = args.out or cfg.run_path / "bench_schedule"
    out.mkdir(parents=True, exist_ok=True)
    gamma = cfg.eval.draft_length
    schedules = tuple(args.schedules.split(","))

    # one proposer per (drafter, schedule) for the per-domain tables; the batch curve switches one per drafter
    tables: dict = {}
    proposers = {"none": NoDraft()}
    for family, d in families.items():
        proposers[family] = get_family(family).proposer(d, cfg.eval)
        for mode in schedules:
            proposers[f"{family}/{mode}"] = get_family(family).proposer(d, cfg.eval)
    # plain decoding again, last: its "speedup" over the first plain run is the noise of a ratio measured this way
    proposers[AGAIN] = NoDraft()
    decoder = Decoder(
        runners={n: HFTarget(model, p.aux_ids, tok.pad_token_id) for n, p in proposers.items()},
        proposers=proposers,
        gammas={n: getattr(p, "length", None) or gamma for n, p in proposers.items()},
        stops=stop_token_ids(tok, model),
        tree=None,
        seed=cfg.eval.seed,
        device=target.device,
    )
    print(
        f"{len(prompts)} prompts, drafters {list(families)}, γ {gamma}, {args.max_new_tokens} new tokens, "
        f"{model.dtype}, {torch.get_num_threads()} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}",
        flush=True,
    )
    sizes = sorted({1, *batches, *(int(b) for b in args.table_batches.split(",") if b)})
    rows = [p["ids"] for p in prompts]
    cached: dict[str, bool] = {}
    for family in families:
        key = cost_key(
            target, families[family].config.to_dict(), sizes, gamma, cfg.eval.cost_rounds, run=str(cfg.run_path)
        )
        measure = lambda f=family: measure_costs(  # noqa: E731
            decoder.runners[f], proposers[f], rows, sizes, decoder.gammas[f], cfg.eval.cost_rounds
        )
        tables[family], cached[family] = cached_costs(cache_root() / "costs", key, measure)

    def use(name: str, mode: str) -> None:
        rule, which = VARIANTS.get(mode, (mode, None))
        proposers[name].use(rule, tables[name.split("/")[0]], args.threshold)
        if rule == "cost":  # the batch curve switches one proposer's one cost schedule between the variants
            schedule.variant(proposers[name].schedule, which)

    for family in families:
        for mode in schedules:
            use(f"{family}/{mode}", mode)
    costs = {f: {"cached": cached[f], **asdict(t)} for f, t in tables.items()}  # eval.json's `costs` layout
    print(cost_tables_markdown(costs), flush=True)

    # warm-up, untimed: allocations and kernel choice, for every configuration
    for name in proposers:
        decoder.run(prompts[:1], name, SamplingParams(), 8)

    record: dict = {"settings": vars(args) | {"out": str(out)}, "per_domain": [], "batch_curve": []}
    names = ["none"] + [f"{f}/{m}" for f in families for m in schedules] + [AGAIN]
    for temperature in floats(args.temperatures):
        params = SamplingParams(temperature, cfg.eval.top_p, cfg.eval.top_k)
        by: dict = defaultdict(lambda: defaultdict(list))
        diverged: dict = defaultdict(list)
        for rep in range(args.repeats):
            # the per-domain runs use `decoder.proposers` restricted to plain + per-schedule proposers
            sub = replace(decoder, proposers={n: proposers[n] for n in names})
            part, div = sub.temperature(
                [[p] for p in prompts],
                params,
                args.max_new_tokens,
                f"T={temperature} #{rep}",
                reverse_first=rep % 2 == 1,
            )
            for domain, per in part.items():
                for n, results in per.items():
                    by[domain][n].extend(results)
            for n, v in div.items():
                diverged[n] += v
        run = summarize(temperature, by, diverged, decoder.gammas, names, len(prompts) * args.repeats, params.greedy)
        _pool(run, by, names)
        # what each per-domain cost schedule timed against its table at this temperature (its regime's own rounds)
        kept = {n: getattr(proposers[n], "schedule", None) for n in names}  # plain decoding has none
        run["regime_corrections"] = {n: s.regime_corrections(params.regime) for n, s in kept.items() if s is not None}
        record["per_domain"].append(run)
        print(_domain_markdown(run, list(families), schedules), flush=True)
        timed = {
            f"{n}, at T = {temperature}": costs[n.split("/")[0]] | {"corrections": c}
            for n, c in run["regime_corrections"].items()
        }
        print(cost_tables_markdown(timed), flush=True)

    for temperature in floats(args.curve_temperatures) if batches else []:
        params = SamplingParams(temperature, cfg.eval.top_p, cfg.eval.top_k)
        configs = [(f, m) for f in families for m in args.curve_schedules.split(",")] + [("none", "again")]
        sums: dict = {}
        rows = args.curve_repeats * sum(max(b, MIN_ROWS) for b in batches)
        bar = tqdm(total=rows, desc=f"batch curve T={temperature}", unit="row")
        for rep in range(args.curve_repeats):  # all sizes once, then again: a slow minute reaches one size less
            curve = batch_curve(
                decoder.run,
                configs,
                use,
                prompts,
                batches,
                params,
                args.max_new_tokens,
                progress=bar.update,
                reverse_first=rep % 2 == 1,  # a size of one group runs in order, then in reverse
            )
            for k, v in curve.items():
                sums[k] = {f: sums.get(k, {}).get(f, 0.0) + x for f, x in v.items()}
        bar.close()
        record["batch_curve"] += curve_points(sums, temperature)
        print(curve_table([p for p in record["batch_curve"] if p["temperature"] == temperature]), flush=True)
    if record["batch_curve"]:
        curve_plot(record["batch_curve"], out / "batch_curve.png")
    # what the curve's cost schedules (one per drafter, kept across groups) timed against their tables
    for family in families:
        kept = proposers[family].cost_schedule
        if kept is not None:
            costs[family]["corrections"] = kept.corrections()
    record["costs"] = costs
    if any("corrections" in t for t in costs.values()):
        print(cost_tables_markdown({f: t for f, t in costs.items() if "corrections" in t}), flush=True)
    (out / "bench_schedule.json").write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out / 'bench_schedule.json'}" + (f" and {out / 'batch_curve.png'}" if record["batch_curve"] else ""))


def _domain_markdown(run: dict, families: list[str], schedules: tuple[str, ...]) -> str:
    """Per domain: plain tok/s, then each drafter's speedup (τ) under each schedule, then plain decoding run again
    (the A/A ratio: how far from 1.00x noise alone moves a ratio); the last row is all domains. Then the speedups
    again, over both plain runs pooled. Each with its 95% interval over the prompts."""
    from draftsmith.eval.report import speedup_text

    cols = [f"{f}/{m}" for f in families for m in schedules] + [AGAIN]
    lines = [
        f"### T = {run['temperature']}, batch 1: speedup over plain decoding (τ)",
        "| domain | prompts | plain tok/s | " + " | ".join(cols) + " |",
        "|---" * (3 + len(cols)) + "|",
    ]
    rows = [*run["domains"].items(), ("**all**", run["overall"])]
    for domain, row in rows:
        plain = row["none"]
        cells = [domain, str(plain["prompts"]), f"{plain['tokens_per_s']:.1f}"]
        cells += [f"{speedup_text(row[c])} ({row[c]['tau']:.2f})" for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    # the same against both plain runs pooled (before and after every other configuration): a drift of the machine's
    # speed during a prompt's configurations then moves the baseline with it
    cols = cols[:-1]
    lines += [
        "",
        f"### T = {run['temperature']}, batch 1: speedup over plain decoding run before and after, pooled",
        "| domain | plain tok/s (both runs) | " + " | ".join(cols) + " |",
        "|---" * (2 + len(cols)) + "|",
    ]
    for domain, row in rows:
        runs = (row["none"], row[AGAIN])
        pooled = sum(r["new_tokens"] for r in runs) / sum(r["seconds"] for r in runs)
        cells = [domain, f"{pooled:.1f}"] + [speedup_text(row[c]["pooled"]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\nIn square brackets: the 95% interval over the domain's prompts and repeats (a bootstrap paired by prompt, "
        "eval.metrics.speedup_interval); the A/A column's intervals above show how far noise alone moves a ratio."
    )
    return "\n".join(lines) + "\n"


def _pool(run: dict, by: dict, names: list[str]) -> None:
    """Each configuration's speedup over both plain runs pooled (before and after it: a drift of the machine's speed
    during a prompt's configurations moves that baseline with it), with its interval, as `pooled` next to the speedup
    over the first plain run; plain decoding again gets the interval of its speedup over the first run."""
    from draftsmith.eval.metrics import speedup_interval

    everything = {n: [r for per in by.values() for r in per[n]] for n in names}
    for row, per in [*((run["domains"][d], by[d]) for d in by), (run["overall"], everything)]:
        base = [per["none"], per[AGAIN]]
        plain_rate = sum(len(r.tokens) for p in base for r in p) / sum(r.seconds for p in base for r in p)
        for n in names[1:-1]:
            interval = speedup_interval(per[n], base)
            row[n]["pooled"] = {"speedup": row[n]["tokens_per_s"] / plain_rate}
            if interval is not None:
                row[n]["pooled"]["speedup_interval"] = [round(x, 4) for x in interval]


if __name__ == "__main__":
    main()
