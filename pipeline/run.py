"""`draftsmith run`: every stage in order into one run directory, skipping what is already complete.

Whether a stage runs is decided by one rule (pipeline/completion.py), for every stage alike: its artifact is
COMPLETE (made from the inputs this run would use: skipped), RESUMABLE (interrupted with the same inputs: generate
and collect continue from their finished chunks/shards, training from its latest checkpoint, the others start
over), STALE (made from other settings or other input data) or ABSENT. What a stage does with a STALE artifact is
its policy below: prepare, eval and export make it again; generate, collect and train, hours of work, refuse and
name what differs. An input's fingerprint is part of each stage's inputs, so a stage that ran makes everything
built from its old output stale.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from draftsmith.pipeline.completion import Status, stage_completion
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console
from draftsmith.pipeline.dist import dist_state
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.layout import RunLayout

log = logging.getLogger(__name__)

REMAKE, REFUSE = "remake", "refuse"
ON_STALE = {"prepare": REMAKE, "generate": REFUSE, "collect": REFUSE, "train": REFUSE, "eval": REMAKE, "export": REMAKE}
"""What each stage does with an artifact made from other inputs."""
DONE_WORD = {"generate": "complete", "collect": "complete"}
"""How the summary names a stage found complete ("skipped" for the others)."""


def plan_stages(cfg: RunConfig) -> list[str]:
    stages = []
    if cfg.data.sources:
        stages.append("prepare")
    if cfg.data.sources or cfg.generate.synthesize:
        stages.append("generate")
    if cfg.train.features == "offline":
        stages.append("collect")
    stages += ["train", "eval", "export"]
    return stages


def run_all(cfg: RunConfig) -> Path:
    from draftsmith.pipeline.collect import run_collect
    from draftsmith.pipeline.evaluate import run_eval
    from draftsmith.pipeline.export import run_export
    from draftsmith.pipeline.generate import run_generate
    from draftsmith.pipeline.prepare import run_prepare
    from draftsmith.pipeline.train import run_train

    stages = plan_stages(cfg)
    # under torchrun / accelerate launch every rank runs this loop (the stages share the work out); one prints
    state = dist_state()
    main_process = state.is_main_process
    # Each stage first reads what the run directory holds, then all ranks meet, then the stage runs: otherwise a
    # slow rank could read outputs the main process has just written and take another branch (and collective).
    agreed = state.wait_for_everyone
    timings: dict[str, str] = {}
    seconds: dict[str, float] = {}  # of the stages that really ran
    started = time.perf_counter()
    budget = None
    if cfg.budget.minutes is not None:
        from draftsmith.pipeline.budget import plan_budget
        from draftsmith.pipeline.config import save_config

        cfg, budget = plan_budget(cfg, main_process, agreed)
        if main_process:
            save_config(cfg, RunLayout.of(cfg).config_file)  # the sized config is the one this run used
    layout = RunLayout.of(cfg)
    for i, stage in enumerate(stages, start=1):
        if main_process:
            console.rule(f"[bold]stage {i}/{len(stages)}: {stage}")
        t0 = time.perf_counter()
        families = list(cfg.train.drafters) if stage == "train" else [None]
        found = {family: stage_completion(cfg, stage, family=family) for family in families}
        agreed()
        stale = [c for c in found.values() if c.status is Status.STALE]
        if stale and ON_STALE[stage] == REFUSE:
            raise StageError(stale[0].refusal(stage))
        todo = [family for family, c in found.items() if not c.complete]
        if not todo:
            log.info(
                "%s: complete for this config, skipped (%s)", stage, ", ".join(str(c.directory) for c in found.values())
            )
            timings[stage] = DONE_WORD.get(stage, "skipped")
            continue
        if stage == "prepare":
            run_prepare(cfg)
        elif stage == "generate":
            run_generate(cfg)  # continues from the chunks already generated
        elif stage == "collect":
            run_collect(cfg)  # continues from the shards already stored
        elif stage == "train":
            resume = any(found[family].status is Status.RESUMABLE for family in todo)
            run_train(cfg, resume=resume, families=[f for f in todo if f is not None])  # (all are, in train)
        elif stage == "eval":
            run_eval(cfg)
        elif stage == "export":
            run_export(cfg)
        seconds[stage] = time.perf_counter() - t0
        timings[stage] = f"{seconds[stage]:.0f}s"
    total = time.perf_counter() - started
    if not main_process:
        return cfg.run_path
    console.rule("[bold]draftsmith run: done")
    console.print(
        "stages: " + ", ".join(f"{s} {t}" for s, t in timings.items()) + f"; total {total:.0f}s", highlight=False
    )
    if budget is not None:
        from draftsmith.pipeline.budget import budget_table, record_actuals

        budget = record_actuals(cfg, budget, seconds, total)
        console.rule(f"[bold]budget {cfg.budget.minutes:g} min: predicted and actual stage times")
        console.print(budget_table(budget), highlight=False)
    if layout.eval_json.is_file():
        from draftsmith.eval.report import markdown_table

        console.rule("[bold]results: τ and speedup over plain decoding, per domain")
        console.print(markdown_table(json.loads(layout.eval_json.read_text())), highlight=False)
        plots = sorted(p.name for p in layout.eval.glob("*.png"))
        console.print(
            f"report: {layout.eval_report}" + (f"; plots: {', '.join(plots)}" if plots else ""),
            highlight=False,
        )
    return cfg.run_path
