"""The trainer's store of the teacher's full-vocabulary statistics, kept between epochs.

At every position the teacher needs the target's argmax over its whole vocabulary and, at temperature > 0, the
normalizer of its softmax: a [positions, V] product per micro-batch, which for a 49k-vocabulary target costs more than
the drafter's own step (docs/benchmarks.md). Both depend only on the record (its tokens, the target's final states over
them) and the temperature, and the records repeat every epoch and at every holdout evaluation. So the trainer computes
them the first time it meets a record and keeps two numbers per token (8 bytes) on the training device; the objective
then computes only the draft-vocab columns (`drafters.losses.teacher_from_final` with `known`). Nothing in the field's
libraries does this; it is written here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.drafters.losses import FullVocabStats, full_vocab_stats

RecordKey = tuple[str, int, str]
"""(record id, positions kept, digest of those positions' token ids)."""


def record_keys(batch: dict[str, Any]) -> list[RecordKey] | None:
    """The key of each row of a batch, read on the host (where a loader calls it, before any copy to the device);
    None for a batch whose tokens are not on the host (reading them would wait for the device: no cache then).

    A row's positions are those up to its last attended one (right padding is not part of the record). The digest of
    their token ids makes a key that matches only the same tokens under the same id."""
    input_ids, attention = batch["input_ids"], batch["attention_mask"]
    if input_ids.device.type != "cpu" or attention.device.type != "cpu":
        return None
    keys = []
    for sid, ids, mask in zip(batch["ids"], input_ids, attention.bool()):
        attended = mask.nonzero()
        length = int(attended[-1, 0]) + 1 if len(attended) else 0
        digest = hashlib.blake2b(ids[:length].to(torch.int64).numpy().tobytes(), digest_size=16).hexdigest()
        keys.append((str(sid), length, digest))
    return keys


@dataclass
class _Entry:
    argmax: torch.Tensor
    """[L] int32."""
    lse: torch.Tensor | None
    """[L] fp32, None at temperature 0."""


class TeacherCache:
    """The full-vocabulary statistics of the records met so far, on the device of `head_weight`, up to
    `capacity_tokens` positions (past it, the records not kept are computed again each time they come)."""

    def __init__(self, head_weight: torch.Tensor, temperature: float, capacity_tokens: int):
        self.head_weight, self.temperature, self.capacity = head_weight, temperature, capacity_tokens
        self._entries: dict[RecordKey, _Entry] = {}
        self.tokens = 0
        """Positions kept."""
        self.computed = 0
        """Rows whose statistics were computed (not found)."""
        self.served = 0
        """Rows served from the cache."""

    def fill(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch with `teacher_argmax` [B, T] (int32) and, at temperature > 0, `teacher_lse` [B, T] (fp32) on
        the device: computed for the rows not kept yet, read for the others. Past a row's last attended position the
        argmax is 0 and the logsumexp +inf (a probability of 0), found or computed alike, so a record's teacher does
        not depend on which batch computed it. When the cache is off or the batch has no keys: a copy of the batch as
        it came (the objective computes its teacher whole)."""
        keys = batch.get("record_keys")
        if self.capacity <= 0 or keys is None:
            return dict(batch)
        device = self.head_weight.device
        final = batch["final"]
        B, T = final.shape[:2]
        # the rows not kept, computed a run of neighbouring rows at a time: slices, no index tensor to copy to the
        # device (the step reads nothing from the device and waits for no copy)
        fresh: dict[int, tuple[FullVocabStats, int]] = {}
        missing = [b for b, key in enumerate(keys) if key not in self._entries]
        for run in _runs(missing):
            stats = full_vocab_stats(final[run[0] : run[-1] + 1].to(device), self.head_weight, self.temperature)
            fresh.update({b: (stats, b - run[0]) for b in run})
        greedy = self.temperature <= 0
        argmax = torch.zeros((B, T), dtype=torch.int32, device=device)
        lse = None if greedy else torch.full((B, T), float("inf"), device=device)
        for b, key in enumerate(keys):
            length = key[1]
            entry = self._entries.get(key)
            if entry is None:
                stats, row = fresh[b]
                entry = _Entry(
                    stats.argmax[row, :length].to(torch.int32),
                    None if stats.lse is None else stats.lse[row, :length].clone(),
                )
                self.computed += 1
                if self.tokens + length <= self.capacity:  # (a row repeated in the batch is served, stored once)
                    self._entries[key] = entry
                    self.tokens += length
            else:
                self.served += 1
            argmax[b, :length] = entry.argmax
            if lse is not None:
                assert entry.lse is not None
                lse[b, :length] = entry.lse
        out = {**batch, "teacher_argmax": argmax}
        if lse is not None:
            out["teacher_lse"] = lse
        return out

    def summary(self) -> dict[str, int]:
        """Figures for the manifest: records and positions kept, rows computed and served."""
        return {
            "records": len(self._entries),
            "tokens": self.tokens,
            "capacity_tokens": self.capacity,
            "rows_computed": self.computed,
            "rows_served": self.served,
        }


def _runs(rows: list[int]) -> list[list[int]]:
    """Ascending row numbers grouped into runs of consecutive ones: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for b in rows:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
