"""eval.json -> a Markdown table (console + report.md) and PNG plots (τ by domain, first slot by domain against its
break-even, survival, reliability)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def break_evens(costs: dict[str, Any], batch: int) -> dict[str, tuple[float, float | None]]:
    """Per drafter, the first-slot acceptance from which drafting pays at `batch` rows (`CostSchedule.break_even`):
    by its cost table as measured, and as the eval's own rounds timed it (None where they timed nothing). `costs`: per
    drafter, a `CostTable` as a dict, with the eval's `corrections`."""
    from draftsmith.eval.schedule import CostSchedule, CostTable

    out: dict[str, tuple[float, float | None]] = {}
    for name, t in costs.items():
        table = CostTable.from_dict(t)
        if not any(2 in row for row in table.verify.values()):
            continue
        timed = t.get("corrections", {}).get(str(batch), t.get("corrections", {}).get(batch))
        out[name] = (
            CostSchedule(table, learn_costs=False).break_even(batch),
            CostSchedule.as_timed(table, {batch: timed}).break_even(batch) if timed else None,
        )
    return out


def cost_tables_markdown(costs: dict[str, Any]) -> str:
    """The cost tables the schedule decided from, as markdown (ms per target pass by batch and width, and the
    acceptance a first slot needs to pay), each with what the rounds timed said against it (`corrections`). `costs`:
    per drafter, a `CostTable` as a dict plus `cached`."""
    lines = []
    for name, t in costs.items():
        widths = sorted({int(w) for row in t["verify"].values() for w in row})
        lines += [
            f"\n### Cost table: {name} ({'cached' if t['cached'] else 'measured at the start of eval'})\n",
            "| batch | " + " | ".join(f"verify {w} slot(s)" for w in widths) + " | draft round | draft step "
            "| a first slot pays from |",
            "|---" * (len(widths) + 4) + "|",
        ]
        for b, row in sorted(t["verify"].items(), key=lambda kv: int(kv[0])):
            row = {int(w): v for w, v in row.items()}  # (eval.json's keys are strings)
            cells = " | ".join(f"{1e3 * row[w]:.1f} ms" if w in row else "-" for w in widths)
            table, timed = break_evens({name: t}, int(b)).get(name, (None, None))
            pays = "-" if table is None else f"{100 * table:.0f}% acceptance"
            if timed is not None:
                pays += f" ({100 * timed:.0f}% as timed in eval)"
            lines.append(
                f"| {b} | {cells} | {1e3 * t['draft_round'].get(b, 0.0):.1f} ms "
                f"| {1e3 * t['draft_step'].get(b, 0.0):.1f} ms | {pays} |"
            )
        for b, kinds in t.get("corrections", {}).items():
            said = ", ".join(
                f"{k} {1e3 * c['excess_s']:+.1f} ms over {c['rounds']:.0f} "
                + ("pairs of neighbouring plain and wider rounds" if k == "increment" else "rounds")
                + (f" ({c['checks']:.0f} taken to time it)" if c.get("checks") else "")
                + (f" ({c['probes']:.0f} of them probes of a drafter that did not pay)" if c.get("probes") else "")
                + (
                    f" ({c['explores']:.0f} of them verifying a slot only to time the pass)"
                    if c.get("explores")
                    else ""
                )
                for k, c in kinds.items()
            )
            lines.append(f"\nTimed during eval at batch {b} (measured − table, mean): {said}.")
    return "\n".join(lines) + ("\n" if lines else "")


def markdown_table(ev: dict[str, Any]) -> str:
    lines = []
    for run in ev["runs"]:
        st = ev["settings"]
        shape = (
            f"tree depth {st['tree_depth']} / top-k {st['tree_top_k']} / {st['tree_nodes']} nodes for the trained "
            f"drafter, chain γ = {st['draft_length']} for prompt lookup"
            if st.get("tree_depth")
            else f"chain γ = {st['draft_length']}"
        )
        lengths = {d: n for d, n in (st.get("draft_lengths") or {}).items() if n != st["draft_length"] and d != "none"}
        if lengths:
            shape += " (" + ", ".join(f"{d}: {n} per round" for d, n in lengths.items()) + ")"
        if run["temperature"] and not st.get("tree_depth"):  # how a sampled round's drafts were drawn
            shape += f", {st.get('draft_sample_method', 'probabilistic')} drafts"
        lines.append(f"### T = {run['temperature']}, {shape}, max_new_tokens = {st['max_new_tokens']}")
        drafters = [d for d in run["drafters"] if d != "none"]
        head = "| domain | prompts | plain tok/s | " + " | ".join(
            f"{d} τ | {d} first slot | {d} speedup" for d in drafters
        )
        lines += [head + " |", "|" + "---|" * (3 + 3 * len(drafters))]
        for domain, row in run["domains"].items():
            plain = row["none"]
            cells = [domain, str(plain["prompts"]), f"{plain['tokens_per_s']:.1f}"]
            for d in drafters:
                s = row[d]
                cells += [f"{s['tau']:.2f}" if s["tau"] else "-", first_slot_text(s), speedup_text(s)]
            lines.append("| " + " | ".join(cells) + " |")
        if len(run["domains"]) > 1 and run.get("overall"):
            plain = run["overall"]["none"]
            cells = ["**all**", str(plain["prompts"]), f"{plain['tokens_per_s']:.1f}"]
            for d in drafters:
                s = run["overall"][d]
                cells += [
                    f"**{s['tau']:.2f}**" if s["tau"] else "-",
                    first_slot_text(s, bold=True),
                    speedup_text(s, bold=True),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", first_slot_caption(drafters, ev.get("costs", {}), int(st.get("batch_size") or 1))]
        if run.get("greedy_divergence"):
            lines.append("")
            lines.append(
                "Greedy outputs differing from plain decoding: "
                + ", ".join(
                    f"{d}: {v['prompts']}/{v['of']}"
                    + (f" (margin ≤ {v['largest_margin']:.3g})" if "largest_margin" in v else "")
                    for d, v in run["greedy_divergence"].items()
                )
                + ". The margin is how many logits the target's choice led the other token by where the outputs first"
                " differ: a floating-point near-tie (passes of other widths round differently, in bf16 above all)"
                " leads by about the logits' rounding; a token kept that the target did not choose would usually lead"
                " by whole logits."
            )
        lines.append("")
    if ev.get("batch_curve"):
        lines.append(curve_table(ev["batch_curve"]))
    return "\n".join(lines)


def first_slot_text(stats: dict[str, Any], bold: bool = False) -> str:
    """A first-slot cell: the share of the rounds that drafted whose first draft the target accepted, then how many of
    the rounds drafted, e.g. "12% (58/64)"; "-" where no round drafted (or eval.json predates the count)."""
    drafted, share = stats.get("drafted_rounds"), (stats.get("acceptance_by_position") or [None])[0]
    if not drafted or share is None:
        return "-" if drafted is None else f"- (0/{stats['rounds']})"
    text = f"{100 * share:.0f}%"
    return f"**{text}** ({drafted}/{stats['rounds']})" if bold else f"{text} ({drafted}/{stats['rounds']})"


def first_slot_caption(drafters: list[str], costs: dict[str, Any], batch: int) -> str:
    """What the first-slot column says, with the acceptance each drafter's first slot needs to pay for itself at the
    eval's batch size (`break_evens`): a domain whose first slots are accepted below it cannot be sped up by drafting
    there, however the slots are scheduled; only a better drafter, or a cheaper draft round, lifts it."""
    text = (
        "First slot: the share of the rounds that drafted whose first draft the target accepted (rounds that drafted /"
        " rounds)."
    )
    pays = break_evens({d: costs[d] for d in drafters if d in costs}, batch)
    if pays:
        text += " Drafting pays from: " + ", ".join(
            f"{d} {100 * table:.0f}% by its cost table" + (f", {100 * timed:.0f}% as timed in eval" if timed else "")
            for d, (table, timed) in pays.items()
        )
        text += f" ({batch} row{'s' if batch > 1 else ''} a pass; cost tables below)."
    return text


def speedup_text(stats: dict[str, Any], bold: bool = False) -> str:
    """A speedup cell: the speedup, then its 95% interval over the prompts where one was computed
    (`eval.metrics.speedup_interval`), e.g. "0.98x [0.93, 1.03]"; "-" where there is no speedup."""
    if not stats.get("speedup"):
        return "-"
    text = f"**{stats['speedup']:.2f}x**" if bold else f"{stats['speedup']:.2f}x"
    if stats.get("speedup_interval"):
        lo, hi = stats["speedup_interval"]
        text += f" [{lo:.2f}, {hi:.2f}]"
    return text


def curve_table(points: list[dict[str, Any]]) -> str:
    """The batch curve as one table per temperature: tokens/s of plain decoding, then each drafter and schedule as a
    speedup with its verified draft slots per row and round."""
    lines = []
    for t in sorted({p["temperature"] for p in points}):
        at = [p for p in points if p["temperature"] == t]
        # every configuration but plain decoding itself (plain decoding again, an A/A run, is a column too)
        configs = list(
            dict.fromkeys((p["drafter"], p["schedule"]) for p in at if (p["drafter"], p["schedule"]) != ("none", "-"))
        )
        lines += [
            f"### Batch curve, T = {t}: speedup over plain decoding (verified draft slots per row and round)",
            "| batch | plain tok/s | " + " | ".join(f"{d} {m}" for d, m in configs) + " |",
            "|---" * (2 + len(configs)) + "|",
        ]
        for b in sorted({p["batch"] for p in at}):
            row = {(p["drafter"], p["schedule"]): p for p in at if p["batch"] == b}
            plain = row.get(("none", "-"))
            cells = [str(b), f"{plain['tokens_per_s']:.1f}" if plain else "-"]
            for c in configs:
                p = row.get(c)
                cells.append(f"{p['speedup']:.2f}x ({p['slots_per_row_round']:.2f})" if p else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def curve_plot(points: list[dict[str, Any]], path: Path) -> None:
    """Tokens/s against batch size (left) and verified draft slots per row and round (right), one line per drafter
    and schedule, one row of panels per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({p["temperature"] for p in points})
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 4 * len(temps)), squeeze=False)
    for (rate_ax, slot_ax), t in zip(axes, temps):
        at = [p for p in points if p["temperature"] == t]
        for d, m in dict.fromkeys((p["drafter"], p["schedule"]) for p in at):
            line = sorted((p for p in at if (p["drafter"], p["schedule"]) == (d, m)), key=lambda p: p["batch"])
            label = ("plain decoding" if m == "-" else f"plain decoding {m}") if d == "none" else f"{d} {m}"
            xs = [p["batch"] for p in line]
            rate_ax.plot(xs, [p["tokens_per_s"] for p in line], marker="o", label=label)
            if d != "none":
                slot_ax.plot(xs, [p["slots_per_row_round"] for p in line], marker="o", label=label)
        for ax in (rate_ax, slot_ax):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (rows)")
            ax.legend(fontsize=7)
        rate_ax.set_ylabel("tokens/s")
        rate_ax.set_title(f"throughput by batch size (T = {t:g})")
        slot_ax.set_ylabel("verified draft slots per row and round")
        slot_ax.set_title(f"what the schedule verifies (T = {t:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _domain_bars(ax, run: dict[str, Any], drafters: list[str], value) -> dict[str, Any]:
    """One bar per domain and drafter of `value(stats)`, grouped by domain; returns each drafter's bar colour."""
    domains = list(run["domains"])
    width = 0.8 / max(1, len(drafters))
    colours = {}
    for j, d in enumerate(drafters):
        bars = ax.bar(
            [i + j * width for i in range(len(domains))],
            [value(run["domains"][k][d]) for k in domains],
            width,
            label=d,
        )
        colours[d] = bars.patches[0].get_facecolor() if bars.patches else None
    ax.set_xticks([i + width * (len(drafters) - 1) / 2 for i in range(len(domains))], domains, rotation=30, ha="right")
    return colours


def plots(ev: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    batch = int(ev["settings"].get("batch_size") or 1)
    for run in ev["runs"]:
        tag = f"T{run['temperature']:g}"
        domains = list(run["domains"])
        drafters = [d for d in run["drafters"] if d != "none"]
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(domains)), 4))
        _domain_bars(ax, run, drafters, lambda s: s["tau"] or 0)
        ax.set_ylabel("acceptance length τ")
        ax.set_title(f"τ by domain ({tag})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"tau_by_domain_{tag}.png", dpi=110)
        plt.close(fig)
        written.append(f"tau_by_domain_{tag}.png")

        if all("drafted_rounds" in run["domains"][k][d] for k in domains for d in drafters):  # (older eval.json)
            fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(domains)), 4))
            bars = _domain_bars(ax, run, drafters, lambda s: 100 * ((s["acceptance_by_position"] or [None])[0] or 0))
            pays = break_evens({d: ev["costs"][d] for d in drafters if d in ev.get("costs", {})}, batch)
            for d, (table, timed) in pays.items():
                line = timed if timed is not None else table
                ax.axhline(100 * line, ls="--", lw=1.2, color=bars[d], label=f"{d} pays from {100 * line:.0f}%")
            ax.set_ylabel("first draft accepted, % of rounds that drafted")
            ax.set_title(f"first slot by domain, against the acceptance drafting needs ({tag})")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"first_slot_{tag}.png", dpi=110)
            plt.close(fig)
            written.append(f"first_slot_{tag}.png")

        fig, ax = plt.subplots(figsize=(5, 4))
        for d in drafters:
            surv = run["overall"][d]["survival"]
            ax.plot(range(1, len(surv) + 1), surv, marker="o", label=d)
        ax.set_xticks(range(1, ev["settings"]["draft_length"] + 1))
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(first i drafts accepted)")
        ax.set_ylim(0, 1)
        ax.set_title(f"survival ({tag})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"survival_{tag}.png", dpi=110)
        plt.close(fig)
        written.append(f"survival_{tag}.png")

        calib = {d: run["overall"][d].get("calibration") for d in drafters if run["overall"][d].get("calibration")}
        if calib:
            fig, ax = plt.subplots(figsize=(4.5, 4.5))
            ax.plot([0, 1], [0, 1], color="gray", lw=0.8)
            for d, c in calib.items():
                auc = f", AUC {c['auc']:.2f}" if c.get("auc") is not None else ""  # None: one outcome only, or older
                ax.plot(
                    [b["confidence"] for b in c["reliability"]],
                    [b["accuracy"] for b in c["reliability"]],
                    marker="o",
                    label=f"{d} (ECE {c['ece']:.3f}{auc})",
                )
            ax.set_xlabel("confidence")
            ax.set_ylabel("accepted fraction")
            ax.set_title(f"reliability ({tag})")
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / f"reliability_{tag}.png", dpi=110)
            plt.close(fig)
            written.append(f"reliability_{tag}.png")
    if ev.get("batch_curve"):
        curve_plot(ev["batch_curve"], out / "batch_curve.png")
        written.append("batch_curve.png")
    return written
