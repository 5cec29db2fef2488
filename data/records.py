"""Turning normalized conversations into tokenized records (the rows of prepare/generate shards)."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import Any

from draftsmith.data.chat import ChatTemplateError, tokenize_conversation

log = logging.getLogger(__name__)


def holdout_split(conv_id: str, fraction: float, seed: int = 0) -> str:
    """'holdout' for a stable `fraction` of ids (by hash, so independent of order and of other records)."""
    if fraction <= 0:
        return "train"
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "holdout" if u < fraction else "train"


def is_complete(conv: dict[str, Any]) -> bool:
    return all(m.get("content") is not None for m in conv["messages"])


def build_record(
    tokenizer, conv: dict[str, Any], split: str, max_length: int, overlong: str, counts: Counter
) -> dict[str, Any] | None:
    """A record with input_ids / loss_mask, or None (counted under the reason) when it cannot be used.

    Conversations whose assistant turns are still pending are kept as prompt-only records (no tokens):
    `generate` answers them.
    """
    base = {
        "id": conv["id"],
        "domain": conv["domain"],
        "source": conv["source"],
        "split": split,
        "messages": conv["messages"],
    }
    if not is_complete(conv):
        counts["prompt_only"] += 1
        return base | {"input_ids": [], "loss_mask": [], "num_tokens": 0, "num_supervised": 0, "truncated": False}
    try:
        tk = tokenize_conversation(tokenizer, conv["messages"])
    except ChatTemplateError as err:
        counts["template_error"] += 1
        if counts["template_error"] == 1:
            log.warning("skipping %s: %s (further template errors are only counted)", conv["id"], err)
        return None
    ids, mask, truncated = tk.input_ids, tk.loss_mask, False
    if len(ids) > max_length:
        if overlong == "skip":
            counts["overlong_skipped"] += 1
            return None
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if sum(mask) == 0:
        counts["no_supervised_tokens"] += 1
        return None
    if truncated:
        counts["truncated"] += 1
    counts["tokenized"] += 1
    return base | {
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_supervised": sum(mask),
        "truncated": truncated,
    }
