"""Peak memory and time of one EAGLE-3 training step against sequence length, per TTT attention path (issue 20).

    python launch/bench_ttt_memory.py                                   # T = 1024 2048 4096; reference and chunked
    python launch/bench_ttt_memory.py --lengths 8192 --impls chunked    # the new path alone at 8k
    python launch/bench_ttt_memory.py --mixed-precision bf16            # under bf16 autocast, as the trainer runs

One training step is the trainer's own: eagle3_objective (teacher head, TTT unroll of --ttt-steps, losses) +
backward + AdamW step, batch 1 of T tokens, on a drafter of hidden 256 (4 heads / 2 kv heads x 64, MLP 768),
draft vocab 4096 over a target vocab of 8192, on the CPU.

How memory is measured: each (T, path) runs in a fresh subprocess, so one run's allocations cannot hide in
another's. The step's peak is the process's peak resident set (`ru_maxrss`) minus its resident set just before
the first step (model, optimizer, batch and teacher head already built). torch's CPU allocator returns freed
blocks to malloc, and the subprocess fixes glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_) so that every large
tensor is its own mapping, returned to the OS when freed: the resident set then follows live tensors. One step
runs, timed; AdamW's state, created at its end once the activations are freed, is not part of its peak
(between steps it is held memory, as the model is).

Beside each measurement it prints what `draftsmith plan` predicts for the same step (pipeline/plan.py,
`eagle3_step_peak_bytes`), and the error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 256, 4, 2, 64, 768
DRAFT_VOCAB, TARGET_VOCAB, N_AUX = 4096, 8192, 3
MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """One (T, path) run: the step's peak memory above the state before it, and its time."""

    peak_bytes: int
    seconds: float


def _rss_bytes() -> int:
    """The resident set now (not the peak): /proc/self/statm's second field, in pages."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(length: int, impl: str, steps: int, bf16: bool, threads: int) -> Measured:
    """Build the drafter and one batch of `length` tokens, run one training step with TTT attention `impl`."""
    import torch

    from draftsmith.drafters import ttt_attention
    from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_objective

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = Eagle3Config(
        vocab_size=TARGET_VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        hidden_size=HIDDEN,
        target_hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=MLP,
        aux_layer_ids=[1, 2, 3],
        max_position_embeddings=max(4096, length),
    )
    model = Eagle3Drafter(cfg).train()
    model.d2t.copy_(torch.arange(DRAFT_VOCAB) * (TARGET_VOCAB // DRAFT_VOCAB - 1))  # every other target id
    head = torch.randn(TARGET_VOCAB, HIDDEN) * 0.05
    batch = {
        "input_ids": torch.randint(0, TARGET_VOCAB, (1, length)),
        "loss_mask": torch.ones(1, length, dtype=torch.uint8),
        "attention_mask": torch.ones(1, length, dtype=torch.bool),
        "aux": torch.randn(1, length, N_AUX * HIDDEN),
        "final": torch.randn(1, length, HIDDEN),
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    settings = ObjectiveSettings(steps=steps)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = eagle3_objective(model, batch, head, settings)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    before = _rss_bytes()
    with ttt_attention.use_impl(impl):
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return Measured(peak_bytes=_peak_rss_bytes() - before, seconds=seconds)


def measure(length: int, impl: str, steps: int, bf16: bool, threads: int) -> Measured:
    """`worker` in a fresh subprocess (its own peak resident set), with glibc's mmap threshold fixed."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    args = [sys.executable, __file__, "--worker", str(length), impl, str(steps), str(int(bf16)), str(threads)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"T={length} {impl}: the worker failed\n{done.stderr[-4000:]}")
    return Measured(**json.loads(done.stdout.strip().splitlines()[-1]))


def predicted(length: int, steps: int, bf16: bool) -> float:
    """draftsmith plan's estimate of the same step's peak above the state before it."""
    from draftsmith.pipeline.plan import DrafterShape, eagle3_step_peak_bytes

    shape = DrafterShape("eagle3", HIDDEN, 1, HEADS, KV_HEADS, HEAD_DIM, MLP, N_AUX, DRAFT_VOCAB, TARGET_VOCAB)
    return eagle3_step_peak_bytes(shape, steps, length, act=2 if bf16 else 4, attention="chunked")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--impls", nargs="+", default=["reference", "chunked"], choices=["reference", "chunked"])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--mixed-precision", choices=["no", "bf16"], default="no")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        length, impl, steps, bf16, threads = args.worker
        m = worker(int(length), impl, int(steps), bool(int(bf16)), int(threads))
        print(json.dumps(m.__dict__))
        return

    bf16 = args.mixed_precision == "bf16"
    print(
        f"EAGLE-3 training step, batch 1 x T, TTT {args.ttt_steps}, hidden {HIDDEN} ({HEADS}/{KV_HEADS} heads x "
        f"{HEAD_DIM}), draft vocab {DRAFT_VOCAB}, {'bf16 autocast' if bf16 else 'fp32'}, {args.threads} thread(s)"
    )
    header = f"{'T':>6} {'path':>9} {'peak MiB':>9} {'s/step':>7} {'plan MiB':>9} {'plan err':>8}"
    print(header + f" {'ref/new':>8}")
    for length in args.lengths:
        peaks: dict[str, int] = {}
        for impl in args.impls:
            m = measure(length, impl, args.ttt_steps, bf16, args.threads)
            peaks[impl] = m.peak_bytes
            line = f"{length:>6} {impl:>9} {m.peak_bytes / MIB:>9.0f} {m.seconds:>7.2f}"
            if impl == "chunked":
                plan = predicted(length, args.ttt_steps, bf16)
                line += f" {plan / MIB:>9.0f} {plan / m.peak_bytes - 1:>+8.1%}"
                if "reference" in peaks:
                    line += f" {peaks['reference'] / m.peak_bytes:>8.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
