"""Drafters as the decoding engine sees them: propose up to k tokens (with the distributions they were
sampled from), then learn what the target committed.

- `NoDraft`: plain decoding (τ = 1 by construction).
- `PromptLookup`: the no-training baseline: continue the longest recent n-gram match from the context.
- `Eagle3Proposer`: a trained EAGLE-3 drafter with its own KV cache, fed the target's aux features of every
  verified position and rolled back after rejections; optional adaptive draft length from its confidence head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.drafters.vocab import draft_to_target_ids
from draftsmith.eval.sampling import SamplingParams, probs_from_logits, sample


class NoDraft:
    name = "none"
    needs_features = False

    def start(self, prompt: Sequence[int], first: int, feats) -> None:
        pass

    def propose(
        self, history: Sequence[int], k: int, params: SamplingParams, gen
    ) -> tuple[list[int], torch.Tensor | None, list[float]]:
        return [], None, []

    def commit(self, drafts: Sequence[int], n: int, new: int, feats) -> None:
        pass


class PromptLookup(NoDraft):
    """Deterministic proposals (q is one-hot on the drafted token), as in prompt-lookup decoding."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history, k, params, gen):
        seq = list(history)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            # most recent earlier occurrence of the last n tokens
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + k]
                    if follow:
                        return follow, None, []
        return [], None, []


class TrainedProposer:
    """What proposers of trained drafters share: the draft->target vocabulary map and drawing one draft token."""

    needs_features = True

    def __init__(self, drafter, confidence_threshold: float | None = None):
        self.drafter = drafter.eval()
        self.device = next(drafter.parameters()).device
        self.ids = draft_to_target_ids(drafter.d2t).to(self.device)
        self.vocab = drafter.config.vocab_size
        self.threshold = confidence_threshold
        self.aux_ids = drafter.config.aux_layer_ids

    def _draw(self, logits: torch.Tensor, params: SamplingParams, gen) -> tuple[int, torch.Tensor | None]:
        """(target token id, the full-vocabulary q it was sampled from; None when greedy) from draft-vocab logits."""
        if params.greedy:
            return int(self.ids[logits.argmax()]), None
        qd = probs_from_logits(logits, params)
        q = torch.zeros(self.vocab, device=self.device, dtype=qd.dtype)
        q[self.ids] = qd
        return sample(q, gen), q


class Eagle3Proposer(TrainedProposer):
    name = "eagle3"

    def _extend(self, feats: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """Append step-0 entries (target features of verified positions + the tokens that follow them)."""
        n = len(next_tokens)
        pos = torch.arange(self.ctx, self.ctx + n, device=self.device).unsqueeze(0)
        toks = torch.tensor([list(next_tokens)], device=self.device)
        logits, conf, h = self.drafter.decode(
            feats.unsqueeze(0).to(self.device), toks, pos, self.cache, from_target=True
        )
        self.ctx += n
        self.last = (logits[0, -1], conf[0, -1], h[:, -1:])

    @torch.no_grad()
    def start(self, prompt, first, feats):
        self.cache = self.drafter.new_cache()
        self.ctx = 0
        self._extend(feats, list(prompt[1:]) + [first])

    @torch.no_grad()
    def propose(self, history, k, params, gen):
        logits, conf, h = self.last
        drafts, qs, confs = [], [], []
        survival = 1.0
        for i in range(k):
            c = float(torch.sigmoid(conf))
            # adaptive length: whether to draft position i uses only what precedes it (non-anticipating)
            if self.threshold is not None and i > 0 and survival * c < self.threshold:
                break
            survival *= c
            x, q = self._draw(logits, params, gen)
            if q is not None:
                qs.append(q)
            drafts.append(x)
            confs.append(c)
            if i + 1 < k:
                tok = torch.tensor([[x]], device=self.device)
                pos = torch.tensor([[self.ctx + i]], device=self.device)
                out, cf, h = self.drafter.decode(h, tok, pos, self.cache, from_target=False)
                logits, conf = out[0, 0], cf[0, 0]
        return drafts, (torch.stack(qs) if qs else None), confs

    @torch.no_grad()
    def commit(self, drafts, n, new, feats):
        self.cache.crop(self.ctx)  # drop the entries of this round's drafting steps
        self._extend(feats, list(drafts[:n]) + [new])

    @torch.no_grad()
    def propose_tree(self, depth: int, top_k: int, total: int):
        """EAGLE-2-style dynamic tree: top-k children per expanded node, the top-k frontier nodes (by cumulative
        draft log-probability) expanded at each depth, then the best `total` nodes kept."""
        from draftsmith.eval.tree import Tree, prune

        tree = Tree()
        logits, _, h_root = self.last
        logp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(logp, min(top_k, logp.numel()))
        for lp, d in zip(top.values.tolist(), top.indices.tolist()):
            tree.tokens.append(int(self.ids[d]))
            tree.parents.append(-1)
            tree.depths.append(1)
            tree.scores.append(lp)
        outputs: dict[int, torch.Tensor] = {-1: h_root}
        entry: dict[int, int] = {}  # node -> its slot in the drafter cache
        for d in range(1, depth):
            frontier = [i for i in range(len(tree)) if tree.depths[i] == d]
            expand = sorted(frontier, key=lambda i: -tree.scores[i])[:top_k]
            past = self.cache.length()
            n = len(expand)
            mask = torch.zeros(n, past + n, dtype=torch.bool)
            mask[:, : self.ctx] = True  # the context (step-0 entries)
            for row, i in enumerate(expand):
                entry[i] = past + row
                for a in tree.ancestors(i):
                    if a in entry:
                        mask[row, entry[a]] = True
            hidden = torch.cat([outputs[tree.parents[i]] for i in expand], dim=1)
            toks = torch.tensor([[tree.tokens[i] for i in expand]], device=self.device)
            pos = torch.tensor([[self.ctx + d - 1] * n], device=self.device)
            out, _, h = self.drafter.decode(hidden, toks, pos, self.cache, from_target=False, attn_mask=mask)
            for row, i in enumerate(expand):
                outputs[i] = h[:, row : row + 1]
                lp_row = torch.log_softmax(out[0, row].float(), -1)
                top = torch.topk(lp_row, min(top_k, lp_row.numel()))
                for lp, c in zip(top.values.tolist(), top.indices.tolist()):
                    tree.tokens.append(int(self.ids[c]))
                    tree.parents.append(i)
                    tree.depths.append(d + 1)
                    tree.scores.append(tree.scores[i] + lp)
        return prune(tree, total)

    @torch.no_grad()
    def commit_path(self, tokens: list[int], new: int, feats):
        """After tree verification: the accepted path's tokens and the target's features of root + path."""
        self.cache.crop(self.ctx)
        self._extend(feats, list(tokens) + [new])


class DSparkProposer(TrainedProposer):
    """A DSpark-style block drafter: one backbone pass per round drafts the block, then tokens are sampled left
    to right from the logits plus the sequential bias of the token just sampled. The context keys/values come
    from the target's features of verified positions and are appended after each round (never rolled back:
    only verified positions enter them). q is the biased distribution each token was actually sampled from.

    Adaptive length: the calibrated confidence of position i reads the block state and the token at position
    i-1, never x_i; drafting stops before position i when the running survival would fall below the threshold,
    so whether x_i is verified does not depend on x_i (non-anticipating)."""

    name = "dspark"

    def __init__(self, drafter, confidence_threshold: float | None = None, draft_length: int | None = None):
        super().__init__(drafter, confidence_threshold)
        self.block = drafter.config.block_size
        self.length = min(draft_length or self.block, self.block)

    def _extend(self, feats: torch.Tensor) -> None:
        n = feats.shape[0]
        pos = torch.arange(self.ctx, self.ctx + n, device=self.device).unsqueeze(0)
        self.drafter.extend_context(self.cache, feats.unsqueeze(0).to(self.device), pos)
        self.ctx += n

    @torch.no_grad()
    def start(self, prompt, first, feats):
        self.cache = self.drafter.new_cache()
        self.ctx = 0
        self._extend(feats)  # the prompt's positions; the anchor is `first`, at position len(prompt)
        self.anchor = first

    @torch.no_grad()
    def propose(self, history, k, params, gen):
        k = min(k, self.length)
        h, base = self.drafter.draft_block(
            self.cache, torch.tensor([self.anchor], device=self.device), torch.tensor([self.ctx], device=self.device)
        )
        drafts, qs, confs = [], [], []
        survival = 1.0
        prev = self.anchor
        for i in range(k):
            logits, conf = self.drafter.heads(h[:, i], torch.tensor([prev], device=self.device), base[:, i])
            c = float(self.drafter.calibrated(conf[0], i))
            if self.threshold is not None and i > 0 and survival * c < self.threshold:
                break
            survival *= c
            x, q = self._draw(logits[0], params, gen)
            if q is not None:
                qs.append(q)
            drafts.append(x)
            confs.append(c)
            prev = x
        return drafts, (torch.stack(qs) if qs else None), confs

    @torch.no_grad()
    def commit(self, drafts, n, new, feats):
        self._extend(feats)  # the old anchor and the n accepted drafts are now verified positions
        self.anchor = new


PROPOSERS = {"eagle3": Eagle3Proposer, "dspark": DSparkProposer}
"""The proposer of each trained drafter family."""
