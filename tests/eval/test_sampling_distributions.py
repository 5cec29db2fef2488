"""Emitted-token distributions under the settings users serve with: T != 1 with top-p and top-k, the q a trained
drafter really samples from, and batched decoding at T > 0. Each test compares the first three emitted tokens
with the target's exact distribution (chi-square), and each has mutants of the code it covers that it must reject:
that is what shows it has the power to catch them."""

import itertools
from collections import Counter

import pytest
import torch

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import Eagle3Proposer, PromptLookup, TrainedProposer
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator, probs_from_logits, sample
from draftsmith.eval.verify import residual, sampling_verify
from tests.eval.test_exactness import BigramTarget, chi_square_pvalue

PARAMS = SamplingParams(temperature=0.7, top_p=0.85, top_k=3)  # every processing step changes the distribution

# a 5-token bigram target and a perturbed drafter over the same tokens (log-probabilities as logits)
P5 = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.12, 0.08],
        [0.10, 0.45, 0.20, 0.15, 0.10],
        [0.30, 0.10, 0.35, 0.15, 0.10],
        [0.25, 0.25, 0.20, 0.20, 0.10],
        [0.05, 0.15, 0.30, 0.20, 0.30],
    ],
    dtype=torch.float64,
)
Q5 = torch.tensor(
    [
        [0.20, 0.40, 0.10, 0.20, 0.10],
        [0.30, 0.30, 0.25, 0.10, 0.05],
        [0.15, 0.20, 0.40, 0.15, 0.10],
        [0.10, 0.40, 0.30, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.10, 0.30],
    ],
    dtype=torch.float64,
)


def pooled_pvalue(counts: Counter, probs: dict, min_expected: float = 5.0) -> float:
    """Chi-square p-value, with the cells expected fewer than `min_expected` times pooled into one; 0 when a
    sequence the target cannot emit was emitted."""
    if any(k not in probs for k in counts):
        return 0.0
    n = sum(counts.values())
    big = {k: p for k, p in probs.items() if n * p >= min_expected}
    small = [k for k in probs if k not in big]
    merged = Counter({k: counts.get(k, 0) for k in big})
    table = dict(big)
    if small:
        merged["rest"] = sum(counts.get(k, 0) for k in small)
        table["rest"] = sum(probs[k] for k in small)
    return chi_square_pvalue(merged, table)


def exact_bigram(table, params, prompt_token=0, n=3):
    rows = probs_from_logits(table.log(), params)
    out = {}
    for seq in itertools.product(range(table.shape[0]), repeat=n):
        prob, prev = 1.0, prompt_token
        for x in seq:
            prob *= float(rows[prev, x])
            prev = x
        if prob > 0:
            out[seq] = prob
    return out


class BigramTrained(TrainedProposer):
    """A trained-drafter proposer whose 'drafter' is the Q5 bigram: propose() drafts as Eagle3Proposer does (one
    `_draw` per position from draft-vocab logits), so the q that reaches the verifier is the real code's."""

    def __init__(self, table, greedy_drafts=False):
        self.logits = table.log()
        self.ids = torch.arange(table.shape[0])
        self.vocab, self.device, self.threshold = table.shape[0], torch.device("cpu"), None
        self.greedy_drafts = greedy_drafts

    def propose(self, histories, active, k, params, generators):
        last = torch.tensor([h[-1] for h in histories])

        def step(i, x):
            return self.logits[last if x is None else x], torch.ones(len(histories), dtype=torch.float64)

        return self._chain(k, active, params, generators, step)


class QBeforeProcessing(BigramTrained):
    """Mutant: samples from the processed distribution but reports the raw softmax as q."""

    def _draw(self, logits, params, generators, rows):
        x, _ = super()._draw(logits, params, generators, rows)
        return x, torch.softmax(logits.double(), -1)


class ArgmaxWithSampledQ(BigramTrained):
    """Mutant: drafts the argmax but reports the processed distribution as q, as if the draft had been drawn from
    it."""

    def _draw(self, logits, params, generators, rows):
        x, _ = super()._draw(logits, params, generators, rows)
        return x, probs_from_logits(logits, params)


def verify_p_from_next_position(drafts, q, p, gen):
    """Mutant: p and q of different positions (the target's row one further on)."""
    shifted = torch.cat([p[1:], p[-1:]])
    return sampling_verify(drafts, q, shifted, gen)


def verify_resample_from_p(drafts, q, p, gen):
    """Mutant: on rejection, sample from p instead of the residual."""
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, sample(p[i], gen)
    return len(drafts), sample(p[len(drafts)], gen)


def verify_bonus_from_last_draft_row(drafts, q, p, gen):
    """Mutant: the bonus token drawn from the last drafted position's p instead of the next one."""
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, sample(residual(p[i], q[i]), gen)
    return len(drafts), sample(p[max(len(drafts) - 1, 0)], gen)


def emitted_bigram(proposer, verify=sampling_verify, gamma=3, n=8000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target, counts, accepted = BigramTarget(P5), Counter(), 0
    for _ in range(n):
        (r,) = decode(target, proposer, [[0]], PARAMS, gamma, 3, generators=[gen], verify=verify)
        counts[tuple(r.tokens[:3])] += 1
        accepted += sum(a for _, a in r.rounds)
    return counts, accepted


@pytest.mark.parametrize("gamma", [1, 3])  # γ = 1: the bonus token is the third emitted; γ = 3: drafts 1-2 are
def test_processed_sampling_with_a_trained_drafters_q_emits_the_targets_distribution(gamma):
    counts, accepted = emitted_bigram(BigramTrained(Q5), gamma=gamma)
    assert accepted > 2000  # the drafts are often accepted: the accept branch is what is being tested
    assert pooled_pvalue(counts, exact_bigram(P5, PARAMS)) > 1e-3


@pytest.mark.parametrize(
    "mutant, gamma",
    [("q_before_processing", 3), ("p_from_next_position", 3), ("resample_from_p", 3), ("bonus_from_last_row", 1)],
)
def test_the_processed_sampling_test_rejects_mutants(mutant, gamma):
    proposer = QBeforeProcessing(Q5) if mutant == "q_before_processing" else BigramTrained(Q5)
    verify = {
        "p_from_next_position": verify_p_from_next_position,
        "resample_from_p": verify_resample_from_p,
        "bonus_from_last_row": verify_bonus_from_last_draft_row,
    }.get(mutant, sampling_verify)
    counts, _ = emitted_bigram(proposer, verify, gamma=gamma, seed=1)
    assert pooled_pvalue(counts, exact_bigram(P5, PARAMS)) < 1e-6


@pytest.mark.parametrize("gamma", [1, 3])
def test_argmax_drafts_at_t_above_0_emit_the_targets_distribution(gamma):
    """eval.draft_sample_method = greedy: every draft is the drafter's argmax, verified as a one-hot q (kept with the
    target's probability of it), and what is emitted is still the target's processed distribution."""
    proposer = BigramTrained(Q5, greedy_drafts=True)
    history = [[0, 3]]
    drafts = proposer.propose(history, [True], 2, PARAMS, [torch.Generator().manual_seed(0)])
    assert drafts.drafts == [[int(Q5[3].argmax()), int(Q5[int(Q5[3].argmax())].argmax())]] and drafts.q is None
    counts, accepted = emitted_bigram(proposer, gamma=gamma)
    assert accepted > 2000
    assert pooled_pvalue(counts, exact_bigram(P5, PARAMS)) > 1e-3


def test_the_argmax_draft_test_rejects_a_q_it_was_not_drawn_from():
    counts, _ = emitted_bigram(ArgmaxWithSampledQ(Q5, greedy_drafts=True), seed=1)
    assert pooled_pvalue(counts, exact_bigram(P5, PARAMS)) < 1e-6


# ------------------------------------------------------------------------ batched decoding at T > 0, real model


@pytest.fixture(scope="module")
def tiny64(tiny_tok, test_device):
    from tests.tiny import tiny_llama

    return tiny_llama(tiny_tok, seed=0, num_layers=2, dtype=torch.float64).to(test_device)


PROMPTS = [[11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 40, 41, 40]]  # repetitive: prompt lookup finds drafts


@torch.no_grad()
def exact_model(model, prompt, params, n=3):
    def probs(ids):
        return probs_from_logits(model(torch.tensor([ids], device=model.device)).logits[0, -1], params)

    out = {}

    def walk(prefix, prob):
        if len(prefix) == n:
            out[tuple(prefix)] = prob
            return
        p = probs(prompt + prefix)
        for x in p.nonzero().flatten().tolist():
            walk(prefix + [x], prob * float(p[x]))

    walk([], 1.0)
    return out


def emitted_batched(model, kind, drafter, samples, seed=0):
    rows = PROMPTS * 4  # 8 rows, the two prompts alternating (of different lengths: ragged)
    gens = [make_generator(model.device, seed * 100 + b) for b in range(len(rows))]  # on the model's device
    proposer = Eagle3Proposer(drafter) if kind == "eagle3" else PromptLookup()
    target = HFTarget(model, proposer.aux_ids)
    counts = [Counter(), Counter()]
    accepted = 0
    for _ in range(samples // 4):
        for i, r in enumerate(decode(target, proposer, rows, PARAMS, 3, 3, (), gens)):
            counts[i % 2][tuple(r.tokens[:3])] += 1
            accepted += sum(a for _, a in r.rounds)
    return counts, accepted


def _eagle3(model):
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab

    torch.manual_seed(1)
    d2t, t2d = select_draft_vocab(torch.arange(384).flip(0), 384)
    return (
        Eagle3Drafter.from_target(model.config, [1, 2], 384, model.get_input_embeddings().weight.cpu(), d2t, t2d)
        .double()
        .to(model.device)
    )


@pytest.mark.parametrize("kind", ["prompt_lookup", "eagle3"])
def test_batched_sampling_emits_each_rows_target_distribution(tiny64, kind):
    drafter = _eagle3(tiny64) if kind == "eagle3" else None
    counts, accepted = emitted_batched(tiny64, kind, drafter, 1200)
    if kind == "prompt_lookup":
        assert accepted > 100  # drafts were accepted, not only rejected
    for prompt, c in zip(PROMPTS, counts):
        assert pooled_pvalue(c, exact_model(tiny64, prompt, PARAMS)) > 1e-3, (kind, prompt)


@pytest.mark.parametrize("mutant", ["p_from_another_row", "p_from_next_position"])
def test_the_batched_sampling_test_rejects_mutants(tiny64, monkeypatch, mutant):
    real_step = HFTarget.step

    def broken_step(self, tokens, valid, depths=None, visible=None):
        logits, feats = real_step(self, tokens, valid, depths, visible)
        if mutant == "p_from_another_row":
            return logits.roll(1, dims=0), feats
        return torch.cat([logits[:, 1:], logits[:, -1:]], dim=1), feats

    monkeypatch.setattr(HFTarget, "step", broken_step)
    counts, _ = emitted_batched(tiny64, "prompt_lookup", None, 600, seed=2)
    worst = min(pooled_pvalue(c, exact_model(tiny64, prompt, PARAMS)) for prompt, c in zip(PROMPTS, counts))
    assert worst < 1e-6
