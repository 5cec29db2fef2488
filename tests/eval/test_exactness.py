"""The verifier's contract, proven on output distributions (sampling) and on token equality (greedy)."""

import itertools
from collections import Counter

import pytest
import torch

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import Eagle3Proposer, NoDraft, PromptLookup, Proposal
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator, sample, uniform
from draftsmith.eval.verify import residual, sampling_verify

# ------------------------------------------------------------------ an exactly solvable model: bigrams

P = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]], dtype=torch.float64)  # target
Q = torch.tensor([[0.2, 0.6, 0.2], [0.4, 0.3, 0.3], [0.6, 0.2, 0.2]], dtype=torch.float64)  # a perturbed draft


class BigramTarget:
    """The bigram target on the device of `table` (its logits, and so the verifier's p, live there): the logits at
    a slot are the table's row of the slot's token. It keeps no cache, so what a round keeps changes nothing."""

    pad_id = 0

    def __init__(self, table):
        self.logp = table.log()
        self.device = table.device

    def prefill(self, prompts):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
        return self.logp[ids.to(self.device)], None, valid

    def step(self, tokens, valid, depths=None, visible=None):
        return self.logp[tokens.to(self.device)], None

    def keep(self, b, n_new, kept):
        pass

    def compact(self):
        pass


class BigramDraft(NoDraft):
    def __init__(self, table):
        self.table = table

    def propose(self, histories, active, k, params, generators):
        drafts, qs = [], []
        for h, gen in zip(histories, generators):
            x, row, row_q = h[-1], [], []
            for _ in range(k):
                q = self.table[x]
                x = sample(q, gen)
                row.append(x)
                row_q.append(q)
            drafts.append(row)
            qs.append(torch.stack(row_q))
        return Proposal(drafts, torch.stack(qs))


def chi_square_pvalue(counts: Counter, probs: dict) -> float:
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    df = len(probs) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def exact_three_token_distribution(prompt_token=0):
    out = {}
    for a, b, c in itertools.product(range(3), repeat=3):
        out[(a, b, c)] = float(P[prompt_token, a] * P[a, b] * P[b, c])
    return out


def emitted(verify, gamma, device, n=20000, seed=0):
    gen = make_generator(device, seed)  # on the tables' device, as sampling there requires
    target, draft = BigramTarget(P.to(device)), BigramDraft(Q.to(device))
    counts = Counter()
    for _ in range(n):
        (r,) = decode(target, draft, [[0]], SamplingParams(temperature=1.0), gamma, 3, generators=[gen], verify=verify)
        counts[tuple(r.tokens[:3])] += 1
    return counts


@pytest.mark.parametrize("gamma", [1, 3])
def test_sampling_output_is_the_targets_distribution(gamma, test_device):
    p = chi_square_pvalue(emitted(sampling_verify, gamma, test_device), exact_three_token_distribution())
    assert p > 1e-3, p


def resample_from_p(drafts, q, p, gen):  # a classic bug: on rejection, sample from p instead of the residual
    for i, x in enumerate(drafts):
        if uniform(gen) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, sample(p[i], gen)
    return len(drafts), sample(p[len(drafts)], gen)


def anticipating(drafts, q, p, gen):  # verification that depends on the drafted token: token 1 skips the test
    for i, x in enumerate(drafts):
        if x == 1 or uniform(gen) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, sample(residual(p[i], q[i]), gen)
    return len(drafts), sample(p[len(drafts)], gen)


@pytest.mark.parametrize("broken", [resample_from_p, anticipating])
def test_the_chi_square_test_rejects_broken_verifiers(broken, test_device):
    p = chi_square_pvalue(emitted(broken, 3, test_device), exact_three_token_distribution())
    assert p < 1e-6, p


def test_residual_rule_on_the_chapter_example(test_device):
    p = torch.tensor([0.5, 0.3, 0.2], device=test_device)
    q = torch.tensor([0.2, 0.6, 0.2], device=test_device)
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0], device=test_device))
    assert abs(float(torch.minimum(p, q).sum()) - 0.7) < 1e-6


# ----------------------------------------------------------------------------- greedy on a real HF model


def plain_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


class OracleDraft(NoDraft):
    """Near-perfect: the target's own greedy continuation (recomputed without a cache), corrupted at rate 0.25
    (by a CPU generator of its own: which drafts are corrupted is the same on every device)."""

    def __init__(self, model, seed=0):
        self.model, self.rng = model, torch.Generator().manual_seed(seed)

    def propose(self, histories, active, k, params, generators):
        (history,) = histories
        cont = plain_greedy(self.model, history, k)
        return Proposal([[t if float(torch.rand((), generator=self.rng)) > 0.25 else (t + 1) % 384 for t in cont]])


def _eagle3(model):
    """A random EAGLE-3 drafter for `model`, on the model's device (initialized on the CPU: the same weights on
    every device)."""
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab

    torch.manual_seed(1)
    d2t, t2d = select_draft_vocab(torch.arange(384).flip(0), 200)
    embed = model.get_input_embeddings().weight.cpu()
    return Eagle3Drafter.from_target(model.config, [1, 2, 4], 200, embed, d2t, t2d).double().to(model.device)


@pytest.mark.parametrize("kind", ["none", "prompt_lookup", "eagle3", "eagle3_adaptive", "oracle"])
def test_greedy_commits_exactly_the_targets_greedy_tokens(tiny64, kind):
    g = torch.Generator().manual_seed(3)
    drafter = _eagle3(tiny64) if kind.startswith("eagle3") else None
    all_rounds = []
    for trial in range(6):
        prompt = torch.randint(5, 380, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        n_new = [5, 17, 40][trial % 3]
        gamma = [1, 3, 5][trial % 3]
        proposer = {
            "none": NoDraft(),
            "prompt_lookup": PromptLookup(),
            "oracle": OracleDraft(tiny64, trial),
            "eagle3": Eagle3Proposer(drafter) if drafter else None,
            # adaptive draft length: whether position i is drafted depends only on what precedes it
            "eagle3_adaptive": Eagle3Proposer(drafter, confidence_threshold=0.3) if drafter else None,
        }[kind]
        target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids if drafter else None)
        (r,) = decode(target, proposer, [prompt], SamplingParams(), gamma, n_new)
        assert r.tokens == plain_greedy(tiny64, prompt, n_new), (kind, trial)
        assert r.tau == sum(a + 1 for _, a in r.rounds) / len(r.rounds)
        assert r.target_passes == len(r.rounds) + 1
        all_rounds += r.rounds
        if kind == "none":
            assert r.tau == 1.0 and all(d == 0 for d, _ in r.rounds)
    if kind == "oracle":  # the near-perfect drafter is mostly accepted
        assert sum(a + 1 for _, a in all_rounds) / len(all_rounds) > 1.8


def test_eagle3_sampling_runs_and_accounts(tiny64):
    drafter = _eagle3(tiny64)
    target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)
    gen = make_generator(tiny64.device, 0)
    (r,) = decode(
        target,
        Eagle3Proposer(drafter, confidence_threshold=0.2),
        [[5, 6, 7, 8]],
        SamplingParams(1.0, 0.9, 50),
        4,
        30,
        generators=[gen],
    )
    assert len(r.tokens) == 30 and 1.0 <= r.tau <= 5.0
    assert all(len(c) == d for c, (d, _) in zip(r.confidences, r.rounds))
