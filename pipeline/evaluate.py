"""`draftsmith eval`: acceptance length per domain and real speedup, with the exact verifier.

For every prompt, plain decoding, the prompt-lookup baseline and the trained drafter run back to back on
the same target in the same process, so speedups compare like with like. Output: RUN_DIR/eval/eval.json
(every number with its settings), report.md (also printed) and PNG plots.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from data.artifacts import write_manifest
from data.chat import prompt_ids, stop_token_ids
from data.sources import iter_conversations
from drafters.registry import load_drafter
from eval.batch import decode_batch
from eval.engine import TreeSpec, decode
from eval.metrics import acceptance_stats, calibration
from eval.proposers import Eagle3Proposer, NoDraft, PromptLookup
from eval.report import markdown_table, plots
from eval.runner import HFTarget
from eval.sampling import SamplingParams
from pipeline.config import RunConfig
from pipeline.console import console
from pipeline.errors import StageError
from pipeline.target import load_target
from pipeline.train import trained_drafter

log = logging.getLogger(__name__)


def eval_prompts(cfg: RunConfig, tok) -> list[dict[str, Any]]:
    prompts = []
    for src in cfg.eval.sources:
        counts: Counter = Counter()
        n = 0
        for conv in iter_conversations(src, counts):
            if cfg.eval.max_prompts is not None and n >= cfg.eval.max_prompts:
                break
            first_reply = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
            prompts.append({"id": conv["id"], "domain": conv["domain"], "ids": prompt_ids(tok, conv["messages"][:first_reply])})
            n += 1
        if n == 0:
            raise StageError(f"eval source {src.name} yielded no prompt (counts: {dict(counts)})")
    return prompts


def run_eval(cfg: RunConfig, drafter: str | None = None) -> Path:
    e = cfg.eval
    target = load_target(cfg.model)
    model, tok = target.model, target.tokenizer
    stops = stop_token_ids(tok, model)
    proposers: dict[str, Any] = {"none": NoDraft()}
    if "prompt_lookup" in e.drafters:
        proposers["prompt_lookup"] = PromptLookup(e.prompt_lookup_max_ngram)
    drafter_info = None
    if e.tree_depth is not None and e.batch_size > 1:
        raise StageError("eval.tree_depth (tree drafting) runs one prompt at a time: set eval.batch_size=1")
    tree = TreeSpec(e.tree_depth, e.tree_top_k, e.tree_nodes) if e.tree_depth else None
    if e.confidence_threshold is not None and e.batch_size > 1:
        raise StageError("eval.confidence_threshold (adaptive draft length) runs one prompt at a time: set eval.batch_size=1")
    if "trained" in e.drafters:
        path = trained_drafter(cfg, target.identity, drafter or e.drafter_path)
        try:
            d = load_drafter(path).to(target.device, model.dtype)
        except (ValueError, KeyError, OSError) as exc:
            raise StageError(f"cannot load the drafter in {path}: {exc}") from None
        proposers[d.name] = Eagle3Proposer(d, e.confidence_threshold)
        drafter_info = {"path": str(path), "family": d.name, "aux_layer_ids": d.config.aux_layer_ids}
    plain = HFTarget(model)
    with_features = HFTarget(model, aux_ids=drafter_info["aux_layer_ids"]) if drafter_info else None
    prompts = eval_prompts(cfg, tok)
    log.info("eval: %d prompts, drafters %s, temperatures %s", len(prompts), list(proposers), e.temperatures)

    runs = []
    for temperature in e.temperatures:
        params = SamplingParams(temperature, e.top_p, e.top_k)
        gen = torch.Generator().manual_seed(e.seed)
        by: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        diverged: Counter = Counter()
        by_domain: dict[str, list] = defaultdict(list)
        for p in prompts:
            by_domain[p["domain"]].append(p)
        batches = [group[i:i + e.batch_size] for group in by_domain.values() for i in range(0, len(group), e.batch_size)]
        bar = tqdm(total=len(prompts), desc=f"eval T={temperature}", unit="prompt")
        for batch in batches:
            outputs = {}
            for name, proposer in proposers.items():
                ids = [p["ids"] for p in batch]
                if e.batch_size == 1:
                    runner = with_features if getattr(proposer, "needs_features", False) else plain
                    res = [decode(runner, proposer, ids[0], params, e.draft_length, e.max_new_tokens, stops, gen,
                                  tree=tree if hasattr(proposer, "propose_tree") else None)]
                else:
                    res = decode_batch(model, ids, name, params, e.draft_length, e.max_new_tokens, stops, gen,
                                       drafter=getattr(proposer, "drafter", None), pad_id=tok.pad_token_id,
                                       max_ngram=e.prompt_lookup_max_ngram)
                by[batch[0]["domain"]][name].extend(res)
                outputs[name] = [r.tokens for r in res]
            if params.greedy:
                for name, toks in outputs.items():
                    diverged[name] += sum(a != b for a, b in zip(toks, outputs["none"]))
            bar.update(len(batch))
        bar.close()
        domains = {}
        for domain, per in by.items():
            row = {name: acceptance_stats(results, e.draft_length) for name, results in per.items()}
            for name in row:
                if name != "none" and row["none"]["tokens_per_s"]:
                    row[name]["speedup"] = row[name]["tokens_per_s"] / row["none"]["tokens_per_s"]
            domains[domain] = row
        overall = {}
        for name in proposers:
            results = [r for per in by.values() for r in per[name]]
            overall[name] = acceptance_stats(results, e.draft_length)
            overall[name]["calibration"] = calibration(results)
            if name != "none":
                overall[name]["speedup"] = overall[name]["tokens_per_s"] / overall["none"]["tokens_per_s"]
        run = {"temperature": temperature, "drafters": list(proposers), "domains": domains, "overall": overall}
        if params.greedy:
            run["greedy_divergence"] = {n: {"prompts": diverged[n], "of": len(prompts)} for n in proposers if n != "none"}
        runs.append(run)

    out = cfg.run_path / "eval"
    out.mkdir(parents=True, exist_ok=True)
    ev = {
        "target": target.identity,
        "drafter": drafter_info,
        "settings": {**e.model_dump(mode="json"), "device": str(target.device), "dtype": str(model.dtype),
                     "prompts": len(prompts)},
        "runs": runs,
    }
    (out / "eval.json").write_text(json.dumps(ev, indent=2))
    table = markdown_table(ev)
    written = plots(ev, out)
    (out / "report.md").write_text(f"# draftsmith eval\n\nTarget: `{target.identity['name']}`; drafter: "
                                   f"`{drafter_info['path'] if drafter_info else 'none'}`; device {target.device}, "
                                   f"{model.dtype}; {len(prompts)} prompts.\n\n{table}\n"
                                   + "".join(f"\n![{w}]({w})\n" for w in written))
    write_manifest(out, "eval", target=target.identity, drafter=drafter_info, files=["eval.json", "report.md", *written])
    console.print(table, highlight=False)
    return out
