"""How well a run's EAGLE-3 drafter can tell its accepted first slots from its rejected ones, by its calibrated
confidence head and by its own top-1 draft probability, on the eval prompts at T = 0.

    python launch/bench_confidence.py RUN/config.yaml [--per-domain 4] [--max-new-tokens 64] [--out DIR]

Per eval prompt (the first `--per-domain` of each domain): the target's greedy continuation (plain decoding), then one
target pass over prompt + continuation for its aux features, and the drafter over all of them at once (its cached
decode, teacher-forced): the first slot drafted after each continuation position is accepted when its top token is the
target's next-but-one token (greedy verification). Prints, over all slots and per domain, the acceptance, the ranking
AUC (`eval.metrics.ranking_auc`: 0.5 is chance) of each score (`SCORES`), and the acceptance of the slots each score
puts in its top 10 / 20 / 50%; writes OUT/bench_confidence.json (with every slot scored, in decoding order, for
launch/replay_schedule.py, with each slot's chance of acceptance at T = 1 on the same prefix, sum_v min(p, q)). The
scores a round knows before it drafts (one round old, or the target's own) say whether a schedule could skip the draft
round where its slot would fail; on the demo's drafter (AMD EPYC, bf16) all ranked at chance (AUC 0.49-0.55), against
0.72 for the slot's own top-1. Eval reports the head's AUC over the slots a schedule verified; this one scores every
slot, so a schedule's choices do not select what is measured. Per prompt, it also scores what the prompt's own text
says before decoding (`PROMPT_SCORES`) and prints their rank correlation with the share of the answer's first slots
accepted: a prompt-level estimate would let a schedule skip a weak prompt from its first round. On the demo's drafter
(an AMX Xeon, bf16, 45 prompts) neither ranked them: 0.04 and 0.21 (docs/benchmarks.md, 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

SCORES = ("head", "top1", "target_top1", "last_head", "last_top1", "last_accepted", "recent_accepted")
"""What a first slot is scored by: the drafter's calibrated head and its top-1 probability for this slot (known once
the drafter has run), and what a round knows before it drafts: the target's top-1 probability for the token just
committed, the last slot's head, top-1 probability and fate, and an exponential mean of the decode's earlier fates."""
BEFORE = SCORES[2:]
PROMPT_SCORES = ("prompt_agreement", "prompt_head")
"""What a prompt's own text says of the drafter's level on it, before its answer is decoded: over the prompt's entries
(the chat template left out), the share whose drafted token is the target's own top token at the prefill (a first
slot's T = 0 acceptance, teacher-forced on the prompt), and the mean calibrated head."""


def _template_ends(prompts: list[list[int]]) -> tuple[int, int]:
    """(tokens every prompt starts with, tokens every prompt ends with): the chat template's system turn and generation
    prompt, left out of a prompt's own text."""
    first, shortest = prompts[0], min(len(p) for p in prompts)
    head = next((i for i in range(shortest) if any(p[i] != first[i] for p in prompts)), shortest)
    tail = next(
        (i for i in range(shortest - head) if any(p[-1 - i] != first[-1 - i] for p in prompts)), shortest - head
    )
    return head, tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from draftsmith.drafters.vocab import draft_to_target_ids
    from draftsmith.eval.engine import decode
    from draftsmith.eval.metrics import rank_correlation, ranking_auc
    from draftsmith.eval.proposers import NoDraft
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.evaluate import bench_inputs

    # an EAGLE-3 drafter's (a run without one: bench_inputs says there is no trained drafter where it looked)
    inputs = bench_inputs(args.config, args.overrides, args.per_domain, ["eagle3"])
    cfg, loaded, prompts, drafter = inputs.cfg, inputs.target, inputs.prompts, inputs.drafters["eagle3"]
    tok, model = loaded.tokenizer, loaded.model
    ids = draft_to_target_ids(drafter.d2t).to(loaded.device)
    plain = HFTarget(model, [], tok.pad_token_id or 0)
    hooked = HFTarget(model, drafter.config.aux_layer_ids, tok.pad_token_id or 0)
    slots: list[dict] = []  # per first slot: its domain, whether it was accepted, and each score (None: none yet)
    template = _template_ends([p["ids"] for p in prompts])
    levels: list[dict] = []  # per prompt: what its own text says before decoding, and its answer's acceptance
    for index, prompt in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        [res] = decode(plain, NoDraft(), [prompt["ids"]], SamplingParams(temperature=0.0), 1, args.max_new_tokens)
        seq = list(prompt["ids"]) + res.tokens
        with torch.no_grad():
            target_logits, feats, _ = hooked.prefill([seq])
            n = len(seq)
            nxt = torch.tensor([seq[1:] + [0]], device=loaded.device)
            positions = torch.arange(n, device=loaded.device)[None]
            logits, conf, _ = drafter.decode(feats, nxt, positions, drafter.new_cache(), from_target=True)
        q = torch.softmax(logits[0].float(), -1)
        top = q.max(-1)
        p = torch.softmax(target_logits[0].float(), -1)
        # at T = 1 a slot drafted from q is accepted with probability sum_v min(p(v), q(v)) (the target's p for the
        # same token, one position on; q lives on the draft vocabulary)
        alpha = torch.minimum(p[1:, ids], q[:-1]).sum(-1).tolist()
        head = drafter.calibrated(conf[0], 0).tolist()
        top1 = top.values.tolist()
        target_top1 = p.max(-1).values.tolist()
        # the entry at position t (the target's features there, token t + 1) drafts token t + 2; the first slots of
        # decoding start at the prompt's last token
        first = len(prompt["ids"]) - 1
        hit = [float(int(ids[top.indices[t]]) == seq[t + 2]) for t in range(n - 2)]
        recent = None  # exponential mean (weight 0.3 on the newest) of the decode's earlier first slots' fate
        for t in range(first, n - 2):
            old = t > first  # a slot one round back exists
            slots.append(
                {
                    "domain": prompt["domain"],
                    "prompt": index,
                    "accepted": hit[t],
                    "acceptance_t1": alpha[t],  # its chance at T = 1, on the greedy continuation's prefix
                    "head": head[t],
                    "top1": top1[t],
                    "target_top1": target_top1[t],  # the target's pass that gave token t + 1: known before drafting
                    "last_head": head[t - 1] if old else None,
                    "last_top1": top1[t - 1] if old else None,
                    "last_accepted": hit[t - 1] if old else None,
                    "recent_accepted": recent,
                }
            )
            recent = hit[t] if recent is None else 0.7 * recent + 0.3 * hit[t]
        # the entries whose drafted token (t + 2) is the prompt's own text, template left out: known at the prefill
        lo, hi = max(template[0] - 2, 0), len(prompt["ids"]) - template[1] - 2
        agree = (ids[top.indices[lo:hi]] == target_logits[0, lo + 1 : hi + 1].argmax(-1)).float()
        levels.append(
            {
                "domain": prompt["domain"],
                "prompt": index,
                "answer_accepted": sum(hit[first : n - 2]) / max(n - 2 - first, 1),
                "prompt_agreement": float(agree.mean()) if hi > lo else None,
                "prompt_head": sum(head[lo:hi]) / (hi - lo) if hi > lo else None,
            }
        )

    def summary(rows: list[dict]) -> dict:
        out: dict = {"slots": len(rows), "accepted": sum(r["accepted"] for r in rows) / max(len(rows), 1)}
        for name in SCORES:
            scored = [(r[name], r["accepted"]) for r in rows if r[name] is not None]
            out[f"auc_{name}"] = ranking_auc(scored)
            ranked = sorted(scored, key=lambda r: -r[0])
            for share in (0.1, 0.2, 0.5):
                chosen = ranked[: max(1, round(share * len(ranked)))]
                out[f"accepted_{name}_top{round(100 * share)}"] = sum(r[1] for r in chosen) / len(chosen)
        return out

    by_domain: dict[str, list] = defaultdict(list)
    for row in slots:
        by_domain[row["domain"]].append(row)
    result = {
        "all": summary(slots),
        "domains": {d: summary(rows) for d, rows in by_domain.items()},
        "slots": slots,  # every first slot in decoding order per prompt (launch/replay_schedule.py replays them)
        "prompts": levels,
    }
    scored = {k: [x for x in levels if x[k] is not None] for k in PROMPT_SCORES}
    result["prompt_level"] = {
        k: rank_correlation([x[k] for x in rows], [x["answer_accepted"] for x in rows]) for k, rows in scored.items()
    }

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    where = (
        loaded.device.type if loaded.device.type != "cpu" else f"cpu, {torch.backends.cpu.get_cpu_capability()} kernels"
    )
    print(f"\nEAGLE-3 first slots at T = 0 ({where}, {model.dtype})")
    print(
        "| domain | slots | accepted | AUC head | AUC top-1 | top 10% head | top 10% top-1 | top 20% head | top 20% top-1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in [*sorted(result["domains"].items()), ("**all**", result["all"])]:
        print(
            f"| {name} | {s['slots']} | {s['accepted']:.1%} | {fmt(s['auc_head'])} | {fmt(s['auc_top1'])} | "
            f"{s['accepted_head_top10']:.1%} | {s['accepted_top1_top10']:.1%} | "
            f"{s['accepted_head_top20']:.1%} | {s['accepted_top1_top20']:.1%} |"
        )
    print("\nAUC of what a round knows before it drafts (the next first slot's fate)")
    print("| domain | " + " | ".join(BEFORE) + " |")
    print("|---|" + "---|" * len(BEFORE))
    for name, s in [*sorted(result["domains"].items()), ("**all**", result["all"])]:
        print(f"| {name} | " + " | ".join(fmt(s[f"auc_{k}"]) for k in BEFORE) + " |")
    print(
        f"\nPer prompt ({len(levels)}): rank correlation of what its own text says, before decoding, with the share of "
        "its answer's first slots accepted"
    )
    print("| score | Spearman |\n|---|---|")
    for k, r in result["prompt_level"].items():
        print(f"| {k} | {fmt(r)} |")
    out = args.out or cfg.run_path / "bench_confidence"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_confidence.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_confidence.json'}")


if __name__ == "__main__":
    main()
