"""Assistant loss masks (data/chat.py) under the chat templates of real model families.

The Llama-3, Llama-3.1, Qwen3 and Mistral templates below are the plain-text parts (no tools, no
multimodal content) of the templates those models ship, written out by hand: for system/user/assistant
conversations of strings they render the same text the real ones do. Each one is attached to a fresh tiny
byte-level BPE tokenizer (which already has all of these families' special tokens), with bos/eos set as
the family's tokenizer sets them, because the real templates write `bos_token` / `eos_token`. ChatML is
checked twice: with the real SmolLM2-135M-Instruct tokenizer and template from its GGUF (slow), and with
the tiny tokenizer's own ChatML template (fast).

Every check compares strings or id lists exactly, so a mask that is off by one token, that misses the
end-of-turn token or that also covers the "\\n" written after it fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from draftsmith.data.chat import (
    ChatTemplateError,
    end_of_turn,
    prompt_ids,
    render,
    stop_token_ids,
    tokenize_conversation,
)

# ------------------------------------------------------------------------------------------ templates

# Meta-Llama-3-8B-Instruct (verbatim: it is a one-liner).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama-3.1-8B-Instruct without its tool branches: it always writes a system header with the
# "Cutting Knowledge Date" / "Today Date" lines, then the (trimmed) system message if there is one.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen3 (Qwen3-8B) without its tool branches. The logic that matters here is kept as it is: find the
# last real user query (last_query_index); an assistant turn after it gets a <think> block when it is the
# last message or has reasoning content (given, or split out of "<think>...</think>" in its content);
# every other assistant turn is written without one; content after </think> is lstrip('\n')-ed.
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Mistral-7B-Instruct v0.1/v0.2 layout: "<s>[INST] user [/INST]assistant</s>[INST] ...", roles must
# alternate; an optional system message is prepended to the first user message (as Mistral's later
# revisions of this template do).
MISTRAL_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# ------------------------------------------------------------------------------------------ families


@dataclass
class Family:
    name: str
    tok: Any
    eot: str
    # how the template writes an assistant message's content: (content, is the conversation's last message)
    shown: Callable[[str, bool], str]
    # text the template writes between the generation prompt and the assistant content, per the same args
    pre_content: Callable[[str, bool], str] = lambda content, last: ""


def _as_is(content: str, last: bool) -> str:
    return content


def _trimmed(content: str, last: bool) -> str:  # jinja's |trim is str.strip()
    return content.strip()


def _qwen3_shown(content: str, last: bool) -> str:
    return content.lstrip("\n") if last else content


def _qwen3_pre(content: str, last: bool) -> str:
    return "<think>\n\n</think>\n\n" if last else ""


def _tiny(template: str, bos: str | None = None, eos: str | None = None):
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer(seed=0, chat_template=template)  # fresh: end_of_turn caches on the object
    if bos is not None:
        tok.bos_token = bos
    if eos is not None:
        tok.eos_token = eos
    return tok


def _smollm2_tok():
    from draftsmith.pipeline.config import ModelConfig
    from draftsmith.pipeline.target import load_tokenizer

    return load_tokenizer(ModelConfig(target="smollm2-135m-instruct"))


def _make_family(name: str) -> Family:
    if name == "llama3":
        tok = _tiny(LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")
        return Family(name, tok, "<|eot_id|>", _trimmed)
    if name == "llama3.1":
        tok = _tiny(LLAMA31_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")
        return Family(name, tok, "<|eot_id|>", _trimmed)
    if name == "qwen3":
        return Family(name, _tiny(QWEN3_TEMPLATE), "<|im_end|>", _qwen3_shown, _qwen3_pre)
    if name == "mistral":
        return Family(name, _tiny(MISTRAL_TEMPLATE, bos="<s>", eos="</s>"), "</s>", _as_is)
    if name == "chatml-tiny":
        from tests.tiny import CHATML_TEMPLATE

        return Family(name, _tiny(CHATML_TEMPLATE), "<|im_end|>", _as_is)
    if name == "smollm2":
        return Family(name, _smollm2_tok(), "<|im_end|>", _as_is)
    raise AssertionError(name)


FAMILIES = [
    "llama3",
    "llama3.1",
    "qwen3",
    "mistral",
    "chatml-tiny",
    pytest.param("smollm2", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request) -> Family:
    return _make_family(request.param)


# ------------------------------------------------------------------------------------------ conversations

SYSTEM = "You are a terse assistant. Answer in as few words as possible."

CONVERSATIONS = {
    # the assistant's answer is also written, verbatim, inside the user message before it (twice)
    "echo": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Say hello world"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "Again: hello world. Now say hello world once more."},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "What is 2 + 2? Reply with: The answer is 4."},
        {"role": "assistant", "content": "The answer is 4."},
    ],
    # leading/trailing spaces and newlines, unicode (multi-byte, CJK, emoji, combining accent)
    "whitespace-unicode": [
        {"role": "user", "content": "  Bonjour ! Ça va ?\n"},
        {"role": "assistant", "content": "  Très bien, merci \u2014 et toi ? 🙂\n\n"},
        {"role": "user", "content": "日本語で答えて。\n\n"},
        {"role": "assistant", "content": "\n\nはい、日本語で答えます。 e\u0301 "},
    ],
    # code with indentation, and an answer that is a substring of the system prompt
    "code": [
        {"role": "system", "content": "  You write python code.\n"},
        {"role": "user", "content": "Write a function that returns the sum of a list."},
        {"role": "assistant", "content": "def total(xs):\n    return sum(xs)\n"},
        {"role": "user", "content": "Which language do you write?"},
        {"role": "assistant", "content": "python"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome. 👍"},
    ],
    # no system message, a single exchange whose answer starts with a newline
    "single": [
        {"role": "user", "content": "Give me a list of two fruits."},
        {"role": "assistant", "content": "\n- apple\n- pear"},
    ],
}


def _conversation(key: str) -> list[dict[str, Any]]:
    return [dict(m) for m in CONVERSATIONS[key]]


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of 1s."""
    out, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def _assistant_turns(messages) -> list[tuple[int, dict[str, Any], bool]]:
    return [(i, m, i == len(messages) - 1) for i, m in enumerate(messages) if m["role"] == "assistant"]


# ------------------------------------------------------------------------------------------ tests


def test_end_of_turn(fam):
    s, i = end_of_turn(fam.tok)
    assert s == fam.eot
    assert i == fam.tok.convert_tokens_to_ids(fam.eot)
    assert _decode(fam.tok, [i]) == fam.eot
    assert stop_token_ids(fam.tok)[0] == i
    assert end_of_turn(fam.tok) == (s, i)  # cached value is the same


@pytest.mark.parametrize("key", list(CONVERSATIONS))
def test_input_ids_decode_to_rendered_text(fam, key):
    msgs = _conversation(key)
    tok = fam.tok
    out = tokenize_conversation(tok, msgs)
    assert len(out.input_ids) == len(out.loss_mask)
    assert set(out.loss_mask) <= {0, 1}
    expected = tok.apply_chat_template(msgs, tokenize=False)
    assert _decode(tok, out.input_ids) == expected
    # ...and with the generation prompt, for a conversation that ends with a user turn
    head = msgs[:-1]
    out = tokenize_conversation(tok, head, add_generation_prompt=True)
    assert _decode(tok, out.input_ids) == tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
    assert out.input_ids == prompt_ids(tok, head)


@pytest.mark.parametrize("key", list(CONVERSATIONS))
def test_masked_runs_are_exactly_the_assistant_turns(fam, key, request):
    msgs = _conversation(key)
    tok = fam.tok
    eot_id = tok.convert_tokens_to_ids(fam.eot)
    out = tokenize_conversation(tok, msgs)
    runs = _runs(out.loss_mask)
    turns = _assistant_turns(msgs)
    assert len(runs) == len(turns)
    for (start, end), (_, m, last) in zip(runs, turns):
        assert _decode(tok, out.input_ids[start:end]) == fam.shown(m["content"], last) + fam.eot
        # the run ends exactly on the end-of-turn token (not one before, not one after)
        assert out.input_ids[end - 1] == eot_id
        assert eot_id not in out.input_ids[start : end - 1]
        # the masked ids are the template text's own tokenization, piece by piece
        assert (
            out.input_ids[start : end - 1] == tok(fam.shown(m["content"], last), add_special_tokens=False)["input_ids"]
        )
    # the unmasked tokens never contain an end-of-turn token that belongs to an assistant turn: what is left
    # between runs decodes to exactly the template's own text
    full = tok.apply_chat_template(msgs, tokenize=False)
    pos = 0
    for (start, end), (_, m, last) in zip(runs, turns):
        shown = fam.shown(m["content"], last) + fam.eot
        gap = _decode(tok, out.input_ids[pos:start])
        assert full.startswith(gap + shown)
        full = full[len(gap + shown) :]
        pos = end
    assert _decode(tok, out.input_ids[pos:]) == full


@pytest.mark.parametrize("key", list(CONVERSATIONS))
def test_text_before_each_turn_is_the_generation_prompt(fam, key, request):
    """The unmasked text right before each masked run ends with the generation prompt (+ Qwen3's empty think)."""
    msgs = _conversation(key)
    tok = fam.tok
    out = tokenize_conversation(tok, msgs)
    runs = _runs(out.loss_mask)
    gen = render(tok, [{"role": "user", "content": "x"}], add_generation_prompt=True)
    gen = gen[gen.rindex("x") + 1 :]  # what follows the last user message's content
    for (start, _), (_, m, last) in zip(runs, _assistant_turns(msgs)):
        before = _decode(tok, out.input_ids[:start])
        assert before.endswith(gen + fam.pre_content(m["content"], last))


@pytest.mark.parametrize("key", list(CONVERSATIONS))
def test_prompt_ids_prefix(fam, key, request):
    """prompt_ids of the messages before each assistant turn are a prefix of the whole sequence.

    For plain-text conversations all these templates render prefixes consistently: the generation prompt
    is exactly the text the full render has before that turn's content. Qwen3 included, for every turn:
    its earlier assistant turns have no think block in the full render, and neither has the prompt; its
    final turn has "<think>\\n\\n</think>\\n\\n" after the generation prompt, which the model writes
    itself at inference (so that block must be in the sequence, unmasked, right after the prompt). What
    would break Qwen3's consistency is history with reasoning: the template drops earlier turns' think
    blocks, which the model did generate after those prompts -- not something plain-text messages have.
    """
    msgs = _conversation(key)
    tok = fam.tok
    out = tokenize_conversation(tok, msgs)
    runs = _runs(out.loss_mask)
    turns = _assistant_turns(msgs)
    assert len(runs) == len(turns)
    for (start, _), (i, m, last) in zip(runs, turns):
        p = prompt_ids(tok, msgs[:i])
        assert out.input_ids[: len(p)] == p
        assert len(p) <= start and out.loss_mask[len(p) - 1] == 0  # the turn's run starts after the prompt
        # the prompt ends where the assistant's tokens start (Qwen3's final turn: where its think block starts)
        assert _decode(tok, out.input_ids[len(p) : start]) == fam.pre_content(m["content"], last)


def test_qwen3_final_think_block_is_not_masked():
    fam = _make_family("qwen3")
    tok = fam.tok
    msgs = _conversation("echo")
    full = tok.apply_chat_template(msgs, tokenize=False)
    # the final turn (only) carries the empty think block; earlier assistant turns don't
    assert full.count("<think>\n\n</think>\n\n") == 1
    assert full.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is 4.<|im_end|>\n")
    assert "<|im_start|>assistant\nhello world<|im_end|>\n" in full
    out = tokenize_conversation(tok, msgs)
    think, end_think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    t0, t1 = out.input_ids.index(think), out.input_ids.index(end_think)
    assert out.loss_mask[t0 : t1 + 1] == [0] * (t1 + 1 - t0)
    last_start, last_end = _runs(out.loss_mask)[-1]
    assert last_start > t1
    assert _decode(tok, out.input_ids[t1:last_start]) == "</think>\n\n"
    assert _decode(tok, out.input_ids[last_start:last_end]) == "The answer is 4.<|im_end|>"
    assert _decode(tok, out.input_ids[last_end:]) == "\n"


def _byte_level_ids(tok, text: str) -> list[int]:
    """One id per UTF-8 byte (GPT-2 byte-to-unicode alphabet): a valid but non-canonical tokenization."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, map(chr, cs)))
    ids = tok.convert_tokens_to_ids([byte_to_char[b] for b in text.encode("utf-8")])
    assert None not in ids and (tok.unk_token_id is None or tok.unk_token_id not in ids)
    return ids


@pytest.mark.parametrize("override", ["byte-level", "other-text"])
def test_token_ids_override(fam, override):
    tok = fam.tok
    eot_id = tok.convert_tokens_to_ids(fam.eot)
    msgs = _conversation("echo")
    base = tokenize_conversation(tok, msgs)
    k = 1  # which assistant turn gets explicit token_ids (the middle one of three)
    i, m, last = _assistant_turns(msgs)[k]
    shown = fam.shown(m["content"], last)
    if override == "byte-level":
        given = _byte_level_ids(tok, shown)
        assert _decode(tok, given) == shown
        assert given != tok(shown, add_special_tokens=False)["input_ids"]  # really non-canonical
    else:
        given = tok("Sure: HELLO, WORLD!! 🌍", add_special_tokens=False)["input_ids"]
    msgs[i] = {**msgs[i], "token_ids": list(given)}
    out = tokenize_conversation(tok, msgs)
    runs, base_runs = _runs(out.loss_mask), _runs(base.loss_mask)
    assert len(runs) == len(base_runs) == 3
    start, end = runs[k]
    assert out.input_ids[start:end] == list(given) + [eot_id]
    # everything outside that turn is unchanged
    b_start, b_end = base_runs[k]
    assert start == b_start
    assert out.input_ids[:start] == base.input_ids[:b_start]
    assert out.input_ids[end:] == base.input_ids[b_end:]
    assert out.loss_mask[end:] == base.loss_mask[b_end:]
    for j in (0, 2):
        s0, e0 = runs[j]
        _, mj, lastj = _assistant_turns(msgs)[j]
        assert _decode(tok, out.input_ids[s0:e0]) == fam.shown(mj["content"], lastj) + fam.eot
    if override == "byte-level":  # same text, other ids: the decoded sequence is still the rendered one
        assert _decode(tok, out.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_token_ids_override_final_qwen3_turn():
    """Explicit ids on the final Qwen3 turn replace only the answer, not the (unmasked) empty think block."""
    fam = _make_family("qwen3")
    tok = fam.tok
    msgs = _conversation("echo")
    given = _byte_level_ids(tok, "The answer is 4.")
    msgs[-1] = {**msgs[-1], "token_ids": given}
    out = tokenize_conversation(tok, msgs)
    start, end = _runs(out.loss_mask)[-1]
    assert out.input_ids[start:end] == given + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert _decode(tok, out.input_ids[:start]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ------------------------------------------------------------------------------------------ bad templates

USER_ONLY_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|im_start|>user\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# assistant content followed by plain text ("\n\n"), the end-of-turn special token only later
NO_SPECIAL_EOT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\n' + message['content'] + '\n\n' }}"
    "{% endfor %}"
    "{{ '<|endoftext|>' }}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", [USER_ONLY_TEMPLATE, NO_SPECIAL_EOT_TEMPLATE], ids=["user-only", "no-special-eot"])
def test_unusable_templates_raise(template):
    tok = _tiny(template)
    msgs = _conversation("echo")
    with pytest.raises(ChatTemplateError):
        end_of_turn(tok)
    with pytest.raises(ChatTemplateError):
        tokenize_conversation(tok, msgs)


def test_mistral_role_order_raises():
    tok = _make_family("mistral").tok
    bad = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        tokenize_conversation(tok, bad)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="alternate"):
        tokenize_conversation(tok, bad)


def test_end_of_turn_cache_follows_template_changes():
    tok = _tiny(QWEN3_TEMPLATE)
    assert end_of_turn(tok) == ("<|im_end|>", tok.convert_tokens_to_ids("<|im_end|>"))
    tok.chat_template = LLAMA3_TEMPLATE
    assert end_of_turn(tok) == ("<|eot_id|>", tok.convert_tokens_to_ids("<|eot_id|>"))
    tok.chat_template = MISTRAL_TEMPLATE
    tok.eos_token = "</s>"
    assert end_of_turn(tok) == ("</s>", tok.convert_tokens_to_ids("</s>"))


# ------------------------------------------------------------------------------------------ rendered text


def test_templates_render_the_family_formats():
    """The hand-written templates produce the documented layouts (guards the templates themselves)."""
    msgs = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": " Hello!\n"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    llama3 = _make_family("llama3").tok.apply_chat_template(msgs, tokenize=False)
    assert llama3 == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>"
    )
    llama31 = _make_family("llama3.1").tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert llama31 == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>"
    )
    qwen3 = _make_family("qwen3").tok
    assert qwen3.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\n Be brief. <|im_end|>\n"
        "<|im_start|>user\nHi <|im_end|>\n"
        "<|im_start|>assistant\n Hello!\n<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nBye.<|im_end|>\n"
    )
    assert qwen3.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    mistral = _make_family("mistral").tok.apply_chat_template(msgs, tokenize=False)
    assert mistral == "<s>[INST]  Be brief. \n\nHi  [/INST] Hello!\n</s>[INST] Bye [/INST]Bye.</s>"
    assert _make_family("mistral").tok.apply_chat_template(msgs[1:], tokenize=False) == (
        "<s>[INST] Hi  [/INST] Hello!\n</s>[INST] Bye [/INST]Bye.</s>"
    )


# ------------------------------------------------------------------ regressions (bugs found in assistant_spans)


def test_qwen3_final_turn_leading_newline():
    """Regression: Qwen3 lstrips "\\n" off the final turn's content, right after its own "</think>\\n\\n".

    assistant_spans tries the raw content first; '\\nA' is found inside '</think>\\n\\nA' (followed by the
    end-of-turn token), so the masked run starts one template newline early. With token_ids the span's text
    is replaced by the given ids, so that template newline is lost from the sequence altogether.
    """
    tok = _make_family("qwen3").tok
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "\nA"}]
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert full == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    out = tokenize_conversation(tok, msgs)
    ((start, end),) = _runs(out.loss_mask)
    assert _decode(tok, out.input_ids[start:end]) == "A<|im_end|>"
    msgs[1]["token_ids"] = tok("A", add_special_tokens=False)["input_ids"]
    out = tokenize_conversation(tok, msgs)
    assert _decode(tok, out.input_ids) == full


@pytest.mark.parametrize("content", ["think", "k", ">", "\n"])
def test_qwen3_final_turn_content_inside_think_block(content):
    tok = _make_family("qwen3").tok
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}]
    out = tokenize_conversation(tok, msgs)
    ((start, end),) = _runs(out.loss_mask)
    assert _decode(tok, out.input_ids[start:end]) == content.lstrip("\n") + "<|im_end|>"
    assert _decode(tok, out.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("content", ["  ", " \n"])
def test_llama3_whitespace_only_turn(content):
    tok = _make_family("llama3").tok
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content}]
    out = tokenize_conversation(tok, msgs)
    ((start, end),) = _runs(out.loss_mask)
    assert _decode(tok, out.input_ids[start:end]) == "<|eot_id|>"
