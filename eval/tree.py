"""Token trees: EAGLE-2-style dynamic drafting, tree verification (greedy and recursive rejection), and the
tree attention mask / depth-based positions the target verifies them with.

A tree's nodes are listed parents-first; node i has a token, a parent (-1: the root, i.e. the last committed
token), a depth (1 = a candidate for the next token) and a score (cumulative draft log-probability).
Candidates are chosen deterministically (top-k), so each is a one-hot proposal: recursive rejection accepts
child x with probability p(x) under the current residual, zeroes x and renormalizes on rejection, and samples
from what is left when every child is rejected. The emitted tokens are distributed exactly as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.eval.sampling import sample, uniform


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        """Children of node i (-1: root), best score first."""
        kids = [j for j, p in enumerate(self.parents) if p == i]
        return sorted(kids, key=lambda j: -self.scores[j])

    def ancestors(self, i: int) -> list[int]:
        """Nodes on the path from the root to i, i included, top first."""
        path = []
        while i != -1:
            path.append(i)
            i = self.parents[i]
        return path[::-1]


def prune(tree: Tree, total: int) -> Tree:
    """Keep the `total` best-scoring nodes plus their ancestors, parents first."""
    best = sorted(range(len(tree)), key=lambda i: -tree.scores[i])[:total]
    keep = sorted({a for i in best for a in tree.ancestors(i)}, key=lambda i: (tree.depths[i], -tree.scores[i]))
    index = {old: new for new, old in enumerate(keep)}
    return Tree(
        [tree.tokens[i] for i in keep],
        [index.get(tree.parents[i], -1) for i in keep],
        [tree.depths[i] for i in keep],
        [tree.scores[i] for i in keep],
    )


def tree_mask(tree: Tree, past: int) -> torch.Tensor:
    """[1+N, past+1+N] bool: row 0 is the root (the last committed token), row 1+i node i; each sees the cache,
    the root, its ancestors and itself."""
    n = len(tree)
    mask = torch.zeros(1 + n, past + 1 + n, dtype=torch.bool)
    mask[:, : past + 1] = True
    for i in range(n):
        for a in tree.ancestors(i):
            mask[1 + i, past + 1 + a] = True
    return mask


def greedy_tree_verify(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """(accepted node path, the target's next token). logits: [1+N, V], row 0 = root."""
    path: list[int] = []
    node = -1
    while True:
        choice = int(logits[0 if node == -1 else 1 + node].argmax())
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == choice), None)
        if nxt is None:
            return path, choice
        path.append(nxt)
        node = nxt


def sampling_tree_verify(tree: Tree, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Recursive rejection over siblings. p: [1+N, V] target distributions, row 0 = root."""
    path: list[int] = []
    node = -1
    while True:
        dist = p[0 if node == -1 else 1 + node].clone()
        accepted = None
        for child in tree.children(node):
            x = tree.tokens[child]
            if uniform(generator) < float(dist[x]):
                accepted = child
                break
            dist[x] = 0.0
            total = dist.sum()
            if total <= 0:
                break
            dist = dist / total
        if accepted is None:
            return path, sample(dist, generator)
        path.append(accepted)
        node = accepted
