"""What one target pass costs by rows and width on the CPU, the way the loaded target computes it against the way
transformers and torch would alone: `--compare linear` times torch's `nn.Linear` products against
`eval.cpu_linear.CpuLinear`, `--compare attention` transformers' `sdpa` attention against
`eval.cpu_attention.grouped_sdpa` (which reads grouped key/value heads in place). The prefill of a prompt, then passes
over `width` new slots per row, each cropped back, timed one configuration after the other per shape (the order
reversed every other repeat). Prints the median milliseconds per pass, their ratio, and how far slot 0's logits of a
wide pass are from a 1-wide pass's (the rounding two widths of one pass differ by).

    python launch/bench_target_pass.py configs/demo.yaml [model.dtype=float32] [--shapes 1x1,1x2,1x3,1x4,1x6,4x1,4x2]
        [--compare linear|attention] [--prompt-length 128] [--passes 10] [--repeats 3]

To see what an AVX2-only machine's kernels do on an AVX-512 one, cap them (the memory system stays this machine's):
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.eval.cpu_attention import NAME
from draftsmith.eval.cpu_linear import CpuLinear
from draftsmith.eval.runner import HFTarget
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--shapes", default="1x1,1x2,1x3,1x4,1x6,4x1,4x2", help="rows x width per pass")
    ap.add_argument("--passes", type=int, default=10, help="timed passes per shape and configuration")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--compare", choices=["linear", "attention"], default="linear")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    loaded = load_target(cfg.model)
    model = loaded.model
    if loaded.device.type != "cpu":
        raise SystemExit(f"bench_target_pass measures CPU products; the target is on {loaded.device}")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    target = HFTarget(model, [], loaded.tokenizer.pad_token_id or 0)
    prompt = [
        int(t) for t in torch.randint(100, 1000, (args.prompt_length,), generator=torch.Generator().manual_seed(0))
    ]
    loaded_attention = model.config._attn_implementation
    if args.compare == "linear":
        configs = {"nn.Linear": torch.nn.Linear, "CpuLinear": CpuLinear}
    elif loaded_attention != NAME:
        raise SystemExit(f"--compare attention: the target loaded with {loaded_attention!r} attention, not {NAME!r}")
    else:
        configs = {"sdpa": "sdpa", "grouped_sdpa": NAME}
    loaded_config = list(configs)[1]

    def use(what) -> None:
        if args.compare == "attention":
            model.set_attn_implementation(what)
            return
        for m in linears:
            m.__class__ = what

    def passes(rows: int, width: int, n: int) -> tuple[list[float], torch.Tensor]:
        target.prefill([prompt] * rows)
        times, first = [], None
        for _ in range(n):
            tokens = torch.full((rows, width), 200)
            t0 = time.perf_counter()
            logits, _ = target.step(tokens, torch.ones(rows, width, dtype=torch.bool))
            times.append(time.perf_counter() - t0)
            first = logits[0, 0] if first is None else first
            for b in range(rows):
                target.keep(b, width, [0])
            target.compact()
        return times, first

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    times: dict[str, dict[tuple, list[float]]] = {c: {s: [] for s in shapes} for c in configs}
    slot0: dict[str, dict[tuple, torch.Tensor]] = {c: {} for c in configs}
    print(
        f"{model.dtype}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads; {len(linears)} linear layers",
        flush=True,
    )
    for rep in range(args.repeats):
        for shape in shapes:
            for name in configs if rep % 2 == 0 else list(configs)[::-1]:
                use(configs[name])
                ts, first = passes(*shape, args.passes)
                times[name][shape] += ts
                slot0[name][shape] = first
    use(configs[loaded_config])
    a_name, b_name = configs
    print(f"| rows x width | {a_name} ms | {b_name} ms | ratio | slot 0 vs 1-wide, max abs diff |")
    print("|---|---|---|---|---|")
    for shape in shapes:
        a, b = (statistics.median(times[c][shape]) * 1e3 for c in configs)
        ref = slot0[loaded_config].get((shape[0], 1))
        diff = f"{float((slot0[loaded_config][shape] - ref).abs().max()):.2e}" if ref is not None else "-"
        print(f"| {shape[0]} x {shape[1]} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {diff} |")


if __name__ == "__main__":
    main()
