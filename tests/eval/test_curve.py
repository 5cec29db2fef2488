"""The order in which configurations decode side by side (eval.curve.batch_curve, pipeline.evaluate.Decoder): plain
decoding first, then last, group after group, so a steady drift of the machine's speed does not favour the
configurations that run early."""

from draftsmith.eval.curve import batch_curve
from draftsmith.eval.engine import DecodeResult
from draftsmith.eval.sampling import SamplingParams
from draftsmith.pipeline.evaluate import Decoder

PROMPTS = [{"id": f"p{i}", "domain": f"d{i % 2}", "ids": [1, 2]} for i in range(4)]


def _fake_run(calls: list):
    def run(rows, name, params, max_new_tokens):
        calls.append(name)
        return [DecodeResult(tokens=[3] * max_new_tokens, rounds=[(0, 0)] * max_new_tokens, seconds=1.0) for _ in rows]

    return run


def test_the_curve_reverses_the_order_of_configurations_every_other_group():
    """Batch 4 decodes 8 rows in two groups: plain, a, b, then b, a, plain; batch 8 one group, in order, or reversed
    with `reverse_first` (the bench's second pass, so a size of one group is balanced too). Every configuration
    still gets every row."""
    calls: list[str] = []
    configs = [("a", "fixed"), ("b", "cost")]
    sums = batch_curve(_fake_run(calls), configs, lambda n, m: None, PROMPTS, [4, 8], SamplingParams(), 2)
    forward, backward = ["none", "a", "b"], ["b", "a", "none"]
    assert calls == forward + backward + forward
    assert all(sums[(b, n, m)]["rows"] == 8 for b in (4, 8) for n, m in [("none", "-"), *configs])
    calls.clear()
    batch_curve(_fake_run(calls), configs, lambda n, m: None, PROMPTS, [8], SamplingParams(), 2, reverse_first=True)
    assert calls == backward
    calls.clear()  # a rank's share keeps each group's place in the alternation
    part = lambda groups: groups[1::2]  # noqa: E731 (the second of two ranks)
    batch_curve(_fake_run(calls), configs, lambda n, m: None, PROMPTS, [4], SamplingParams(), 2, part=part)
    assert calls == backward


def test_eval_decodes_every_other_batch_in_reverse():
    """Per-domain eval: the proposers decode side by side, and where they are even, the first batch goes in order
    (plain decoding first), the next in reverse; results land under their own proposer whatever the order, and
    exactness is still judged against plain decoding's output."""
    calls: list[str] = []
    dec = Decoder({}, {"none": None, "x": None, "y": None}, {"none": 1, "x": 3, "y": 3}, [], None, 0, None)
    run = _fake_run(calls)

    def decoding(rows, name, params, max_new_tokens):  # one step each, all equally long: the order breaks the tie
        yield 1.0
        return run(rows, name, params, max_new_tokens)

    dec.decoding = decoding  # type: ignore[method-assign]
    batches = [[p] for p in PROMPTS[:3]]
    by, diverged = dec.temperature(batches, SamplingParams(), 4, "test")
    assert calls == ["none", "x", "y", "y", "x", "none", "none", "x", "y"]
    assert {d: {n: len(r) for n, r in per.items()} for d, per in by.items()} == {
        "d0": {"none": 2, "x": 2, "y": 2},
        "d1": {"none": 1, "x": 1, "y": 1},
    }
    assert not diverged
    calls.clear()
    dec.temperature(batches[:1], SamplingParams(), 4, "test", reverse_first=True)
    assert calls == ["y", "x", "none"]
