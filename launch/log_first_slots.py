"""Every first slot a run's trained drafters draft on the eval prompts, decoded live, with its calibrated confidence and
whether the target accepted it: what `launch/replay_schedule.py` replays through the cost schedule.

    python launch/log_first_slots.py RUN/config.yaml [run_dir=...] [--per-domain 2] [--max-new-tokens 64]
        [--temperatures 0,1] [--drafters eagle3,dspark] [--out DIR]

Each eval prompt (the first `--per-domain` of each domain) is decoded alone by each drafter drafting two slots every
round (eval's engine, the fixed schedule), at each temperature: a round's first slot is scored by the confidence the
cost schedule predicts from and its fate is the live verification's (at T = 1 the sampled one, on the text that decode
sampled). Unlike `launch/bench_confidence.py` (EAGLE-3, teacher-forced over the greedy answer) it covers every family
and temperature, and answers as long as `--max-new-tokens`. Writes OUT/first_slots_{drafter}_T{T}.json per drafter and
temperature, in replay_schedule's layout (`slots`: domain, prompt, head, accepted per first slot, in decoding order;
`acceptance_t1` is the fate itself, so a replay at either temperature replays the logged fates; `by`: "round", one
slot per round, not per token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def first_slots(rounds: list[tuple[int, int]], confidences: list[list[float]], domain: str, prompt: int) -> list[dict]:
    """A decode's first slots in replay_schedule's layout, from its (drafted, accepted) rounds and their confidences
    (`eval.engine.DecodeResult`): one per round that drafted, accepted when the round kept a draft."""
    slots = []
    for (drafted, accepted), confs in zip(rounds, confidences, strict=True):
        if drafted and confs:  # a round may draft nothing (a row that ends before its round drafts)
            fate = float(accepted > 0)
            slots.append(
                {"domain": domain, "prompt": prompt, "head": confs[0], "accepted": fate, "acceptance_t1": fate}
            )
    return slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--per-domain", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--drafters", default="", help="families to log (default: the run's trained drafters)")
    ap.add_argument("--out", type=Path, default=None, help="default: RUN/first_slots")
    args = ap.parse_args()

    from tqdm import tqdm

    from draftsmith.data.chat import stop_token_ids
    from draftsmith.eval.runner import HFTarget
    from draftsmith.eval.sampling import SamplingParams
    from draftsmith.pipeline.evaluate import Decoder, bench_inputs
    from draftsmith.pipeline.families import get_family

    inputs = bench_inputs(
        args.config, args.overrides, args.per_domain, [f for f in args.drafters.split(",") if f] or None
    )
    cfg, target, prompts = inputs.cfg, inputs.target, inputs.prompts
    tok, model = target.tokenizer, target.model
    out = args.out or cfg.run_path / "first_slots"
    out.mkdir(parents=True, exist_ok=True)
    proposers = {}
    for family, drafter in inputs.drafters.items():
        proposers[family] = get_family(family).proposer(drafter, cfg.eval)
        proposers[family].use("fixed")
    decoder = Decoder(
        runners={n: HFTarget(model, p.aux_ids, tok.pad_token_id) for n, p in proposers.items()},
        proposers=proposers,
        gammas={n: 2 for n in proposers},  # a second slot: the first one's fate is known whether it was accepted or not
        stops=stop_token_ids(tok, model),
        tree=None,
        seed=cfg.eval.seed,
        device=target.device,
    )
    for temperature in [float(t) for t in args.temperatures.split(",") if t]:
        params = SamplingParams(temperature, cfg.eval.top_p, cfg.eval.top_k)
        for family in proposers:
            slots = []
            for index, prompt in enumerate(tqdm(prompts, desc=f"{family} T={temperature:g}", unit="prompt")):
                result = decoder.run([prompt], family, params, args.max_new_tokens)[0]
                slots += first_slots(result.rounds, result.confidences, prompt["domain"], index)
            path = out / f"first_slots_{family}_T{temperature:g}.json"
            record = {"temperature": temperature, "drafter": family, "by": "round", "slots": slots}
            path.write_text(json.dumps(record))
            share = sum(s["accepted"] for s in slots) / max(len(slots), 1)
            print(f"{family} T = {temperature:g}: {len(slots)} first slots, {share:.1%} accepted; wrote {path}")


if __name__ == "__main__":
    main()
