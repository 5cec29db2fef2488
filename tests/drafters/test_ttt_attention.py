"""TTT attention (drafters/ttt_attention.py): the chunked path and flex_attention's mask compute exactly what the
dense reference computes, forward and backward, and the chunked path keeps nothing quadratic in T for backward."""

from __future__ import annotations

import os

import pytest
import torch

from draftsmith.drafters import ttt_attention as ta


def _inputs(heads, kv_heads, T, steps, dtype, device, d=8, B=2, seed=0):
    """Random q [B, heads, T, d], step-0 k/v and `steps` diagonal k/v [B, kv_heads, T, d], all leaves with grad."""
    g = torch.Generator().manual_seed(seed)

    def leaf(h):
        return torch.randn(B, h, T, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()

    return (
        leaf(heads),
        leaf(kv_heads),
        leaf(kv_heads),
        [leaf(kv_heads) for _ in range(steps)],
        [leaf(kv_heads) for _ in range(steps)],
    )


def _run(fn, inputs, grad_seed=1):
    """fn's output and the gradients of every input under a fixed random upstream gradient."""
    q, k0, v0, dk, dv = inputs
    leaves = [q, k0, v0, *dk, *dv]
    for x in leaves:
        x.grad = None
    out = fn(q, k0, v0, dk, dv, 0.35)
    g = torch.Generator().manual_seed(grad_seed)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    (out * upstream).sum().backward()
    return out.detach(), [x.grad.clone() for x in leaves]


def _as_float64(inputs):
    """The same inputs (already rounded to their dtype) as new float64 leaves."""
    q, k0, v0, dk, dv = inputs

    def up(x):
        return x.detach().double().requires_grad_()

    return up(q), up(k0), up(v0), [up(x) for x in dk], [up(x) for x in dv]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_chunked_path_equals_the_reference_forward_and_backward(dtype, heads, kv_heads, steps, test_device):
    """fp32: equal to the reference within 1e-5. bf16: the reference itself rounds every intermediate to bf16, so
    both are held against the float64 result on the same inputs: the chunked path (fp32 softmax, fp32 gradient
    sums) must be about as close to it as the reference is (up to half a bf16 ulp of the largest entry: the
    two round differently), and within 1% of that entry."""
    inputs = _inputs(heads, kv_heads, 37, steps, dtype, test_device)  # 37 queries: chunks of 8 leave a 5
    ref = _run(ta.ttt_attention_reference, inputs)
    new = _run(lambda *a: ta.chunked_ttt_attention(*a, chunk=8), inputs)
    exact = _run(ta.ttt_attention_reference, _as_float64(inputs))
    names = ["output", "grad q", "grad k0", "grad v0"]
    names += [f"grad diag_k{j}" for j in range(steps)] + [f"grad diag_v{j}" for j in range(steps)]
    for name, n, r, e in zip(names, [new[0], *new[1]], [ref[0], *ref[1]], [exact[0], *exact[1]]):
        assert n.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(n, r, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        else:
            err_new, err_ref = (n.double() - e).abs().max(), (r.double() - e).abs().max()
            top = e.abs().max()
            assert err_new <= 1.25 * err_ref + 2**-8 * top and err_new <= 0.01 * top, (name, err_new, err_ref)


def test_gradcheck_in_float64():
    B, heads, kv_heads, T, d = 1, 4, 2, 5, 3
    g = torch.Generator().manual_seed(2)

    def leaf(h):
        return torch.randn(B, h, T, d, generator=g, dtype=torch.float64).requires_grad_()

    q, k0, v0 = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    dk, dv = [leaf(kv_heads), leaf(kv_heads)], [leaf(kv_heads), leaf(kv_heads)]

    def fn(q, k0, v0, dk1, dk2, dv1, dv2):
        return ta.chunked_ttt_attention(q, k0, v0, [dk1, dk2], [dv1, dv2], 0.7, chunk=2)

    assert torch.autograd.gradcheck(fn, (q, k0, v0, *dk, *dv), eps=1e-6, atol=1e-7)


def test_chunked_path_keeps_nothing_quadratic_for_backward():
    """The largest tensor saved for backward grows linearly in T with the chunked path (quadratically with the
    reference): the point of the chunked path. Measured with autograd's saved-tensor hooks."""

    def largest_saved(fn, T):
        inputs = _inputs(4, 2, T, 2, torch.float32, "cpu", B=1)
        sizes = []

        def pack(x):
            sizes.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn(*inputs, 0.35)
        return max(sizes)

    chunked = lambda *a: ta.chunked_ttt_attention(*a, chunk=16)  # noqa: E731
    assert largest_saved(chunked, 256) == 2 * largest_saved(chunked, 128)
    assert largest_saved(ta.ttt_attention_reference, 256) > 3.9 * largest_saved(ta.ttt_attention_reference, 128)


def test_default_chunk_bounds_the_score_matrix(monkeypatch):
    assert ta.default_chunk(1, 4, 8192) * 4 * 8192 <= ta.CHUNK_ELEMENTS
    assert ta.default_chunk(1, 4, 16) == 16 and ta.default_chunk(64, 64, 2**20) == 1
    monkeypatch.setattr(ta, "CHUNK_ELEMENTS", 2 * 4 * 13 * 5)
    assert ta.default_chunk(2, 4, 13) == 5


# ---------------------------------------------------------------------------------------------- flex


def _visible_keys(attend, T, steps):
    """[T, (1 + steps) T] which keys (laid out [k0; diag_1; ...]) each query's output draws on, read off the
    attention itself: zero queries give every visible key the same weight, and value = one-hot of the key's index."""
    n = T * (1 + steps)
    eye = torch.eye(n, dtype=torch.float64).view(1, 1, n, n)
    q = torch.zeros(1, 1, T, n, dtype=torch.float64)
    k = torch.zeros(1, 1, T, n, dtype=torch.float64)
    values = [eye[:, :, j * T : (j + 1) * T] for j in range(1 + steps)]
    out = attend(q, k, values[0], [k] * steps, values[1:], 1.0)
    return out[0, 0] > 0


@pytest.mark.parametrize("T,steps", [(1, 1), (5, 1), (9, 3)])
def test_flex_mask_mod_is_the_references_mask(T, steps):
    from torch.nn.attention.flex_attention import create_mask

    reference = _visible_keys(ta.ttt_attention_reference, T, steps)
    # what the reference computes: step-0 keys causally, and each diagonal step's key at the query's own slot
    expected = torch.cat([torch.ones(T, T).tril().bool()] + [torch.eye(T).bool()] * steps, dim=1)
    assert torch.equal(reference, expected)
    flex = create_mask(ta.ttt_mask_mod(T), 1, 1, T, T * (1 + steps), device="cpu")[0, 0]
    assert torch.equal(flex, reference)
    chunked = _visible_keys(lambda *a: ta.chunked_ttt_attention(*a, chunk=2), T, steps)
    assert torch.equal(chunked, reference)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("steps", [1, 3])
def test_flex_attention_eagerly_on_cpu_equals_the_reference(heads, kv_heads, steps):
    """flex_attention runs eagerly on the CPU (forward only: its CPU backward is not implemented) with the same
    block mask the CUDA path compiles."""
    q, k0, v0, dk, dv = (
        x.detach() if isinstance(x, torch.Tensor) else [y.detach() for y in x]
        for x in _inputs(heads, kv_heads, 21, steps, torch.float64, "cpu")
    )
    ref = ta.ttt_attention_reference(q, k0, v0, dk, dv, 0.35)
    out = ta.flex_ttt_attention(q, k0, v0, dk, dv, 0.35, compiled=False)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ choosing


def test_the_default_path_on_the_test_device_equals_the_reference(test_device):
    """What the drafter runs by default on this device (chunked on the CPU, compiled flex_attention on CUDA),
    forward and backward, against the reference on the same device."""
    inputs = _inputs(4, 2, 150, 3, torch.float32, test_device)  # 150: more than one 128-block of flex
    expected = "flex" if test_device.type == "cuda" and ta.flex_available() else "chunked"
    assert ta.selected_impl(inputs[0]) == expected
    ref_out, ref_grads = _run(ta.ttt_attention_reference, inputs)
    out, grads = _run(ta.ttt_attention, inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_the_choice_is_made_in_one_place(monkeypatch):
    q = torch.zeros(1, 1, 2, 2)
    monkeypatch.delenv(ta.ENV_VAR, raising=False)
    assert ta.selected_impl(q) == "chunked"  # a CPU tensor
    with ta.use_impl("reference"):
        assert ta.selected_impl(q) == "reference"
        with ta.use_impl("chunked"):
            assert ta.selected_impl(q) == "chunked"
        assert ta.selected_impl(q) == "reference"
    monkeypatch.setenv(ta.ENV_VAR, "reference")
    assert ta.selected_impl(q) == "reference"
    monkeypatch.setenv(ta.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ta.ENV_VAR):
        ta.selected_impl(q)
    with pytest.raises(ValueError, match="one of"):
        with ta.use_impl("fast"):
            pass
    with pytest.raises(ValueError, match="steps 1..i"):
        ta.ttt_attention(q, q, q, [], [], 1.0)


@pytest.mark.skipif(os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu") == "cpu", reason="a CUDA check")
def test_the_flex_block_mask_is_built_once_per_length_and_step(test_device):
    if not ta.flex_available():
        pytest.skip("this torch has no flex_attention")
    ta.ttt_block_mask.cache_clear()
    inputs = _inputs(4, 2, 64, 2, torch.bfloat16, test_device)
    for _ in range(2):
        _run(ta.ttt_attention, inputs)
    info = ta.ttt_block_mask.cache_info()
    assert info.misses == 1 and info.hits == 1
