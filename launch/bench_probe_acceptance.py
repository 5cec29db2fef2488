"""Whether a drafter's first slots are accepted as often when it drafts only every n-th round as when it drafts every
round. The cost schedule, where drafting does not pay, skips rounds and asks the drafter again now and then (a probe):
the drafter then runs over every round it skipped in one pass (a catch-up) before it drafts. A catch-up that saw the
skipped text differently, or probes landing on harder text, would make a probe's slot fail more often than a slot
drafted every round, and the schedule, learning acceptance from what it verifies, would keep skipping.

    python launch/bench_probe_acceptance.py RUN/config.yaml [run_dir=...] [--drafter dspark] [--every 1,2,4,8,16]
        [--per-domain 2] [--max-new-tokens 64]

Greedy decoding (T = 0) of the eval prompts, one slot per drafted round, once per n: prints the first slots accepted
over those drafted, and the same for each decode's first round alone (drafted right after the prompt). The text is the
target's greedy one whatever n is; only which of its positions get a slot changes.
"""

from __future__ import annotations

import argparse

from draftsmith.eval.schedule import ScriptedSchedule


class EveryNth(ScriptedSchedule):
    """A schedule (`TrainedProposer.schedule`) that drafts the first round of a decode and every n-th round after it,
    one slot each, and skips the others: the rounds between are kept and caught up on as the cost schedule's are."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"draft every n-th round needs n >= 1, got {n}")
        self.n, self.round, self.skipped = n, 0, 0

    def worth_drafting(self, c0, active) -> bool:
        self.round += 1
        drafts = (self.round - 1) % self.n == 0
        self.skipped += not drafts
        return drafts

    def reset(self) -> None:
        self.round = 0


def first_slots(rounds) -> tuple[int, int, int, int]:
    """(drafted, accepted, drafted in the decode's first round, accepted there) from a decode's (drafted, accepted)
    per round."""
    drafted = sum(d > 0 for d, _ in rounds)
    accepted = sum(d > 0 and a > 0 for d, a in rounds)
    first = rounds[:1]
    return drafted, accepted, sum(d > 0 for d, _ in first), sum(d > 0 and a > 0 for d, a in first)


def main() -> None:
    from draftsmith.eval.engine import decode
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.evaluate import bench_inputs
    from draftsmith.pipeline.families import get_family

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. run_dir=runs/exp")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--every", default="1,2,4,8,16")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    inputs = bench_inputs(args.config, args.overrides, args.per_domain, [args.drafter])
    cfg, target, drafter = inputs.cfg, inputs.target, inputs.drafters[args.drafter]
    tok, model = target.tokenizer, target.model
    prompts = [p["ids"] for p in inputs.prompts]
    print(f"{args.drafter}, {len(prompts)} prompts, {args.max_new_tokens} greedy tokens each, one slot a drafted round")
    for n in [int(x) for x in args.every.split(",")]:
        proposer = get_family(args.drafter).proposer(drafter, cfg.eval)
        proposer.schedule = EveryNth(n)
        runner = HFTarget(model, proposer.aux_ids, tok.pad_token_id)
        totals = [0, 0, 0, 0]
        for prompt in prompts:
            result = decode(runner, proposer, [prompt], SamplingParams(), 1, args.max_new_tokens)[0]
            totals = [t + x for t, x in zip(totals, first_slots(result.rounds))]
        drafted, accepted, drafted0, accepted0 = totals
        print(
            f"  every {n:2d} round(s): {accepted}/{drafted} first slots accepted ({accepted / max(drafted, 1):.1%}); "
            f"a decode's first round {accepted0}/{drafted0}",
            flush=True,
        )


if __name__ == "__main__":
    main()
