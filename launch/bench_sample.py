"""Seconds of one sampled token: `eval.sampling.sample` (the cumulative sum inverted at one uniform) against
torch.multinomial, over vocabularies of the sizes drafters and targets use, on one device. Medians over `--repeats`
draws, each from a fresh softmax of random logits, the two timed one after the other on the same distribution.

    python launch/bench_sample.py [--device cpu] [--vocabs 8192,32000,49152,128256,151936] [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from draftsmith.eval.engine import clock
from draftsmith.eval.sampling import make_generator, sample

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--device", default="cpu")
ap.add_argument("--vocabs", default="8192,32000,49152,128256,151936")
ap.add_argument("--repeats", type=int, default=300)
args = ap.parse_args()

device = torch.device(args.device)
gen = make_generator(device, 0)
print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; median ms per draw")
print("| vocabulary | torch.multinomial | sample | ratio |")
print("|---|---|---|---|")
for vocab in (int(v) for v in args.vocabs.split(",")):
    times: dict[str, list[float]] = {"multinomial": [], "sample": []}
    for _ in range(args.repeats):
        probs = torch.softmax(torch.randn(vocab, device=device, generator=gen), -1)
        start = clock(device)
        int(torch.multinomial(probs, 1, generator=gen))  # int(): the draw is read, as decoding reads it
        middle = clock(device)
        sample(probs, gen)
        times["multinomial"].append(middle - start)
        times["sample"].append(clock(device) - middle)
    m, s = (statistics.median(times[k]) * 1e3 for k in ("multinomial", "sample"))
    print(f"| {vocab} | {m:.3f} | {s:.3f} | {m / s:.1f}x |")
