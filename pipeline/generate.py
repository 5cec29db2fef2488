"""`draftsmith generate`: regenerate every assistant turn with the target (on-policy), turn by turn.

Work is cut into fixed chunks of conversations (in input order). Each chunk is written as its own shard
plus a small JSON sidecar that marks it done, so a killed run resumes by skipping finished chunks and
produces the same set of records. Under `accelerate launch`/`torchrun`, rank r takes chunks r, r+W, ...;
the main process writes the manifest once every chunk is done.

Optional dataset-free bootstrap (`generate.synthesize: N`): the target writes N user prompts from its own
chat template's user header (Magpie-style), filtered, before they are answered the same way.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from accelerate import PartialState
from tqdm.auto import tqdm

from draftsmith.data.artifacts import (
    ArtifactError,
    atomic_write_text,
    check_same_target,
    read_records,
    write_manifest,
    write_records,
)
from draftsmith.data.chat import encode_text, prompt_ids, stop_token_ids, user_header
from draftsmith.data.generation import Generator, HFGenerator, Sampling
from draftsmith.data.records import build_record, holdout_split
from draftsmith.data.synthesis import PromptFilter
from draftsmith.eval.sampling import derive_seed
from draftsmith.pipeline.completion import stage_inputs, start
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console, counts_table
from draftsmith.pipeline.dist import dist_state
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.target import load_model, load_tokenizer, pick_device, resolve_target

log = logging.getLogger(__name__)


def _assistant_indices(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def _reset(conv: dict[str, Any]) -> dict[str, Any]:
    """A copy with every assistant turn pending (generate rewrites them all)."""
    conv = copy.deepcopy(conv)
    conv["messages"] = [
        {"role": m["role"], "content": None}
        if m["role"] == "assistant"
        else {"role": m["role"], "content": m["content"]}
        for m in conv["messages"]
    ]
    return conv


def answer_conversations(
    gen: Generator,
    tok,
    convs: list[dict[str, Any]],
    sampling: Sampling,
    seed: int,
    max_length: int,
    counts: Counter,
) -> list[dict[str, Any]]:
    """Fill every assistant turn, turn by turn (the model sees its own earlier answers).

    A conversation whose next prompt no longer fits in `max_length` keeps the turns answered so far;
    one whose first prompt does not fit is dropped. Both are counted.
    """
    work = [_reset(c) for c in convs]
    alive = [True] * len(work)
    turn = 0
    while True:
        todo, prompts = [], []
        for ci, conv in enumerate(work):
            if not alive[ci]:
                continue
            slots = _assistant_indices(conv["messages"])
            if turn >= len(slots):
                continue
            idx = slots[turn]
            p = prompt_ids(tok, conv["messages"][:idx])
            if len(p) >= max_length:
                counts["turns_dropped_overlong"] += len(slots) - turn
                if turn == 0:
                    counts["prompt_overlong"] += 1
                    alive[ci] = False
                else:
                    conv["messages"] = conv["messages"][: idx - 1]
                continue
            todo.append((ci, idx))
            prompts.append(p)
        if not todo:
            break
        completions = gen.generate(prompts, sampling, seed=derive_seed(seed, "turn", turn))
        for (ci, idx), comp in zip(todo, completions):
            msg = work[ci]["messages"][idx]
            msg["content"] = tok.decode(comp.token_ids, skip_special_tokens=False)
            msg["token_ids"] = comp.token_ids
            msg["finish_reason"] = comp.finish_reason
            counts[f"finish_{comp.finish_reason}"] += 1
            counts["generated_tokens"] += len(comp.token_ids)
        turn += 1
    return [c for c, ok in zip(work, alive) if ok]


# ------------------------------------------------------------------------------------------ synthesis


def synthesize_prompts(
    gen: Generator, tok, cfg: RunConfig, synth_dir: Path, state: PartialState
) -> tuple[list[dict[str, Any]], Counter]:
    """`generate.synthesize` user prompts, written by the target itself, as pending conversations.

    Rounds of `chunk_size` candidates are saved as they finish (round r by rank r mod W), and the filter
    runs over all rounds in order, so a resumed or multi-rank run accepts the same prompts.
    """
    g = cfg.generate
    s = g.synth
    header = user_header(tok, s.system_prompt)
    # candidate j of every round continues opener j mod len(openers); the opener is part of the prompt text
    openers = list(s.openers) or [""]
    round_openers = [openers[j % len(openers)] for j in range(s.round_size)]
    round_prompts = [encode_text(tok, header + op) for op in round_openers]
    sampling = Sampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    filt = PromptFilter(tok.get_added_vocab().keys(), s.min_chars, s.max_repeat_fraction)
    accepted: list[str] = []
    first = 0
    bar = tqdm(total=g.synthesize, desc="synthesize prompts", unit="prompt", disable=not state.is_local_main_process)
    while len(accepted) < g.synthesize:
        if first >= s.max_rounds:
            raise StageError(
                f"self-synthesis accepted only {len(accepted)} of {g.synthesize} prompts in {s.max_rounds} rounds "
                f"(rejections: {dict(filt.counts)}); raise generate.synth.max_rounds or relax the filters"
            )
        mine = first + state.process_index
        path = synth_dir / f"round-{mine:05d}.jsonl"
        if mine < s.max_rounds and not path.exists():
            comps = gen.generate(round_prompts, sampling, seed=derive_seed(g.seed, "synth", mine))
            lines = [
                json.dumps(
                    {
                        "text": op + tok.decode(c.token_ids, skip_special_tokens=False),
                        "finished": c.finish_reason == "stop",
                    }
                )
                for op, c in zip(round_openers, comps)
            ]
            atomic_write_text(path, "\n".join(lines) + "\n")
        state.wait_for_everyone()
        for r in range(first, min(first + state.num_processes, s.max_rounds)):
            for line in (synth_dir / f"round-{r:05d}.jsonl").read_text().splitlines():
                if len(accepted) == g.synthesize:
                    break  # candidates past the N-th accepted one are neither examined nor counted
                cand = json.loads(line)
                if filt(cand["text"], cand["finished"]):
                    accepted.append(cand["text"].strip())
                    bar.update(1)
        first += state.num_processes
    bar.close()
    convs = []
    for i, text in enumerate(accepted):
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": None}]
        if s.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": s.system_prompt})
        conv_id = f"synth:{i}"
        convs.append(
            {
                "id": conv_id,
                "domain": "synthetic",
                "source": "synthesize",
                "messages": messages,
                "split": holdout_split(conv_id, cfg.data.holdout_fraction, cfg.data.seed),
            }
        )
    return convs, filt.counts


# --------------------------------------------------------------------------------------------- stage


def make_generator(cfg: RunConfig, tok, state: PartialState) -> tuple[Generator, Any]:
    """(generator, model or None). vLLM is used on CUDA nodes where it is installed, unless told otherwise."""
    from draftsmith.data.vllm_backend import VLLMGenerator, vllm_available

    spec = resolve_target(cfg.model)
    device = pick_device(cfg.model.device)
    backend = cfg.generate.backend
    if backend == "auto":
        backend = (
            "vllm"
            if device.type == "cuda" and spec.kind != "gguf" and state.num_processes == 1 and vllm_available()
            else "hf"
        )
    stops = stop_token_ids(tok)
    if backend == "vllm":
        if not vllm_available():
            raise StageError(
                "generate.backend=vllm but vllm cannot be imported (pip install -e .[vllm] on a CUDA node)"
            )
        if state.num_processes > 1:
            raise StageError(
                "generate.backend=vllm runs as one process (vLLM parallelizes itself); start it without accelerate/torchrun"
            )
        dtype = "auto" if cfg.model.dtype == "auto" else cfg.model.dtype
        return VLLMGenerator(
            spec.location,
            stops,
            dtype=dtype,
            revision=spec.revision,
            seed=cfg.generate.seed,
            tensor_parallel_size=cfg.generate.tensor_parallel_size,
        ), None
    model = load_model(cfg.model, spec, device)
    stops = stop_token_ids(tok, model)
    gen = HFGenerator(model, tok.pad_token_id, stops, cfg.generate.batch_size, progress=False)
    return gen, model


def run_generate(cfg: RunConfig) -> Path:
    state = dist_state()
    g = cfg.generate
    layout = RunLayout.of(cfg)
    out, chunks_dir = layout.generated, layout.generated_chunks
    spec = resolve_target(cfg.model)
    tok = load_tokenizer(cfg.model, spec)
    identity = spec.identity()

    prepared_manifest, convs = None, []
    if cfg.data.sources:
        prepared_dir = layout.prepared
        try:
            prepared_manifest, rows = read_records(prepared_dir, "prepared")
        except ArtifactError as exc:
            raise StageError(f"{exc} (run `draftsmith prepare` with this config first)") from None
        check_same_target(prepared_manifest, identity, prepared_dir)
        convs = [{k: r[k] for k in ("id", "domain", "source", "split", "messages")} for r in rows]
    if not convs and g.synthesize == 0:
        raise StageError("nothing to generate: data.sources is empty and generate.synthesize is 0")

    inputs = stage_inputs(cfg, "generate", identity=identity)
    if start(out, inputs, state, "generate").complete:  # (other inputs: refused, naming what differs)
        return out

    gen, _model = make_generator(cfg, tok, state)
    log.info("generate: backend=%s, %d rank(s)", gen.name, state.num_processes)

    synth_counts: Counter = Counter()
    if g.synthesize:
        synth, synth_counts = synthesize_prompts(gen, tok, cfg, layout.synthesized, state)
        convs = convs + synth

    sampling = Sampling(g.temperature, g.top_p, g.top_k, g.max_new_tokens)
    n_chunks = (len(convs) + g.chunk_size - 1) // g.chunk_size
    mine = [k for k in range(state.process_index, n_chunks, state.num_processes)]
    todo = [k for k in mine if not (chunks_dir / f"chunk-{k:05d}.json").is_file()]
    if len(todo) < len(mine):
        log.info("generate: resuming, %d of this rank's %d chunks already done", len(mine) - len(todo), len(mine))
    bar = tqdm(
        todo, desc=f"generate (rank {state.process_index})", unit="chunk", disable=not state.is_local_main_process
    )
    started, new_tokens = time.perf_counter(), 0
    for k in bar:
        chunk = convs[k * g.chunk_size : (k + 1) * g.chunk_size]
        counts: Counter = Counter()
        answered = answer_conversations(
            gen, tok, chunk, sampling, derive_seed(g.seed, "chunk", k), cfg.data.max_length, counts
        )
        records = []
        for conv in answered:
            rec = build_record(tok, conv, conv["split"], cfg.data.max_length, cfg.data.overlong, counts)
            if rec is not None:
                records.append(rec)
        counts["conversations"] += len(chunk)
        counts["records"] += len(records)
        write_chunk(chunks_dir, k, records, counts)
        new_tokens += counts["generated_tokens"]
        bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")

    state.wait_for_everyone()
    if state.is_main_process:
        finalize(out, n_chunks, inputs, synth_counts, gen.name, identity, cfg)
    state.wait_for_everyone()
    return out


def write_chunk(chunks_dir: Path, k: int, records: list[dict[str, Any]], counts: Counter) -> None:
    """Shard first, sidecar last: the sidecar is the chunk's completion mark."""
    shard = write_records(chunks_dir / f"chunk-{k:05d}.parquet", records) if records else None
    atomic_write_text(
        chunks_dir / f"chunk-{k:05d}.json", json.dumps({"chunk": k, "counts": dict(counts), "shard": shard})
    )


def finalize(
    out: Path,
    n_chunks: int,
    inputs: dict[str, Any],
    synth_counts: Counter,
    backend: str,
    identity: dict[str, Any],
    cfg: RunConfig,
) -> None:
    chunks_dir = RunLayout.of(cfg).generated_chunks
    totals: Counter = Counter()
    shards = []
    for k in range(n_chunks):
        side = chunks_dir / f"chunk-{k:05d}.json"
        if not side.is_file():
            raise StageError(f"chunk {k} is missing ({side}); a rank failed — re-run the same command to resume")
        info = json.loads(side.read_text())
        totals.update(info["counts"])
        if info["shard"]:
            shards.append(info["shard"] | {"file": str((chunks_dir / info["shard"]["file"]).relative_to(out))})
    if totals["records"] == 0:
        raise StageError(f"generation produced no usable record (counts: {dict(totals)})")
    console.print(counts_table(f"generate -> {out}", {"answers": dict(totals)}))
    if synth_counts:
        console.print(counts_table("self-synthesized prompts", {"candidates": dict(synth_counts)}))
    write_manifest(
        out,
        "generated",
        inputs=inputs,
        target=identity,
        backend=backend,
        config={"model": cfg.model.model_dump(mode="json"), "generate": cfg.generate.model_dump(mode="json")},
        counts=dict(totals),
        synthesis=dict(synth_counts),
        records=totals["records"],
        tokens=sum(s["tokens"] for s in shards),
        supervised_tokens=sum(s["supervised_tokens"] for s in shards),
        shards=shards,
    )
    log.info("generated %d records into %s", totals["records"], out)
