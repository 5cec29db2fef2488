"""The offline feature store: a directory of safetensors shards plus a manifest.

Each shard holds many samples concatenated along tokens:
    input_ids int32 [N]   loss_mask uint8 [N]   aux [N, n_aux*H]   final [N, H]   offsets int64 [S+1]
and, in its safetensors metadata, the samples' ids, domains and splits (JSON). Sample s of the shard spans
tokens offsets[s]:offsets[s+1]. Shards are memory-mapped on read, so random access touches only the
bytes of the samples asked for.

Shards are written by a background thread (compute never waits for disk), each as a temp file renamed
into place, followed by a small JSON sidecar that marks it done: a shard is either complete or absent.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.data.artifacts import ArtifactError, atomic_write_text, check_same_target, read_manifest, sha256_file
from draftsmith.data.features import right_pad

KIND = "features"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def bytes_per_token(n_aux: int, hidden: int, dtype: str) -> int:
    """Payload bytes per stored token: aux + final features, the token id (int32) and its mask byte."""
    return (n_aux + 1) * hidden * DTYPES[dtype].itemsize + 4 + 1


class ShardWriter:
    """Writes shards on a background thread; `submit` blocks only when `max_pending` shards are queued."""

    def __init__(self, directory: Path, max_pending: int = 2):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def submit(
        self, k: int, tensors: dict[str, torch.Tensor], samples: list[dict[str, Any]], info: dict[str, Any]
    ) -> None:
        if self._error is not None:
            raise RuntimeError("the shard writer failed") from self._error
        self._queue.put((k, tensors, samples, info))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._write(*item)
                except BaseException as exc:  # reported to the producer at its next submit/close
                    self._error = exc

    def _write(
        self, k: int, tensors: dict[str, torch.Tensor], samples: list[dict[str, Any]], info: dict[str, Any]
    ) -> None:
        path = self.directory / shard_name(k)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"samples": json.dumps(samples)})
        tmp.replace(path)
        entry = info | {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        atomic_write_text(path.with_suffix(".json"), json.dumps(entry))

    def close(self) -> None:
        """Finish every queued shard, stop the thread, and re-raise a write error if there was one."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("the shard writer failed") from self._error


def is_done(directory: Path, k: int) -> bool:
    return (Path(directory) / shard_name(k)).with_suffix(".json").is_file()


def pack_shard(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-sample tensors (input_ids, loss_mask, aux, final) along tokens, with offsets."""
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
        "aux": torch.cat([s["aux"] for s in samples]),
        "final": torch.cat([s["final"] for s in samples]),
        "offsets": offsets,
    }


class FeatureStore:
    """Random access by sample and padded batches over a finished store (see `data.features.iterate_batches`).

    Pass what this run expects (`target` identity, `aux_ids`, `hidden_size`): a store made with anything
    else is refused with an error naming the mismatch.
    """

    def __init__(
        self,
        directory: str | Path,
        target: dict[str, Any] | None = None,
        aux_ids: Sequence[int] | None = None,
        hidden_size: int | None = None,
    ):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory, KIND)
        m = self.manifest
        if target is not None:
            check_same_target(m, target, self.directory)
        if aux_ids is not None and list(aux_ids) != m["aux_layer_ids"]:
            raise ArtifactError(
                f"{self.directory} holds aux layers {m['aux_layer_ids']} but this run uses {list(aux_ids)}; "
                f"collect again or set collect.aux_layer_ids={m['aux_layer_ids']}"
            )
        if hidden_size is not None and hidden_size != m["hidden_size"]:
            raise ArtifactError(
                f"{self.directory} holds hidden size {m['hidden_size']} but this run's target has {hidden_size}"
            )
        self.aux_ids = m["aux_layer_ids"]
        self.hidden_size = m["hidden_size"]
        self.lengths: list[int] = []
        self.meta: list[dict[str, Any]] = []
        self._where: list[tuple[int, int, int]] = []
        self._files = []
        for s, shard in enumerate(m["shards"]):
            path = self.directory / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["bytes"]:
                raise ArtifactError(f"{path} is missing or does not have the size its manifest lists")
            f = safe_open(str(path), framework="pt")  # memory-mapped; tensors are read on access
            self._files.append(f)
            offsets = f.get_tensor("offsets").tolist()
            samples = json.loads(f.metadata()["samples"])
            for j, meta in enumerate(samples):
                self._where.append((s, offsets[j], offsets[j + 1]))
                self.lengths.append(offsets[j + 1] - offsets[j])
                self.meta.append(meta)

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, a, b = self._where[i]
        f = self._files[s]
        return {
            "input_ids": f.get_slice("input_ids")[a:b].to(torch.long),
            "loss_mask": f.get_slice("loss_mask")[a:b],
            "aux": f.get_slice("aux")[a:b],
            "final": f.get_slice("final")[a:b],
            **self.meta[i],
        }

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of sample i, without reading its features."""
        s, a, b = self._where[i]
        f = self._files[s]
        return f.get_slice("input_ids")[a:b].to(torch.long), f.get_slice("loss_mask")[a:b]

    def load_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        samples = [self[i] for i in indices]
        return {
            "input_ids": right_pad([x["input_ids"] for x in samples]),
            "loss_mask": right_pad([x["loss_mask"] for x in samples]),
            "attention_mask": right_pad([torch.ones(len(x["input_ids"]), dtype=torch.bool) for x in samples], False),
            "aux": right_pad([x["aux"] for x in samples]),
            "final": right_pad([x["final"] for x in samples]),
            "ids": [x["id"] for x in samples],
            "domains": [x["domain"] for x in samples],
        }
