"""eval.cpu_linear: the products decoding hands a CPU go down torch's fast paths, with `F.linear`'s results.

What is fast is measured by launch/bench_target_pass.py (docs/benchmarks.md), not asserted here: these tests check
which product computes what, and that the result is `F.linear`'s to rounding. They are CPU products by definition, so
they stay on the CPU whatever DRAFTSMITH_TEST_DEVICE says."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from draftsmith.eval import cpu_linear
from draftsmith.eval.cpu_linear import FEW_ROWS, CpuLinear, cpu_product, use_cpu_linears


class Products:
    """Records which product (`linear` or `mm`) each call of `cpu_product` ran, and its input's shape."""

    def __init__(self, monkeypatch, weight: torch.Tensor):
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        real_linear, real_mm = F.linear, torch.mm

        def linear(x, w, *rest):
            if w is weight:
                self.calls.append(("linear", tuple(x.shape)))
            return real_linear(x, w, *rest)

        def mm(a, b):
            if a is weight:  # W @ x.T: the input is the transposed second operand
                self.calls.append(("mm", tuple(b.t().shape)))
            return real_mm(a, b)

        monkeypatch.setattr(cpu_linear.F, "linear", linear)
        monkeypatch.setattr(cpu_linear.torch, "mm", mm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_few_fp32_rows_are_multiplied_as_weight_times_input_transposed(monkeypatch, dtype, bias):
    """fp32 over fewer than FEW_ROWS rows: `W @ x.T`, an odd count padded to even (torch's `F.linear` runs one
    matrix-vector product per row there: 2 rows cost twice 1). Every other dtype and row count: `F.linear` over the
    flattened input. Either way `F.linear`'s result, for strided 3-D inputs too."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias).to(dtype)
    products = Products(monkeypatch, layer.weight)
    for rows in range(1, FEW_ROWS + 3):
        hidden = torch.randn(rows, 3, 24, generator=g).to(dtype)
        x = hidden[:, -1:, :]  # strided, as generate's prefill hands the head
        products.calls.clear()
        out = cpu_product(x, layer.weight, layer.bias)
        assert out.shape == (rows, 1, 40) and out.is_contiguous()
        if dtype == torch.float32 and rows < FEW_ROWS:
            assert products.calls == [("mm", (rows + rows % 2, 24))], rows
        else:
            assert products.calls == [("linear", (rows, 24))], rows
        tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out, F.linear(x.contiguous(), layer.weight, layer.bias), **tol)


def test_a_layer_hands_a_contiguous_bf16_input_to_f_linear_as_it_is(monkeypatch):
    """bf16 needs no other product than torch's: a contiguous input goes to `F.linear` as it is (3-D: no reshape or view
    around it, `nn.Linear`'s own cost), a strided one flattened (away from the slow batched path)."""
    layer = torch.nn.Linear(24, 40).to(torch.bfloat16)
    use_cpu_linears(layer)
    products = Products(monkeypatch, layer.weight)
    x = torch.randn(2, 3, 24).to(torch.bfloat16)
    layer(x)
    layer(x[:, -1:, :])
    assert products.calls == [("linear", (2, 3, 24)), ("linear", (2, 24))]


def test_the_products_keep_gradients_and_empty_inputs():
    layer = torch.nn.Linear(6, 5)
    layer.__class__ = CpuLinear
    x = torch.randn(3, 6, requires_grad=True)
    layer(x).sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    F.linear(ref, layer.weight.detach()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
    assert layer(torch.zeros(0, 6)).shape == (0, 5)


def test_the_loaded_fp32_target_and_a_cpu_drafter_decode_with_them(tiny_target_dir, monkeypatch):
    """The defect: on an AVX2-only CPU (fp32) a target pass two slots wide cost 1.6-1.7x one slot, because every layer's
    `F.linear` ran a matrix-vector product per row. Every linear layer of the target loaded on the CPU, and of a
    proposer's drafter there, is a `CpuLinear`; a 2-wide pass multiplies each layer's weight once, as `W @ x.T`."""
    from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from draftsmith.eval.proposers import Eagle3Proposer
    from draftsmith.eval.runner import HFTarget
    from draftsmith.pipeline.config import ModelConfig
    from draftsmith.pipeline.target import load_target

    model = load_target(ModelConfig(target=str(tiny_target_dir), dtype="float32", device="cpu")).model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is CpuLinear for m in linears)
    twin = copy.deepcopy(model).get_output_embeddings()  # a copy computes with its own weight, the same way
    assert type(twin) is CpuLinear and twin.weight is not model.get_output_embeddings().weight

    down = model.model.layers[0].mlp.down_proj
    products = Products(monkeypatch, down.weight)
    target = HFTarget(model)
    target.prefill([[1, 5, 9, 30]])
    products.calls.clear()
    target.step(torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool))
    assert products.calls == [("mm", (2, down.in_features))]

    cfg = Eagle3Config(
        vocab_size=97, draft_vocab_size=41, hidden_size=32, target_hidden_size=24, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, aux_layer_ids=[1, 2, 3],
    )  # fmt: skip
    drafter = Eagle3Drafter(cfg)
    Eagle3Proposer(drafter)
    assert all(type(m) is CpuLinear for m in drafter.modules() if isinstance(m, torch.nn.Linear))


def test_the_head_multiplies_a_strided_slice_as_one_matrix_on_cpu(tiny_target_dir, monkeypatch):
    """transformers' generate hands the head `hidden[:, -1:, :]`; torch's CPU matmul takes a slow batched path for such
    a strided 3-D input (SmolLM2's head, 32 rows, bf16: 1.9 s against 9 ms flattened, on an AVX-512 BF16 EPYC), so the
    loaded target's head multiplies a 2-D view of it, with the same result."""
    from draftsmith.pipeline.config import ModelConfig
    from draftsmith.pipeline.target import load_target

    t = load_target(ModelConfig(target=str(tiny_target_dir), dtype="float32", device="cpu"))
    head = t.model.get_output_embeddings()
    hidden = torch.randn(3, 5, head.in_features, generator=torch.Generator().manual_seed(0))
    x = hidden[:, -1:, :]
    products = Products(monkeypatch, head.weight)  # the head's products only, not the layers'
    out = head(x)
    assert [len(shape) for _, shape in products.calls] == [2], "the head multiplied a 3-D input"
    assert out.shape == (3, 1, head.out_features)
    torch.testing.assert_close(out, F.linear(x.contiguous(), head.weight))
    twin = copy.deepcopy(t.model).get_output_embeddings()  # a copy computes with its own weight
    with torch.no_grad():
        twin.weight.zero_()
    assert not twin(x).any() and head(x).any()
    ids = torch.tensor([[1, 5, 9, 30], [2, 6, 10, 31]])
    with torch.no_grad():  # generate's prefill goes through it
        products.calls.clear()
        t.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    # the prefill's last position, then the one new token
    assert [len(shape) for _, shape in products.calls] == [2, 2]


def test_use_cpu_linears_swaps_only_plain_linears():
    class Other(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Other(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 3)))
    assert use_cpu_linears(model) == 2
    assert [type(m) for m in model.modules()][1:] == [CpuLinear, Other, torch.nn.Sequential, CpuLinear]
