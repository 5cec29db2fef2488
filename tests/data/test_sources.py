"""Ingestion: the three record schemas, file formats, builtin prompt sets, and counted (never silent) skips."""

import json
from collections import Counter

import pytest

from draftsmith.data.config import SourceConfig
from draftsmith.data.sources import SourceError, iter_conversations

GOOD = [
    {
        "id": "m1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
    },
    {
        "id": "s1",
        "conversations": [
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "human", "value": "Q2"},
        ],
    },
    {"id": "p1", "prompt": "Write a haiku.", "category": "poetry"},
    {
        "id": "m2",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": "ok"},
        ],
    },
]
BAD = [
    ({"id": "x1", "messages": [{"role": "assistant", "content": "starts with assistant"}]}, "bad_turn_order"),
    ({"id": "x2", "messages": [{"role": "user", "content": "   "}]}, "empty_message"),
    ({"id": "x3", "messages": []}, "empty"),
    ({"id": "x4", "text": "no schema"}, "unknown_schema"),
    ({"id": "x5", "messages": [{"role": "tool", "content": "{}"}]}, "unsupported_role"),
    (
        {"id": "x6", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
        "non_text_content",
    ),
    ({"id": "x7", "conversations": [{"from": "human"}]}, "malformed"),
    ({"id": "m1", "prompt": "same id as the first record"}, "duplicate_id"),
]


def _write_jsonl(path, records, extra_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_three_schemas_normalize_to_one(tmp_path):
    path = tmp_path / "mix.jsonl"
    _write_jsonl(path, GOOD)
    counts = Counter()
    convs = {c["id"]: c for c in iter_conversations(SourceConfig(path=str(path), domain_field="category"), counts)}
    assert counts["read"] == 4 and len(convs) == 4
    m1 = convs["mix:m1"]["messages"]
    assert [m["role"] for m in m1] == ["system", "user", "assistant"] and m1[2]["content"] == "Hello!"
    # ShareGPT roles mapped, and a trailing user turn gets a pending assistant turn
    s1 = convs["mix:s1"]["messages"]
    assert [(m["role"], m["content"]) for m in s1] == [
        ("user", "Q1"),
        ("assistant", "A1"),
        ("user", "Q2"),
        ("assistant", None),
    ]
    assert convs["mix:p1"]["messages"] == [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": None},
    ]
    assert convs["mix:p1"]["domain"] == "poetry" and convs["mix:m1"]["domain"] == "mix"
    assert convs["mix:m2"]["messages"][0]["content"] == "part one, part two"


def test_bad_records_are_counted_by_reason(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, GOOD[:1] + [r for r, _ in BAD], extra_lines=["{not json", "[1, 2]"])
    counts = Counter()
    kept = list(iter_conversations(SourceConfig(path=str(path)), counts))
    assert [c["id"] for c in kept] == ["bad:m1"]
    expected = Counter(reason for _, reason in BAD)
    for reason, n in expected.items():
        assert counts[reason] == n, (reason, counts)
    assert counts["bad_json"] == 2
    assert counts["read"] == 1 + len(BAD)


@pytest.mark.parametrize("fmt", ["json", "json-wrapped", "parquet"])
def test_json_and_parquet_files(tmp_path, fmt):
    import datasets

    records = [{"id": f"r{i}", "prompt": f"question {i}", "topic": "math" if i % 2 else "code"} for i in range(5)]
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path))
    else:
        path = tmp_path / "d.json"
        path.write_text(json.dumps(records if fmt == "json" else {"data": records}))
    counts = Counter()
    convs = list(
        iter_conversations(SourceConfig(path=str(path), schema="prompt", domain_field="topic", limit=4), counts)
    )
    assert [c["id"] for c in convs] == ["d:r0", "d:r1", "d:r2", "d:r3"]
    assert [c["domain"] for c in convs] == ["code", "math", "code", "math"]


def test_source_level_errors_are_clear(tmp_path):
    with pytest.raises(SourceError, match="not found"):
        list(iter_conversations(SourceConfig(path=str(tmp_path / "nope.jsonl")), Counter()))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type"):
        list(iter_conversations(SourceConfig(path=str(tmp_path / "x.csv")), Counter()))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SourceError, match="not valid JSON"):
        list(iter_conversations(SourceConfig(path=str(tmp_path / "broken.json")), Counter()))


def test_hub_dataset_without_network_is_a_clear_error():
    with pytest.raises(SourceError, match="network access"):
        list(iter_conversations(SourceConfig(builtin="gsm8k"), Counter()))


def test_builtin_mtbench_has_80_questions_in_8_categories():
    counts = Counter()
    convs = list(iter_conversations(SourceConfig(builtin="mtbench"), counts))
    assert len(convs) == 80
    domains = Counter(c["domain"] for c in convs)
    assert sorted(domains) == sorted(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    )
    assert set(domains.values()) == {10}
    # two user turns, each followed by a pending assistant turn
    assert all([m["role"] for m in c["messages"]] == ["user", "assistant", "user", "assistant"] for c in convs)
    assert all(c["messages"][1]["content"] is None for c in convs)


def test_builtin_humaneval_has_164_prompts():
    convs = list(iter_conversations(SourceConfig(builtin="humaneval"), Counter()))
    assert len(convs) == 164
    assert convs[0]["id"] == "humaneval:HumanEval/0" and "def has_close_elements" in convs[0]["messages"][0]["content"]
    assert {c["domain"] for c in convs} == {"humaneval"}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_lines_that_are_not_utf8_are_counted_skips_named_by_line_and_offset(tmp_path, caplog, suffix):
    import gzip

    good = [json.dumps(r).encode() + b"\n" for r in GOOD[:2]]
    latin1 = json.dumps({"id": "l1", "prompt": "caf\u00e9"}, ensure_ascii=False).encode("latin-1") + b"\n"
    data = b"\xef\xbb\xbf" + good[0] + latin1 + good[1] + b"\xff\xfe\n"  # a BOM, then two bad lines
    path = tmp_path / f"mixed{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    counts = Counter()
    kept = list(iter_conversations(SourceConfig(path=str(path)), counts))
    assert [c["id"].split(":")[-1] for c in kept] == ["m1", "s1"]
    assert counts["not_utf8"] == 2 and counts["bad_json"] == 0
    offset = 3 + len(good[0]) + latin1.index(b"\xe9")
    assert any(
        f"line 2 is not UTF-8 (byte offset {offset}" in r.getMessage() and str(path) in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_json_file_that_is_not_utf8_is_a_named_error(tmp_path):
    path = tmp_path / "latin1.json"
    text = json.dumps([{"id": "a", "prompt": "ok"}, {"id": "b", "prompt": "na\u00efve"}], ensure_ascii=False, indent=1)
    path.write_bytes(text.encode("latin-1"))
    offset, line = text.encode("latin-1").index(b"\xef"), text[: text.index("\u00ef")].count("\n") + 1
    with pytest.raises(SourceError, match=rf"latin1.json: not UTF-8 text at byte offset {offset} \(line {line}:"):
        list(iter_conversations(SourceConfig(path=str(path)), Counter()))


def test_a_utf16_file_is_a_named_error(tmp_path):
    path = tmp_path / "utf16.jsonl"
    path.write_bytes((json.dumps(GOOD[2]) + "\n").encode("utf-16"))
    with pytest.raises(SourceError, match="utf16.jsonl: the file is UTF-16"):
        list(iter_conversations(SourceConfig(path=str(path)), Counter()))
