"""`sampling.sample`, the one draw every sampled token goes through (plain decoding, a drafter's draft, the verifier's
residual and bonus token): drawn by inverting the cumulative sum at one uniform. It must draw each token with its
weight, never a token of weight 0 (not even at the ends of the uniform's range), and read its uniform from the
generator it is given on that generator's device."""

import pytest
import torch

from draftsmith.drafters.losses import inverse_cdf
from draftsmith.eval import sampling
from draftsmith.eval.sampling import make_generator, sample

# zeros at both ends and inside: a draw at a boundary of the cumulative sum must skip them
WEIGHTS = [0.0, 0.1, 0.0, 0.4, 0.2, 0.3, 0.0]


def test_sample_draws_each_token_with_its_weight(test_device):
    probs = torch.tensor(WEIGHTS, device=test_device)
    gen = make_generator(test_device, 0)
    n = 20000
    counts = torch.zeros(len(WEIGHTS))
    for _ in range(n):
        counts[sample(probs, gen)] += 1
    freq = counts / n
    for w, f in zip(WEIGHTS, freq.tolist()):
        if w == 0:
            assert f == 0.0
        else:  # within 5 standard errors: a miss this wide has a chance under 1e-6 for any seed
            assert abs(f - w) < 5 * (w * (1 - w) / n) ** 0.5, (WEIGHTS, freq.tolist())


def test_sample_takes_unnormalized_weights(test_device):
    """Weights that do not sum to 1 (a residual before it is normalized) draw as their normalized selves: the
    same uniform picks the same token."""
    probs = torch.tensor(WEIGHTS, device=test_device)
    a, b = make_generator(test_device, 3), make_generator(test_device, 3)
    assert [sample(probs, a) for _ in range(200)] == [sample(7.0 * probs, b) for _ in range(200)]


@pytest.mark.parametrize(("u", "expected"), [(0.0, 1), (1.0 - 2.0**-53, 5)])
def test_sample_never_draws_a_zero_weight_token_at_the_ends(monkeypatch, u, expected):
    """u = 0 lands on the cumulative sum's first value (0 before any weight): the first token of positive weight,
    not the zero before it. The largest u below 1: the last token of positive weight, not the zero after it (nor
    past the end), for totals of 1 and of three thirds."""
    real = torch.rand

    def fixed(*args, **kwargs):
        return torch.full((), u, dtype=kwargs.get("dtype") or torch.float32, device=kwargs.get("device"))

    monkeypatch.setattr(sampling.torch, "rand", fixed)
    probs = torch.tensor(WEIGHTS, dtype=torch.float64)
    assert sample(probs, None) == expected
    thirds = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64)
    assert sample(thirds, None) == (0 if u == 0.0 else 2)
    monkeypatch.setattr(sampling.torch, "rand", real)


def test_inverse_cdf_draws_every_row_at_its_own_uniform(test_device):
    """The batched form (DSpark's sampled training-time test) picks, row by row, what `sample` picks at that row's
    uniform: the first token whose cumulative weight exceeds u times the row's total."""
    probs = torch.tensor([WEIGHTS, WEIGHTS[::-1], [1.0] * len(WEIGHTS)], device=test_device).view(3, 1, -1)
    u = torch.tensor([[0.05], [0.05], [0.999]], dtype=torch.float64, device=test_device)
    got = inverse_cdf(probs, u)
    assert got.shape == (3, 1) and got.view(-1).tolist() == [1, 1, 6]
    # a weight-0 token is never drawn, at any of many uniforms
    many = torch.rand(4000, dtype=torch.float64, generator=make_generator(test_device, 0), device=test_device)
    drawn = inverse_cdf(probs[0, 0].expand(4000, -1), many)
    assert not torch.isin(drawn, torch.tensor([0, 2, 6], device=test_device)).any()
