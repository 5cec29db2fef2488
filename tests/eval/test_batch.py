"""Batched decoding (ragged prompts, rows accepting different lengths) gives each row exactly what it
gives alone: the target's greedy tokens, for every drafter kind."""

import pytest
import torch

from draftsmith.eval.engine import decode
from draftsmith.eval.proposers import DSparkProposer, Eagle3Proposer, NoDraft, PromptLookup, TrainedProposer
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator


def plain_greedy(model, prompt, n, stops=()):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
            if ids[-1] in stops:
                break
    return ids[len(prompt) :]


def _eagle3(model):
    """A random EAGLE-3 drafter for `model`, on the model's device (initialized on the CPU: the same weights on
    every device)."""
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab

    torch.manual_seed(1)
    d2t, t2d = select_draft_vocab(torch.arange(384).flip(0), 200)
    embed = model.get_input_embeddings().weight.cpu()
    return Eagle3Drafter.from_target(model.config, [1, 2, 4], 200, embed, d2t, t2d).double().to(model.device)


def _dspark(model):
    from tests.eval.test_dspark_exactness import _dspark_for

    return _dspark_for(model, calibrated=True)


def _proposer(kind, model, threshold=None, draft_length=None):
    if kind == "none":
        return NoDraft()
    if kind == "prompt_lookup":
        return PromptLookup()
    if kind == "eagle3":
        return Eagle3Proposer(_eagle3(model), threshold)
    return DSparkProposer(_dspark(model), threshold, draft_length)


@pytest.mark.parametrize("kind", ["none", "prompt_lookup", "eagle3", "dspark"])
def test_batched_greedy_equals_plain_greedy(tiny64, kind):
    g = torch.Generator().manual_seed(7)
    # repetitive prompts make prompt lookup accept long runs in some rows and nothing in others
    prompts = [
        torch.randint(5, 380, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g).tolist() * (1 + i % 2)
        for i in range(5)
    ]
    proposer = _proposer(kind, tiny64)
    stops = [7, 11]
    results = decode(HFTarget(tiny64, proposer.aux_ids), proposer, prompts, SamplingParams(), 4, 24, stops)
    for p, r in zip(prompts, results):
        assert r.tokens == plain_greedy(tiny64, p, 24, stops), kind
        assert r.tau == sum(a + 1 for _, a in r.rounds) / len(r.rounds) if r.rounds else True
    if kind == "none":
        assert all(r.tau == 1.0 for r in results if r.rounds)
    if kind == "prompt_lookup":  # rows drafted different numbers of tokens in the same rounds (ragged batches)
        assert len({tuple(d for d, _ in r.rounds) for r in results}) > 1 and any(
            d for r in results for d, _ in r.rounds
        )


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_batched_matches_unbatched_acceptance(tiny64, kind, threshold):
    """Same rounds (drafted, accepted) and confidences per row as a batch of one, for both trained families, with
    and without adaptive draft length."""
    proposer = _proposer(kind, tiny64, threshold, 3)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 101, 102, 100, 101, 102, 100]]
    batched = decode(HFTarget(tiny64, proposer.aux_ids), proposer, prompts, SamplingParams(), 3, 15)
    for p, rb in zip(prompts, batched):
        (r1,) = decode(HFTarget(tiny64, proposer.aux_ids), proposer, [p], SamplingParams(), 3, 15)
        assert rb.tokens == r1.tokens and rb.rounds == r1.rounds
        assert [len(c) for c in rb.confidences] == [len(c) for c in r1.confidences]
        for cb, c1 in zip(rb.confidences, r1.confidences):  # equal up to float64 rounding of other batch shapes
            torch.testing.assert_close(torch.tensor(cb), torch.tensor(c1), rtol=0, atol=1e-12)
    drafted = [d for r in batched for d, _ in r.rounds]
    if threshold is not None:  # adaptive length really cut some rounds short, and not all to one length
        assert min(drafted) < 3 and len(set(drafted)) > 1, drafted


class ScriptedConfidences(TrainedProposer):
    """A proposer whose confidence of position i in row b is confs[b, i] (greedy drafts of uniform logits)."""

    def __init__(self, confs, threshold):
        self.confs, self.threshold = confs, threshold
        self.ids = torch.arange(4, device=confs.device)

    def drafted(self) -> list[int]:
        B, k = self.confs.shape

        def step(i, x):
            return torch.zeros(B, 4, device=self.confs.device), self.confs[:, i]

        prop = self._chain(k, [True] * B, SamplingParams(), [None] * B, step)
        return [len(d) for d in prop.drafts]


def test_adaptive_lengths_keep_drafts_while_the_running_confidence_holds(test_device):
    confs = torch.tensor([[0.9, 0.5, 0.8], [0.3, 0.9, 0.9], [0.99, 0.99, 0.99]], device=test_device)
    # 0.9*0.5*0.8 = 0.36 < 0.4; 0.3 drafts the first anyway
    assert ScriptedConfidences(confs, 0.4).drafted() == [2, 1, 3]
    assert ScriptedConfidences(confs, None).drafted() == [3, 3, 3]


def test_batched_sampling_runs(tiny64):
    gens = [make_generator(tiny64.device, b) for b in range(2)]
    proposer = _proposer("eagle3", tiny64)
    res = decode(
        HFTarget(tiny64, proposer.aux_ids),
        proposer,
        [[5, 6, 7], [9, 10, 11, 12, 13]],
        SamplingParams(1.0),
        3,
        20,
        (),
        gens,
    )
    assert [len(r.tokens) for r in res] == [20, 20] and all(1 <= r.tau <= 4 for r in res)


def test_batched_dspark_drafts_what_each_row_drafts_alone(tiny64):
    """Rows with ragged prompts accept different numbers of drafts per round (scripted here, so every pattern
    occurs): each row's drafts and calibrated confidences equal those of the row drafted alone, so padding and the
    unverified slots of other rows' rounds never leak into a row's context."""
    drafter = _dspark(tiny64)
    width = len(drafter.config.aux_layer_ids) * drafter.config.target_hidden_size
    g = torch.Generator().manual_seed(5)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [100, 101, 102, 100, 101, 102, 100]]
    firsts = [17, 18, 19]
    accepted_by_round = [[2, 0, 3], [0, 3, 1], [1, 1, 0], [3, 2, 2]]
    P = max(len(p) for p in prompts)
    # drawn on the CPU (the same values on every device), then on the target's device, where eval's features are
    feats = torch.randn(3, P, width, generator=g, dtype=torch.float64)
    valid = torch.zeros(3, P, dtype=torch.bool)  # on the CPU, as eval's prefill makes it
    for b, p in enumerate(prompts):
        valid[b, P - len(p) :] = True
        feats[b, : P - len(p)] = 1e3  # padding: would swamp a row that attended to it
    feats = feats.to(tiny64.device)
    batched = DSparkProposer(drafter, draft_length=3)
    batched.start(prompts, firsts, feats, valid)
    singles = [DSparkProposer(drafter, draft_length=3) for _ in prompts]
    for b, p in enumerate(prompts):
        singles[b].start([p], [firsts[b]], feats[b : b + 1, P - len(p) :], valid[b : b + 1, P - len(p) :])
    greedy, rows = SamplingParams(), [None] * 3
    for accepted in accepted_by_round:
        prop = batched.propose([[]] * 3, [True] * 3, 3, greedy, rows)
        assert prop.q is None and [len(d) for d in prop.drafts] == [3, 3, 3]
        news = torch.randint(5, 380, (3,), generator=g).tolist()
        round_feats = torch.randn(3, 4, width, generator=g, dtype=torch.float64).to(tiny64.device)
        for b in range(3):
            alone = singles[b].propose([[]], [True], 3, greedy, [None])
            assert alone.drafts[0] == prop.drafts[b]
            torch.testing.assert_close(alone.confidences[0], prop.confidences[b], rtol=0, atol=1e-12)
            n = accepted[b]
            round_feats[b, n + 1 :] = 1e3  # unverified slots: must stay holes
            singles[b].commit(alone.drafts, [n], [news[b]], round_feats[b : b + 1, : n + 1])
        batched.commit(prop.drafts, accepted, news, round_feats)
