"""The trainer's teacher cache (drafters/teacher_cache.py): the full-vocabulary statistics of a record are computed the
first time it is met, served afterwards, and give the objectives the teacher they would compute themselves."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.drafters import teacher_cache as cache_module
from draftsmith.drafters.losses import full_vocab_stats, teacher_from_final
from draftsmith.drafters.objectives import (
    DSparkObjectiveSettings,
    ObjectiveSettings,
    dspark_calibration_data,
    dspark_objective,
    eagle3_calibration_data,
    eagle3_objective,
    supervised_from,
)
from draftsmith.drafters.teacher_cache import TeacherCache, record_keys

V, H = 300, 32


def _records(n: int, gen: torch.Generator, lengths=None) -> list[dict]:
    lengths = lengths or [int(x) for x in torch.randint(12, 24, (n,), generator=gen)]
    return [
        {
            "id": f"r{i}",
            "input_ids": torch.randint(0, V, (L,), generator=gen),
            "final": torch.randn(L, H, generator=gen) * 3,
            "aux": torch.randn(L, 3 * H, generator=gen),
            "loss_mask": (torch.arange(L) >= L // 3).long(),
        }
        for i, L in enumerate(lengths)
    ]


def _batch(records: list[dict], pad_to: int | None = None) -> dict:
    """Right-padded, as a feature source's `load_batch` makes it."""
    T = pad_to or max(len(r["input_ids"]) for r in records)

    def pad(x):
        out = x.new_zeros((T, *x.shape[1:]))
        out[: len(x)] = x
        return out

    batch = {
        "input_ids": torch.stack([pad(r["input_ids"]) for r in records]),
        "final": torch.stack([pad(r["final"]) for r in records]),
        "aux": torch.stack([pad(r["aux"]) for r in records]),
        "loss_mask": torch.stack([pad(r["loss_mask"]) for r in records]),
        "attention_mask": torch.stack([pad(torch.ones(len(r["input_ids"]), dtype=torch.bool)) for r in records]),
        "ids": [r["id"] for r in records],
        "domains": ["chat"] * len(records),
        "epoch": 1,
    }
    batch["supervised_from"] = supervised_from(batch["loss_mask"])
    batch["record_keys"] = record_keys(batch)
    return batch


def _counting(monkeypatch) -> list[int]:
    """Rows whose full-vocabulary statistics the cache computes, per call."""
    calls: list[int] = []
    real = cache_module.full_vocab_stats

    def counted(final, *args, **kwargs):
        calls.append(final.shape[0])
        return real(final, *args, **kwargs)

    monkeypatch.setattr(cache_module, "full_vocab_stats", counted)
    return calls


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_known_statistics_give_the_teacher_computed_from_scratch(temperature, test_device):
    gen = torch.Generator().manual_seed(1)
    final = (torch.randn(2, 40, H, generator=gen) * 3).to(test_device)
    head = torch.randn(V, H, generator=gen).to(test_device)
    draft_ids = torch.randperm(V, generator=gen)[:90].sort().values.to(test_device)
    logits = final.double() @ head.double().T  # the reference, whole and in fp64
    known = full_vocab_stats(final, head, temperature)
    got = teacher_from_final(final, head, draft_ids, temperature, known=known)
    assert torch.equal(got.argmax, logits.argmax(-1)) and torch.equal(got.in_vocab, torch.isin(got.argmax, draft_ids))
    soft = torch.softmax(logits[..., draft_ids] / (temperature or 1.0), -1)
    torch.testing.assert_close(got.probs.double(), soft, atol=1e-5, rtol=1e-4)
    if temperature > 0:
        full = torch.softmax(logits / temperature, -1)[..., draft_ids]
        torch.testing.assert_close(got.exact.double(), full, atol=1e-5, rtol=1e-4)
    else:
        assert got.exact is None and known.lse is None
    plain = teacher_from_final(final, head, draft_ids, temperature)  # the same, computed from the whole logits
    assert torch.equal(plain.argmax, got.argmax)
    torch.testing.assert_close(plain.probs, got.probs, atol=1e-6, rtol=1e-5)
    if temperature > 0:
        torch.testing.assert_close(plain.exact, got.exact, atol=1e-6, rtol=1e-5)


def test_a_record_met_again_is_served_not_computed(monkeypatch):
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    recs = _records(5, gen)
    head = torch.randn(V, H, generator=gen)
    cache = TeacherCache(head, 1.0, capacity_tokens=10_000)
    first = cache.fill(_batch(recs[:3]))
    assert calls == [3] and cache.summary()["records"] == 3
    # the same records in other company and at another padded length: only the new ones are computed
    again = cache.fill(_batch([recs[3], recs[1], recs[0]], pad_to=30))
    assert calls == [3, 1]
    assert cache.computed == 4 and cache.served == 2
    for b_then, b_now in ((0, 2), (1, 1)):
        L = len(recs[b_then]["input_ids"])
        assert torch.equal(first["teacher_argmax"][b_then, :L], again["teacher_argmax"][b_now, :L])
        assert torch.equal(first["teacher_lse"][b_then, :L], again["teacher_lse"][b_now, :L])
        # past the record: argmax 0 and a log-normalizer of +inf (probability 0), never NaN
        assert (again["teacher_argmax"][b_now, L:] == 0).all() and torch.isinf(again["teacher_lse"][b_now, L:]).all()
    stats = full_vocab_stats(_batch([recs[3]])["final"], head, 1.0)
    torch.testing.assert_close(again["teacher_lse"][0, : len(recs[3]["input_ids"])], stats.lse[0])


def test_the_same_id_with_other_tokens_is_computed_again(monkeypatch):
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    recs = _records(2, gen)
    cache = TeacherCache(torch.randn(V, H, generator=gen), 0.0, capacity_tokens=10_000)
    cache.fill(_batch(recs))
    changed = dict(recs[0], input_ids=recs[0]["input_ids"].flip(0), final=recs[0]["final"].flip(0))
    out = cache.fill(_batch([changed]))
    assert calls == [2, 1]
    assert "teacher_lse" not in out  # greedy: the argmax is all the teacher needs
    expected = full_vocab_stats(_batch([changed])["final"], cache.head_weight, 0.0).argmax
    assert torch.equal(out["teacher_argmax"].long(), expected)


def test_the_cap_bounds_what_is_kept_and_the_rest_is_computed_each_time(monkeypatch):
    calls = _counting(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    recs = _records(4, gen, lengths=[10, 10, 10, 10])
    cache = TeacherCache(torch.randn(V, H, generator=gen), 1.0, capacity_tokens=25)
    for _ in range(3):
        cache.fill(_batch(recs))
    assert cache.tokens == 20 and cache.summary()["records"] == 2
    assert calls == [4, 2, 2]
    off = TeacherCache(cache.head_weight, 1.0, capacity_tokens=0)
    batch = _batch(recs)
    assert off.fill(batch).keys() == batch.keys()  # off: the objective computes its teacher itself


def test_a_batch_whose_tokens_are_not_on_the_host_is_left_to_the_objective():
    batch = _batch(_records(2, torch.Generator().manual_seed(5)))
    batch["input_ids"] = batch["input_ids"].to("meta")
    assert record_keys(batch) is None
    batch["record_keys"] = None
    assert TeacherCache(torch.randn(V, H), 1.0, 100).fill(batch).keys() == batch.keys()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("family", ["eagle3", "dspark"])
def test_the_objectives_give_the_same_loss_and_statistics_with_the_cache(family, temperature, test_device):
    from tests.drafters import test_dspark, test_eagle3

    # the drafters of the families' own tests: a 97-token target vocabulary, 24-wide aux layers, a 32-wide final state
    gen = torch.Generator().manual_seed(6)
    recs = [
        {
            "id": f"r{i}",
            "input_ids": torch.randint(0, 96, (L,), generator=gen),
            "final": torch.randn(L, 32, generator=gen) * 3,
            "aux": torch.randn(L, 3 * 24, generator=gen),
            "loss_mask": (torch.arange(L) >= L // 3).long(),
        }
        for i, L in enumerate([20, 16, 23])
    ]
    head = torch.randn(97, 32, generator=gen).to(test_device)
    if family == "eagle3":
        model = test_eagle3._drafter(dtype=torch.float32, seed=6, device=test_device)
        objective, settings = eagle3_objective, ObjectiveSettings(steps=3, temperature=temperature)
        calibration = eagle3_calibration_data
    else:
        model = test_dspark._drafter(dtype=torch.float32, seed=6, block_size=3, device=test_device)
        objective, calibration = dspark_objective, dspark_calibration_data
        settings = DSparkObjectiveSettings(block_size=3, anchors_per_sequence=4, temperature=temperature)
    cache = TeacherCache(head, temperature, capacity_tokens=10_000)
    loss, stats = objective(model, _batch(recs), head, settings)
    for _ in range(2):  # computed, then served
        filled = cache.fill(_batch(recs))
        loss_c, stats_c = objective(model, filled, head, settings)
        torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
        assert stats_c.keys() == stats.keys()
        for k in stats:
            torch.testing.assert_close(stats_c[k], stats[k], atol=1e-4, rtol=1e-5, msg=k)
    assert cache.computed == 3 and cache.served == 3 and math.isfinite(float(loss.detach()))
    # the calibration data after training (from the holdout, whose records the evaluations have kept)
    with torch.no_grad():
        plain, served = calibration(model, _batch(recs), head, settings), calibration(model, filled, head, settings)
    (conf, alpha, valid), (conf_p, alpha_p, valid_p) = served, plain
    assert torch.equal(valid, valid_p) and valid.any()
    torch.testing.assert_close(conf, conf_p)
    # where a chain is valid; past a row's end the teacher is padding (probability 0 from the cache, the padded
    # final state's softmax without it) and the fit never reads it
    torch.testing.assert_close(alpha[valid], alpha_p[valid], atol=1e-5, rtol=1e-5)
