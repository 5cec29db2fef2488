"""How well a run's EAGLE-3 drafter can tell its accepted first slots from its rejected ones, by its calibrated
confidence head and by its own top-1 draft probability, on the eval prompts at T = 0.

    python launch/bench_confidence.py RUN/config.yaml [--per-domain 4] [--max-new-tokens 64] [--out DIR]

Per eval prompt (the first `--per-domain` of each domain): the target's greedy continuation (plain decoding), then one
target pass over prompt + continuation for its aux features, and the drafter over all of them at once (its cached
decode, teacher-forced): the first slot drafted after each continuation position is accepted when its top token is
the target's next-but-one token (greedy verification). Prints, over all slots and per domain, the acceptance, the
ranking AUC (`eval.metrics.ranking_auc`: 0.5 is chance) of each score, and the acceptance of the slots each score puts
in its top 10 / 20 / 50%; writes OUT/bench_confidence.json. Eval reports the head's AUC over the slots a schedule
verified; this one scores every slot, so a schedule's choices do not select what is measured.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


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
    from draftsmith.eval.metrics import ranking_auc
    from draftsmith.eval.proposers import NoDraft
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.config import load_config
    from draftsmith.pipeline.evaluate import eval_prompts
    from draftsmith.pipeline.families import load_drafter
    from draftsmith.pipeline.inputs import trained_drafter
    from draftsmith.pipeline.target import load_target

    cfg = load_config(args.config, [*args.overrides, f"eval.max_prompts_per_domain={args.per_domain}"])
    if "eagle3" not in cfg.train.drafters:
        raise SystemExit("bench_confidence scores an EAGLE-3 drafter; this run's train.drafters has none")
    loaded = load_target(cfg.model)
    tok, model = loaded.tokenizer, loaded.model
    drafter = load_drafter(trained_drafter(cfg, loaded.identity, None, "eagle3")).to(loaded.device, model.dtype).eval()
    ids = draft_to_target_ids(drafter.d2t).to(loaded.device)
    plain = HFTarget(model, [], tok.pad_token_id or 0)
    hooked = HFTarget(model, drafter.config.aux_layer_ids, tok.pad_token_id or 0)
    slots: list[tuple[str, float, float, float]] = []  # (domain, head confidence, top-1 probability, accepted)
    for prompt in tqdm(eval_prompts(cfg, tok), desc="prompts", unit="prompt"):
        [res] = decode(plain, NoDraft(), [prompt["ids"]], SamplingParams(temperature=0.0), 1, args.max_new_tokens)
        seq = list(prompt["ids"]) + res.tokens
        with torch.no_grad():
            _, feats, _ = hooked.prefill([seq])
            n = len(seq)
            nxt = torch.tensor([seq[1:] + [0]], device=loaded.device)
            positions = torch.arange(n, device=loaded.device)[None]
            logits, conf, _ = drafter.decode(feats, nxt, positions, drafter.new_cache(), from_target=True)
        probs = torch.softmax(logits[0].float(), -1)
        top = probs.max(-1)
        head = drafter.calibrated(conf[0], 0)
        # the entry at position t (the target's features there, token t + 1) drafts token t + 2; the first slots of
        # decoding start at the prompt's last token
        for t in range(len(prompt["ids"]) - 1, n - 2):
            accepted = float(int(ids[top.indices[t]]) == seq[t + 2])
            slots.append((prompt["domain"], float(head[t]), float(top.values[t]), accepted))

    def summary(rows: list[tuple[str, float, float, float]]) -> dict:
        out: dict = {"slots": len(rows), "accepted": sum(r[3] for r in rows) / max(len(rows), 1)}
        for name, k in (("head", 1), ("top1", 2)):
            out[f"auc_{name}"] = ranking_auc([(r[k], r[3]) for r in rows])
            ranked = sorted(rows, key=lambda r: -r[k])
            for share in (0.1, 0.2, 0.5):
                chosen = ranked[: max(1, round(share * len(ranked)))]
                out[f"accepted_{name}_top{round(100 * share)}"] = sum(r[3] for r in chosen) / len(chosen)
        return out

    by_domain: dict[str, list] = defaultdict(list)
    for row in slots:
        by_domain[row[0]].append(row)
    result = {"all": summary(slots), "domains": {d: summary(rows) for d, rows in by_domain.items()}}

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
    out = args.out or cfg.run_path / "bench_confidence"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_confidence.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_confidence.json'}")


if __name__ == "__main__":
    main()
