"""Artifact directories: a manifest.json that says what produced them, plus payload shards.

A manifest is written last and atomically, so a directory without one is never mistaken for a complete
artifact. Stages check the manifests of their inputs and refuse ones made from another target.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
"""The file that marks an artifact directory complete (written last, atomically)."""


class ArtifactError(ValueError):
    """An input artifact is missing, incomplete, or does not match this run."""


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("draftsmith", "torch", "transformers", "datasets", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_manifest(directory: Path, kind: str, inputs: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """Mark `directory` complete: its kind, `status: complete`, and `inputs`, everything the artifact was made from
    (settings, target identity, fingerprints of input artifacts), which a later run compares with its own to know
    whether the artifact is still current (pipeline/completion.py)."""
    manifest = {
        "kind": kind,
        "schema_version": SCHEMA_VERSION,
        "status": "complete",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        **({"inputs": json.loads(json.dumps(inputs))} if inputs is not None else {}),
        **fields,
    }
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(directory: Path, kind: str) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(
            f"{directory} is not a complete '{kind}' artifact (no manifest.json); run the stage that writes it"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("kind") != kind:
        raise ArtifactError(f"{directory} holds a '{manifest.get('kind')}' artifact, expected '{kind}'")
    return manifest


def check_same_target(manifest: dict[str, Any], identity: dict[str, Any], where: Path) -> None:
    theirs = manifest.get("target", {})
    for key in ("name", "sha256", "revision"):
        if theirs.get(key) != identity.get(key):
            raise ArtifactError(
                f"{where} was made from another target: {key} {theirs.get(key)!r} there, "
                f"{identity.get(key)!r} in this run"
            )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------ conversation records


def record_features():
    """The one schema of tokenized conversation shards (prepare and generate both write it)."""
    import datasets as hfd

    message = {
        "role": hfd.Value("string"),
        "content": hfd.Value("string"),
        "token_ids": hfd.Sequence(hfd.Value("int32")),
        "finish_reason": hfd.Value("string"),
    }
    return hfd.Features(
        {
            "id": hfd.Value("string"),
            "domain": hfd.Value("string"),
            "source": hfd.Value("string"),
            "split": hfd.Value("string"),
            "messages": [message],
            "input_ids": hfd.Sequence(hfd.Value("int32")),
            "loss_mask": hfd.Sequence(hfd.Value("int8")),
            "num_tokens": hfd.Value("int32"),
            "num_supervised": hfd.Value("int32"),
            "truncated": hfd.Value("bool"),
        }
    )


def _message_row(m: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": m["role"],
        "content": m.get("content"),
        "token_ids": m.get("token_ids"),
        "finish_reason": m.get("finish_reason"),
    }


def write_records(path: Path, rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Write one parquet shard atomically; returns its shard entry (file, records, tokens, sha256)."""
    import datasets as hfd

    hfd.disable_progress_bars()  # one bar per shard write is noise; the stages show their own progress
    rows = [dict(r, messages=[_message_row(m) for m in r["messages"]]) for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    hfd.Dataset.from_list(rows, features=record_features()).to_parquet(str(tmp))
    tmp.replace(path)
    return {
        "file": path.name,
        "records": len(rows),
        "tokens": sum(r["num_tokens"] for r in rows),
        "supervised_tokens": sum(r["num_supervised"] for r in rows),
        "sha256": sha256_file(path),
    }


def _clean_message(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if v is not None or k == "content"}


def read_records(directory: Path, kind: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(manifest, records) of a complete records artifact, with shard checksums verified."""
    import pyarrow.parquet as pq

    directory = Path(directory)
    manifest = read_manifest(directory, kind)
    rows: list[dict[str, Any]] = []
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if not path.is_file():
            raise ArtifactError(f"{path} is listed in the manifest but missing")
        if sha256_file(path) != shard["sha256"]:
            raise ArtifactError(f"{path} does not match its manifest checksum (modified or truncated)")
        for r in pq.read_table(path).to_pylist():
            r["messages"] = [_clean_message(m) for m in r["messages"]]
            rows.append(r)
    return manifest, rows
