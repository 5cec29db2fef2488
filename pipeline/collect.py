"""`draftsmith collect`: run the target over tokenized conversations and store its features.

The records (generated, or prepared) are cut into shards of about `collect.shard_tokens` tokens in input
order; rank r of W takes shards r, r+W, ... Inside a shard, samples are batched by length for the forward
and stored back in input order, so the store does not depend on the number of ranks. Finished shards are
skipped on a re-run (resume); the main process writes the manifest once all shards exist.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.data.artifacts import write_manifest
from draftsmith.data.feature_store import (
    DTYPES,
    KIND,
    FeatureStore,
    ShardWriter,
    bytes_per_token,
    is_done,
    pack_shard,
    shard_name,
)
from draftsmith.data.features import FeatureCapture, length_batches, right_pad
from draftsmith.pipeline.completion import stage_inputs, start
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console, counts_table
from draftsmith.pipeline.dist import dist_state
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.inputs import input_records
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.target import load_target

log = logging.getLogger(__name__)


def shard_plan(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Contiguous runs of samples holding about `shard_tokens` tokens each (at least one sample)."""
    shards: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if current and tokens + n > shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        shards.append(current)
    return shards


def collect_samples(
    capture: FeatureCapture, records: list[dict[str, Any]], batch_tokens: int, dtype: torch.dtype
) -> list[dict[str, torch.Tensor]]:
    """Per-sample features of `records`, in their order (forward batches are grouped by length)."""
    device = next(capture.model.parameters()).device
    out: list[dict[str, torch.Tensor] | None] = [None] * len(records)
    for batch in length_batches([r["num_tokens"] for r in records], batch_tokens):
        ids = right_pad([torch.tensor(records[i]["input_ids"], dtype=torch.long) for i in batch])
        aux, final = capture(ids.to(device))
        aux, final = aux.to("cpu", dtype), final.to("cpu", dtype)
        for row, i in enumerate(batch):
            n = records[i]["num_tokens"]
            out[i] = {
                "input_ids": ids[row, :n],
                "loss_mask": torch.tensor(records[i]["loss_mask"], dtype=torch.uint8),
                "aux": aux[row, :n],
                "final": final[row, :n],
            }
    return out  # type: ignore[return-value]


def run_collect(cfg: RunConfig, verify: int = 0) -> Path:
    state = dist_state()
    c = cfg.collect
    out = RunLayout.of(cfg).features
    target = load_target(cfg.model)
    capture = FeatureCapture(target.model, c.aux_layer_ids)
    source_kind, _, records = input_records(cfg, target.identity)
    inputs = stage_inputs(cfg, "collect", identity=target.identity)
    complete = start(out, inputs, state, "collect").complete  # (other inputs: refused, naming what differs)
    shards = shard_plan([r["num_tokens"] for r in records], c.shard_tokens)
    log.info(
        "collect: %d %s records in %d shards over %d rank(s), aux layers %s, %s",
        len(records),
        source_kind,
        len(shards),
        state.num_processes,
        capture.aux_ids,
        c.dtype,
    )

    if not complete:
        mine = list(range(state.process_index, len(shards), state.num_processes))
        todo = [k for k in mine if not is_done(out, k)]
        if len(todo) < len(mine):
            log.info("collect: resuming, %d of this rank's %d shards already done", len(mine) - len(todo), len(mine))
        total = sum(records[i]["num_tokens"] for k in todo for i in shards[k])
        bar = tqdm(
            total=total,
            desc=f"collect (rank {state.process_index})",
            unit="tok",
            unit_scale=True,
            disable=not state.is_local_main_process,
        )
        writer = ShardWriter(out)
        try:
            for k in todo:
                chunk = [records[i] for i in shards[k]]
                samples = collect_samples(capture, chunk, c.batch_tokens, DTYPES[c.dtype])
                meta = [{"id": r["id"], "domain": r["domain"], "split": r["split"]} for r in chunk]
                info = {
                    "shard": k,
                    "samples": len(chunk),
                    "tokens": sum(r["num_tokens"] for r in chunk),
                    "supervised_tokens": sum(r["num_supervised"] for r in chunk),
                }
                writer.submit(k, pack_shard(samples), meta, info)
                bar.update(info["tokens"])
        finally:
            writer.close()
            bar.close()
        state.wait_for_everyone()
        if state.is_main_process:
            finalize(out, len(shards), inputs, cfg, target.identity, capture)
        state.wait_for_everyone()

    if verify and state.is_main_process:
        verify_store(out, capture, records, verify, c.verify_tolerance, seed=cfg.seed)
    return out


def finalize(
    out: Path, n_shards: int, inputs: dict[str, Any], cfg: RunConfig, identity: dict[str, Any], capture: FeatureCapture
) -> None:
    entries = []
    for k in range(n_shards):
        side = (out / shard_name(k)).with_suffix(".json")
        if not side.is_file():
            raise StageError(f"shard {k} is missing ({side}); a rank failed — re-run the same command to resume")
        entries.append(json.loads(side.read_text()))
    tokens = sum(e["tokens"] for e in entries)
    bpt = bytes_per_token(len(capture.aux_ids), capture.hidden_size, cfg.collect.dtype)
    summary = {
        "samples": sum(e["samples"] for e in entries),
        "tokens": tokens,
        "supervised_tokens": sum(e["supervised_tokens"] for e in entries),
        "shards": n_shards,
        "bytes_per_token": bpt,
        "GiB": round(sum(e["bytes"] for e in entries) / 2**30, 3),
    }
    write_manifest(
        out,
        KIND,
        inputs=inputs,
        target=identity,
        aux_layer_ids=capture.aux_ids,
        hidden_size=capture.hidden_size,
        num_layers=capture.num_layers,
        dtype=cfg.collect.dtype,
        source=inputs["source"],
        config={"model": cfg.model.model_dump(mode="json"), "collect": cfg.collect.model_dump(mode="json")},
        counts=summary,
        bytes_per_token=bpt,
        shards=entries,
    )
    console.print(counts_table(f"collect -> {out}", {"features": summary}))


def verify_store(
    out: Path, capture: FeatureCapture, records: list[dict[str, Any]], n: int, tolerance: float, seed: int = 0
) -> dict[str, float]:
    """Recompute `n` random stored samples one by one and compare; raises StageError above tolerance."""
    store = FeatureStore(out)
    by_id = {r["id"]: r for r in records}
    picks = random.Random(seed).sample(range(len(store)), min(n, len(store)))
    dtype = DTYPES[store.manifest["dtype"]]
    worst: dict[str, float] = {}
    scale: dict[str, float] = {}
    started = time.perf_counter()
    for i in picks:
        stored = store[i]
        rec = by_id.get(stored["id"])
        if (
            rec is None
            or stored["input_ids"].tolist() != rec["input_ids"]
            or stored["loss_mask"].tolist() != rec["loss_mask"]
        ):
            raise StageError(f"stored sample {stored['id']} does not match its input record (tokens or loss mask)")
        fresh = collect_samples(capture, [rec], 1 << 30, dtype)[0]
        H = capture.hidden_size
        pairs = {
            f"aux[{a}]": (stored["aux"][:, j * H : (j + 1) * H], fresh["aux"][:, j * H : (j + 1) * H])
            for j, a in enumerate(capture.aux_ids)
        }
        pairs["final"] = (stored["final"], fresh["final"])
        for name, (x, y) in pairs.items():
            worst[name] = max(worst.get(name, 0.0), (x.float() - y.float()).abs().max().item())
            scale[name] = max(scale.get(name, 0.0), y.float().abs().max().item())
    rows = {
        name: {
            "max_abs_diff": f"{worst[name]:.3g}",
            "max_abs_value": f"{scale[name]:.3g}",
            "relative": f"{worst[name] / max(scale[name], 1e-12):.3g}",
        }
        for name in worst
    }
    console.print(
        counts_table(f"verify: {len(picks)} samples recomputed in {time.perf_counter() - started:.1f}s", rows)
    )
    bad = [name for name in worst if worst[name] > tolerance * max(scale[name], 1e-12)]
    if bad:
        raise StageError(
            f"verify failed: {', '.join(bad)} differ from a recomputation by more than "
            f"{tolerance:.0%} of their magnitude"
        )
    return worst
