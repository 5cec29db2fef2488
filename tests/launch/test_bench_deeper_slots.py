"""launch/bench_deeper_slots.py's "lumped" column is the cost schedule as it was before `CostSchedule.step_time`: on
the scripted rounds of tests/eval/test_schedule.py it verifies a second slot in every drafted round, as the old rule
(the mutation named there) did, while the schedule stops after one."""

import runpy
from pathlib import Path

import pytest

from draftsmith.eval.schedule import CostSchedule, variant
from tests.eval.test_schedule import DEEP_TABLE, deeper_rounds

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_deeper_slots.py"


def test_the_lumped_schedule_is_the_rule_before_step_time():
    lumped = runpy.run_path(str(SCRIPT))["LumpedSchedule"](DEEP_TABLE)  # not run as __main__: nothing decodes
    # decided from the scripted confidence (0.5; the rounds observe no fate, so no level is learned), from the first
    # slot on, as estimated: drafting pays by under `check_margin`, and round 4 is a plain one, taken to time the
    # plain pass
    variant(lumped, "last")
    assert deeper_rounds(lumped) == [2, 2, 2, 2, 0, 2]
    said = lumped.corrections()[1]
    assert "step" not in said and said["draft"] == {"excess_s": pytest.approx(0.3), "rounds": 5}  # all on the round
    assert lumped.step_time(1) == DEEP_TABLE.step_time(1)
    assert deeper_rounds(CostSchedule(DEEP_TABLE)) == [2, 1, 1, 1, 1, 1]
