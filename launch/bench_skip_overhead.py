"""What a round the cost schedule skips costs beyond a plain step, on a run's trained drafters: plain decoding (no aux
hooks), plain with the target's aux hooks on, each drafter under a schedule that never drafts and never probes, each
drafter under a schedule that never verifies a slot but probes the drafter as eval's does (`--probe`: every 64 rounds,
catching up on the rounds it skipped, and admitting nothing), and plain decoding again (the A/A ratio: the noise of
this measurement). Every configuration decodes the same prompts one right after the other, in order for one repeat and
in reverse for the next (ABBA), `--repeats` times; medians of tokens/s and of the paired ratios. At T > 0 every
configuration draws from the same seeded generator per prompt and verifies no slot, so all decode the same text.

    python launch/bench_skip_overhead.py RUN/config.yaml --batches 1,16 --repeats 3 [--temperature 1] [--probe]
"""

import argparse
import statistics

from draftsmith.eval.engine import clock, decode
from draftsmith.eval.proposers import NoDraft
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
from draftsmith.eval.schedule import CostSchedule, CostTable
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.evaluate import eval_prompts
from draftsmith.pipeline.families import get_family, load_drafter
from draftsmith.pipeline.inputs import trained_drafter
from draftsmith.pipeline.target import load_target

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("config")
ap.add_argument("--batches", default="1,16")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--probe", action="store_true", help="also each drafter probed as eval's schedule probes it")
ap.add_argument("--max-new-tokens", type=int, default=64)
args = ap.parse_args()

cfg = load_config(args.config, ["eval.max_prompts_per_domain=1"])
target = load_target(cfg.model)
tok, model = target.tokenizer, target.model
prompts = [p["ids"] for p in eval_prompts(cfg, tok)][:8]
params = SamplingParams(temperature=args.temperature)
# a draft round dearer than any gain: the schedule verifies no slot; its probe floor (100 / (0.02 * 1) rounds) is
# capped by max_backoff, so `--probe` asks the drafter every 64 rounds, as eval's schedule does a drafter that never pays
never = CostTable({1: {1: 1.0, 2: 100.0}}, {1: 1.0}, {1: 100.0})
configs = {"plain": (HFTarget(model, [], tok.pad_token_id), NoDraft())}
for fam in cfg.train.drafters:
    d = load_drafter(trained_drafter(cfg, target.identity, None, fam)).to(target.device, model.dtype)
    p = get_family(fam).proposer(d, cfg.eval)
    hooked = HFTarget(model, p.aux_ids, tok.pad_token_id)
    configs["plain+hooks"] = (hooked, NoDraft())
    p.schedule = CostSchedule(never, learn_costs=False)
    p.schedule.max_backoff = 10**9
    configs[f"{fam} skipping"] = (hooked, p)
    if args.probe:
        p = get_family(fam).proposer(d, cfg.eval)
        p.schedule = CostSchedule(never, learn_costs=False)
        configs[f"{fam} probing"] = (hooked, p)
configs["plain again"] = (HFTarget(model, [], tok.pad_token_id), NoDraft())


def run(name: str, chunk: list, start: int) -> float:
    r, p = configs[name]
    gens = [make_generator(target.device, derive_seed(0, start + i)) for i in range(len(chunk))]
    t0 = clock(target.device)  # synchronizes a CUDA device before reading the time
    res = decode(r, p, chunk, params, cfg.eval.draft_length, args.max_new_tokens, [], generators=gens)
    dt = clock(target.device) - t0
    assert all(d == 0 for x in res for d, _ in x.rounds), f"{name} verified a draft slot"
    texts[name].append([x.tokens for x in res])
    return sum(len(x.tokens) for x in res) / dt


for batch in [int(b) for b in args.batches.split(",")]:
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    texts: dict[str, list] = {n: [] for n in configs}
    for name in configs:
        run(name, rows, 0)  # warm-up: allocations and kernel choice for this shape
    texts = {n: [] for n in configs}
    times: dict[str, list[float]] = {n: [] for n in configs}
    order = list(configs)
    starts = range(0, len(prompts), min(batch, len(prompts)))
    for rep in range(args.repeats):
        for j, i in enumerate(starts):
            chunk = rows if batch >= len(prompts) else prompts[i : i + batch]
            for name in order if (rep * len(starts) + j) % 2 == 0 else order[::-1]:
                times[name].append(run(name, chunk, i))
    same = all(texts[n] == texts["plain"] for n in configs)
    base = statistics.median(times["plain"])
    print(
        f"batch {batch}, T = {args.temperature:g}: plain {base:.1f} tok/s (median of {len(times['plain'])}); "
        f"every configuration decoded the same text: {same}",
        flush=True,
    )
    for n, v in times.items():
        if n != "plain":
            paired = statistics.median(a / b for a, b in zip(v, times["plain"]))
            print(f"  {n}: {statistics.median(v) / base:.3f}x (ratio of medians), paired median {paired:.3f}x")
