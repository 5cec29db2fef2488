"""How often a draft is accepted at T > 0 when the drafter's argmax is drafted (vLLM's default) against a draft drawn
from the drafter's distribution (what eval does), on the same positions.

    python launch/bench_draft_sampling.py RUN/config.yaml [run_dir=...] [--per-domain 2] [--temperatures 1]
        [--max-new-tokens 64] [--sharpen 0.5] [--drafters eagle3,dspark] [--out DIR]

Both rules are exact; they differ in how often a draft survives. Drawn from the drafter's distribution q, a draft x is
kept with probability min(1, p(x)/q(x)), so a slot survives with probability Σ min(p, q) (the chapter's rule, and
vLLM's `draft_sample_method="probabilistic"`). Taken as the argmax of q and verified as a one-hot q, it is kept with
probability p(argmax q): vLLM's default `draft_sample_method="greedy"` (vllm/config/speculative.py), which SGLang's
target-only verification and the EAGLE reference code do as well. The first can lose where q is flat and the target
sure, the second where the target itself is unsure; which wins is the drafter's.

Each eval prompt is decoded by each trained drafter one slot a round (eval's engine, drafts drawn from q, every round
drafted), so the text is the one the target samples at that temperature. At every verified first slot the bench takes
the target's p and the drafter's q of that slot and records the probability each rule's draft would have been kept:
Σ min(p, q), p(argmax q), and Σ min(p, q') for q' = q^(1/t) renormalized at each t of --sharpen (a draft drawn at a
lower temperature). These are exact expectations on the same contexts, so the rules are compared without the noise of
the accept step's draws. Only the first slot: a later slot's context holds the earlier drafts, which differ by rule.
Prints a table per drafter and temperature and writes OUT/draft_sampling.json (default OUT: RUN/draft_sampling).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch


def expected_acceptance(p: torch.Tensor, q: torch.Tensor, sharpen: tuple[float, ...] = ()) -> dict[str, float]:
    """The probability that a draft at a slot is kept, for the target's distribution `p` [V] and the drafter's `q` [V]
    at that slot, under each way of drafting: "sampled" (drawn from q, kept with min(1, p/q)), "greedy" (argmax q,
    verified as one-hot), and "sharpened T" for each T of `sharpen` (drawn from q^(1/T) renormalized)."""
    p, q = p.double(), q.double()
    said = {"sampled": float(torch.minimum(p, q).sum()), "greedy": float(p[q.argmax()])}
    for t in sharpen:
        if t <= 0:
            raise ValueError(f"a sharpening temperature must be positive, got {t}")
        s = q.pow(1.0 / t)
        said[f"sharpened {t:g}"] = float(torch.minimum(p, s / s.sum()).sum())
    return said


class FirstSlotRecorder:
    """A verify rule for `eval.engine.decoding` (its `verify`): verifies as `eval.verify.sampling_verify` does, and
    records the first slot's `expected_acceptance` of every row that drafted one (in `rows`)."""

    def __init__(self, sharpen: tuple[float, ...] = ()):
        self.sharpen = sharpen
        self.rows: list[dict[str, float]] = []

    def __call__(self, drafts, q, p, generator):
        from draftsmith.eval.verify import sampling_verify

        if len(drafts):
            self.rows.append(expected_acceptance(p[0], q[0], self.sharpen))
        return sampling_verify(drafts, q, p, generator)


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each rule's expected acceptance over `rows`, and how many there are."""
    rules = list(rows[0]) if rows else []
    return {"first_slots": len(rows), **{r: sum(x[r] for x in rows) / len(rows) for r in rules}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="1")
    ap.add_argument("--sharpen", default="0.5", help="temperatures to draw drafts at, applied to q ('' for none)")
    ap.add_argument("--drafters", default="", help="families to bench (default: the run's trained drafters)")
    ap.add_argument("--out", type=Path, default=None, help="default: RUN/draft_sampling")
    args = ap.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    if not temperatures or min(temperatures) <= 0:
        ap.error("--temperatures: every temperature must be > 0 (at T = 0 both rules draft the argmax)")
    sharpen = tuple(float(t) for t in args.sharpen.split(",") if t)

    from tqdm import tqdm

    from draftsmith.data.chat import stop_token_ids
    from draftsmith.eval.engine import decode
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
    from draftsmith.pipeline.evaluate import bench_inputs
    from draftsmith.pipeline.families import get_family

    inputs = bench_inputs(
        args.config, args.overrides, args.per_domain, [f for f in args.drafters.split(",") if f] or None
    )
    cfg, target, prompts = inputs.cfg, inputs.target, inputs.prompts
    tok, model = target.tokenizer, target.model
    stops = stop_token_ids(tok, model)
    out = args.out or cfg.run_path / "draft_sampling"
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for family, drafter in inputs.drafters.items():
        proposer = get_family(family).proposer(drafter, cfg.eval)
        proposer.use("fixed")  # every round drafts: every position of the text gets a first slot
        runner = HFTarget(model, proposer.aux_ids, tok.pad_token_id)
        for temperature in temperatures:
            params = SamplingParams(temperature, cfg.eval.top_p, cfg.eval.top_k)
            by_domain: dict[str, list[dict[str, float]]] = defaultdict(list)
            for prompt in tqdm(prompts, desc=f"{family} T={temperature:g}", unit="prompt"):
                recorder = FirstSlotRecorder(sharpen)
                gens = [make_generator(target.device, derive_seed(cfg.eval.seed, prompt["id"], temperature))]
                decode(runner, proposer, [prompt["ids"]], params, 1, args.max_new_tokens, stops, gens, verify=recorder)
                by_domain[prompt["domain"]] += recorder.rows
            table = {d: summary(rows) for d, rows in by_domain.items()}
            table["all"] = summary([r for rows in by_domain.values() for r in rows])
            record.setdefault(family, {})[f"{temperature:g}"] = table
            rules = [k for k in table["all"] if k != "first_slots"]
            print(f"\n{family}, T = {temperature:g}: a first slot kept, expected, by how it is drafted")
            print("| domain | first slots | " + " | ".join(rules) + " | greedy / sampled |")
            print("|---|---|" + "---|" * len(rules) + "---|")
            for domain, row in table.items():
                ratio = row["greedy"] / row["sampled"] if row.get("sampled") else float("nan")
                cells = " | ".join(f"{row[r]:.1%}" for r in rules)
                print(f"| {domain} | {row['first_slots']} | {cells} | {ratio:.2f} |")
    path = out / "draft_sampling.json"
    path.write_text(json.dumps({"per_domain": args.per_domain, "max_new_tokens": args.max_new_tokens, **record}))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
