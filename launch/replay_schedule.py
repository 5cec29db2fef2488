"""Replay an EAGLE-3 drafter's first slots through the cost schedule's decision to draft, on a cost table, without a
target: what the rule (`eval.schedule.CostSchedule`) gains at batch 1 with the noise of a shared machine taken out.

    python launch/replay_schedule.py RUN/bench_confidence/bench_confidence.json RUN/bench_paired/bench_schedule.json
        [--drafter eagle3] [--orders 20] [--temperature 0] [--timed]

The slots are `launch/bench_confidence.py`'s (every first slot of the eval prompts, teacher-forced over the target's
greedy continuation, with the drafter's calibrated confidence and whether the target accepts it) or
`launch/log_first_slots.py`'s (decoded live, any drafter and temperature, one slot per round: its fates are replayed
as logged, a slot per round replayed), the table is the one `launch/bench_schedule.py` printed and saved. Each prompt
is decoded round by round as the engine does: the schedule
decides from the row's level whether to draft (`CostSchedule.row_level`; or, the rule before 2026-12-07, from its last
first-slot confidence); a drafted round costs the table's draft round and
admits the first slot or not; an admitted slot is accepted as the target would (a round then commits two tokens and
moves two slots on), and the schedule observes it; a round costs the table's pass at its width. Only the first slot is
replayed (a second slot survived in under 2% of the demo's fixed-γ rounds), the table is taken as exact (the schedule's
own timing corrections are off) and a catch-up costs a draft round. Prints, per domain and overall, the speedup over
plain decoding and the slots drafted and accepted, for the cost schedule (with each row's own calibration, with
the pooled one alone, deciding from the last confidence, and stopping wherever the level as estimated says drafting
does not pay: `eval.schedule.VARIANTS`), drafting every round, and an oracle that knows
each prompt's acceptance beforehand and drafts every round of the prompts where that pays (the best any rule deciding
from a level could do). The schedule carries what it learns from one prompt to the next, so the order matters: the table
is for eval's order (domain by domain), and `--orders` more replays in shuffled orders give each policy's overall
speedup and its worst domain's as a mean and range. With `--temperature 1` a slot is accepted with its chance at
T = 1 (`acceptance_t1`, drawn
once per slot from a seeded generator, the same draws for every policy), on the greedy continuation's prefixes (the text
a T = 1 decode samples differs: the demo's EAGLE-3 had a 12.3% chance here, 14.2% of its first slots accepted in a
T = 1 bench).

The table is measured in a minute of the machine's life, and a bench runs on a machine that has changed since: on an
AMX Xeon, the demo's DSpark table put a plain pass at 49.7 ms and a first slot's break-even at 10%, while the bench's
rounds timed plain passes 1.2-9.6 ms under it. With `--timed` the replay prices rounds as the bench's own cost schedule
timed them at that temperature (`regime_corrections` of `DRAFTER/cost` in bench_schedule.json, batch 1): the table's
passes plus the mean plain-pass excess, its wider passes plus the increment its neighbouring rounds timed, its draft
round plus the draft rounds' excess. A regime whose schedule timed no round of a kind keeps the table's there.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("slots", type=Path, help="bench_confidence.json")
    ap.add_argument("costs", type=Path, help="bench_schedule.json (its cost tables)")
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--orders", type=int, default=20, help="replays in shuffled prompt orders (seeded)")
    ap.add_argument("--temperature", type=int, choices=(0, 1), default=0)
    ap.add_argument(
        "--timed", action="store_true", help="price rounds as the bench's cost schedule timed them (its corrections)"
    )
    args = ap.parse_args()

    import random

    import torch

    from draftsmith.eval.schedule import CostSchedule, CostTable, variant

    raw = json.loads(args.slots.read_text())
    if "slots" not in raw:
        raise SystemExit(f"{args.slots} has no slots: run launch/bench_confidence.py again")
    record = json.loads(args.costs.read_text())
    table = CostTable.from_dict(record["costs"][args.drafter])
    timed = ""
    if args.timed:
        table, timed = timed_table(table, record, args.drafter, float(args.temperature))
    plain, wide, draft = table.verify_time(1, 1), table.verify_time(2, 1), table.round_time(1)
    pays_from = (wide + draft) / plain - 1
    draws = random.Random(0)
    prompts: dict[int, list[dict]] = defaultdict(list)
    per_round = raw.get("by") == "round"  # launch/log_first_slots.py: one slot per round decoded, not per token
    for slot in raw["slots"]:
        if args.temperature:  # the slot's fate at T = 1, drawn once
            slot = {**slot, "accepted": float(draws.random() < slot["acceptance_t1"])}
        prompts[slot["prompt"]].append(slot)
    on = torch.tensor([True])

    def replay(
        always: bool = False,
        oracle: bool = False,
        rule: str | None = None,
        order: list[int] | None = None,
    ) -> dict[str, list[float]]:
        """Per domain: [tokens, seconds, drafted, accepted] over its prompts, decoded in `order` (eval's: sorted) by
        one schedule (`rule`: one of `eval.schedule.VARIANTS`, None for the cost schedule's own)."""
        s = variant(CostSchedule(table, learn_costs=False), rule)
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for index in order or sorted(prompts):
            slots = prompts[index]
            tally = out[slots[0]["domain"]]
            rate = sum(x["accepted"] for x in slots) / len(slots)
            s.reset()
            c0 = torch.tensor([float("nan")], dtype=torch.float64)
            t = 0
            while t < len(slots):
                if oracle:
                    drafts = rate >= pays_from
                elif always:
                    drafts = True
                else:
                    drafts = s.worth_drafting(c0, on)
                if not drafts:
                    tally[0] += 1
                    tally[1] += plain
                    t += 1
                    continue
                c = torch.tensor([slots[t]["head"]], dtype=torch.float64)
                c0 = c
                s.begin(on)
                admitted = always or oracle or bool(s.admit(0, c, torch.ones(1, dtype=torch.float64), on).any())
                if not admitted:
                    tally[0] += 1
                    tally[1] += draft + plain
                    t += 1
                    continue
                hit = int(slots[t]["accepted"])
                s.observe([[float(c)]], [hit])
                tally[0] += 1 + hit
                tally[1] += draft + wide
                tally[2] += 1
                tally[3] += hit
                t += 1 if per_round else 1 + hit  # an accepted slot commits two tokens: the next slot is 2 on
        return out

    runs = {
        "every round": dict(always=True),
        "cost schedule": {},
        "pooled calibration alone": dict(rule="pooled"),
        "decided by the last confidence": dict(rule="last"),
        "level as estimated (no evidence asked)": dict(rule="greedy"),
        "oracle (per prompt)": dict(oracle=True),
    }
    policies = {name: replay(**kw) for name, kw in runs.items()}

    domains = sorted({d for p in policies.values() for d in p})

    def speedup(t: list[float]) -> float:
        return (t[0] / t[1]) * plain

    print(
        f"\n{args.drafter} first slots replayed at T = {args.temperature}, batch 1, on the table: "
        f"plain {plain * 1e3:.1f} ms, 2 wide "
        f"{wide * 1e3:.1f} ms, draft round {draft * 1e3:.1f} ms (a first slot pays from {pays_from:.0%} acceptance)"
        + timed
    )
    print("| domain | accepted | " + " | ".join(policies) + " |")
    print("|---|---|" + "---|" * len(policies))
    for d in [*domains, "all"]:
        rows = [x for p in prompts.values() for x in p if d in ("all", x["domain"])]
        cells = []
        for p in policies.values():
            t = [sum(v[i] for k, v in p.items() if d in ("all", k)) for i in range(4)]
            cells.append(f"{speedup(t):.3f}x ({int(t[2])}/{int(t[3])})")
        print(f"| {d} | {sum(x['accepted'] for x in rows) / len(rows):.1%} | " + " | ".join(cells) + " |")
    print("(in brackets: first slots verified / accepted)")
    if args.orders:
        rng = random.Random(0)
        orders = [rng.sample(sorted(prompts), len(prompts)) for _ in range(args.orders)]
        print(f"\nOver {args.orders} shuffled prompt orders: overall speedup and the worst domain's, mean [min, max]")
        print("| policy | speedup | worst domain |")
        print("|---|---|---|")
        for name, kw in runs.items():
            ups, worst = [], []
            for o in orders:
                tallies = replay(**kw, order=o)
                ups.append(speedup([sum(v[i] for v in tallies.values()) for i in range(4)]))
                worst.append(min(speedup(v) for v in tallies.values()))
            print(
                f"| {name} | {sum(ups) / len(ups):.3f}x [{min(ups):.3f}, {max(ups):.3f}] | "
                f"{sum(worst) / len(worst):.3f}x [{min(worst):.3f}, {max(worst):.3f}] |"
            )


def timed_table(table, record: dict, drafter: str, temperature: float):
    """(the table corrected by what `drafter`'s cost schedule timed at batch 1 in the bench's regime at
    `temperature`, a sentence saying by how much)."""
    from draftsmith.eval.schedule import CostTable

    run = next((r for r in record.get("per_domain", []) if r["temperature"] == temperature), None)
    if run is not None and "regime_corrections" not in run:
        raise SystemExit(
            "--timed: this bench saved its corrections summed over its temperatures (bench_schedule.py before "
            "2026-12-07's regime_corrections); run the bench again"
        )
    said_by = (run or {}).get("regime_corrections", {}).get(f"{drafter}/cost", {}).get("1", {})
    if not said_by:
        raise SystemExit(f"--timed: the bench has no {drafter}/cost rounds at T = {temperature:g}")

    def own(kind: str) -> tuple[float, float]:
        c = said_by.get(kind) or {}
        return c.get("excess_s", 0.0), c.get("rounds", 0)

    (p, n_p), (i, n_i), (d, n_d) = own("plain"), own("increment"), own("draft")
    verify = {w: t + p + (i if w > 1 else 0.0) for w, t in table.verify[1].items()}
    corrected = CostTable(
        verify={1: verify},
        draft_step={1: table.step_time(1)},
        draft_round={1: table.round_time(1) + d},
        key=table.key,
    )
    said = (
        f"; as the bench's rounds at T = {temperature:g} timed it: plain {p * 1e3:+.1f} ms over {n_p:g} rounds, the "
        f"wider pass's increment {i * 1e3:+.1f} ms over {n_i:g} pairs, draft round {d * 1e3:+.1f} ms over {n_d:g}"
    )
    return corrected, said


if __name__ == "__main__":
    main()
