"""Batched speculative decoding: several prompts per round, each with its own accepted length.

Rows advance at different speeds, so caches are not cropped: every round appends the same number of slots
to every row, and a row's padding and rejected drafts stay in its cache as masked holes. A 2-D key mask
plus explicit position ids (the row's true positions) make each row compute exactly what it would alone.
Rows that have finished keep feeding a dummy token, and their outputs are ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from draftsmith.data.features import AuxHooks, decoder_of
from draftsmith.drafters.vocab import draft_to_target_ids
from draftsmith.eval.engine import DecodeResult, clock
from draftsmith.eval.sampling import SamplingParams, probs_from_logits, sample
from draftsmith.eval.sampling import one_hot as _one_hot
from draftsmith.eval.verify import end_round, greedy_verify, sampling_verify


class BatchedHFTarget:
    def __init__(self, model, aux_ids: Sequence[int] | None = None, pad_id: int = 0):
        from transformers import DynamicCache

        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.aux_ids = list(aux_ids) if aux_ids else []
        self.base = decoder_of(model)
        self._cache_cls = DynamicCache
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.passes = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor):
        hooks = AuxHooks(self.base, self.aux_ids)
        with hooks:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=self.key_mask.long().to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **{self._cache_kw: self.cache},
            )
        self.passes += 1
        return out.logits.float(), (hooks.concat() if self.aux_ids else None)

    @torch.no_grad()  # not inference_mode: the key mask is edited in place between passes
    def prefill(self, prompts: Sequence[Sequence[int]]):
        """Left-padded prefill. Returns (logits [B,P,V], feats [B,P,F] or None, valid [B,P])."""
        try:
            self.cache = self._cache_cls(config=self.model.config)
        except TypeError:
            self.cache = self._cache_cls()
        self.passes = 0
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(list(p))
            valid[b, width - len(p) :] = True
        self.key_mask = valid.clone()
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        self.next_pos = torch.tensor([len(p) for p in prompts])
        logits, feats = self._forward(ids, positions)
        return logits, feats, valid

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, valid: torch.Tensor):
        """Append n slots per row (tokens [B,n], valid [B,n]) and run one pass; positions continue each row's own."""
        self.key_mask = torch.cat([self.key_mask, valid], dim=1)
        positions = self.next_pos[:, None] + torch.arange(tokens.shape[1])[None, :]
        return self._forward(tokens, positions)

    def keep(self, b: int, n_new: int, kept: int) -> None:
        """Of the last `n_new` slots of row b, keep the first `kept` (the rest become holes)."""
        total = self.key_mask.shape[1]
        self.key_mask[b, total - n_new + kept :] = False
        self.next_pos[b] += kept


class BatchedDrafting:
    """What batched drafting of trained drafters shares: the draft->target vocabulary map and drawing one token
    per row."""

    def __init__(self, drafter):
        self.drafter = drafter.eval()
        self.device = next(drafter.parameters()).device
        self.ids = draft_to_target_ids(drafter.d2t).to(self.device)
        self.vocab = drafter.config.vocab_size
        self.aux_ids = drafter.config.aux_layer_ids

    def _draw(self, logits: torch.Tensor, params: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(target token ids [B] on the CPU, the full-vocabulary q [B, V] they were sampled from; None when greedy)
        from draft-vocab logits [B, D]."""
        if params.greedy:
            return self.ids[logits.argmax(-1)].cpu(), None
        qd = probs_from_logits(logits, params)
        q = torch.zeros(logits.shape[0], self.vocab, dtype=qd.dtype, device=self.device)
        q[:, self.ids] = qd
        return torch.tensor([sample(q[b], gen) for b in range(logits.shape[0])]), q


class BatchedEagle3(BatchedDrafting):
    """EAGLE-3 drafting for a batch, with the drafter cache kept like the target's (holes + key mask)."""

    def _extend(self, feats, tokens, valid, positions):
        self.key_mask = torch.cat([self.key_mask, valid.to(self.device)], dim=1)
        logits, conf, h = self.drafter.decode(
            feats.to(self.device),
            tokens.to(self.device),
            positions.to(self.device),
            self.cache,
            from_target=True,
            key_mask=self.key_mask,
        )
        return logits, conf, h

    @torch.no_grad()
    def start(self, prompts, firsts, feats, valid):
        B, P = valid.shape
        self.cache = self.drafter.new_cache()
        self.key_mask = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        nxt = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            nxt[b, P - len(p) :] = torch.tensor(list(p[1:]) + [firsts[b]])
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)
        logits, conf, h = self._extend(feats, nxt, valid, positions)
        self.pos = torch.tensor([len(p) for p in prompts])  # next step-0 position per row
        self.last = (logits[:, -1], conf[:, -1], h[:, -1:])

    @torch.no_grad()
    def propose(self, k: int, params: SamplingParams, gen):
        logits, conf, h = self.last
        B = logits.shape[0]
        drafts = torch.zeros(B, k, dtype=torch.long)
        confs = torch.zeros(B, k, dtype=torch.float64)  # as the one-prompt proposers keep them (Python floats)
        qs = []
        self.round_start = self.key_mask.shape[1]
        for i in range(k):
            x, q = self._draw(logits, params, gen)
            if q is not None:
                qs.append(q)
            drafts[:, i] = x
            confs[:, i] = torch.sigmoid(conf).double().cpu()
            if i + 1 < k:
                self.key_mask = torch.cat([self.key_mask, torch.ones(B, 1, dtype=torch.bool, device=self.device)], 1)
                out, cf, h = self.drafter.decode(
                    h,
                    x[:, None].to(self.device),
                    (self.pos + i)[:, None].to(self.device),
                    self.cache,
                    from_target=False,
                    key_mask=self.key_mask,
                )
                logits, conf = out[:, 0], cf[:, 0]
        return drafts, (torch.stack(qs, 1) if qs else None), confs

    @torch.no_grad()
    def commit(self, drafts: torch.Tensor, accepted: list[int], news: list[int], feats: torch.Tensor):
        """feats [B, k+1, F]: target features of this round's verified slots; row b keeps 1 + accepted[b]."""
        self.cache.crop(self.round_start)
        self.key_mask = self.key_mask[:, : self.round_start]
        B, k1 = feats.shape[:2]
        toks = torch.zeros(B, k1, dtype=torch.long)
        valid = torch.zeros(B, k1, dtype=torch.bool)
        for b in range(B):
            n = accepted[b]
            toks[b, : n + 1] = torch.tensor(drafts[b, :n].tolist() + [news[b]])
            valid[b, : n + 1] = True
        positions = self.pos[:, None] + torch.arange(k1)[None, :]
        logits, conf, h = self._extend(feats, toks, valid, positions)
        idx = torch.tensor(accepted, device=self.device)
        rows = torch.arange(B, device=self.device)
        self.last = (logits[rows, idx], conf[rows, idx], h[rows, idx].unsqueeze(1))
        self.pos += torch.tensor(accepted) + 1


class BatchedDSpark(BatchedDrafting):
    """DSpark drafting for a batch. Each row's context keys/values are appended from the target's features of
    every slot of a round, like the target's cache: the row's padding and its rejected slots stay as masked holes,
    so a row drafts exactly what it would alone. A round drafts min(k, block size) tokens per row."""

    def _extend(self, feats, valid, positions):
        self.drafter.extend_context(self.cache, feats.to(self.device), positions.to(self.device))
        self.key_mask = torch.cat([self.key_mask, valid.to(self.device)], dim=1)

    @torch.no_grad()
    def start(self, prompts, firsts, feats, valid):
        """The prompts' (left-padded) positions become context; each row's anchor is its first token."""
        self.cache = self.drafter.new_cache()
        self.key_mask = torch.zeros(valid.shape[0], 0, dtype=torch.bool, device=self.device)
        self._extend(feats, valid, (valid.long().cumsum(1) - 1).clamp_min(0))
        self.pos = torch.tensor([len(p) for p in prompts])  # anchor position per row
        self.anchor = torch.tensor(list(firsts))

    @torch.no_grad()
    def propose(self, k: int, params: SamplingParams, gen):
        k = min(k, self.drafter.config.block_size)
        h, base = self.drafter.draft_block(
            self.cache, self.anchor.to(self.device), self.pos.to(self.device), context_mask=self.key_mask
        )
        B = h.shape[0]
        drafts = torch.zeros(B, k, dtype=torch.long)
        confs = torch.zeros(B, k, dtype=torch.float64)  # as the one-prompt proposers keep them (Python floats)
        qs = []
        prev = self.anchor.to(self.device)
        for i in range(k):
            logits, conf = self.drafter.heads(h[:, i], prev, base[:, i])
            x, q = self._draw(logits, params, gen)
            if q is not None:
                qs.append(q)
            drafts[:, i] = x
            confs[:, i] = self.drafter.calibrated(conf, i).cpu()
            prev = x.to(self.device)
        return drafts, (torch.stack(qs, 1) if qs else None), confs

    @torch.no_grad()
    def commit(self, drafts: torch.Tensor, accepted: list[int], news: list[int], feats: torch.Tensor):
        """feats [B, k+1, F]: target features of this round's slots (the anchor, then the drafts); row b's first
        1 + accepted[b] are verified and become context, the rest holes. The new anchors are `news`."""
        k1 = feats.shape[1]
        valid = torch.arange(k1)[None, :] < (torch.tensor(accepted) + 1)[:, None]
        self._extend(feats, valid, self.pos[:, None] + torch.arange(k1)[None, :])
        self.pos += torch.tensor(accepted) + 1
        self.anchor = torch.tensor(list(news))


BATCHED_DRAFTERS = {"eagle3": BatchedEagle3, "dspark": BatchedDSpark}
"""The batched drafting of each trained drafter family."""


def _prompt_lookup(history: Sequence[int], k: int, max_ngram: int) -> list[int]:
    from draftsmith.eval.proposers import PromptLookup

    return PromptLookup(max_ngram).propose(history, k, None, None)[0]


def adaptive_lengths(confs: torch.Tensor, threshold: float | None) -> list[int]:
    """Per row of confidences [B, k]: how many drafts to keep under adaptive length. Position i >= 1 is dropped, with
    all after it, once the running survival c_0 * ... * c_i falls below the threshold; c_i is read before x_i is
    drawn, so keeping x_i never depends on x_i (the one-prompt proposers' rule). None: keep all k."""
    B, k = confs.shape
    if threshold is None:
        return [k] * B
    below = torch.cumprod(confs.double(), dim=1) < threshold
    below[:, 0] = False  # the first draft is always proposed
    return [int(row.nonzero()[0]) if row.any() else k for row in below]


def decode_batch(
    model,
    prompts: Sequence[Sequence[int]],
    kind: str,
    params: SamplingParams,
    gamma: int,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    drafter=None,
    pad_id: int = 0,
    max_ngram: int = 3,
    confidence_threshold: float | None = None,
) -> list[DecodeResult]:
    """Decode a batch of prompts with `kind` in none | prompt_lookup | eagle3 | dspark (the last two need `drafter`).
    `gamma` is the chain length; a DSpark drafter drafts min(gamma, its block size). With `confidence_threshold`,
    each row of a trained drafter keeps its drafts only while their running confidence stays above it."""
    stops = set(stop_ids)
    if kind in BATCHED_DRAFTERS and drafter is None:
        raise ValueError(f"decode_batch(kind={kind!r}) needs the trained drafter")
    drafting = BATCHED_DRAFTERS[kind](drafter) if kind in BATCHED_DRAFTERS else None
    target = BatchedHFTarget(model, drafting.aux_ids if drafting else None, pad_id)
    device = target.device
    started = clock(device)
    draft_seconds = verify_seconds = 0.0
    logits, feats, valid = target.prefill(prompts)
    B = len(prompts)
    firsts = [
        int(logits[b, -1].argmax()) if params.greedy else sample(probs_from_logits(logits[b, -1], params), generator)
        for b in range(B)
    ]
    results = [DecodeResult(tokens=[f]) for f in firsts]
    history = [list(p) + [f] for p, f in zip(prompts, firsts)]
    active = [len(r.tokens) < max_new_tokens and r.tokens[-1] not in stops for r in results]
    if drafting:
        drafting.start(prompts, firsts, feats, valid)
    while any(active):
        t0 = clock(device)
        if drafting:
            dr, q, confs = drafting.propose(gamma, params, generator)
            # the whole batch drafts every position; a row's drafts past its adaptive length are dropped unverified
            keep = adaptive_lengths(confs, confidence_threshold)
            drafts = [dr[b, : keep[b]].tolist() if active[b] else [] for b in range(B)]
        elif kind == "prompt_lookup":
            drafts = [_prompt_lookup(history[b], gamma, max_ngram) if active[b] else [] for b in range(B)]
            q = None
        else:
            drafts, q = [[] for _ in range(B)], None
        k = max(len(d) for d in drafts)
        tokens = torch.full((B, k + 1), pad_id, dtype=torch.long)
        ok = torch.zeros(B, k + 1, dtype=torch.bool)
        for b in range(B):
            row = [history[b][-1]] + drafts[b]
            tokens[b, : len(row)] = torch.tensor(row)
            ok[b, : len(row)] = True
        t1 = clock(device)
        logits, feats = target.step(tokens, ok)
        accepted, news = [], []
        for b in range(B):
            d = drafts[b]
            if params.greedy:
                n, new = greedy_verify(d, logits[b, : len(d) + 1])
            else:
                p = probs_from_logits(logits[b, : len(d) + 1], params)
                qb = q[b, : len(d)] if q is not None else _one_hot(d, p.shape[-1], p.device)
                n, new = sampling_verify(d, qb, p, generator)
            target.keep(b, k + 1, n + 1 if active[b] else 1)
            accepted.append(n if active[b] else 0)
            news.append(new)
            if active[b]:
                committed, drafted, kept, stopped = end_round(d, n, new, stops)
                results[b].tokens += committed
                history[b] += committed
                results[b].rounds.append((drafted, kept))
                results[b].confidences.append(confs[b, :drafted].tolist() if drafting else [])
                active[b] = len(results[b].tokens) < max_new_tokens and not stopped
            else:
                history[b].append(history[b][-1])  # the dummy token a finished row keeps feeding
        t2 = clock(device)
        if drafting:
            drafting.commit(torch.tensor([d + [0] * (k - len(d)) for d in drafts]), accepted, news, feats)
        verify_seconds += t2 - t1
        draft_seconds += (t1 - t0) + (clock(device) - t2)
    seconds = clock(device) - started
    for r in results:
        cut = len(r.tokens)
        for i, t in enumerate(r.tokens[:max_new_tokens]):
            if t in stops:
                cut = i + 1
                break
        r.tokens = r.tokens[: min(cut, max_new_tokens)]
        r.target_passes = 1 + len(r.rounds)
        # the batch's rounds are shared by its rows: each row is charged an equal share
        r.seconds, r.draft_seconds, r.verify_seconds = seconds / B, draft_seconds / B, verify_seconds / B
    return results
