"""What a round the cost schedule skips costs beyond a plain step, on a run's trained drafters: plain decoding (no aux
hooks), plain with the target's aux hooks on, each drafter under a schedule that never drafts (and never probes), and
plain decoding again last (the A/A ratio: the noise of this measurement), every configuration decoding the same
prompts greedily one right after the other, `REPEATS` times; medians of tokens/s and of the paired ratios.

    python launch/bench_skip_overhead.py RUN/config.yaml BATCHES REPEATS     # e.g. runs/demo/config.yaml 1,16 3
"""

import statistics
import sys
import time

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import NoDraft
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.schedule import CostSchedule, CostTable
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.evaluate import eval_prompts
from draftsmith.pipeline.families import get_family, load_drafter
from draftsmith.pipeline.inputs import trained_drafter
from draftsmith.pipeline.target import load_target

cfg = load_config(sys.argv[1], ["eval.max_prompts_per_domain=1"])
target = load_target(cfg.model)
tok, model = target.tokenizer, target.model
prompts = [p["ids"] for p in eval_prompts(cfg, tok)][:8]
never = CostTable({1: {1: 1.0, 2: 100.0}}, {1: 1.0}, {1: 100.0})
configs = {"plain": (HFTarget(model, [], tok.pad_token_id), NoDraft())}
for fam in cfg.train.drafters:
    d = load_drafter(trained_drafter(cfg, target.identity, None, fam)).to(target.device, model.dtype)
    p = get_family(fam).proposer(d, cfg.eval)
    p.schedule = CostSchedule(never)
    p.schedule.max_backoff = 10**9
    configs["plain+hooks"] = (HFTarget(model, p.aux_ids, tok.pad_token_id), NoDraft())
    configs[f"{fam} skipping"] = (HFTarget(model, p.aux_ids, tok.pad_token_id), p)
configs["plain again"] = (HFTarget(model, [], tok.pad_token_id), NoDraft())
for batch in [int(b) for b in sys.argv[2].split(",")]:
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    for r, p in configs.values():
        decode(r, p, rows, SamplingParams(), 5, 4, [])
    times = {n: [] for n in configs}
    for _rep in range(int(sys.argv[3])):
        for i in range(0, len(prompts), batch if batch < len(prompts) else len(prompts)):
            chunk = rows if batch >= len(prompts) else prompts[i : i + batch]
            for name, (r, p) in configs.items():
                t0 = time.perf_counter()
                res = decode(r, p, chunk, SamplingParams(), 5, 64, [])
                dt = time.perf_counter() - t0
                assert all(d == 0 for x in res for d, _ in x.rounds)
                times[name].append(sum(len(x.tokens) for x in res) / dt)
    base = statistics.median(times["plain"])
    print(
        f"batch {batch}: plain {base:.1f} tok/s; "
        + "; ".join(
            f"{n} {statistics.median(v) / base:.3f}x (ratio of medians), paired median "
            f"{statistics.median(a / b for a, b in zip(v, times['plain'])):.3f}x"
            for n, v in times.items()
            if n != "plain"
        ),
        flush=True,
    )
