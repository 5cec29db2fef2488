"""Tokens/s against batch size, per drafter and verification schedule, measured side by side (eval.batch_curve).

At every batch size B the same rows (the eval prompts taken in turn across domains, repeated to fill max(B, 8) rows)
are decoded B at a time by plain decoding and by each (drafter, schedule) configuration, one right after the other
for each group of rows, so a drift of the machine's speed reaches every configuration alike; the order is reversed
every other group (plain first, then last), so a steady drift over a pair of groups does not favour the
configurations that run early. A repeated prompt gets its own id (and so its own random stream at T > 0): the rows of
a batch are distinct decodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any

from draftsmith.eval.sampling import SamplingParams

MIN_ROWS = 8
"""Rows decoded at each batch size at least (a batch size below it decodes several batches)."""


def curve_rows(prompts: Sequence[dict[str, Any]], rows: int) -> list[dict[str, Any]]:
    """`rows` prompts, the domains taken in turn; the n-th reuse of a prompt is renamed `id#n`."""
    by_domain: dict[str, list] = defaultdict(list)
    for p in prompts:
        by_domain[p["domain"]].append(p)
    mixed = [p for group in zip_longest(*by_domain.values()) for p in group if p is not None]
    out = []
    for i in range(rows):
        p, reuse = mixed[i % len(mixed)], i // len(mixed)
        out.append(p if reuse == 0 else {**p, "id": f"{p['id']}#{reuse}"})
    return out


def batch_curve(
    run: Callable[[list[dict[str, Any]], str, SamplingParams, int], list],
    configs: Sequence[tuple[str, str]],
    use: Callable[[str, str], None],
    prompts: Sequence[dict[str, Any]],
    batches: Sequence[int],
    params: SamplingParams,
    max_new_tokens: int,
    part: Callable[[list], list] = lambda groups: groups,
    progress: Callable[[int], None] | None = None,
    reverse_first: bool = False,
) -> dict[tuple[int, str, str], dict[str, float]]:
    """Sums per (batch size, drafter, schedule) of tokens, seconds, drafted slots, row-rounds, tokens committed by
    them and rows.

    `run(rows, drafter, params, max_new_tokens)` decodes one batch (the engine's results); `configs` lists the
    (drafter, schedule) pairs besides plain decoding ("none", "-"), and `use(drafter, schedule)` sets a drafter's
    schedule before its run. `part` picks this process's share of the groups (multi-rank eval); `progress` is told
    the rows done. Each batch size's first group runs the configurations in order (plain decoding first), the next in
    reverse, and so on; `reverse_first` starts reversed (a second pass over the sizes, for a size of one group). The
    sums of all processes add up (`curve_points` turns them into rates)."""
    sums: dict[tuple[int, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    order = [("none", "-"), *configs]
    for B in batches:
        rows = curve_rows(prompts, max(B, MIN_ROWS))
        groups = list(enumerate([rows[i : i + B] for i in range(0, len(rows), B)]))
        for g, group in part(groups):
            for name, mode in order[::-1] if (g + reverse_first) % 2 else order:
                if name != "none":
                    use(name, mode)
                results = run(group, name, params, max_new_tokens)
                s = sums[(B, name, mode)]
                s["tokens"] += sum(len(r.tokens) for r in results)
                s["seconds"] += sum(r.seconds for r in results)  # each row's share of the batch's wall time
                s["slots"] += sum(d for r in results for d, _ in r.rounds)
                s["rounds"] += sum(len(r.rounds) for r in results)
                s["committed"] += sum(a + 1 for r in results for _, a in r.rounds)
                s["rows"] += len(results)
            if progress is not None:
                progress(len(group))
    return {k: dict(v) for k, v in sums.items()}


def curve_points(sums: dict[tuple[int, str, str], dict[str, float]], temperature: float) -> list[dict[str, Any]]:
    """One record per (batch size, drafter, schedule): tokens/s, speedup over plain decoding at that batch size,
    verified draft slots per row and round, and τ (tokens committed per row and round)."""
    points = []
    # by batch size, plain decoding first, then the configurations in the order they ran
    for (B, name, mode), s in sorted(sums.items(), key=lambda kv: (kv[0][0], kv[0][1] != "none")):
        rate = s["tokens"] / s["seconds"] if s["seconds"] else float("nan")
        plain = sums.get((B, "none", "-"))
        base = plain["tokens"] / plain["seconds"] if plain and plain["seconds"] else float("nan")
        points.append(
            {
                "temperature": temperature,
                "batch": B,
                "drafter": name,
                "schedule": mode,
                "rows": int(s["rows"]),
                "tokens_per_s": rate,
                "speedup": rate / base,
                "slots_per_row_round": s["slots"] / max(s["rounds"], 1),
                "tau": s["committed"] / max(s["rounds"], 1),
            }
        )
    return points
