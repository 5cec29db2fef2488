"""`draftsmith prepare`: ingest the configured datasets, render them with the target's chat template,
compute assistant loss masks, split train/holdout by id hash, and write tokenized shards."""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.data.artifacts import write_manifest, write_records
from draftsmith.data.records import build_record, holdout_split
from draftsmith.data.sources import iter_conversations
from draftsmith.pipeline.completion import stage_inputs
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console, counts_table
from draftsmith.pipeline.dist import single_writer
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.target import load_target

log = logging.getLogger(__name__)


def fresh_dir(path: Path) -> Path:
    """An empty `<path>.partial` directory to build an artifact in before it is moved into place."""
    partial = path.with_name(path.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def publish_dir(partial: Path, path: Path) -> None:
    """Replace `path` by the finished `partial` directory (the manifest inside is already written)."""
    if path.exists():
        shutil.rmtree(path)
    partial.rename(path)


@single_writer
def run_prepare(cfg: RunConfig) -> Path:
    if not cfg.data.sources:
        raise StageError(
            "data.sources is empty: nothing to prepare (for a dataset-free run set generate.synthesize "
            "and run `draftsmith generate`)"
        )
    out = RunLayout.of(cfg).prepared
    target = load_target(cfg.model, with_model=False)
    tok = target.tokenizer
    work = fresh_dir(out)

    per_source: dict[str, Counter] = {}
    buffers: dict[str, list] = {"train": [], "holdout": []}
    shards: list[dict] = []
    split_counts: Counter = Counter()

    def flush(split: str, force: bool = False) -> None:
        buf = buffers[split]
        while buf and (force or len(buf) >= cfg.data.shard_size):
            chunk, buffers[split] = buf[: cfg.data.shard_size], buf[cfg.data.shard_size :]
            buf = buffers[split]
            index = sum(1 for s in shards if s["split"] == split)
            entry = write_records(work / f"{split}-{index:05d}.parquet", chunk)
            shards.append(entry | {"split": split})

    for src in cfg.data.sources:
        counts: Counter = Counter()
        per_source[src.name] = counts
        for conv in tqdm(iter_conversations(src, counts), desc=f"prepare {src.name}", unit="rec", leave=False):
            split = holdout_split(conv["id"], cfg.data.holdout_fraction, cfg.data.seed)
            rec = build_record(tok, conv, split, cfg.data.max_length, cfg.data.overlong, counts)
            if rec is None:
                continue
            counts["kept"] += 1
            split_counts[split] += 1
            buffers[split].append(rec)
            flush(split)
        for reason in (
            "not_utf8",
            "bad_json",
            "malformed",
            "unknown_schema",
            "empty",
            "empty_message",
            "bad_turn_order",
            "unsupported_role",
            "non_text_content",
            "duplicate_id",
            "template_error",
            "overlong_skipped",
            "no_supervised_tokens",
        ):
            if counts[reason]:
                log.warning("%s: skipped %d records (%s)", src.name, counts[reason], reason)
    flush("train", force=True)
    flush("holdout", force=True)

    total_kept = sum(c["kept"] for c in per_source.values())
    console.print(counts_table(f"prepare -> {out}", {k: dict(v) for k, v in per_source.items()}))
    if total_kept == 0:
        shutil.rmtree(work)
        raise StageError(
            f"data.sources yielded no usable record (counts: { ({k: dict(v) for k, v in per_source.items()}) })"
        )

    write_manifest(
        work,
        "prepared",
        inputs=stage_inputs(cfg, "prepare", identity=target.identity),
        target=target.identity,
        chat_template_sha256=hashlib.sha256(tok.chat_template.encode()).hexdigest(),
        config={"model": cfg.model.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json", by_alias=True)},
        counts={k: dict(v) for k, v in per_source.items()},
        splits=dict(split_counts),
        records=total_kept,
        tokens=sum(s["tokens"] for s in shards),
        supervised_tokens=sum(s["supervised_tokens"] for s in shards),
        shards=shards,
    )
    publish_dir(work, out)
    log.info("prepared %d records (%s) into %s", total_kept, dict(split_counts), out)
    return out
