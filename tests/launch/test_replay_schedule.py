"""launch/replay_schedule.py on made-up slots and a made-up table, where every policy's speedup is known by hand."""

import json
import runpy
import sys
from pathlib import Path

import pytest

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
    every, schedule, pooled, last, greedy, oracle = (cell.strip(" |") for cell in rows["easy"])
    assert every == schedule == pooled == last == greedy == oracle == "1.538x (10/10)"
    every, schedule, pooled, last, greedy, oracle = (cell.strip(" |") for cell in rows["hard"])
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


def test_timed_replays_price_rounds_as_the_benchs_schedule_timed_that_temperature(tmp_path, monkeypatch, capsys):
    """With `--timed`, the table is corrected by what the bench's `DRAFTER/cost` schedule timed at batch 1 in the
    replayed temperature's regime, which the bench saves per temperature (`regime_corrections`): at T = 1 plain
    passes +0.4 s over 20 rounds, the increment of a wider pass +0.2 over 2 pairs, draft rounds +0.05 over 20 (at
    T = 0, +0.1 over 10 and no draft round). At T = 1 a plain pass then costs 1.4 s, two wide 1.2 + 0.4 + 0.2 = 1.8 and
    a draft round 0.15: a first slot pays from 39%. Read off T = 0's run (the mutation: the first run, whatever its
    temperature) it would say 1.1 and 1.3."""
    slots = [{"domain": "easy", "prompt": 0, "head": 0.9, "accepted": 1.0, "acceptance_t1": 1.0} for _ in range(10)]
    (tmp_path / "slots.json").write_text(json.dumps({"slots": slots, "by": "round"}))
    table = {"verify": {"1": {"1": 1.0, "2": 1.2}}, "draft_step": {"1": 0.05}, "draft_round": {"1": 0.1}}
    at = lambda excess, rounds: {"excess_s": excess, "rounds": rounds}  # noqa: E731
    runs = [
        {"temperature": 0.0, "regime_corrections": {"eagle3/cost": {"1": {"plain": at(0.1, 10)}}}},
        {
            "temperature": 1.0,
            "regime_corrections": {
                "eagle3/cost": {"1": {"plain": at(0.4, 20), "increment": at(0.2, 2), "draft": at(0.05, 20)}}
            },
        },
    ]
    (tmp_path / "costs.json").write_text(json.dumps({"costs": {"eagle3": table}, "per_domain": runs}))
    argv = [str(SCRIPT), str(tmp_path / "slots.json"), str(tmp_path / "costs.json"), "--orders", "0", "--timed"]
    monkeypatch.setattr(sys, "argv", [*argv, "--temperature", "1"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert "plain 1400.0 ms, 2 wide 1800.0 ms, draft round 150.0 ms (a first slot pays from 39% acceptance)" in out
    assert "plain +400.0 ms over 20 rounds, the wider pass's increment +200.0 ms over 2 pairs" in out
    # every round drafted and accepted: 2 tokens per 1.95 s against 1 per 1.4
    easy = next(line for line in out.splitlines() if line.startswith("| easy"))
    assert easy.split(" | ")[2].strip(" |") == "1.436x (10/10)"
    # a temperature the bench did not run is an error naming it, not a replay on the bare table
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "--timed", "--temperature", "1"])
    (tmp_path / "costs.json").write_text(json.dumps({"costs": {"eagle3": table}, "per_domain": runs[:1]}))
    with pytest.raises(SystemExit, match="no eagle3/cost rounds at T = 1"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    # nor is a bench whose cost schedule ran another drafter
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "--timed", "--drafter", "eagle3", "--temperature", "0"])
    (tmp_path / "costs.json").write_text(
        json.dumps({"costs": {"eagle3": table}, "per_domain": [{**runs[0], "regime_corrections": {}}]})
    )
    with pytest.raises(SystemExit, match="no eagle3/cost rounds at T = 0"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    # a bench that saved its corrections summed over its temperatures (before `regime_corrections`) says so
    summed = {"temperature": 0.0, "corrections": {"eagle3/cost": {"1": {"plain": at(0.1, 10)}}}}
    (tmp_path / "costs.json").write_text(json.dumps({"costs": {"eagle3": table}, "per_domain": [summed]}))
    with pytest.raises(SystemExit, match="summed over its temperatures"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
