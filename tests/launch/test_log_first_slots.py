"""launch/log_first_slots.py writes a decode's first slots in the layout launch/replay_schedule.py replays."""

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "log_first_slots.py"


def test_each_drafted_round_gives_one_first_slot_with_its_confidence_and_fate():
    first_slots = runpy.run_path(str(SCRIPT))["first_slots"]  # not run as __main__: nothing loads
    rounds = [(2, 0), (2, 2), (0, 0), (2, 1)]
    confidences = [[0.3, 0.2], [0.6, 0.5], [], [0.4, 0.1]]
    slots = first_slots(rounds, confidences, "coding", 7)
    assert [(s["head"], s["accepted"]) for s in slots] == [(0.3, 0.0), (0.6, 1.0), (0.4, 1.0)]
    assert all(s["domain"] == "coding" and s["prompt"] == 7 and s["acceptance_t1"] == s["accepted"] for s in slots)
    with pytest.raises(ValueError):  # a confidence list per round, or the decode is not what was logged
        first_slots(rounds, confidences[:2], "coding", 7)
