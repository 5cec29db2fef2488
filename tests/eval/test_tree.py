"""Tree drafting and verification: greedy trees reproduce the target's greedy tokens; sampled trees emit the
target's exact distribution (chi-square on a bigram model), and the test rejects broken recursive rejection."""

import importlib.util
import pathlib
from collections import Counter

import pytest
import torch

from draftsmith.eval.engine import TreeSpec, decode
from draftsmith.eval.proposers import Eagle3Proposer, NoDraft, Proposal
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, make_generator, sample, uniform
from draftsmith.eval.tree import Tree, prune, sampling_tree_verify, tree_mask

_spec = importlib.util.spec_from_file_location("exactness", pathlib.Path(__file__).with_name("test_exactness.py"))
_ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ex)
P, Q, BigramTarget, chi_square_pvalue, exact3 = (
    _ex.P,
    _ex.Q,
    _ex.BigramTarget,
    _ex.chi_square_pvalue,
    _ex.exact_three_token_distribution,
)


class BigramTreeDraft(NoDraft):
    """Deterministic top-k children from the draft bigram Q (scores: cumulative log q)."""

    def __init__(self, table):
        self.logq = table.log()

    def start(self, prompts, firsts, feats, valid):
        (self.last,) = firsts

    def commit(self, drafts, accepted, news, feats):
        (self.last,) = news

    def propose_tree(self, depth, top_k, total):
        tree = Tree()
        frontier = [(-1, self.last, 0.0)]
        for d in range(1, depth + 1):
            nxt = []
            for parent, token, score in sorted(frontier, key=lambda f: -f[2])[:top_k]:
                lq = self.logq[token]
                for c in torch.topk(lq, top_k).indices.tolist():
                    tree.tokens.append(c)
                    tree.parents.append(parent)
                    tree.depths.append(d)
                    tree.scores.append(score + float(lq[c]))
                    nxt.append((len(tree) - 1, c, tree.scores[-1]))
            frontier = nxt
        return Proposal([[]], tree=prune(tree, total))


SMALL_TREE = TreeSpec(depth=2, top_k=2, total=5)


def emitted_tree(tree_verify, device, n=20000, seed=0, spec=SMALL_TREE):
    gen = make_generator(device, seed)  # on the tables' device, as sampling there requires
    target, draft = BigramTarget(P.to(device)), BigramTreeDraft(Q.to(device))
    counts = Counter()
    for _ in range(n):
        (r,) = decode(
            target, draft, [[0]], SamplingParams(temperature=1.0), 0, 3, [], [gen], tree=spec, tree_verify=tree_verify
        )
        counts[tuple(r.tokens[:3])] += 1
    return counts


def test_sampled_trees_emit_the_targets_distribution(test_device):
    assert chi_square_pvalue(emitted_tree(sampling_tree_verify, test_device), exact3()) > 1e-3


def no_residual(tree, p, gen):  # bug: after a rejected child, the next sibling is tested against the unchanged p
    path, node = [], -1
    while True:
        dist = p[0 if node == -1 else 1 + node]
        for child in tree.children(node):
            if uniform(gen) < float(dist[tree.tokens[child]]):
                path.append(child)
                node = child
                break
        else:
            return path, sample(dist, gen)


def anticipating_tree(tree, p, gen):  # bug: a child whose token is 1 is accepted without the test
    path, node = [], -1
    while True:
        dist = p[0 if node == -1 else 1 + node].clone()
        for child in tree.children(node):
            x = tree.tokens[child]
            if x == 1 or uniform(gen) < float(dist[x]):
                path.append(child)
                node = child
                break
            dist[x] = 0.0
            dist = dist / dist.sum()
        else:
            return path, sample(dist, gen)


@pytest.mark.parametrize("broken", [no_residual, anticipating_tree])
def test_the_chi_square_test_rejects_broken_tree_verifiers(broken, test_device):
    assert chi_square_pvalue(emitted_tree(broken, test_device), exact3()) < 1e-6


def test_tree_mask_and_prune():
    t = Tree([5, 6, 7, 8], [-1, -1, 0, 2], [1, 1, 2, 3], [-0.1, -2.0, -0.5, -0.9])
    m = tree_mask(t, past=2)
    assert m.shape == (5, 7) and m[:, :3].all()
    assert m[4].tolist() == [True, True, True, True, False, True, True]  # node 3 sees root, 0, 2, itself
    small = prune(t, 2)  # the two best are nodes 0 and 2; pruning keeps them parents-first
    assert small.tokens == [5, 7] and small.parents == [-1, 0]


@pytest.mark.parametrize("spec", [TreeSpec(depth=3, top_k=2, total=6), TreeSpec(depth=5, top_k=4, total=24)])
def test_greedy_trees_commit_exactly_the_targets_greedy_tokens(tiny64, spec):
    drafter = _ex._eagle3(tiny64)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        prompt = torch.randint(5, 380, (int(torch.randint(3, 16, (1,), generator=g)),), generator=g).tolist()
        target = HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids)
        (r,) = decode(target, Eagle3Proposer(drafter), [prompt], SamplingParams(), 0, 20, tree=spec)
        assert r.tokens == _ex.plain_greedy(tiny64, prompt, 20)
        assert r.target_passes == len(r.rounds) + 1


def test_sampled_trees_run_on_a_real_model(tiny64):
    drafter = _ex._eagle3(tiny64)
    gen = make_generator(tiny64.device, 0)
    (r,) = decode(
        HFTarget(tiny64, aux_ids=drafter.config.aux_layer_ids),
        Eagle3Proposer(drafter),
        [[5, 6, 7]],
        SamplingParams(1.0),
        0,
        25,
        generators=[gen],
        tree=TreeSpec(depth=3, top_k=3, total=8),
    )
    assert len(r.tokens) == 25 and r.tau >= 1.0


class OracleTreeDraft(NoDraft):
    """Children of each node: the target's greedy token (replaced by a wrong one 30% of the time) plus a random
    sibling, down `depth` levels along the greedy line, so accepted paths are long and branch (the corruption and
    the siblings drawn by a CPU generator of its own: the same trees on every device)."""

    def __init__(self, model, seed):
        self.model, self.rng = model, torch.Generator().manual_seed(seed)

    def start(self, prompts, firsts, feats, valid):
        self.history = list(prompts[0]) + [firsts[0]]

    def commit(self, drafts, accepted, news, feats):
        self.history += list(drafts[0][: accepted[0]]) + [news[0]]

    def propose_tree(self, depth, top_k, total):
        greedy = _ex.plain_greedy(self.model, self.history, depth)
        tree, parent = Tree(), -1
        for d, g in enumerate(greedy, start=1):
            good = g if float(torch.rand((), generator=self.rng)) > 0.3 else (g + 1) % 384
            other = int(torch.randint(0, 384, (1,), generator=self.rng))
            if other == good:
                other = (other + 7) % 384
            for tok, score in ((other, -2.0 * d), (good, -1.0 * d)):
                tree.tokens.append(tok)
                tree.parents.append(parent)
                tree.depths.append(d)
                tree.scores.append(score)
            parent = len(tree) - 1
        return Proposal([[]], tree=tree)


def test_greedy_trees_with_long_accepted_paths(tiny64):
    g = torch.Generator().manual_seed(11)
    rounds = []
    for trial in range(3):
        prompt = torch.randint(5, 380, (8,), generator=g).tolist()
        (r,) = decode(
            HFTarget(tiny64),
            OracleTreeDraft(tiny64, trial),
            [prompt],
            SamplingParams(),
            0,
            30,
            tree=TreeSpec(depth=4, top_k=2, total=8),
        )
        assert r.tokens == _ex.plain_greedy(tiny64, prompt, 30)
        rounds += r.rounds
    assert sum(a for _, a in rounds) / len(rounds) > 1.0  # paths of several nodes were accepted and gathered
