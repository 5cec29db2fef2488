"""The exact verifier with the DSpark-style block drafter: the emitted distribution is the target's (chi-square
on an exactly solvable bigram target, with and without adaptive length), and greedy decoding commits exactly
the target's greedy tokens on a real HF model."""

import itertools
from collections import Counter

import pytest
import torch

from draftsmith.drafters.dspark import DSparkConfig, DSparkDrafter
from draftsmith.drafters.vocab import select_draft_vocab
from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer, Proposal
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator
from tests.eval.test_exactness import BigramTarget, P, chi_square_pvalue, plain_greedy


class FeatureBigramTarget(BigramTarget):
    """The bigram target, also returning a fixed feature vector per token (what a drafter conditions on), both on
    the device of `table` (the features drawn on the CPU: the same values on every device)."""

    def __init__(self, table, width, seed=0):
        super().__init__(table)
        self.feats = torch.randn(
            table.shape[0], width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        ).to(table.device)

    def prefill(self, prompts):
        logp, _, valid = super().prefill(prompts)
        width = valid.shape[1]
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        return logp, self.feats[ids], valid

    def step(self, tokens, valid, depths=None, visible=None):
        logp, _ = super().step(tokens, valid)
        return logp, self.feats[tokens.to(self.device)]


def _tiny_dspark(vocab=3, draft_vocab=3, hidden=16, aux=(1, 2, 3), target_hidden=8, block=3, seed=0, device="cpu"):
    """A random DSpark drafter over the bigram's tokens, initialized on the CPU and then moved to `device`."""
    torch.manual_seed(seed)
    cfg = DSparkConfig(
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        aux_layer_ids=list(aux),
        mask_token_id=vocab - 1,
        block_size=block,
        num_layers=2,
        markov_rank=4,
    )
    model = DSparkDrafter(cfg).double().eval()
    d2t, t2d = select_draft_vocab(torch.arange(vocab).flip(0).float(), draft_vocab)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        model.lm_head.weight.normal_(0, 2.0)  # a draft that disagrees with the target often, but not always
        model.markov_head.markov_w1.weight.normal_(0, 2.0)
    return model.to(device)


def _emitted_dspark(proposer, n=4000, seed=0, tokens=4):
    gen = make_generator(proposer.device, seed)  # the drafter's device: the bigram target, q and p live there too
    target = FeatureBigramTarget(P.to(proposer.device), 3 * 8)
    counts, accepted, drafted = Counter(), 0, 0
    for _ in range(n):
        (r,) = decode(target, proposer, [[0]], SamplingParams(temperature=1.0), 3, tokens, generators=[gen])
        counts[tuple(r.tokens[:tokens])] += 1
        drafted += sum(d for d, _ in r.rounds)
        accepted += sum(a for _, a in r.rounds)
    return counts, accepted, drafted


def _exact(tokens=4):
    out = {}
    for seq in itertools.product(range(3), repeat=tokens):
        prob, prev = 1.0, 0
        for x in seq:
            prob *= float(P[prev, x])
            prev = x
        out[seq] = prob
    return out


@pytest.mark.parametrize("threshold", [None, 0.45])
def test_sampling_with_dspark_blocks_emits_the_targets_distribution(threshold, test_device):
    """Four emitted tokens: the prefill's, then a block whose slots 1 and 2 decide the third and fourth whenever
    the earlier slots are accepted (two tokens would only ever see slot 0)."""
    proposer = DSparkProposer(_tiny_dspark(device=test_device), confidence_threshold=threshold)
    counts, accepted, drafted = _emitted_dspark(proposer)
    assert chi_square_pvalue(counts, _exact()) > 1e-3, counts
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both the accept and the reject branch were exercised


class AnticipatingStop(DSparkProposer):
    """Mutant: an adaptive stop that reads the drafted token itself (the chain stops before any later draft that
    came out as token 1)."""

    def propose(self, histories, active, k, params, generators):
        prop = super().propose(histories, active, k, params, generators)
        (drafts,), (confs,) = prop.drafts, prop.confidences
        cut = next((i for i in range(1, len(drafts)) if drafts[i] == 1), len(drafts))
        return Proposal([drafts[:cut]], prop.q[:, :cut], [confs[:cut]])


class LaterSlotsFromSlotZero(DSparkProposer):
    """Mutant: reports slot 0's q for every slot (p and q of different positions from slot 1 on)."""

    def propose(self, histories, active, k, params, generators):
        prop = super().propose(histories, active, k, params, generators)
        return Proposal(prop.drafts, prop.q[:, :1].expand_as(prop.q).clone(), prop.confidences)


@pytest.mark.parametrize("mutant", [AnticipatingStop, LaterSlotsFromSlotZero])
def test_the_dspark_sampling_test_rejects_mutants(mutant, test_device):
    counts, _, _ = _emitted_dspark(mutant(_tiny_dspark(device=test_device), confidence_threshold=None), n=2000, seed=3)
    assert chi_square_pvalue(counts, _exact()) < 1e-6


def test_adaptive_length_uses_only_earlier_positions(test_device):
    """With a threshold, fewer positions are drafted, and the first one always is."""
    drafter = _tiny_dspark(device=test_device)
    target = FeatureBigramTarget(P.to(test_device), 3 * 8)
    gen = make_generator(test_device, 1)
    (full,) = decode(target, DSparkProposer(drafter), [[0]], SamplingParams(temperature=1.0), 3, 40, generators=[gen])
    (short,) = decode(
        target,
        DSparkProposer(drafter, confidence_threshold=0.6),
        [[0]],
        SamplingParams(temperature=1.0),
        3,
        40,
        generators=[gen],
    )
    assert all(d == 3 for d, _ in full.rounds[:-1])
    assert all(d >= 1 for d, _ in short.rounds) and sum(d for d, _ in short.rounds) / len(short.rounds) < 3


def _dspark_for(model, calibrated=False):
    """A random DSpark drafter for `model`, on the model's device (initialized on the CPU: the same weights on
    every device)."""
    from draftsmith.drafters.dspark import DSparkDrafter

    torch.manual_seed(1)
    d2t, t2d = select_draft_vocab(torch.arange(384).flip(0), 200)
    d = (
        DSparkDrafter.from_target(
            model.config,
            [1, 2, 4],
            200,
            model.get_input_embeddings().weight.cpu(),
            d2t,
            t2d,
            head_weight=model.get_output_embeddings().weight.cpu(),
            block_size=4,
            num_layers=2,
            markov_rank=8,
        )
        .double()
        .to(model.device)
    )
    if calibrated:
        d.config.confidence_temperatures = [0.5, 2.0, 1.0, 3.0]
    return d


@pytest.mark.parametrize("kind", ["dspark", "dspark_adaptive"])
def test_greedy_with_dspark_commits_exactly_the_targets_greedy_tokens(tiny64, kind):
    g = torch.Generator().manual_seed(3)
    drafter = _dspark_for(tiny64, calibrated=kind.endswith("adaptive"))
    for trial in range(6):
        prompt = torch.randint(5, 380, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        n_new, gamma = [5, 17, 40][trial % 3], [1, 3, 4][trial % 3]
        proposer = DSparkProposer(drafter, confidence_threshold=0.3 if kind.endswith("adaptive") else None)
        target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)
        (r,) = decode(target, proposer, [prompt], SamplingParams(), gamma, n_new)
        assert r.tokens == plain_greedy(tiny64, prompt, n_new), (kind, trial)
        assert r.target_passes == len(r.rounds) + 1
        assert all(len(c) == d for c, (d, _) in zip(r.confidences, r.rounds))
