"""The eval report's first-slot column: how often the rounds that drafted had their first draft accepted, against the
acceptance a first slot needs to pay for itself, so a domain below 1.0x reads as the drafter's (or the machine's)
and not the schedule's."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from draftsmith.eval.engine import DecodeResult
from draftsmith.eval.metrics import acceptance_stats
from draftsmith.eval.report import first_slot_text, markdown_table
from draftsmith.eval.schedule import CostTable


def test_the_first_slot_share_is_over_the_rounds_that_drafted():
    """Rounds that drafted nothing (the schedule's plain steps) count in the rounds, not in the share: 2 of the 3
    rounds that drafted had their first draft accepted, out of 5 rounds."""
    res = [DecodeResult(tokens=[1] * 7, rounds=[(1, 0), (0, 0), (2, 1), (0, 0)]), DecodeResult([1], [(3, 2)])]
    stats = acceptance_stats(res, 3)
    assert (stats["drafted_rounds"], stats["rounds"]) == (3, 5)
    assert stats["acceptance_by_position"][0] == pytest.approx(2 / 3)
    assert first_slot_text(stats) == "67% (3/5)"
    assert first_slot_text(stats, bold=True) == "**67%** (3/5)"


def test_a_drafter_that_never_drafted_and_an_older_record_say_so():
    never = acceptance_stats([DecodeResult(tokens=[1, 2], rounds=[(0, 0), (0, 0)])], 3)
    assert first_slot_text(never) == "- (0/2)"
    older = {"rounds": 4, "acceptance_by_position": [0.5, None]}  # eval.json before the count was kept
    assert first_slot_text(older) == "-"


def test_the_table_gives_each_drafter_its_first_slot_column_and_the_line_it_must_clear():
    """One domain, one drafter on a cost table of 40 / 42 ms passes and a 4 ms draft round: the row carries the
    first-slot cell between τ and the speedup, and the caption the break-even (15%) and, where the eval timed its
    rounds, the line as timed."""
    stats = acceptance_stats([DecodeResult(tokens=[1] * 5, rounds=[(1, 1), (1, 0), (0, 0), (1, 0)], seconds=0.2)], 2)
    plain = acceptance_stats([DecodeResult(tokens=[1] * 5, rounds=[(0, 0)] * 5, seconds=0.2)], 2)
    stats.update(speedup=1.02, speedup_interval=[0.99, 1.05])
    table = CostTable(verify={1: {1: 0.040, 2: 0.042}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    timed = {"1": {"plain": {"excess_s": 0.0, "rounds": 50.0}, "increment": {"excess_s": 0.002, "rounds": 98.0}}}
    ev = {
        "settings": {"draft_length": 2, "max_new_tokens": 5},
        "costs": {"eagle3": {**asdict(table), "cached": False, "corrections": timed}},
        "runs": [
            {
                "temperature": 0.0,
                "drafters": ["none", "eagle3"],
                "domains": {"math": {"none": plain, "eagle3": stats}},
                "overall": {"none": plain, "eagle3": stats},
            }
        ],
    }
    md = markdown_table(ev)
    assert "| eagle3 τ | eagle3 first slot | eagle3 speedup |" in md
    assert "| math | 1 | " in md and "| 1.25 | 33% (3/4) | 1.02x [0.99, 1.05] |" in md
    # (40 + 2 + 2 x 98/100 + 4) / 40 - 1 = 19.9%
    assert "eagle3 15% by its cost table, 20% as timed in eval" in md


def test_the_first_slot_plot_is_drawn_where_the_record_has_the_counts(tmp_path):
    """eval writes first_slot_T*.png beside the τ plot (bars per domain and drafter, the break-even a dashed line);
    an eval.json from before the count was kept still gets its other plots and no first-slot one."""
    from draftsmith.eval.report import plots

    stats = acceptance_stats([DecodeResult(tokens=[1] * 5, rounds=[(1, 1), (1, 0), (0, 0)], seconds=0.2)], 2)
    table = CostTable(verify={1: {1: 0.040, 2: 0.042}}, draft_step={1: 0.001}, draft_round={1: 0.004})
    run = {"temperature": 0.0, "drafters": ["none", "eagle3"], "domains": {"math": {"none": stats, "eagle3": stats}}}
    run["overall"] = run["domains"]["math"]
    ev = {"settings": {"draft_length": 2, "batch_size": 1}, "costs": {"eagle3": asdict(table)}, "runs": [run]}
    assert plots(ev, tmp_path) == ["tau_by_domain_T0.png", "first_slot_T0.png", "survival_T0.png"]
    assert (tmp_path / "first_slot_T0.png").stat().st_size > 0
    del stats["drafted_rounds"]  # (every row of the run is this one dict)
    assert plots(ev, tmp_path) == ["tau_by_domain_T0.png", "survival_T0.png"]
