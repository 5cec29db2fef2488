"""Whether a wider target pass costs more right after the drafter caught up on skipped rounds than amid a stretch of
drafting.

The cost schedule prices a draft slot by how much more a wider target pass costs than a plain one, timed by pairs of
neighbouring plain and wider rounds (`CostSchedule._paired`). Where the schedule has stopped drafting, the only wider
rounds are its probes, each right after the drafter's pass over every round it skipped (a catch-up). Had that pass
evicted the target's weights from the cache, or made the probe's target pass dearer some other way, a stall's pairs
would price a slot dearer than a stretch of drafting pays for it, and the stall would hold itself.

    python launch/bench_round_pairs.py RUN/config.yaml [run_dir=...] [--drafters eagle3,dspark] [--per-domain 2]
        [--temperatures 0,1] [--max-new-tokens 64]

Each drafter decodes the eval prompts one at a time under a scripted schedule whose rounds run through `CYCLE` (from its
start at every decode): twelve plain rounds, three drafted (the first catching up on the twelve), one plain, one
drafted, two plain, two drafted, one plain; a drafted round verifies one slot per row. Prints, per drafter and
temperature, the median target pass of each kind of round and, per kind of neighbouring pair, the median wider − plain
and how many pairs: a probe after twelve skipped rounds, a drafted round after one or two, a plain round after a
drafted one, and plain after plain (no increment: the pairs' own noise); with each kind's trimmed mean and its standard
error (how the cost schedule estimates the increment: `CostSchedule.pair_trim`) and the standard deviation of one pair.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from draftsmith.eval.schedule import CostSchedule, ScriptedSchedule, trimmed_mean, trimmed_mean_error

CYCLE = "PPPPPPPPPPPPDDDPDPPDDP"
"""The rounds of one cycle: P a plain round (the drafter skipped), D a drafted one (one slot per row)."""


class Cycle(ScriptedSchedule):
    """A schedule (`TrainedProposer.schedule`) that drafts the rounds `pattern` marks D, one slot each, and skips the
    others (kept and caught up on as the cost schedule's are), restarting the pattern at every decode; it keeps every
    round's target-pass seconds with its letter and the number of plain rounds right before it (`rounds`)."""

    def __init__(self, pattern: str = CYCLE):
        if not pattern or set(pattern) - {"P", "D"}:
            raise ValueError(f"a cycle is a string of P (plain) and D (drafted) rounds, got {pattern!r}")
        self.pattern, self.round, self.decode = pattern, 0, -1
        self.rounds: list[tuple[int, str, int, float]] = []
        """(decode, P or D, plain rounds right before it in this decode, seconds of its target pass) per round."""
        self.plain_before = 0

    def worth_drafting(self, c0, active) -> bool:
        return self.pattern[self.round % len(self.pattern)] == "D"

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        kind = self.pattern[self.round % len(self.pattern)]
        self.rounds.append((self.decode, kind, self.plain_before, verify_seconds))
        self.plain_before = self.plain_before + 1 if kind == "P" else 0
        self.round += 1

    def reset(self) -> None:
        self.round, self.decode, self.plain_before = 0, self.decode + 1, 0


def pairs(rounds: list[tuple[int, str, int, float]]) -> dict[str, list[float]]:
    """Wider − plain seconds of every pair of neighbouring rounds of one decode, by kind: "probe after k plain" (a
    drafted round after k ≥ 1 plain ones, the plain one before it), "plain after drafted", and "plain after plain"
    (the later minus the earlier: no increment, the pairs' noise)."""
    out: dict[str, list[float]] = defaultdict(list)
    for (d0, k0, _, v0), (d1, k1, before, v1) in zip(rounds, rounds[1:]):
        if d0 != d1 or k0 == k1 == "D":
            continue
        if k1 == "D":
            out[f"drafted after {before} plain"].append(v1 - v0)
        elif k0 == "D":
            out["plain after drafted"].append(v0 - v1)
        else:
            out["plain after plain"].append(v1 - v0)
    return dict(out)


def passes(rounds: list[tuple[int, str, int, float]]) -> dict[str, list[float]]:
    """Seconds of the target pass by kind of round: plain, drafted right after plain rounds (after k), drafted after a
    drafted one."""
    out: dict[str, list[float]] = defaultdict(list)
    for j, (decode, kind, before, seconds) in enumerate(rounds):
        if kind == "P":
            out["plain"].append(seconds)
        elif before:
            out[f"drafted after {before} plain"].append(seconds)
        elif j and rounds[j - 1][0] == decode:
            out["drafted after drafted"].append(seconds)
    return dict(out)


def main() -> None:
    from draftsmith.eval.engine import decode
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.evaluate import bench_inputs
    from draftsmith.pipeline.families import get_family

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. run_dir=runs/exp")
    ap.add_argument("--drafters", default="", help="comma-separated (default: every drafter the run trained)")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    inputs = bench_inputs(
        args.config, args.overrides, args.per_domain, [d for d in args.drafters.split(",") if d] or None
    )
    cfg, target = inputs.cfg, inputs.target
    prompts = [p["ids"] for p in inputs.prompts]
    median = lambda xs: f"{1e3 * statistics.median(xs):7.2f} ms" if xs else "      -"  # noqa: E731

    def spread(xs: list[float]) -> str:
        error = trimmed_mean_error(xs, CostSchedule.pair_trim)
        if error is None:
            return "-"
        trimmed = trimmed_mean(xs, CostSchedule.pair_trim)
        return f"{1e3 * trimmed:+.2f} ± {1e3 * error:.2f} ms, sd {1e3 * statistics.stdev(xs):.2f} ms"

    print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens each, rounds cycling {CYCLE}", flush=True)
    for name, drafter in inputs.drafters.items():
        for t in [float(x) for x in args.temperatures.split(",")]:
            proposer = get_family(name).proposer(drafter, cfg.eval)
            proposer.schedule = schedule = Cycle()
            runner = HFTarget(target.model, proposer.aux_ids, target.tokenizer.pad_token_id)
            params = SamplingParams(t, cfg.eval.top_p, cfg.eval.top_k)
            decode(runner, proposer, [prompts[0]], params, 1, 8)  # warm up; its rounds are not counted
            schedule.rounds.clear()
            for prompt in prompts:
                decode(runner, proposer, [prompt], params, 1, args.max_new_tokens)
            print(f"\n{name}, T = {t}: target pass (median) by kind of round", flush=True)
            for kind, xs in sorted(passes(schedule.rounds).items()):
                print(f"  {kind:26s} {median(xs)}  ({len(xs)} rounds)")
            print("  wider − plain, neighbouring rounds of one decode (median; trimmed mean ± its standard error, as")
            print("  the cost schedule estimates the increment; standard deviation of one pair):")
            for kind, xs in sorted(pairs(schedule.rounds).items()):
                print(f"  {kind:26s} {median(xs)}  {spread(xs)}  ({len(xs)} pairs)", flush=True)


if __name__ == "__main__":
    main()
