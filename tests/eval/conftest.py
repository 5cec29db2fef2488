"""The eval tests' real model: a tiny random Llama in float64 (greedy ties cannot flip), on the test device."""

import pytest
import torch


@pytest.fixture(scope="module")
def tiny64(tiny_tok, test_device):
    from tests.tiny import tiny_llama

    return tiny_llama(tiny_tok, seed=0, num_layers=4, dtype=torch.float64).to(test_device)
