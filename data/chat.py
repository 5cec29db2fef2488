"""Chat-template rendering and the exact assistant-token loss mask.

transformers renders templates (`apply_chat_template`), but its assistant mask needs `{% generation %}`
tags that real templates (Llama-3, Qwen3, Mistral, SmolLM2) do not have. So the mask is computed here:
render the whole conversation once, locate each assistant message and the end-of-turn token right after
it, and tokenize the text piece by piece (template text / assistant span / template text / ...).

Tokenizing piece by piece is deliberate: it is exactly how the sequence exists at inference, where the
prompt is tokenized and the model appends its own tokens. When a turn's token ids are known (on-policy
generation stores them), they are used as they are, so training sees precisely what the target wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_SENTINEL = "\u2063DRAFTSMITH_SENTINEL\u2063"


class ChatTemplateError(ValueError):
    """The chat template cannot be used to build supervised sequences."""


def render(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja raises its own exception types (e.g. template-level raise_exception)
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


def _special_strings(tokenizer) -> dict[str, int]:
    """Added/special token strings -> ids (the candidates for an end-of-turn marker)."""
    return {s: i for s, i in tokenizer.get_added_vocab().items()}


def end_of_turn(tokenizer) -> tuple[str, int]:
    """The special token the template writes right after an assistant message (e.g. <|im_end|>, <|eot_id|>, </s>)."""
    cached = getattr(tokenizer, "_draftsmith_eot", None)
    if cached is not None and cached[0] == tokenizer.chat_template:
        return cached[1]
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok" + _SENTINEL}]
    text = render(tokenizer, probe)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ChatTemplateError("the chat template does not render assistant messages (no assistant turn)")
    after = text[at + len(_SENTINEL) :]
    for s, i in sorted(_special_strings(tokenizer).items(), key=lambda kv: -len(kv[0])):
        if s and after.startswith(s):
            tokenizer._draftsmith_eot = (tokenizer.chat_template, (s, i))  # keyed by template: it may be replaced
            return s, i
    raise ChatTemplateError(
        f"the chat template puts no special end-of-turn token right after an assistant message "
        f"(it continues with {after[:20]!r}); a drafter cannot learn where a turn ends"
    )


def user_header(tokenizer, system_prompt: str | None = None) -> str:
    """The rendered text up to where a user message's content starts (for Magpie-style self-synthesis)."""
    msgs = [{"role": "user", "content": _SENTINEL}]
    if system_prompt is not None:
        msgs.insert(0, {"role": "system", "content": system_prompt})
    text = render(tokenizer, msgs)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ChatTemplateError("the chat template does not render the user message content")
    return text[:at]


def encode_text(tokenizer, text: str) -> list[int]:
    # The template already wrote BOS and every other special token as text; add nothing.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    """1 where the token was written by the assistant (its content or its end-of-turn token)."""


def assistant_spans(
    tokenizer, messages: Sequence[dict[str, Any]], full: str, add_generation_prompt: bool = False
) -> list[tuple[int, int, int]]:
    """(message index, start, end) character spans of each assistant content + end-of-turn token in `full`.

    Where a message's content starts is found by rendering the same conversation with that content replaced
    by a sentinel: the text before the sentinel is exactly the text before the content. (Searching for the
    content string instead can latch onto the same words in a user turn or in template text such as
    Qwen3's `<think>` block.) Then the rendered form of the content is chosen among the transformations
    templates apply (none, trim, strip leading newlines) as the one followed by the end-of-turn token.
    """
    eot, _ = end_of_turn(tokenizer)
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        probe = [{"role": x["role"], "content": x["content"]} for x in messages]
        probe[i]["content"] = _SENTINEL
        text = render(tokenizer, probe, add_generation_prompt=add_generation_prompt)
        at = text.find(_SENTINEL)
        if at < cursor or not full.startswith(text[:at]):
            raise ChatTemplateError(
                f"assistant message {i}: the chat template renders the text before it differently depending on "
                f"its content, so its tokens cannot be located"
            )
        content = m["content"]
        variants = [content, content.strip(), content.lstrip("\n"), content.lstrip(), content.rstrip()]
        rendered = next(
            (
                v
                for v in dict.fromkeys(variants)
                if (v or not content.strip()) and full.startswith(v, at) and full.startswith(eot, at + len(v))
            ),
            None,
        )
        if rendered is None:
            raise ChatTemplateError(
                f"assistant message {i} is not rendered verbatim followed by {eot!r} by the chat template"
            )
        end = at + len(rendered) + len(eot)
        spans.append((i, at, end))
        cursor = end
    return spans


def tokenize_conversation(
    tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
) -> Tokenized:
    """Token ids + assistant loss mask of a conversation whose assistant turns all have content.

    A message may carry `token_ids` (what the target generated, without the end-of-turn token); those
    ids replace the re-tokenized content so the sequence is exactly the on-policy one.
    """
    for i, m in enumerate(messages):
        if m.get("content") is None:
            raise ChatTemplateError(f"message {i} ({m['role']}) has no content yet")
    full = render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    _, eot_id = end_of_turn(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for i, start, end in assistant_spans(tokenizer, messages, full, add_generation_prompt):
        head = encode_text(tokenizer, full[pos:start])
        ids += head
        mask += [0] * len(head)
        given = messages[i].get("token_ids")
        body = list(given) + [eot_id] if given is not None else encode_text(tokenizer, full[start:end])
        ids += body
        mask += [1] * len(body)
        pos = end
    tail = encode_text(tokenizer, full[pos:])
    ids += tail
    mask += [0] * len(tail)
    return Tokenized(ids, mask)


def prompt_ids(tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` followed by the generation prompt, built exactly as training sequences are."""
    return tokenize_conversation(tokenizer, messages, add_generation_prompt=True).input_ids


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Ids that end a generated turn: the template's end-of-turn token, EOS, and the model's own EOS list."""
    ids = [end_of_turn(tokenizer)[1]]
    candidates: list[Any] = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates.append(gen_eos)
    for c in candidates:
        for x in c if isinstance(c, (list, tuple)) else [c]:
            if x is not None and x not in ids:
                ids.append(int(x))
    return ids
