"""What pricing a further draft depth from the rounds that drafted it (`CostSchedule.step_time`) changes: a run's
drafter decoded per domain at batch 1, side by side a round at a time (`eval.engine.interleave`), by plain decoding,
one slot drafted every round (fixed γ = 1), the cost schedule as it was before (every excess of a drafted round over
the table put on the draft round, the step left at the table's), the cost schedule, and plain decoding again (the
A/A column: the noise of a ratio measured this way).

    python launch/bench_deeper_slots.py RUN/config.yaml [--drafter eagle3] [--per-domain 2] [--temperature 0]
        [--max-new-tokens 64]

Both schedules decide from the same cached cost table, the one eval measured for the run (`eval.costs`; measured
here when none is cached). Prints, per domain and overall, each configuration's tokens/s over plain decoding's, and
per configuration its rounds, the rounds that drafted, the rounds that verified a second slot, the slots verified and
accepted, and the mean drafting and verification time per round.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict

from draftsmith.eval.schedule import CostSchedule


class LumpedSchedule(CostSchedule):
    """The cost schedule before `step_time`: a drafted round's excess over the table went to the draft round, however
    deep it drafted, and a further depth cost what the table said."""

    def step_time(self, batch: int) -> float:
        return self.costs.step_time(batch)

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        last, behind = self.last, self.behind
        if last is None or last[2] <= 0 or behind or not self.learn_costs:
            return super().timed(verify_seconds, draft_seconds)
        batch, _, steps = last
        round_time, table_step = self.round_time(batch), self.costs.step_time(batch)
        super().timed(verify_seconds, draft_seconds)
        seen = self.excess[batch]  # move what `timed` put on the step onto the draft round, as it was
        seen["step"][0] -= (draft_seconds - round_time - steps * table_step) / steps
        seen["step"][1] -= 1
        seen["draft"][0] += draft_seconds - self.costs.round_time(batch) - steps * table_step
        seen["draft"][1] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch

    from draftsmith.eval.costs import cached_costs, cost_key, measure_costs
    from draftsmith.eval.engine import decoding, interleave
    from draftsmith.eval.proposers import NoDraft
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
    from draftsmith.pipeline.evaluate import bench_inputs
    from draftsmith.pipeline.families import get_family
    from draftsmith.pipeline.target import cache_root

    inputs = bench_inputs(args.config, [], args.per_domain, [args.drafter])
    cfg, target, prompts, drafter = inputs.cfg, inputs.target, inputs.prompts, inputs.drafters[args.drafter]
    tok, model = target.tokenizer, target.model
    family = get_family(args.drafter)
    gamma = cfg.eval.draft_length

    def configuration(kind: str):
        """(target runner, proposer, chain length): each its own, sharing the model's and the drafter's weights."""
        if kind == "plain":
            return HFTarget(model, [], tok.pad_token_id), NoDraft(), 1
        proposer = family.proposer(drafter, cfg.eval)
        runner = HFTarget(model, proposer.aux_ids, tok.pad_token_id)
        if kind == "one slot":
            proposer.use("fixed")
            return runner, proposer, 1
        proposer.use("cost", table)
        if kind == "lumped":
            proposer.schedule = proposer.cost_schedule = LumpedSchedule(table)
        return runner, proposer, gamma

    # launch/bench_schedule.py's key: the table it measured for this run is reused
    key = cost_key(target, drafter.config.to_dict(), [1], gamma, cfg.eval.cost_rounds, run=str(cfg.run_path))
    runner, proposer, _ = configuration("one slot")
    table, cached = cached_costs(
        cache_root() / "costs",
        key,
        lambda: measure_costs(runner, proposer, [p["ids"] for p in prompts], [1], gamma, cfg.eval.cost_rounds),
    )
    print(f"cost table ({'cached' if cached else 'measured'}): {json.dumps(asdict(table)['verify'])}", flush=True)
    names = {"plain": "plain", "one slot": "one slot", "lumped": "lumped", "cost": "cost", "plain again": "plain"}
    configs = {name: configuration(kind) for name, kind in names.items()}
    params = SamplingParams(temperature=args.temperature)
    speed: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    rounds: dict = defaultdict(lambda: defaultdict(lambda: [0] * 7))
    for i, prompt in enumerate(prompts):
        decodes = {}
        for name, (runner, proposer, g) in configs.items():
            gens = [make_generator(target.device, derive_seed(cfg.eval.seed, i, 0))] if not params.greedy else None
            decodes[name] = decoding(runner, proposer, [prompt["ids"]], params, g, args.max_new_tokens, generators=gens)
        for name, (res,) in interleave(decodes).items():
            for where in (prompt["domain"], "all"):
                speed[where][name][0] += len(res.tokens)
                speed[where][name][1] += res.seconds
                r = rounds[where][name]
                for j, x in enumerate(
                    (
                        len(res.rounds),
                        sum(d > 0 for d, _ in res.rounds),
                        sum(d > 1 for d, _ in res.rounds),
                        sum(d for d, _ in res.rounds),
                        sum(a for _, a in res.rounds),
                        res.draft_seconds,
                        res.verify_seconds,
                    )
                ):
                    r[j] += x
        print(f"  prompt {i + 1}/{len(prompts)}", flush=True)

    print(
        f"\n{args.drafter}, T = {args.temperature:g}, {torch.backends.cpu.get_cpu_capability()} kernels, {model.dtype}"
    )
    shown = [n for n in configs if n != "plain"]
    print("| domain | " + " | ".join(shown) + " |\n" + "|---" * (len(shown) + 1) + "|")
    for where in sorted(speed, key=lambda w: (w == "all", w)):
        plain = speed[where]["plain"][0] / speed[where]["plain"][1]
        cells = " | ".join(f"{speed[where][n][0] / speed[where][n][1] / plain:.3f}x" for n in shown)
        print(f"| {where} | {cells} |")
    print("\n| configuration | rounds | drafted | second slot | slots | accepted | draft ms/round | verify ms/round |")
    print("|---" * 8 + "|")
    for name in configs:
        n, drafted, second, slots, accepted, draft_s, verify_s = rounds["all"][name]
        print(
            f"| {name} | {n} | {drafted} | {second} | {slots} | {accepted} | {1e3 * draft_s / n:.2f} "
            f"| {1e3 * verify_s / n:.2f} |"
        )


if __name__ == "__main__":
    main()
