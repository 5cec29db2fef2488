"""Feature capture against HF's own `output_hidden_states`, aux-id rules, and length batching."""

import pytest
import torch

from draftsmith.data.features import (
    FeatureCapture,
    FeatureError,
    default_aux_ids,
    length_batches,
    resolve_aux_ids,
    right_pad,
    shard_for_rank,
)
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def model(tiny_tok):
    return tiny_llama(tiny_tok, seed=0, num_layers=4, dtype=torch.float32)


@pytest.mark.parametrize("aux_ids", [[0, 1, 2, 3, 4], [2, 4], [1, 3]])
def test_capture_equals_hf_hidden_states(model, aux_ids):
    ids = torch.randint(5, 300, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    aux, final = FeatureCapture(model, aux_ids)(ids)
    H = model.config.hidden_size
    assert aux.shape == (3, 17, len(aux_ids) * H) and final.shape == (3, 17, H)
    for j, i in enumerate(aux_ids):
        assert torch.equal(aux[..., j * H : (j + 1) * H], ref.hidden_states[i]), f"aux id {i}"
    assert torch.equal(final, ref.hidden_states[-1])
    # the teacher is exactly recomputable from the final normed state
    with torch.no_grad():
        assert torch.equal(model.lm_head(final), ref.logits)


def test_capture_never_runs_lm_head(model):
    calls = []
    h = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        FeatureCapture(model, [1, 2])(torch.tensor([[5, 6, 7]]))
    finally:
        h.remove()
    assert calls == []
    assert not model.model.layers[1]._forward_pre_hooks  # hooks are removed after each call


def test_aux_id_rules():
    assert default_aux_ids(30) == [2, 15, 27] and default_aux_ids(32) == [2, 16, 29]
    with pytest.raises(FeatureError, match="set collect.aux_layer_ids"):
        default_aux_ids(4)
    with pytest.raises(FeatureError, match=r"out of range.*0\.\.4"):
        resolve_aux_ids([1, 5], 4)
    with pytest.raises(FeatureError, match="duplicates"):
        resolve_aux_ids([1, 1], 4)
    with pytest.raises(FeatureError, match="must be ascending"):
        resolve_aux_ids([3, 1], 4)
    assert resolve_aux_ids(None, 30) == [2, 15, 27]


def test_length_batches_respect_budget_and_cover_everything():
    lengths = [5, 50, 7, 12, 3, 40, 41, 200, 9]
    batches = length_batches(lengths, batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100
    shuffled = [length_batches(lengths, 100, shuffle=True, seed=s) for s in range(5)]
    assert all(sorted(i for b in x for i in b) == list(range(9)) for x in shuffled)
    assert len({str(x) for x in shuffled}) > 1  # epochs differ
    assert length_batches(lengths, 100, shuffle=True, seed=3) == shuffled[3]  # and are reproducible


def test_shard_for_rank_gives_equal_disjoint_shares():
    batches = [[i] for i in range(7)]
    shares = [shard_for_rank(batches, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]
    assert sorted(b[0] for s in shares for b in s) == [0, 1, 2, 3, 4, 5]


def test_right_pad():
    out = right_pad([torch.tensor([1, 2, 3]), torch.tensor([4])], value=9)
    assert out.tolist() == [[1, 2, 3], [4, 9, 9]]
