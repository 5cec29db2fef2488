"""Magpie-style prompt self-synthesis: the target continues its own chat template from the user-turn
header and writes a question; filters keep the usable ones.

Filters (each rejection is counted under its reason):
  unfinished   the model did not end the user turn within the token budget
  template     the text contains chat-template markup (the model wrote past its turn)
  too_short    fewer than `min_chars` characters after stripping
  repetitive   repeated word 3-grams exceed `max_repeat_fraction` of all 3-grams (degenerate loops)
  duplicate    same text as an earlier accepted prompt after case/space/punctuation normalization
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

_WORD = re.compile(r"\w+", re.UNICODE)


def normalize_for_dedup(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def repeat_fraction(text: str, n: int = 3) -> float:
    """Fraction of word n-grams that are repeats of an earlier n-gram in the same text."""
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def reject_reason(
    text: str, finished: bool, markers: Iterable[str], min_chars: int, max_repeat_fraction: float
) -> str | None:
    """Why a synthesized prompt is rejected, or None to keep it (duplicates are checked by `PromptFilter`)."""
    if not finished:
        return "unfinished"
    if any(m and m in text for m in markers):
        return "template"
    stripped = text.strip()
    if len(stripped) < min_chars:
        return "too_short"
    if repeat_fraction(stripped) > max_repeat_fraction:
        return "repetitive"
    return None


class PromptFilter:
    """Stateful filter over candidates in a fixed order; accepted prompts are unique."""

    def __init__(self, markers: Iterable[str], min_chars: int, max_repeat_fraction: float):
        self.markers = [m for m in markers if m]
        self.min_chars = min_chars
        self.max_repeat_fraction = max_repeat_fraction
        self.seen: set[str] = set()
        self.counts: Counter = Counter()

    def __call__(self, text: str, finished: bool) -> bool:
        self.counts["candidates"] += 1
        reason = reject_reason(text, finished, self.markers, self.min_chars, self.max_repeat_fraction)
        if reason is None:
            key = normalize_for_dedup(text)
            if key in self.seen:
                reason = "duplicate"
            else:
                self.seen.add(key)
        if reason is not None:
            self.counts[reason] += 1
            return False
        self.counts["accepted"] += 1
        return True
