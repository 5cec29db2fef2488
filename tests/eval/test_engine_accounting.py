"""What the engine counts: rounds end at the first stop token however it was committed (drafted and accepted,
or the target's own), τ counts exactly the tokens each pass produced, drafting time includes updating the
drafter after verification, and tree verification masks correctly under every attention kernel."""

import math
import time

import pytest
import torch

from draftsmith.eval.engine import TreeSpec, decode
from draftsmith.eval.proposers import Eagle3Proposer, NoDraft, Proposal
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams
from draftsmith.eval.tree import Tree, tree_mask
from tests.eval.test_batch import plain_greedy


class GreedyOracle(NoDraft):
    """Drafts the target's own greedy continuation: every draft is accepted, stop tokens included."""

    def __init__(self, model):
        self.model = model

    def propose(self, histories, active, k, params, generators):
        return Proposal([plain_greedy(self.model, h, k) if a else [] for h, a in zip(histories, active)])


def _prompts_and_stops(model, n=4):
    """Prompts whose greedy answers reach a stop token in the middle of a 4-token draft (not at its end)."""
    g = torch.Generator().manual_seed(2)
    prompts, stops = [], set()
    while len(prompts) < n:
        prompt = torch.randint(5, 380, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        cont = plain_greedy(model, prompt, 12)
        if cont[2] not in cont[:2] and cont[2] not in stops:  # first token from prefill, then drafts cont[1:5]
            prompts.append(prompt)
            stops.add(cont[2])
    return prompts, sorted(stops)


def _check_accounting(model, prompt, r, stops, gamma, max_new):
    expected = plain_greedy(model, prompt, max_new, stops)
    assert r.tokens == expected
    assert r.tokens[-1] in stops and len(r.tokens) < max_new
    # τ counts exactly what the passes produced: the prefill's token plus a+1 per round
    assert 1 + sum(a + 1 for _, a in r.rounds) == len(r.tokens)
    # an oracle's rounds are all full until the one that reaches the stop: no round after it
    assert len(r.rounds) == math.ceil((len(r.tokens) - 1) / (gamma + 1))
    assert r.target_passes == len(r.rounds) + 1


def test_one_prompt_engine_stops_at_an_accepted_stop_token(tiny64):
    prompts, stops = _prompts_and_stops(tiny64)
    for prompt in prompts:
        (r,) = decode(HFTarget(tiny64), GreedyOracle(tiny64), [prompt], SamplingParams(), 4, 40, stops)
        _check_accounting(tiny64, prompt, r, stops, 4, 40)


def test_batched_engine_counts_a_stop_round_the_same_way(tiny64):
    prompts, stops = _prompts_and_stops(tiny64)
    results = decode(HFTarget(tiny64), GreedyOracle(tiny64), prompts, SamplingParams(), 4, 40, stops)
    for prompt, r in zip(prompts, results):
        _check_accounting(tiny64, prompt, r, stops, 4, 40)
    alone = [decode(HFTarget(tiny64), GreedyOracle(tiny64), [p], SamplingParams(), 4, 40, stops)[0] for p in prompts]
    assert [r.rounds for r in results] == [r.rounds for r in alone]


class SlowCommit(GreedyOracle):
    """An oracle whose post-verification update takes 20 ms (EAGLE-3 runs its drafter there)."""

    def commit(self, drafts, accepted, news, feats):
        time.sleep(0.02)


def test_drafting_time_includes_the_drafter_update_after_verification(tiny64):
    (r,) = decode(HFTarget(tiny64), SlowCommit(tiny64), [[5, 6, 7]], SamplingParams(), 2, 12)
    assert r.draft_seconds >= 0.02 * len(r.rounds) and r.verify_seconds > 0


def test_trees_and_batches_record_draft_and_verify_time(tiny64, monkeypatch):
    from tests.eval.test_exactness import _eagle3

    drafter = _eagle3(tiny64).to(tiny64.device)
    (r,) = decode(
        HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids),
        Eagle3Proposer(drafter),
        [[5, 6, 7]],
        SamplingParams(),
        0,
        10,
        tree=TreeSpec(depth=3, top_k=2, total=6),
    )
    assert r.draft_seconds > 0 and r.verify_seconds > 0
    real_commit = Eagle3Proposer.commit

    def slow_commit(self, *args):
        time.sleep(0.02)
        return real_commit(self, *args)

    monkeypatch.setattr(Eagle3Proposer, "commit", slow_commit)
    target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)
    results = decode(target, Eagle3Proposer(drafter), [[5, 6, 7], [8, 9]], SamplingParams(), 3, 10)
    rounds = max(len(r.rounds) for r in results)
    # each row is charged its share of the batch's drafting, the drafter's update included
    assert sum(r.draft_seconds for r in results) >= 0.02 * rounds and all(r.verify_seconds > 0 for r in results)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_each_paths_plain_forward(tiny_tok, attn, test_device):
    from tests.tiny import tiny_llama

    model = tiny_llama(tiny_tok, seed=0, num_layers=2, dtype=torch.float64).to(test_device)
    model.set_attn_implementation(attn)
    prompt, root = [5, 9, 13, 40], 77
    tree = Tree([11, 12, 21, 22, 31], [-1, -1, 0, 0, 2], [1, 1, 2, 2, 3], [-1.0, -2.0, -1.5, -3.0, -2.5])
    target = HFTarget(model)
    target.prefill([prompt])
    n = 1 + len(tree)
    logits, _ = target.step(
        torch.tensor([[root, *tree.tokens]]),
        torch.ones(1, n, dtype=torch.bool),
        torch.tensor([[0, *tree.depths]]),
        tree_mask(tree, 0)[None],
    )
    logits = logits[0]
    with torch.no_grad():
        # eager attention takes its softmax in fp32 even for a float64 model, so paths of other shapes differ by
        # ~1e-6 with some kernels (AVX2); a mask that hides nothing is off by ~1e-2
        whole = model(torch.tensor([prompt + [root]], device=model.device)).logits[0, -1]
        torch.testing.assert_close(logits[0], whole.float(), rtol=0, atol=1e-4)
        for i in range(len(tree)):
            path = [tree.tokens[a] for a in tree.ancestors(i)]
            plain = model(torch.tensor([prompt + [root] + path], device=model.device)).logits[0, -1]
            torch.testing.assert_close(
                logits[1 + i], plain.float(), rtol=0, atol=1e-4, msg=lambda m, i=i: f"node {i} ({attn}): {m}"
            )


def test_the_margin_at_the_first_differing_token_is_the_targets_lead_there(tiny64):
    """`first_difference_margin` finds where an output first departs from plain decoding's and returns how far the
    target's logit of plain decoding's token there led the other's: the top-two gap for the runner-up, more for a
    less likely token, nothing for identical outputs."""
    from draftsmith.eval.metrics import first_difference_margin

    prompt = [5, 17, 33, 9]
    ref = plain_greedy(tiny64, prompt, 8)
    with torch.no_grad():
        logits = tiny64(input_ids=torch.tensor([prompt + ref[:3]], device=tiny64.device)).logits[0, -1].float()
    order = logits.argsort(descending=True).tolist()
    assert order[0] == ref[3]
    runner_up, unlikely = ref[:3] + [order[1]] + ref[4:], ref[:3] + [order[-1]] + ref[4:]
    gap = float(logits[order[0]] - logits[order[1]])
    assert first_difference_margin(tiny64, prompt, ref, runner_up) == pytest.approx(gap, abs=1e-4)
    assert first_difference_margin(tiny64, prompt, ref, unlikely) > gap
    assert first_difference_margin(tiny64, prompt, ref, list(ref)) is None


def test_eval_records_a_departure_from_plain_greedy_with_its_margin(tiny64, monkeypatch):
    """Mutation: a verifier that accepts every draft makes the output depart from plain decoding's; eval's record
    counts the prompt and gives the target's lead at the first differing token, well above a near-tie's (the
    float32 tiny target breaks no ties), and the report prints it."""
    from draftsmith.eval import engine
    from draftsmith.eval.report import markdown_table
    from draftsmith.pipeline.evaluate import Decoder, summarize

    class Sevens(NoDraft):
        name = "sevens"

        def propose(self, histories, active, k, params, generators):
            return Proposal([[7] * k if a else [] for a in active])

    prompt = [5, 17, 33, 9]
    assert 7 not in plain_greedy(tiny64, prompt, 12)[:3]
    monkeypatch.setattr(engine, "greedy_verify", lambda d, logits: (len(d), int(logits[len(d)].argmax())))
    runners = {"none": HFTarget(tiny64), "sevens": HFTarget(tiny64)}  # side by side: a KV cache each
    dec = Decoder(
        runners, {"none": NoDraft(), "sevens": Sevens()}, {"none": 1, "sevens": 3}, [], None, 0, tiny64.device
    )
    by, diverged = dec.temperature([[{"ids": prompt, "domain": "d", "id": "p"}]], SamplingParams(), 12, "test")
    assert len(diverged["sevens"]) == 1 and diverged["sevens"][0] > 0.1
    run = summarize(0.0, by, diverged, dec.gammas, ["none", "sevens"], 1, True)
    assert run["greedy_divergence"]["sevens"] == {"prompts": 1, "of": 1, "largest_margin": diverged["sevens"][0]}
    settings = {"draft_length": 3, "max_new_tokens": 12}
    assert "sevens: 1/1 (margin ≤" in markdown_table({"runs": [run], "settings": settings})
