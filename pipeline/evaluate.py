"""`draftsmith eval`: acceptance length per domain and real speedup, with the exact verifier.

For every prompt, plain decoding, the prompt-lookup baseline and the trained drafters run side by side, a round at a
time, on the same target in the same process, so speedups compare like with like. Under torchrun / accelerate launch
each rank decodes a share of the prompt batches on its own device and the main process merges and writes the results.
Output: RUN_DIR/eval/eval.json (every number with its settings), report.md (also printed) and PNG plots.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from draftsmith.data.artifacts import atomic_write_text, write_manifest
from draftsmith.data.chat import prompt_ids, stop_token_ids
from draftsmith.data.sources import iter_conversations
from draftsmith.eval.costs import cached_costs, cost_key, measure_costs
from draftsmith.eval.curve import MIN_ROWS, batch_curve, curve_points
from draftsmith.eval.engine import TreeSpec, decoding, finish, interleave
from draftsmith.eval.metrics import acceptance_stats, calibration, first_difference_margin, speedup_interval
from draftsmith.eval.proposers import NoDraft, PromptLookup, TrainedProposer
from draftsmith.eval.report import cost_tables_markdown, markdown_table, plots
from draftsmith.eval.runner import HFTarget
from draftsmith.eval.sampling import SamplingParams, derive_seed, make_generator
from draftsmith.eval.schedule import CostTable, merge_corrections
from draftsmith.pipeline.completion import clear, stage_inputs, write_progress
from draftsmith.pipeline.config import RunConfig, load_config
from draftsmith.pipeline.console import console
from draftsmith.pipeline.dist import dist_state
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.families import get_family, load_drafter
from draftsmith.pipeline.inputs import trained_drafter
from draftsmith.pipeline.layout import RunLayout
from draftsmith.pipeline.target import Target, cache_root, load_target

log = logging.getLogger(__name__)


def eval_prompts(cfg: RunConfig, tok) -> list[dict[str, Any]]:
    prompts = []
    for src in cfg.eval.sources:
        counts: Counter = Counter()
        per_domain: Counter = Counter()
        n = 0
        for conv in iter_conversations(src, counts):
            if cfg.eval.max_prompts is not None and n >= cfg.eval.max_prompts:
                break
            if cfg.eval.max_prompts_per_domain is not None:
                if per_domain[conv["domain"]] >= cfg.eval.max_prompts_per_domain:
                    continue
                per_domain[conv["domain"]] += 1
            first_reply = next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")
            prompts.append(
                {"id": conv["id"], "domain": conv["domain"], "ids": prompt_ids(tok, conv["messages"][:first_reply])}
            )
            n += 1
        if n == 0:
            raise StageError(f"eval source {src.name} yielded no prompt (counts: {dict(counts)})")
    return prompts


@dataclass
class BenchInputs:
    """What a bench of a run's trained drafters on its eval prompts starts from (`bench_inputs`)."""

    cfg: RunConfig
    target: Target
    prompts: list[dict[str, Any]]
    """Eval's prompts, as `eval_prompts` gives them (id, domain, ids)."""
    drafters: dict[str, Any]
    """family -> its trained drafter of the run, on the target's device and dtype, in eval mode."""


def bench_inputs(
    config: str | Path, overrides: list[str], per_domain: int, families: list[str] | None = None
) -> BenchInputs:
    """The setup the launch/ benches share: the run's config (`overrides` applied, then
    eval.max_prompts_per_domain = `per_domain`: the bench's own flag wins), its target, the eval prompts, and the
    trained drafter of each of `families` (None: the run's train.drafters; [] loads none)."""
    cfg = load_config(config, [*overrides, f"eval.max_prompts_per_domain={per_domain}"])
    target = load_target(cfg.model)
    drafters = {
        family: load_drafter(trained_drafter(cfg, target.identity, None, family))
        .to(target.device, target.model.dtype)
        .eval()
        for family in (cfg.train.drafters if families is None else families)
    }
    return BenchInputs(cfg, target, eval_prompts(cfg, target.tokenizer), drafters)


def _proposers(cfg: RunConfig, target, drafter: str | None, tree: TreeSpec | None):
    """The proposers eval compares (plain decoding first), and what is recorded about each trained drafter."""
    e = cfg.eval
    proposers: dict[str, Any] = {"none": NoDraft()}
    if "prompt_lookup" in e.drafters:
        proposers["prompt_lookup"] = PromptLookup(e.prompt_lookup_max_ngram)
    info: dict[str, dict[str, Any]] = {}
    if "trained" not in e.drafters:
        return proposers, info
    explicit = drafter or e.drafter_path
    paths = (
        [trained_drafter(cfg, target.identity, explicit)]
        if explicit
        else [trained_drafter(cfg, target.identity, None, family) for family in cfg.train.drafters]
    )
    for path in paths:
        try:
            d = load_drafter(path).to(target.device, target.model.dtype)
        except (ValueError, KeyError, OSError) as exc:
            raise StageError(f"cannot load the drafter in {path}: {exc}") from None
        family = get_family(d.name)
        if tree is not None and not family.trees:
            raise StageError(f"the {d.name} drafter drafts no trees: leave eval.tree_depth unset")
        proposers[d.name] = family.proposer(d, e)
        info[d.name] = {
            "path": str(path),
            "family": d.name,
            "aux_layer_ids": d.config.aux_layer_ids,
            "config": d.config.to_dict(),
        }
        calib = path / "calibration.json"
        if calib.is_file():
            info[d.name]["calibration"] = json.loads(calib.read_text())
    return proposers, info


@dataclass
class Decoder:
    """Runs one batch of prompts with one proposer through the engine: what every call of `run_eval` shares."""

    runners: dict[str, HFTarget]
    proposers: dict[str, Any]
    gammas: dict[str, int]
    stops: Any
    tree: TreeSpec | None
    seed: int
    device: Any

    def decoding(self, batch: list[dict[str, Any]], name: str, params: SamplingParams, max_new_tokens: int):
        """One batch of prompts with one proposer, as the engine's step-at-a-time decode (`eval.engine.decoding`)."""
        # one generator per prompt, seeded by the prompt and the temperature: a prompt's sampled output does not
        # depend on its batch, its rank or the rank count. On the target's device (CUDA refuses a CPU generator).
        gens = [make_generator(self.device, derive_seed(self.seed, p["id"], params.temperature)) for p in batch]
        proposer = self.proposers[name]
        return decoding(
            self.runners[name],
            proposer,
            [p["ids"] for p in batch],
            params,
            self.gammas[name],
            max_new_tokens,
            self.stops,
            gens,
            tree=self.tree if hasattr(proposer, "propose_tree") else None,
        )

    def run(self, batch: list[dict[str, Any]], name: str, params: SamplingParams, max_new_tokens: int):
        """One batch of prompts with one proposer, decoded to the end."""
        return finish(self.decoding(batch, name, params, max_new_tokens))

    def temperature(
        self,
        mine: list[list[dict[str, Any]]],
        params: SamplingParams,
        max_new_tokens: int,
        desc: str,
        reverse_first: bool = False,
    ):
        """Every batch of this rank with every proposer: results per domain and proposer, and at T = 0, per proposer,
        one entry per prompt its output differs from plain decoding's on (exactness: none in float32; in bf16,
        near-ties): the target's logit margin at the first differing token (`first_difference_margin`).

        The proposers decode a batch side by side, a round at a time, keeping pace in time (`eval.engine.interleave`):
        a spell of the machine running slow or fast reaches them all, so their speed ratios hold on a shared CPU.
        Ties go to plain decoding first for the first batch, to the proposers in reverse for the next, and so on
        (`reverse_first` starts reversed: a second repeat)."""
        runners = [self.runners[n] for n in self.proposers if n in self.runners]
        if len({id(r) for r in runners}) < len(runners):
            raise ValueError(
                "Decoder: every proposer needs its own runner (each holds a KV cache; they decode side by side)"
            )
        by: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        diverged: dict[str, list] = defaultdict(list)
        names = list(self.proposers)
        bar = tqdm(total=sum(len(b) for b in mine), desc=desc, unit="prompt")
        for i, batch in enumerate(mine):
            order = names[:: -1 if (i + reverse_first) % 2 else 1]
            ran = interleave({name: self.decoding(batch, name, params, max_new_tokens) for name in order})
            plain = [r.tokens for r in ran["none"]]
            for name in names:
                results = ran[name]
                by[batch[0]["domain"]][name].extend(results)
                for p, r, t in zip(batch, results, plain):
                    if params.greedy and r.tokens != t:  # how near a tie the first differing token was
                        diverged[name].append(
                            first_difference_margin(self.runners["none"].model, p["ids"], t, r.tokens)
                        )
            bar.update(len(batch))
        bar.close()
        return by, diverged


def has_confidences(proposer: TrainedProposer) -> bool:
    """Whether the proposer's drafter has a trained confidence head, which the threshold and cost rules read (an
    EAGLE-3 drafter imported from an engine directory without one has not: `Eagle3Config.confidence_trained`)."""
    return getattr(proposer.drafter.config, "confidence_trained", True)


def _schedules(cfg: RunConfig, decoder: Decoder, target, drafter_info, prompts) -> tuple[dict[str, Any], dict]:
    """Set each trained proposer's admission rule (eval.schedule); where the cost schedule runs (the eval's own, or
    the batch curve's), measure (or reuse) its cost table. Returns the tables, and their record."""
    e = cfg.eval
    mode = e.resolved_schedule()
    if decoder.tree is not None:
        mode = "fixed"  # a tree is verified whole: its size is eval.tree_nodes
    batches = sorted({1, e.batch_size, *e.batch_curve})
    cache = cache_root() / "costs"
    tables: dict[str, CostTable] = {}
    record: dict[str, Any] = {}
    for name, proposer in decoder.proposers.items():
        if not isinstance(proposer, TrainedProposer):
            continue
        if not has_confidences(proposer):
            if e.schedule in ("threshold", "cost"):
                raise StageError(
                    f"eval.schedule={e.schedule} reads the drafter's confidences, and {name}'s confidence head was "
                    "never trained (imported from an export without one): use eval.schedule=fixed or auto"
                )
            log.warning("eval: %s has no trained confidence head (imported without one): fixed γ", name)
            proposer.use("fixed")
            continue
        if mode == "cost" or e.batch_curve:
            key = cost_key(target, drafter_info[name]["config"], batches, decoder.gammas[name], e.cost_rounds)

            def measure(name=name, proposer=proposer):
                log.info("eval: measuring the cost table of %s (batch sizes %s)", name, batches)
                return measure_costs(
                    decoder.runners[name],
                    proposer,
                    [p["ids"] for p in prompts],
                    batches,
                    decoder.gammas[name],
                    e.cost_rounds,
                )

            tables[name], cached = cached_costs(cache, key, measure)
            record[name] = {"cached": cached, **asdict(tables[name])}
        proposer.use(mode, tables.get(name), e.confidence_threshold)
    return tables, record


def _batch_curve(cfg: RunConfig, decoder: Decoder, tables: dict, prompts, params: SamplingParams, rank: str):
    """The batch curve at one temperature (eval.batch_curve): plain decoding, fixed γ and the schedules, side by side
    at each batch size; each rank decodes a share of the groups and the sums are merged. Leaves every trained
    proposer on eval's own schedule."""
    e, state = cfg.eval, dist_state()
    trained = [n for n, p in decoder.proposers.items() if isinstance(p, TrainedProposer)]
    schedules = ["fixed", *(["threshold"] if e.confidence_threshold is not None else []), "cost"]
    configs = [(n, m) for n in trained for m in schedules if m == "fixed" or has_confidences(decoder.proposers[n])]
    use = lambda name, m: decoder.proposers[name].use(m, tables.get(name), e.confidence_threshold)  # noqa: E731
    # eval's own schedules, put back afterwards as they are: what they learned (calibration, timings) is kept
    own = {n: (decoder.proposers[n].schedule, decoder.proposers[n].threshold) for n in trained}
    rows = sum(max(b, MIN_ROWS) for b in e.batch_curve)
    bar = tqdm(total=rows // state.num_processes, desc=f"batch curve T={params.temperature}{rank}", unit="row")
    sums = batch_curve(
        decoder.run,
        configs,
        use,
        prompts,
        e.batch_curve,
        params,
        e.max_new_tokens,
        part=lambda groups: groups[state.process_index :: state.num_processes],
        progress=bar.update,
    )
    bar.close()
    for name in trained:
        decoder.proposers[name].schedule, decoder.proposers[name].threshold = own[name]
    if state.num_processes > 1:
        merged: dict = defaultdict(lambda: defaultdict(float))
        for shard in _gather_objects(sums):
            for k, s in shard.items():
                for field, v in s.items():
                    merged[k][field] += v
        sums = merged
    return curve_points(sums, params.temperature)


def run_eval(cfg: RunConfig, drafter: str | None = None) -> Path:
    e = cfg.eval
    layout = RunLayout.of(cfg)
    out, inputs = layout.eval, stage_inputs(cfg, "eval", drafter=drafter)
    state = dist_state()
    state.wait_for_everyone()  # every rank has read the old record (`draftsmith run`) before it goes
    if state.is_main_process:
        clear(out)
        write_progress(out, inputs)
    state.wait_for_everyone()
    target = load_target(cfg.model)
    model, tok = target.model, target.tokenizer
    if e.tree_depth is not None and e.batch_size > 1:
        raise StageError("eval.tree_depth (tree drafting) runs one prompt at a time: set eval.batch_size=1")
    tree = TreeSpec(e.tree_depth, e.tree_top_k, e.tree_nodes) if e.tree_depth else None
    proposers, drafter_info = _proposers(cfg, target, drafter, tree)
    decoder = Decoder(
        runners={name: HFTarget(model, p.aux_ids, tok.pad_token_id) for name, p in proposers.items()},
        proposers=proposers,
        gammas={name: getattr(p, "length", None) or e.draft_length for name, p in proposers.items()},
        stops=stop_token_ids(tok, model),
        tree=tree,
        seed=e.seed,
        device=target.device,
    )
    prompts = eval_prompts(cfg, tok)
    log.info("eval: %d prompts, drafters %s, temperatures %s", len(prompts), list(proposers), e.temperatures)
    if state.num_processes > 1:
        log.info("eval: %d ranks, each decoding every %d-th batch of prompts", state.num_processes, state.num_processes)
    by_domain: dict[str, list] = defaultdict(list)
    for p in prompts:
        by_domain[p["domain"]].append(p)
    batches = [group[i : i + e.batch_size] for group in by_domain.values() for i in range(0, len(group), e.batch_size)]
    mine = batches[state.process_index :: state.num_processes]
    tables, costs = _schedules(cfg, decoder, target, drafter_info, batches[0])
    # Warm-up, untimed: the first calls of a process pay for allocations and kernel selection; without this,
    # whichever drafter runs first (plain decoding) absorbs them and every speedup is biased upward.
    for name in proposers:
        for temperature in sorted({0.0, *e.temperatures}):
            decoder.run(batches[0], name, SamplingParams(temperature, e.top_p, e.top_k), min(8, e.max_new_tokens))

    settings = {
        **e.model_dump(mode="json"),
        "device": str(target.device),
        "dtype": str(model.dtype),
        "draft_lengths": decoder.gammas,
        "prompts": len(prompts),
        "processes": state.num_processes,
        "schedule": e.resolved_schedule(),
        # a drafter whose confidence head was never trained is drafted at fixed γ whatever the schedule (`_schedules`)
        "no_confidence_head": sorted(
            n for n, p in proposers.items() if isinstance(p, TrainedProposer) and not has_confidences(p)
        ),
    }
    ev: dict[str, Any] = {"target": target.identity, "drafters": drafter_info, "settings": settings, "complete": False}
    ev["costs"] = costs
    ev["runs"] = []
    rank = f" (rank {state.process_index})" if state.num_processes > 1 else ""
    for temperature in e.temperatures:
        params = SamplingParams(temperature, e.top_p, e.top_k)
        by, diverged = decoder.temperature(mine, params, e.max_new_tokens, f"eval T={temperature}{rank}")
        if state.num_processes > 1:
            by, diverged = _gather_results(by, diverged)
        curve = _batch_curve(cfg, decoder, tables, prompts, params, rank) if e.batch_curve else []
        if not state.is_main_process:
            continue
        ev["runs"].append(
            summarize(temperature, by, diverged, decoder.gammas, list(proposers), len(prompts), params.greedy)
        )
        for name in settings["no_confidence_head"]:  # the ECE of an untrained head would read as a drafter's
            ev["runs"][-1]["overall"][name]["calibration"] = None
        ev["batch_curve"] = ev.get("batch_curve", []) + curve
        # each temperature's results are on disk as soon as they exist (marked incomplete until the last one):
        # a failure at a later temperature loses nothing already measured
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(layout.eval_json, json.dumps(ev, indent=2))

    # what every process's timed rounds said its cost table missed (eval's own schedule, or the batch curve's)
    timed = {
        name: schedule.corrections()
        for name, proposer in proposers.items()
        if (schedule := getattr(proposer, "cost_schedule", None)) is not None
    }
    by_rank = _gather_objects(timed) if state.num_processes > 1 else [timed]
    if state.is_main_process:  # the main process writes the merged results
        for name in ev["costs"]:
            ranks = [rank_timed[name] for rank_timed in by_rank if name in rank_timed]
            if ranks:
                ev["costs"][name]["corrections"] = merge_corrections(ranks)
            if len(ranks) > 1:  # each rank times its own device: kept apart too
                ev["costs"][name]["corrections_by_rank"] = ranks
        ev["complete"] = True
        atomic_write_text(layout.eval_json, json.dumps(ev, indent=2))
        _report(layout, inputs, ev, target, model, drafter_info, len(prompts))
    state.wait_for_everyone()  # no rank moves on (`draftsmith run`'s export) before the record exists
    return out


def summarize(temperature, by, diverged, gammas, names, n_prompts, greedy) -> dict[str, Any]:
    """One temperature's statistics: per domain and overall, speedups against plain decoding."""
    domains = {}
    for domain, per in by.items():
        row = {name: acceptance_stats(results, gammas[name]) for name, results in per.items()}
        for name in row:
            if name != "none" and row["none"]["tokens_per_s"]:
                row[name]["speedup"] = row[name]["tokens_per_s"] / row["none"]["tokens_per_s"]
                _interval(row[name], per[name], per["none"])
        domains[domain] = row
    overall = {}
    for name in names:
        results = [r for per in by.values() for r in per[name]]
        overall[name] = acceptance_stats(results, gammas[name])
        overall[name]["calibration"] = calibration(results)
        if name != "none":
            overall[name]["speedup"] = overall[name]["tokens_per_s"] / overall["none"]["tokens_per_s"]
            _interval(overall[name], results, [r for per in by.values() for r in per["none"]])
    run = {"temperature": temperature, "drafters": names, "domains": domains, "overall": overall}
    if greedy:
        run["greedy_divergence"] = {n: _divergence(diverged.get(n, []), n_prompts) for n in names if n != "none"}
    return run


def _interval(stats: dict[str, Any], results: list, plain: list) -> None:
    """The speedup's 95% interval over the prompts (`eval.metrics.speedup_interval`), where there are enough: a
    speedup over a handful of prompts on a shared machine is a few percent uncertain, and the report says how much."""
    interval = speedup_interval(results, [plain])
    if interval is not None:
        stats["speedup_interval"] = [round(x, 4) for x in interval]


def _divergence(margins: list, n_prompts: int) -> dict[str, Any]:
    """How many prompts' greedy outputs differed from plain decoding's, and the largest logit margin by which the
    target preferred plain decoding's token where they first differed (a near-tie: about the logits' rounding)."""
    out: dict[str, Any] = {"prompts": len(margins), "of": n_prompts}
    known = [m for m in margins if m is not None]
    if known:
        out["largest_margin"] = max(known)
    return out


def _report(layout: RunLayout, inputs, ev: dict[str, Any], target, model, drafter_info, n_prompts: int) -> None:
    """report.md (also printed), the plots and the manifest that marks the evaluation complete (with its inputs)."""
    out = layout.eval
    table = markdown_table(ev)
    written = plots(ev, out)
    trained_list = ", ".join(f"{n} `{i['path']}`" for n, i in drafter_info.items()) or "none"
    layout.eval_report.write_text(
        f"# draftsmith eval\n\nTarget: `{target.identity['name']}`; trained drafters: "
        f"{trained_list}; device {target.device}, "
        f"{model.dtype}; {n_prompts} prompts; schedule {ev['settings']['schedule']}"
        + "".join(f" ({n}: fixed γ, no trained confidence head)" for n in ev["settings"].get("no_confidence_head", []))
        + f".\n\n{table}\n"
        + cost_tables_markdown(ev.get("costs", {}))
        + "".join(f"\n![{w}]({w})\n" for w in written)
    )
    files = [layout.eval_json.name, layout.eval_report.name, *written]
    write_manifest(out, "eval", inputs=inputs, target=target.identity, drafters=drafter_info, files=files)
    console.print(table, highlight=False)


def _gather_objects(mine: Any) -> list:
    """Every rank's `mine`, in rank order."""
    import torch.distributed as dist

    shards: list = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    return shards


def _gather_results(by: dict[str, dict[str, list]], diverged: dict[str, list]) -> tuple[dict, dict[str, list]]:
    """Every rank's decode results and greedy divergences, merged (the statistics are sums and maxima over prompts,
    so the order in which ranks decoded them does not matter; every configuration's list is extended in the same rank
    order, so its i-th result stays paired with plain decoding's i-th, which the speedup's interval needs)."""
    shards = _gather_objects(({d: dict(per) for d, per in by.items()}, dict(diverged)))
    merged: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    total: dict[str, list] = defaultdict(list)
    for rank_by, rank_diverged in shards:
        for domain, per in rank_by.items():
            for name, results in per.items():
                merged[domain][name].extend(results)
        for name, margins in rank_diverged.items():
            total[name].extend(margins)
    return merged, total
