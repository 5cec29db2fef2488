"""`draftsmith run`: every stage in order into one run directory, skipping what is already complete.

A re-run after a crash resumes: prepare is skipped when its manifest matches the config, generate and
collect continue from their finished chunks/shards (and refuse other settings), training resumes from its
latest checkpoint, and eval is skipped when eval.json was made with the same settings.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console
from draftsmith.pipeline.dist import dist_state

log = logging.getLogger(__name__)


def _prepared_matches(cfg: RunConfig) -> bool:
    path = cfg.run_path / "prepared" / "manifest.json"
    if not path.is_file():
        return False
    recorded = json.loads(path.read_text()).get("config", {})
    return recorded == {
        "model": cfg.model.model_dump(mode="json"),
        "data": cfg.data.model_dump(mode="json", by_alias=True),
    }


def _eval_matches(cfg: RunConfig) -> bool:
    path = cfg.run_path / cfg.eval.output / "eval.json"
    if not path.is_file():
        return False
    ev = json.loads(path.read_text())
    settings = ev.get("settings", {})
    # eval.json is rewritten after every temperature; one that stopped part-way is not complete
    return ev.get("complete", True) and all(settings.get(k) == v for k, v in cfg.eval.model_dump(mode="json").items())


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
            save_config(cfg, cfg.run_path / "config.yaml")  # the sized config is the one this run used
    upstream_ran = False  # once a stage really ran, later stages may not be skipped on their old outputs
    for i, stage in enumerate(stages, start=1):
        if main_process:
            console.rule(f"[bold]stage {i}/{len(stages)}: {stage}")
        t0 = time.perf_counter()
        if stage == "prepare":
            matches = _prepared_matches(cfg)  # (first stage: nothing upstream)
            agreed()
            if matches:
                log.info("prepare: %s matches this config, skipped", cfg.run_path / "prepared")
                timings[stage] = "skipped"
                continue
            run_prepare(cfg)
        elif stage == "generate":
            done = (cfg.run_path / "generated" / "manifest.json").is_file()
            agreed()
            run_generate(cfg)  # resumes, or returns at once when complete (and refuses other settings)
            if done:
                timings[stage] = "complete"
                continue
        elif stage == "collect":
            done = (cfg.run_path / "features" / "manifest.json").is_file()
            agreed()
            run_collect(cfg)
            if done:
                timings[stage] = "complete"
                continue
        elif stage == "train":
            from draftsmith.pipeline.errors import StageError
            from draftsmith.pipeline.inputs import train_dir

            todo: list[str] = []
            for family in cfg.train.drafters:
                out = train_dir(cfg, family)
                if (out / "manifest.json").is_file():
                    recorded = json.loads((out / "manifest.json").read_text())["config"]["train"]
                    if recorded == cfg.train.model_dump(mode="json") and not upstream_ran:
                        log.info("train: %s is complete for this config, skipped", out)
                        continue
                    raise StageError(
                        f"{out} holds a finished training run made with other settings or older data; "
                        "delete it (or use another run_dir) to retrain"
                    )
                todo.append(family)
            resume = any(
                (train_dir(cfg, f) / "checkpoints").is_dir() and any((train_dir(cfg, f) / "checkpoints").glob("step-*"))
                for f in todo
            )
            agreed()
            if not todo:
                timings[stage] = "skipped"
                continue
            run_train(cfg, resume=resume, families=todo)
        elif stage == "eval":
            matches = _eval_matches(cfg) and not upstream_ran
            agreed()
            if matches:
                log.info("eval: %s matches this config, skipped", cfg.run_path / "eval")
                timings[stage] = "skipped"
                continue
            run_eval(cfg)
        elif stage == "export":
            run_export(cfg)
        seconds[stage] = time.perf_counter() - t0
        timings[stage] = f"{seconds[stage]:.0f}s"
        upstream_ran = True
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
    eval_json = cfg.run_path / cfg.eval.output / "eval.json"
    if eval_json.is_file():
        from draftsmith.eval.report import markdown_table

        console.rule("[bold]results: τ and speedup over plain decoding, per domain")
        console.print(markdown_table(json.loads(eval_json.read_text())), highlight=False)
        plots = sorted(p.name for p in (cfg.run_path / cfg.eval.output).glob("*.png"))
        console.print(
            f"report: {cfg.run_path / cfg.eval.output / 'report.md'}"
            + (f"; plots: {', '.join(plots)}" if plots else ""),
            highlight=False,
        )
    return cfg.run_path
