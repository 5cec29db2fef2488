"""Drafters as the decoding engine sees them: each round, propose up to k tokens for every row of the batch (with
the distributions they were sampled from), then learn what the target committed.

- `NoDraft`: plain decoding (τ = 1 by construction).
- `PromptLookup`: the no-training baseline: continue the longest recent n-gram match from the row's context.
- `Eagle3Proposer`: a trained EAGLE-3 drafter with its own KV cache, fed the target's aux features of every
  verified position; chains for any batch, and EAGLE-2-style dynamic trees for one row.
- `DSparkProposer`: a DSpark-style block drafter: one backbone pass per round drafts the block.

A proposer of a trained drafter keeps its cache like the target's (`eval.runner`): one entry per slot of every row,
the slots a row did not keep masked as holes, so each row drafts exactly what it would alone.

Adaptive length: whether a row drafts position i is decided from the drafter's confidence c_i, which is read before
x_i is drawn, and the running survival c_0 * ... * c_{i-1}. With `confidence_threshold`, position i >= 1 is dropped,
with all after it, once c_0 * ... * c_i falls below the threshold; with a `schedule` (`eval.schedule`), positions
are admitted while they raise the expected tokens per second of the round (eval.schedule.CostSchedule). Keeping x_i therefore never depends on x_i
(non-anticipating), and the emitted tokens stay distributed exactly as the target's. A row draws its tokens from its
own generator, and only for the positions it drafts, so a row's sampled output does not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.drafters.vocab import draft_to_target_ids
from draftsmith.eval.cpu_linear import use_cpu_linears
from draftsmith.eval.sampling import SamplingParams, probs_from_logits, sample
from draftsmith.eval.schedule import CostSchedule, CostTable
from draftsmith.eval.tree import Tree, prune


@dataclass
class Proposal:
    """One round's drafts for every row."""

    drafts: list[list[int]]
    """Per row, the drafted tokens (empty: the row drafts nothing this round)."""
    q: torch.Tensor | None = None
    """[B, k, V]: row b's first len(drafts[b]) rows are the full-vocabulary distributions its drafts were sampled
    from; None when the drafts are deterministic (greedy, prompt lookup): q is then one-hot on each draft."""
    confidences: list[list[float]] | None = None
    """Per row, the drafter's confidence of each drafted position (None: the drafter has none)."""
    tree: Tree | None = None
    """A token tree instead of chains (one row)."""


class NoDraft:
    name = "none"
    aux_ids: list[int] = []
    """Target layers whose features the proposer reads (none)."""

    def start(self, prompts: Sequence[Sequence[int]], firsts: Sequence[int], feats, valid) -> None:
        pass

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        active: Sequence[bool],
        k: int,
        params: SamplingParams,
        generators: Sequence[torch.Generator | None],
    ) -> Proposal:
        return Proposal([[] for _ in histories])

    def commit(self, drafts: Sequence[Sequence[int]], accepted: Sequence[int], news: Sequence[int], feats) -> None:
        pass

    def observe(self, proposal: Proposal, accepted: Sequence[int]) -> None:
        """A chain proposal's verification: how many of each row's drafts were accepted (for a schedule that learns
        from it)."""

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        """What the round just finished cost, by the engine's timers: its target pass (with the acceptance rule) and
        its drafting (proposing, and the update with what was verified), for a schedule that learns from it."""


class PromptLookup(NoDraft):
    """Deterministic proposals (q is one-hot on the drafted token), as in prompt-lookup decoding."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching tail n-gram."""
        seq = list(history)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + k]
                    if follow:
                        return follow
        return []

    def propose(self, histories, active, k, params, generators):
        return Proposal([self.lookup(h, k) if a else [] for h, a in zip(histories, active)])


class TrainedProposer(NoDraft):
    """What proposers of trained drafters share: the draft->target vocabulary map, drawing one token per row, the
    adaptive-length rule, and the key mask over the drafter's cache."""

    key_mask: torch.Tensor
    """[B, cache slots]: the drafter cache's valid slots per row (set by `start`)."""
    next_pos: list[int]
    """Each row's next position (set by `start`). Plain Python, like `pending`: it moves every round, drafted or not,
    and a round the schedule skips should cost what a plain step costs (a few torch ops per round cost 0.1-0.3% of a
    135M target's pass on a CPU, timed inside the decode)."""

    greedy_drafts: bool = False
    """Whether drafts are the drafter's argmax where the target samples too, verified as a one-hot q
    (eval.draft_sample_method = greedy), rather than drawn from its distribution."""
    schedule: CostSchedule | None = None
    """The cost-based admission rule (set by eval; None: the threshold rule, or fixed lengths)."""
    cost_schedule: CostSchedule | None = None
    """The last cost schedule `use` made, kept while another rule is in use."""
    prompt: tuple[torch.Tensor, ...] | None = None
    """The prompts' slots, until the drafter first runs over them (`_sync`; set by `start`)."""
    pending: list[tuple[torch.Tensor, list[list[int]], list[int]]]
    """Verified slots of rounds the drafter has not run over yet, as `commit` keeps them (`_pending_slots`)."""
    c0: list[float]
    """Per row, its first-slot confidence of the last round it drafted (what the schedule predicts from; NaN for a
    row that has not drafted yet)."""

    def __init__(self, drafter, confidence_threshold: float | None = None, draft_sample_method: str = "probabilistic"):
        if draft_sample_method not in ("probabilistic", "greedy"):
            raise ValueError(f"unknown draft_sample_method {draft_sample_method!r}: probabilistic or greedy")
        self.greedy_drafts = draft_sample_method == "greedy"
        self.drafter = drafter.eval()
        self.device = next(drafter.parameters()).device
        if self.device.type == "cpu":  # decoding's few-row products by torch's fast CPU path (eval.cpu_linear)
            use_cpu_linears(drafter)
        self.ids = draft_to_target_ids(drafter.d2t).to(self.device)
        self.vocab = drafter.config.vocab_size
        self.threshold = confidence_threshold
        self.aux_ids = list(drafter.config.aux_layer_ids)

    def use(self, mode: str, costs: CostTable | None = None, threshold: float | None = None) -> None:
        """The admission rule (eval.schedule): "fixed" (every active row drafts k), "threshold" (a row stops once its
        running survival falls below `threshold`) or "cost" (the cost schedule over `costs`)."""
        if mode == "cost" and costs is None:
            raise ValueError("the cost schedule needs a cost table")
        if mode == "threshold" and threshold is None:
            raise ValueError("the threshold rule needs eval.confidence_threshold")
        if mode not in ("fixed", "threshold", "cost"):
            raise ValueError(f"unknown schedule {mode!r}: fixed, threshold or cost")
        # one cost schedule per table, kept while other rules are used (the batch curve switches rules on one
        # proposer): switching back resumes what it learned (calibration, timings) instead of starting again
        self.schedule = None
        if mode == "cost" and costs is not None:
            if self.cost_schedule is None or self.cost_schedule.costs is not costs:
                self.cost_schedule = CostSchedule(costs)
            self.schedule = self.cost_schedule
        self.threshold = threshold if mode == "threshold" else None

    def _draw(self, logits: torch.Tensor, params: SamplingParams, generators, rows: torch.Tensor):
        """(target token ids [B] on the CPU, the full-vocabulary q [B, V] they were sampled from; None when they are
        the argmax: at T = 0, or with `greedy_drafts`, where the verifier reads q as one-hot on them) from draft-vocab
        logits [B, D]. Only the `rows` that draft this position draw (with their own generator); the others get token
        0, which nothing verifies."""
        if params.greedy or self.greedy_drafts:
            return self.ids[logits.argmax(-1)].cpu(), None
        qd = probs_from_logits(logits, params)
        q = torch.zeros(logits.shape[0], self.vocab, dtype=qd.dtype, device=self.device)
        q[:, self.ids] = qd
        # drawn over the draft vocabulary (8k where the target's is 49k: a shorter cumulative sum), then mapped
        tokens = [int(self.ids[sample(qd[b], generators[b])]) if rows[b] else 0 for b in range(logits.shape[0])]
        return torch.tensor(tokens), q

    def _admit(self, i: int, conf: torch.Tensor, survival: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """The rows that draft position i: those still drafting whose running survival with c_i (`conf` [B], read
        before x_i is drawn) stays at or above the threshold; position 0 is always drafted. With a schedule, the rows
        whose slot i raises the round's expected tokens per second."""
        if self.schedule is not None:
            return self.schedule.admit(i, conf, survival, drafting)
        if self.threshold is None or i == 0:
            return drafting
        return drafting & (survival * conf >= self.threshold)

    def _reset_schedule(self, rows: int) -> None:
        """A new decode of `rows` rows: no first-slot confidence seen yet (NaN: the schedule predicts a new row's
        first slot from the first slots drafted so far, `CostSchedule.first_slot_rate`)."""
        self.c0 = [math.nan] * rows
        if self.schedule is not None:
            self.schedule.reset()

    def observe(self, proposal: Proposal, accepted: Sequence[int]) -> None:
        if self.schedule is not None and proposal.confidences is not None:
            self.schedule.observe(proposal.confidences, list(accepted))

    def timed(self, verify_seconds: float, draft_seconds: float) -> None:
        if self.schedule is not None:
            self.schedule.timed(verify_seconds, draft_seconds)

    @property
    def pos(self) -> torch.Tensor:
        """[B] (CPU): each row's next position, as a tensor."""
        return torch.tensor(self.next_pos)

    def _keep_round(self, accepted: Sequence[int], rows: list[list[int]], feats: torch.Tensor) -> None:
        """Remember a verified round for the drafter's next update (`_unseen`): row b kept len(rows[b]) slots, from its
        next position on (`rows[b]`: the tokens the drafter reads with them, EAGLE-3's; a block drafter reads none).
        Kept as Python lists and a view of the features: a round the schedule skips builds no tensors."""
        self.pending.append((feats[:, : max(accepted) + 1], rows, self.next_pos))
        self.next_pos = [p + n + 1 for p, n in zip(self.next_pos, accepted)]

    def _unseen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The slots the drafter has not run over (the prompts, then every pending round, side by side), as (target
        features [B, n, F], tokens [B, n], valid [B, n], positions [B, n]) on the drafter's device, and forgets them;
        None when there are none. Tells the schedule when they are more than the last round's verified slots (a
        decode's prompt, or rounds skipped), so the drafter's time on them is counted as a catch-up."""
        if self.prompt is None and not self.pending:
            return None
        if self.schedule is not None and (self.prompt is not None or len(self.pending) > 1):
            self.schedule.catching_up()
        parts = [self.prompt] if self.prompt is not None else []
        if self.pending:
            parts.append(_pending_slots(self.pending))
        self.prompt, self.pending = None, []
        if len(parts) == 1:
            return tuple(x.to(self.device) for x in parts[0])  # type: ignore[return-value]
        return tuple(torch.cat([p[i] for p in parts], 1).to(self.device) for i in range(4))  # type: ignore[return-value]

    def _skip_round(self, active, params: SamplingParams) -> bool:
        """Whether this round drafts nothing at all (a plain target step, with no drafter work), decided by the
        schedule from the rows' first-slot confidences of earlier rounds: never from this round's drafts. The schedule
        is told the sampling first: what it learns is kept per sampling (`CostSchedule.regime`)."""
        if self.schedule is None:
            return False
        self.schedule.regime(params.regime)
        return not self.schedule.worth_drafting(self.c0, active)

    def _chain(self, k: int, active, params, generators, step) -> Proposal:
        """Draft up to k positions per active row. `step(i, tokens)` gives (draft-vocab logits [B, D], confidence
        [B] in [0, 1]) of position i, given the tokens drawn at position i - 1 (None for i = 0)."""
        B = len(active)
        drafting = torch.tensor(list(active), dtype=torch.bool)
        survival = torch.ones(B, dtype=torch.float64)
        drafts: list[list[int]] = [[] for _ in range(B)]
        confs: list[list[float]] = [[] for _ in range(B)]
        qs, x = [], None
        if len(getattr(self, "c0", ())) != B:  # a chain drafted without `start`
            self.c0 = [math.nan] * B
        if self.schedule is not None:
            self.schedule.begin(drafting)
        for i in range(k):
            if i > 0 and self.schedule is not None and self.schedule.halted:
                break  # decided from confidences up to slot i-1: another draft step cannot pay
            logits, conf = step(i, x)
            c = conf.double().cpu()
            if i == 0:  # what the schedule predicts the next rounds from
                self.c0 = [x if d else old for x, d, old in zip(c.tolist(), drafting.tolist(), self.c0)]
            drafting = self._admit(i, c, survival, drafting)
            if not drafting.any():
                break
            survival = torch.where(drafting, survival * c, survival)
            x, q = self._draw(logits, params, generators, drafting)
            if q is not None:
                qs.append(q)
            for b in drafting.nonzero().flatten().tolist():
                drafts[b].append(int(x[b]))
                confs[b].append(float(c[b]))
        return Proposal(drafts, torch.stack(qs, 1) if qs else None, confs)


class Eagle3Proposer(TrainedProposer):
    name = "eagle3"

    def _extend(self, feats, tokens, valid, positions, heads_at=None):
        """Append step-0 entries: target features of verified positions and the tokens that follow them."""
        self.key_mask = torch.cat([self.key_mask, valid.to(self.device)], dim=1)
        return self.drafter.decode(
            feats.to(self.device),
            tokens.to(self.device),
            positions.to(self.device),
            self.cache,
            from_target=True,
            key_mask=self.key_mask,
            heads_at=heads_at,
        )

    @torch.no_grad()
    def start(self, prompts, firsts, feats, valid):
        B, P = valid.shape
        self.cache = self.drafter.new_cache()
        self.key_mask = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        nxt = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            nxt[b, P - len(p) :] = torch.tensor(list(p[1:]) + [firsts[b]])
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.next_pos = [len(p) for p in prompts]  # next step-0 position per row
        # the prompts reach the drafter when it first drafts (`_sync`): a decode the schedule never drafts in costs
        # it nothing, not even this prefill; without a schedule, at once
        self.prompt, self.pending = (feats, nxt, valid, positions), []
        if self.schedule is None:
            self._sync()
        self._reset_schedule(B)

    def _sync(self) -> None:
        """Run the drafter over the verified slots it has not seen (rounds it skipped, then the last one), in one
        pass: the cache ends as if every round had been committed at once. Its last slot per row gives step 0."""
        unseen = self._unseen()
        if unseen is None:
            return
        feats, toks, valid, positions = unseen
        n = valid.shape[1]
        idx = (n - 1 - valid.flip(1).int().argmax(1)).to(self.device)  # each row's last verified slot
        logits, conf, h = self._extend(feats, toks, valid, positions, heads_at=idx)  # heads of that slot only
        rows = torch.arange(valid.shape[0], device=self.device)
        self.last = (logits[:, 0], conf[:, 0], h[rows, idx].unsqueeze(1))

    @torch.no_grad()
    def propose(self, histories, active, k, params, generators):
        self.round_start = self.key_mask.shape[1]
        if self._skip_round(active, params):
            return Proposal([[] for _ in histories])
        self._sync()
        self.round_start = self.key_mask.shape[1]
        state = {"h": self.last[2]}
        pos = self.pos

        def step(i, x):
            if i == 0:
                logits, conf = self.last[0], self.last[1]
            else:
                B = x.shape[0]
                self.key_mask = torch.cat([self.key_mask, torch.ones(B, 1, dtype=torch.bool, device=self.device)], 1)
                out, cf, state["h"] = self.drafter.decode(
                    state["h"],
                    x[:, None].to(self.device),
                    (pos + i - 1)[:, None].to(self.device),
                    self.cache,
                    from_target=False,
                    key_mask=self.key_mask,
                )
                logits, conf = out[:, 0], cf[:, 0]
            return logits, self.drafter.calibrated(conf, i, params.temperature, self.greedy_drafts)

        return self._chain(k, active, params, generators, step)

    @torch.no_grad()
    def propose_tree(self, depth: int, top_k: int, total: int) -> Proposal:
        """EAGLE-2-style dynamic tree (one row): top-k children per expanded node, the top-k frontier nodes (by
        cumulative draft log-probability) expanded at each depth, then the best `total` nodes kept."""
        if self.key_mask.shape[0] != 1:
            raise ValueError("tree drafting decodes one prompt at a time")
        self._sync()
        self.round_start = self.key_mask.shape[1]
        tree = Tree()
        logits, _, h_root = self.last
        logp = torch.log_softmax(logits[0].float(), -1)
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
            past, n = self.key_mask.shape[1], len(expand)
            mask = torch.zeros(n, past + n, dtype=torch.bool)
            mask[:, : self.round_start] = True  # the context (its holes are hidden by the key mask)
            for row, i in enumerate(expand):
                entry[i] = past + row
                for a in tree.ancestors(i):
                    if a in entry:
                        mask[row, entry[a]] = True
            self.key_mask = torch.cat([self.key_mask, torch.ones(1, n, dtype=torch.bool, device=self.device)], 1)
            hidden = torch.cat([outputs[tree.parents[i]] for i in expand], dim=1)
            toks = torch.tensor([[tree.tokens[i] for i in expand]], device=self.device)
            pos = torch.full((1, n), self.next_pos[0] + d - 1, device=self.device)
            out, _, h = self.drafter.decode(
                hidden, toks, pos, self.cache, from_target=False, key_mask=self.key_mask, attn_mask=mask
            )
            for row, i in enumerate(expand):
                outputs[i] = h[:, row : row + 1]
                lp_row = torch.log_softmax(out[0, row].float(), -1)
                top = torch.topk(lp_row, min(top_k, lp_row.numel()))
                for lp, c in zip(top.values.tolist(), top.indices.tolist()):
                    tree.tokens.append(int(self.ids[c]))
                    tree.parents.append(i)
                    tree.depths.append(d + 1)
                    tree.scores.append(tree.scores[i] + lp)
        return Proposal([[]], tree=prune(tree, total))

    @torch.no_grad()
    def commit(self, drafts, accepted, news, feats):
        """feats [B, n, F]: target features of this round's verified slots; row b's first 1 + accepted[b] are its
        verified ones (the last committed token, then its accepted drafts), after which row b drafts from `news`."""
        if self.key_mask.shape[1] > self.round_start:  # the round drafted: drop its drafting steps' entries
            self.cache.crop(self.round_start)
            self.key_mask = self.key_mask[:, : self.round_start]
        # row b's step-0 entries: each verified slot's features with the token that follows it (its accepted drafts,
        # then the token the target committed after them). With a schedule the drafter sees them when it next drafts
        # (`_sync`): a round that drafts nothing costs it nothing. Without one, at once (the same cache either way).
        self._keep_round(accepted, [list(d[:n]) + [new] for d, n, new in zip(drafts, accepted, news)], feats)
        if self.schedule is None:
            self._sync()


class DSparkProposer(TrainedProposer):
    """A DSpark-style block drafter: one backbone pass per round drafts the block, then tokens are sampled left to
    right from the logits plus the sequential bias of the token just sampled. The context keys/values come from the
    target's features of every slot of a round, the slots a row did not keep masked as holes. q is the biased
    distribution each token was actually sampled from; a round drafts min(k, draft_length) tokens per row.

    The calibrated confidence of position i reads the block state and the token at position i-1, never x_i."""

    name = "dspark"

    def __init__(
        self,
        drafter,
        confidence_threshold: float | None = None,
        draft_length: int | None = None,
        draft_sample_method: str = "probabilistic",
    ):
        super().__init__(drafter, confidence_threshold, draft_sample_method)
        self.block = drafter.config.block_size
        self.length = min(draft_length or self.block, self.block)

    def _extend(self, feats, valid, positions):
        self.drafter.extend_context(self.cache, feats.to(self.device), positions.to(self.device))
        self.key_mask = torch.cat([self.key_mask, valid.to(self.device)], dim=1)

    @torch.no_grad()
    def start(self, prompts, firsts, feats, valid):
        """The prompts' (left-padded) positions become context; each row's anchor is its first token."""
        self.cache = self.drafter.new_cache()
        self.key_mask = torch.zeros(valid.shape[0], 0, dtype=torch.bool, device=self.device)
        self.next_pos = [len(p) for p in prompts]  # anchor position per row
        self.anchors = list(firsts)
        # projected when the drafter first drafts (`_sync`), as EAGLE-3's prompt is; without a schedule, at once
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.prompt, self.pending = (feats, torch.zeros_like(positions), valid, positions), []
        if self.schedule is None:
            self._sync()
        self._reset_schedule(valid.shape[0])

    def _sync(self) -> None:
        """Project the verified slots the drafter has not seen into its context, in one pass."""
        unseen = self._unseen()
        if unseen is not None:
            feats, _, valid, positions = unseen  # a block drafter reads no tokens from its context
            self._extend(feats, valid, positions)

    @torch.no_grad()
    def propose(self, histories, active, k, params, generators):
        if self._skip_round(active, params):
            return Proposal([[] for _ in histories])
        self._sync()
        k = min(k, self.length)
        anchor = torch.tensor(self.anchors)
        h, base = self.drafter.draft_block(
            self.cache, anchor.to(self.device), self.pos.to(self.device), context_mask=self.key_mask
        )

        def step(i, x):
            prev = anchor if i == 0 else x
            logits, conf = self.drafter.heads(h[:, i], prev.to(self.device), base[:, i])
            return logits, self.drafter.calibrated(conf, i, params.temperature, self.greedy_drafts)

        return self._chain(k, active, params, generators, step)

    @torch.no_grad()
    def commit(self, drafts, accepted, news, feats):
        """Row b's first 1 + accepted[b] slots (the old anchor and its accepted drafts) become verified context, the
        rest holes; the new anchors are `news`."""
        # with a schedule, projected when the drafter next drafts (`_sync`); without, at once (the same context)
        self._keep_round(accepted, [[0] * (n + 1) for n in accepted], feats)
        if self.schedule is None:
            self._sync()
        self.anchors = list(news)


def _pending_slots(rounds: list[tuple[torch.Tensor, list[list[int]], list[int]]]):
    """Rounds kept by `TrainedProposer._keep_round` (per round: the target features of its slots [B, k, F], the tokens
    each row kept, each row's first position) as tensors, side by side: (features [B, n, F], tokens [B, n], valid
    [B, n], positions [B, n]); a row's slots past what it kept are holes (token 0, its positions counted on)."""
    B = len(rounds[0][1])
    tokens: list[list[int]] = [[] for _ in range(B)]
    valid: list[list[bool]] = [[] for _ in range(B)]
    positions: list[list[int]] = [[] for _ in range(B)]
    for feats, rows, starts in rounds:
        k = feats.shape[1]
        for b in range(B):
            kept = rows[b]
            tokens[b] += kept + [0] * (k - len(kept))
            valid[b] += [True] * len(kept) + [False] * (k - len(kept))
            positions[b] += range(starts[b], starts[b] + k)
    feats = rounds[0][0] if len(rounds) == 1 else torch.cat([r[0] for r in rounds], 1)
    return feats, torch.tensor(tokens), torch.tensor(valid), torch.tensor(positions)
