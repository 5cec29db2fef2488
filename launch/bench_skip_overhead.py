"""What a round the cost schedule skips costs beyond a plain step, on a run's trained drafters: plain decoding (no aux
hooks), plain with the target's aux hooks on, each drafter under a schedule that never drafts and never probes, each
drafter under a schedule that never verifies a slot but probes the drafter as eval's does (`--probe`: every 64 rounds,
catching up on the rounds it skipped, and admitting nothing), and plain decoding again (the A/A ratio: the noise of
this measurement). Every configuration decodes the same rows side by side, a round at a time (`eval.engine.interleave`:
a slow spell of the machine falls on all of them alike), `--repeats` times over the prompts; per configuration, the
median and mean over the decodes of its tokens/s over plain decoding's in the same interleaved run. At T > 0 every
configuration draws from the same seeded generator per prompt and verifies no slot, so all decode the same text.

    python launch/bench_skip_overhead.py RUN/config.yaml --batches 1,16 --repeats 1 [--temperature 1] [--probe]
"""

import argparse
import statistics

from draftsmith.eval.engine import decoding, interleave
from draftsmith.eval.proposers import NoDraft
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
from draftsmith.eval.schedule import CostSchedule, CostTable
from draftsmith.pipeline.evaluate import bench_inputs
from draftsmith.pipeline.families import get_family

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("config")
ap.add_argument("--batches", default="1,16")
ap.add_argument("--repeats", type=int, default=1)
ap.add_argument("--per-domain", type=int, default=2, help="eval prompts per domain")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--probe", action="store_true", help="also each drafter probed as eval's schedule probes it")
ap.add_argument("--max-new-tokens", type=int, default=64)
args = ap.parse_args()

inputs = bench_inputs(args.config, [], args.per_domain)
cfg, target, drafters = inputs.cfg, inputs.target, inputs.drafters
tok, model = target.tokenizer, target.model
prompts = [p["ids"] for p in inputs.prompts]
params = SamplingParams(temperature=args.temperature)
# a draft round dearer than any gain: the schedule verifies no slot; its probe floor (100 / (0.02 * 1) rounds) is
# capped by max_backoff, so `--probe` asks the drafter every 64 rounds, as eval's schedule does a drafter that never pays
never = CostTable({1: {1: 1.0, 2: 100.0}}, {1: 1.0}, {1: 100.0})


def configurations() -> dict:
    """(target, proposer) per configuration, each with its own target and proposer (each holds a cache), sharing the
    model's and the drafters' weights."""
    configs = {"plain": (HFTarget(model, [], tok.pad_token_id), NoDraft())}
    for fam, d in drafters.items():
        p = get_family(fam).proposer(d, cfg.eval)
        configs["plain+hooks"] = (HFTarget(model, p.aux_ids, tok.pad_token_id), NoDraft())
        p.schedule = CostSchedule(never, learn_costs=False)
        p.schedule.max_backoff = 10**9
        configs[f"{fam} skipping"] = (HFTarget(model, p.aux_ids, tok.pad_token_id), p)
        if args.probe:
            p = get_family(fam).proposer(d, cfg.eval)
            p.schedule = CostSchedule(never, learn_costs=False)
            configs[f"{fam} probing"] = (HFTarget(model, p.aux_ids, tok.pad_token_id), p)
    configs["plain again"] = (HFTarget(model, [], tok.pad_token_id), NoDraft())
    return configs


for batch in [int(b) for b in args.batches.split(",")]:
    configs = configurations()
    chunks = [[prompts[(i + j) % len(prompts)] for j in range(batch)] for i in range(0, len(prompts), batch)]
    ratios: dict[str, list[float]] = {n: [] for n in configs}
    same = True
    # the first chunk once more, first: a warm-up (allocations, kernel choice for this shape), not counted
    for counted, i, chunk in [(False, 0, chunks[0])] + [
        (True, i, c) for _ in range(args.repeats) for i, c in enumerate(chunks)
    ]:
        decodes = {}
        for name, (r, p) in configs.items():
            gens = [make_generator(target.device, derive_seed(0, i, j)) for j in range(len(chunk))]
            decodes[name] = decoding(r, p, chunk, params, cfg.eval.draft_length, args.max_new_tokens, [], gens)
        results = interleave(decodes)
        rate = {n: sum(len(x.tokens) for x in res) / res[0].seconds / len(res) for n, res in results.items()}
        for name, res in results.items():
            assert all(d == 0 for x in res for d, _ in x.rounds), f"{name} verified a draft slot"
            same &= [x.tokens for x in res] == [x.tokens for x in results["plain"]]
            if counted:
                ratios[name].append(rate[name] / rate["plain"])
    print(
        f"batch {batch}, T = {args.temperature:g}: {len(ratios['plain'])} interleaved decodes; every configuration "
        f"decoded the same text: {same}",
        flush=True,
    )
    for n, v in ratios.items():
        if n != "plain":
            print(f"  {n}: median {statistics.median(v):.4f}x, mean {statistics.mean(v):.4f}x of plain decoding")
