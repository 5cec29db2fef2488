"""launch/bench_draft_sampling.py: the probability a draft is kept under each way of drafting at T > 0, from the target's
and the drafter's distributions at one slot, checked against closed forms and against the accept step's own draws."""

import runpy
from pathlib import Path

import pytest
import torch

from draftsmith.eval.sampling import make_generator
from draftsmith.eval.verify import sampling_verify

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "bench_draft_sampling.py"
BENCH = runpy.run_path(str(SCRIPT))  # not run as __main__: nothing loads or decodes


def test_each_rule_keeps_a_draft_with_its_closed_form_probability():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])  # its argmax (1) is not the target's (0)
    said = BENCH["expected_acceptance"](p, q, (0.5,))
    assert said["sampled"] == pytest.approx(0.1 + 0.3 + 0.2 + 0.0)
    assert said["greedy"] == pytest.approx(0.3)  # p at q's argmax
    s = q**2 / (q**2).sum()
    assert said["sharpened 0.5"] == pytest.approx(float(torch.minimum(p, s).sum()))
    # a drafter equal to the target is always kept when it samples, and only as often as the target's mode when greedy
    same = BENCH["expected_acceptance"](p, p)
    assert same == pytest.approx({"sampled": 1.0, "greedy": 0.5})
    with pytest.raises(ValueError, match="positive"):
        BENCH["expected_acceptance"](p, q, (0.0,))


@pytest.mark.parametrize("rule", ["sampled", "greedy"])
def test_the_expectations_are_what_the_accept_step_keeps(rule):
    """Drafted by each rule and verified by eval's own accept step (`sampling_verify`, the one-hot q for a greedy
    draft), the share of drafts kept over 20,000 draws lands within 4 standard errors of the expectation; swapping the
    two rules' expectations (0.45 against 0.3) would be 30 standard errors off."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    expected = BENCH["expected_acceptance"](p[0], q)[rule]
    gen = make_generator("cpu", 7)
    n, kept = 20_000, 0
    for _ in range(n):
        if rule == "sampled":
            x, qd = int(torch.multinomial(q, 1, generator=gen)), q
        else:
            x = int(q.argmax())
            qd = torch.nn.functional.one_hot(torch.tensor(x), 4).double()
        kept += sampling_verify([x], qd[None], p, gen)[0]
    se = (expected * (1 - expected) / n) ** 0.5
    assert abs(kept / n - expected) < 4 * se


def test_the_recorder_verifies_as_eval_does_and_records_first_slots_only():
    recorder = BENCH["FirstSlotRecorder"]((0.5,))
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    gen = make_generator("cpu", 0)
    assert recorder([1], q, p, gen) == sampling_verify([1], q, p, make_generator("cpu", 0))
    assert recorder([], q[:0], p[:1], gen)[0] == 0  # a row that drafted nothing records nothing
    assert len(recorder.rows) == 1 and recorder.rows[0]["greedy"] == 1.0
    assert BENCH["summary"](recorder.rows) == {"first_slots": 1, "sampled": 1.0, "greedy": 1.0, "sharpened 0.5": 1.0}
