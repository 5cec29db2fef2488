"""The confidence head learns calibrated acceptance probabilities from 0/1 acceptance outcomes."""

import torch
from torch.nn import functional as F

from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter


def test_confidence_head_calibrates_on_a_synthetic_case(test_device):
    torch.manual_seed(0)
    cfg = Eagle3Config(
        vocab_size=50,
        draft_vocab_size=50,
        hidden_size=16,
        target_hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        aux_layer_ids=[1, 2, 3],
    )
    model = Eagle3Drafter(cfg).to(test_device)  # initialized on the CPU: the same weights on every device
    rate = torch.rand(cfg.vocab_size)  # each conditioning token has its own true acceptance probability

    def sample(n):
        """Drawn from the CPU's global generator (the same data on every device), then moved to the model's."""
        tokens = torch.randint(0, cfg.vocab_size, (n,))
        hidden = torch.randn(n, cfg.hidden_size)
        accepted = torch.bernoulli(rate[tokens])  # what greedy verification reports: accepted or not
        return hidden.to(test_device), tokens.to(test_device), accepted.to(test_device)

    opt = torch.optim.Adam(model.confidence.parameters(), lr=0.05)
    before = None
    for _ in range(300):
        hidden, tokens, accepted = sample(512)
        _, conf = model.heads(hidden.unsqueeze(0), tokens.unsqueeze(0))
        loss = F.binary_cross_entropy_with_logits(conf[0], accepted)
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = before if before is not None else loss.item()

    hidden, tokens, accepted = sample(20000)
    with torch.no_grad():
        p = torch.sigmoid(model.heads(hidden.unsqueeze(0), tokens.unsqueeze(0))[1][0])
    # expected calibration error over 10 equal-width bins
    bins = torch.clamp((p * 10).long(), max=9)
    ece = sum(
        (bins == b).float().mean() * (p[bins == b].mean() - accepted[bins == b].mean()).abs()
        for b in range(10)
        if (bins == b).any()
    )
    assert ece < 0.03, float(ece)
    assert (p - rate.to(test_device)[tokens]).abs().mean() < 0.08  # it recovers the per-token acceptance rates
    assert loss.item() < before
