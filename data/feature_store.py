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
from collections.abc import Callable, Sequence
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


# ------------------------------------------------------------------------------------------ batch loading


class BatchLoader:
    """The batches of a plan (lists of sample indices), in order, loaded by `load` one ahead of their use.

    With `background`, a thread loads batch n+1 while the caller computes on batch n (the torch ops a training step
    spends its time in release the GIL), and on CUDA hands it over already on `device`: copied from pinned memory on
    a stream of its own, which the caller's stream waits for. Without it, batches are loaded when asked for and left
    where `load` put them (the online source: its target runs in `load`, and a sharded target's collectives must
    stay in step with the training's on every rank).

    An error in `load` is raised by the iteration, with the traceback of where it happened; `close` (or leaving a
    `with` block, however it is left) stops the thread. Iterate once."""

    def __init__(
        self,
        load: Callable[[Sequence[int]], dict[str, Any]],
        plan: Sequence[Sequence[int]],
        device: torch.device,
        background: bool = True,
    ):
        self.load, self.plan, self.device = load, list(plan), torch.device(device)
        self.background = background
        self._next = 0  # the next batch of a serial loader
        self._ended = False
        self._cuda = background and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # one batch ahead of the one in use
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-loader", daemon=True)
        if background:
            self._thread.start()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.background:
            if self._next == len(self.plan):
                raise StopIteration
            self._next += 1
            return self.load(self.plan[self._next - 1])
        if self._ended:
            raise StopIteration
        kind, payload = self._take()
        if kind == "end":
            self._ended = True
            raise StopIteration
        if kind == "error":
            raise payload  # the loader thread's exception, its traceback included
        batch, copied = payload
        if copied is not None:
            self._use_on_current_stream(batch, copied)
        return batch

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is loading) and wait for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    # ------------------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)  # a new thread starts on device 0, whatever the rank's device
            for indices in self.plan:
                if self._stop.is_set():
                    return
                self._put(("batch", self._to_device(self.load(indices))))
            self._put(("end", None))
        except BaseException as exc:  # handed to the caller, who raises it
            self._put(("error", exc))

    def _put(self, item: tuple[str, Any]) -> None:
        """Queue `item` once there is room, unless the loader is closed meanwhile (nobody will take it)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _take(self) -> tuple[str, Any]:
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch loader thread stopped without a batch or an error") from None

    def _to_device(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """(batch, the event its copies complete with): on CUDA its tensors copied to the device from pinned memory,
        without waiting (the copies overlap the caller's computation); elsewhere as loaded."""
        if not self._cuda:
            return batch, None
        with torch.cuda.stream(self._stream):
            moved = {k: self._copy(v) if torch.is_tensor(v) else v for k, v in batch.items()}
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return moved, copied

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        # only a copy from pinned memory runs without the host waiting for it
        return (t.pin_memory() if t.device.type == "cpu" else t).to(self.device, non_blocking=True)

    def _use_on_current_stream(self, batch: dict[str, Any], copied: Any) -> None:
        """Make the caller's stream wait for the copies (on the device, not the host), and tell the allocator the
        tensors are used there, so their memory is not reused before that stream is done with them."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(copied)
        for v in batch.values():
            if torch.is_tensor(v):
                v.record_stream(stream)
