"""How much of what the target writes on the eval prompts its drafter could have learned to draft: per eval domain, the
share of the target's own answer tokens that appear anywhere among the training answers, and the share inside the
drafter's draft vocabulary (a token outside it can never be drafted, so this share is a ceiling on every slot's
acceptance at T = 0). Then the same share for other draft vocabulary sizes, chosen from the same training counts.

    python launch/bench_vocab_coverage.py RUN/config.yaml [run_dir=...] [--drafter eagle3] [--per-domain 4]
        [--max-new-tokens 64] [--sizes 2048,4096,8192,16384]

The answers are the target's greedy ones (what T = 0 serving verifies), decoded here with plain decoding. A token seen
in no training answer is one the drafter was never trained to put first, whatever the vocabulary holds: on the
demo (2026-12-06) 71% of the eval answers' tokens were seen in training (61% in coding), while the 8,192-token
draft vocabulary held 88% of them, its last ~6,000 entries filled by lowest id among unseen tokens. A better fill
cannot reach what the training never showed; more varied training answers can.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import torch


def _pooled(answers: Mapping[str, Sequence[int]]) -> torch.Tensor:
    """Every domain's answer tokens, one after another, as one id tensor."""
    return torch.tensor([t for tokens in answers.values() for t in tokens], dtype=torch.int64)


def _shares(domain: str, ids: torch.Tensor, counts: torch.Tensor, t2d: torch.Tensor) -> dict[str, float]:
    if not ids.numel():
        raise ValueError(f"domain {domain!r} has no answer tokens to measure coverage on")
    return {
        "seen": float((counts[ids] > 0).double().mean()),
        "in_vocab": float(t2d[ids].double().mean()),
        "tokens": float(ids.numel()),
    }


def coverage(
    answers: Mapping[str, Sequence[int]], counts: torch.Tensor, t2d: torch.Tensor
) -> dict[str, dict[str, float]]:
    """Per domain (and `all`): `seen`, the share of the answer tokens counted at least once in `counts` (the training
    answers' token counts over the target vocabulary), `in_vocab`, the share inside the draft vocabulary `t2d` (bool over
    the target vocabulary), and `tokens`, how many there are. A domain with no answer tokens is refused: its shares
    would be 0/0."""
    out = {
        domain: _shares(domain, torch.tensor(list(tokens), dtype=torch.int64), counts, t2d)
        for domain, tokens in answers.items()
    }
    out["all"] = _shares("all", _pooled(answers), counts, t2d)
    return out


def coverage_by_size(
    answers: Mapping[str, Sequence[int]], counts: torch.Tensor, sizes: Sequence[int]
) -> dict[int, float]:
    """The share of all answer tokens inside a draft vocabulary of each size, chosen from `counts` as training chooses
    it (`select_draft_vocab`)."""
    from draftsmith.drafters.vocab import select_draft_vocab

    ids = _pooled(answers)
    return {size: float(select_draft_vocab(counts, size)[1][ids].double().mean()) for size in sizes}


def main() -> None:
    from safetensors.torch import load_file

    from draftsmith.pipeline.evaluate import bench_inputs
    from draftsmith.pipeline.layout import RunLayout
    from draftsmith.pipeline.train import feature_source, token_counts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. run_dir=runs/exp")
    ap.add_argument("--drafter", default="eagle3", help="whose draft vocabulary (RUN_DIR/train/<drafter>/vocab)")
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="2048,4096,8192,16384")
    args = ap.parse_args()

    inputs = bench_inputs(args.config, args.overrides, args.per_domain, [])  # the vocabulary's file, not a drafter
    cfg, target = inputs.cfg, inputs.target
    tok, model = target.tokenizer, target.model
    vocab = model.config.vocab_size
    source, _, _ = feature_source(cfg, target.identity, model.config)
    counts = token_counts(source, vocab)
    t2d = load_file(str(RunLayout.of(cfg).train(args.drafter).vocab))["t2d"]
    print(
        f"training answers: {int(counts.sum())} tokens, {int((counts > 0).sum())} distinct; "
        f"{args.drafter}'s draft vocabulary: {int(t2d.sum())} tokens"
    )

    answers: dict[str, list[int]] = {}
    for prompt in inputs.prompts:
        ids = torch.tensor([prompt["ids"]], device=target.device)
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        answers.setdefault(prompt["domain"], []).extend(out[0, ids.shape[1] :].tolist())

    print(f"\nthe target's greedy answers ({args.max_new_tokens} tokens at most) on the eval prompts:")
    print(f"{'domain':12s} {'tokens':>7s} {'seen in training':>17s} {'in draft vocab':>15s}")
    for domain, c in coverage(answers, counts, t2d).items():
        print(f"{domain:12s} {int(c['tokens']):7d} {c['seen']:17.1%} {c['in_vocab']:15.1%}")
    print("\nin a draft vocabulary of each size, chosen from the same training counts:")
    for size, share in coverage_by_size(answers, counts, [int(s) for s in args.sizes.split(",")]).items():
        print(f"  {size:6d}: {share:.1%}")


if __name__ == "__main__":
    main()
