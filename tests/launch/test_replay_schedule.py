"""launch/replay_schedule.py on made-up slots and a made-up table, where every policy's speedup is known by hand."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "replay_schedule.py"


def test_the_replay_charges_each_round_what_the_table_says(tmp_path, monkeypatch, capsys):
    """A plain pass costs 1.0, two wide 1.2, a draft round 0.1 (a first slot pays from 30%). Domain "easy": every first
    slot accepted, so drafting every round commits 2 tokens per 1.3 (1.538x); domain "hard": none accepted, so drafting
    every round commits 1 per 1.3 (0.769x) and the oracle does not draft there (1.000x). The easy prompts come first."""
    slots = []
    for prompt, (domain, hit) in enumerate([("easy", 1.0), ("easy", 1.0), ("hard", 0.0), ("hard", 0.0)]):
        slots += [
            {"domain": domain, "prompt": prompt, "head": 0.9, "accepted": hit, "acceptance_t1": hit} for _ in range(10)
        ]
    (tmp_path / "slots.json").write_text(json.dumps({"slots": slots}))
    table = {"verify": {"1": {"1": 1.0, "2": 1.2}}, "draft_step": {"1": 0.05}, "draft_round": {"1": 0.1}}
    (tmp_path / "costs.json").write_text(json.dumps({"costs": {"eagle3": table}}))
    argv = [str(SCRIPT), str(tmp_path / "slots.json"), str(tmp_path / "costs.json"), "--orders", "3"]
    monkeypatch.setattr(sys, "argv", [*argv, "--temperature", "1"])  # chances of 1 and 0: the same fates
    runpy.run_path(str(SCRIPT), run_name="__main__")
    at_t1 = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert at_t1.replace("T = 1", "T = 0") == out
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")[2:] for line in out.splitlines() if line.startswith("| ")
    }
    every, schedule, pooled, last, oracle = (cell.strip(" |") for cell in rows["easy"])
    assert every == schedule == pooled == last == oracle == "1.538x (10/10)"
    every, schedule, pooled, last, oracle = (cell.strip(" |") for cell in rows["hard"])
    assert every == "0.769x (20/0)" and oracle == "1.000x (0/0)"
    assert "pays from 30% acceptance" in out and "Over 3 shuffled prompt orders" in out
    # drafting every round: the worst domain is "hard" in every order
    assert "| every round | " in out and "| 0.769x [0.769, 0.769] |" in out


def test_slots_logged_per_round_are_replayed_one_per_round(tmp_path, monkeypatch, capsys):
    """launch/log_first_slots.py logs one first slot per round decoded (`by`: "round"): an accepted slot's round is
    followed by the next logged slot, not by the one after it, so drafting every round of 10 accepted slots verifies
    all 10 (teacher-forced slots, one per token, verify every other one: 5)."""
    slots = [{"domain": "easy", "prompt": 0, "head": 0.9, "accepted": 1.0, "acceptance_t1": 1.0} for _ in range(10)]
    table = {"verify": {"1": {"1": 1.0, "2": 1.2}}, "draft_step": {"1": 0.05}, "draft_round": {"1": 0.1}}
    (tmp_path / "costs.json").write_text(json.dumps({"costs": {"eagle3": table}}))
    verified = {}
    for by in ("round", None):
        (tmp_path / "slots.json").write_text(json.dumps({"slots": slots, **({"by": by} if by else {})}))
        argv = [str(SCRIPT), str(tmp_path / "slots.json"), str(tmp_path / "costs.json"), "--orders", "0"]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(str(SCRIPT), run_name="__main__")
        easy = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| easy"))
        verified[by] = easy.split(" | ")[2].strip(" |")
    assert verified == {"round": "1.538x (10/10)", None: "1.538x (5/5)"}
