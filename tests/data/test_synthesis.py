"""Self-synthesis filters: each rejection reason fires on the input it names and only on it."""

import pytest

from draftsmith.data.synthesis import PromptFilter, normalize_for_dedup, reject_reason, repeat_fraction

MARKERS = ["<|im_start|>", "<|im_end|>"]


def test_repeat_fraction():
    assert repeat_fraction("how do I sort a list in python") == 0.0
    loop = "the cat sat " * 10
    assert repeat_fraction(loop) > 0.8
    assert repeat_fraction("two words") == 0.0


@pytest.mark.parametrize(
    "text, finished, reason",
    [
        ("How do I reverse a linked list in Python?", True, None),
        ("How do I reverse a linked list in", False, "unfinished"),
        ("Tell me a joke<|im_end|>\n<|im_start|>assistant\nSure", True, "template"),
        ("Hi?", True, "too_short"),
        ("please please please help help help me me me " * 4, True, "repetitive"),
    ],
)
def test_reject_reasons(text, finished, reason):
    assert reject_reason(text, finished, MARKERS, min_chars=12, max_repeat_fraction=0.3) == reason


def test_duplicates_are_caught_after_normalization_and_counted():
    f = PromptFilter(MARKERS, min_chars=5, max_repeat_fraction=0.3)
    assert f("What is the capital of France?", True)
    assert not f("what is the capital of   france", True)  # case, spacing, punctuation differ only
    assert f("What is the capital of Spain?", True)
    assert not f("Hi", True)
    assert not f("What is the capital of Italy", False)
    assert dict(f.counts) == {"candidates": 5, "accepted": 2, "duplicate": 1, "too_short": 1, "unfinished": 1}
    assert normalize_for_dedup("A-b  C!") == "a b c"
