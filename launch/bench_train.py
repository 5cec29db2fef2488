"""Benchmark EAGLE-3 training on real target features: tokens/s with TTT k=7, and where the time goes.

    python launch/bench_train.py                         # SmolLM2-135M-Instruct, 32k draft vocab, k=7, fp32 on CPU
    python launch/bench_train.py --steps 20 --batch-tokens 4096

Features come from the target itself (aux layers [2, L//2, L-3] + final state) on MT-Bench prompts padded
out with sampled tokens, computed once up front. Each timed step is the trainer's own objective
(teacher head + TTT unroll + losses) + backward + AdamW step. The frozen teacher head (the target's
lm_head over every position, chunked) is also timed on its own, so its share of a step is reported.

Every batch is stepped twice, side by side: once as in the first epoch (the objective computes the teacher's
full-vocabulary argmax and normalizer itself) and once as in every later epoch and holdout evaluation, where the
trainer's teacher cache (`drafters/teacher_cache.py`) serves them and only the draft-vocab columns are computed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps (after 2 warm-up steps)")
    ap.add_argument("--temperature", type=float, default=1.0, help="teacher temperature (0: greedy)")
    ap.add_argument("--bf16", action="store_true", help="the step under bf16 autocast (the teacher stays fp32)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from collections import Counter

    from draftsmith.data.chat import prompt_ids
    from draftsmith.data.features import FeatureCapture
    from draftsmith.data.sources import iter_conversations
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.losses import full_vocab_stats
    from draftsmith.drafters.objectives import ObjectiveSettings, eagle3_objective
    from draftsmith.drafters.teacher_cache import TeacherCache, record_keys
    from draftsmith.drafters.vocab import select_draft_vocab
    from draftsmith.pipeline.config import ModelConfig, SourceConfig
    from draftsmith.pipeline.target import load_target

    target = load_target(ModelConfig(target=args.target, dtype="float32"))
    model, tok = target.model, target.tokenizer
    rng = random.Random(0)
    prompts = [
        prompt_ids(tok, c["messages"][:1]) for c in iter_conversations(SourceConfig(builtin="mtbench"), Counter())
    ]
    per_batch = max(1, args.batch_tokens // args.seq_len)
    capture = FeatureCapture(model, None)
    batches = []
    for b in range(args.steps + 2):
        rows = []
        for j in range(per_batch):
            p = prompts[(b * per_batch + j) % len(prompts)][: args.seq_len // 2]
            rows.append(p + [rng.randrange(100, 20000) for _ in range(args.seq_len - len(p))])
        ids = torch.tensor(rows)
        aux, final = capture(ids)
        mask = torch.zeros_like(ids, dtype=torch.uint8)
        mask[:, args.seq_len // 2 :] = 1
        batch = {
            "input_ids": ids,
            "loss_mask": mask,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "aux": aux,
            "final": final,
            "ids": [f"b{b}-{j}" for j in range(per_batch)],
        }
        batches.append({**batch, "record_keys": record_keys(batch)})
    counts = torch.bincount(torch.cat([b["input_ids"].flatten() for b in batches]), minlength=model.config.vocab_size)
    d2t, t2d = select_draft_vocab(counts, min(args.draft_vocab, model.config.vocab_size))
    head = model.get_output_embeddings().weight.detach()
    drafter = Eagle3Drafter.from_target(
        model.config, capture.aux_ids, d2t.numel(), model.get_input_embeddings().weight, d2t, t2d
    )
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    settings = ObjectiveSettings(steps=args.ttt_steps, temperature=args.temperature)
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    head = head.float()  # as the trainer holds it
    cache = TeacherCache(head, args.temperature, capacity_tokens=10**9)
    for batch in batches:
        cache.fill(batch)  # the first epoch, untimed: the cache keeps every record

    def step(batch) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, _ = eagle3_objective(drafter, batch, head, settings)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    first, later, head_times = [], [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        full_vocab_stats(batch["final"], head, settings.temperature)
        head_t = time.perf_counter() - t0
        uncached = step(batch)
        t0 = time.perf_counter()
        served = cache.fill(batch)
        cached = time.perf_counter() - t0 + step(served)
        if i >= 2:
            head_times.append(head_t)
            first.append(uncached)
            later.append(cached)
    tokens = per_batch * args.seq_len
    step_1, step_n, head_t = (statistics.median(x) for x in (first, later, head_times))
    ratio = statistics.median([a / b for a, b in zip(first, later)])
    print(
        f"target={args.target} threads={torch.get_num_threads()} drafter params={n_params / 1e6:.1f}M "
        f"draft_vocab={d2t.numel()} ttt_steps={args.ttt_steps} batch={per_batch}x{args.seq_len} tokens "
        f"temperature={args.temperature} {'bf16 autocast' if args.bf16 else 'fp32'}"
    )
    print(
        f"train step, first epoch (teacher computed whole): {step_1 * 1e3:8.1f} ms  -> {tokens / step_1:8.1f} tokens/s"
    )
    print(
        f"train step, later epochs (teacher cache served):  {step_n * 1e3:8.1f} ms  -> {tokens / step_n:8.1f} tokens/s"
    )
    print(f"paired ratio first / later (median over steps): {ratio:.2f}x")
    print(
        f"full-vocab argmax + normalizer alone (what the cache saves): {head_t * 1e3:8.1f} ms  = {head_t / step_1:.1%}"
    )
    if hasattr(__import__("resource"), "getrusage"):
        import resource

        print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
