"""eval.cpu_attention: a grouped-query target's masked passes over several slots read its key/value heads in place, and
compute what transformers' `sdpa` attention computes.

What it saves is measured by launch/bench_target_pass.py (docs/benchmarks.md), not asserted here. The attention is a
CPU path by definition (on another device it hands every call to transformers), so these tests stay on the CPU
whatever DRAFTSMITH_TEST_DEVICE says."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations import sdpa_attention

from draftsmith.eval.cpu_attention import NAME, use_cpu_attention
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.tree import Tree, tree_mask


def _model(tiny_tok, dtype, attn="sdpa"):
    from tests.tiny import tiny_llama

    model = tiny_llama(tiny_tok, seed=0, num_layers=2, dtype=dtype)
    model.set_attn_implementation(attn)
    return model


def _passes(model) -> list[torch.Tensor]:
    """The logits of every pass shape a decode runs: a left-padded prefill of two rows, a plain pass, a chain 3
    slots wide, and a tree (its 4-D additive mask)."""
    target = HFTarget(model)
    out = [target.prefill([[5, 9, 13, 40, 41], [7, 8]])[0]]
    out.append(target.step(torch.tensor([[11], [12]]), torch.ones(2, 1, dtype=torch.bool))[0])
    out.append(target.step(torch.tensor([[21, 22, 23], [24, 25, 26]]), torch.ones(2, 3, dtype=torch.bool))[0])
    for b in range(2):
        target.keep(b, 3, [0, 1])
    target.compact()
    tree = Tree([31, 32, 33], [-1, -1, 0], [1, 1, 2], [-1.0, -2.0, -1.5])
    one = HFTarget(model)
    one.prefill([[5, 9, 13]])
    out.append(
        one.step(
            torch.tensor([[40, *tree.tokens]]),
            torch.ones(1, 4, dtype=torch.bool),
            torch.tensor([[0, *tree.depths]]),
            tree_mask(tree, 0)[None],
        )[0]
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_computes_what_transformers_sdpa_does_without_copying_the_cache(tiny_tok, monkeypatch, dtype):
    """Every pass shape gives transformers' `sdpa` logits (fp32 to 1e-5; bf16 to its rounding: the kernel sums the
    same products, the order may differ), and no pass copies the key/value heads out (`repeat_kv`), where transformers'
    `sdpa` does for each masked pass over several slots (the copy this module removes)."""
    copies: list[tuple[int, ...]] = []
    real = sdpa_attention.repeat_kv

    def counting(hidden, n_rep):
        copies.append(tuple(hidden.shape))
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counting)
    reference = _passes(_model(tiny_tok, dtype))
    assert copies, "transformers' sdpa no longer copies grouped heads: this module may be unneeded"
    copies.clear()
    model = _model(tiny_tok, dtype)
    assert use_cpu_attention(model) and model.config._attn_implementation == NAME
    grouped = _passes(model)
    assert copies == []
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(grouped, reference, strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_a_model_not_on_sdpa_is_left_as_it_is(tiny_tok):
    model = _model(tiny_tok, torch.float32, attn="eager")
    assert not use_cpu_attention(model) and model.config._attn_implementation == "eager"
