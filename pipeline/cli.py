"""The `draftsmith` command: `draftsmith STAGE CONFIG [key.path=value ...]`."""

from __future__ import annotations

import argparse
import logging
import sys

from draftsmith.pipeline.config import ConfigError, load_config, save_config
from draftsmith.pipeline.console import console, setup_logging
from draftsmith.pipeline.layout import RunLayout

log = logging.getLogger("draftsmith")


# stage -> the function that runs it ("module:function"), imported lazily so `draftsmith --help` and config
# errors answer without loading torch
ENTRY_POINTS = {
    "prepare": "draftsmith.pipeline.prepare:run_prepare",
    "generate": "draftsmith.pipeline.generate:run_generate",
    "collect": "draftsmith.pipeline.collect:run_collect",
    "train": "draftsmith.pipeline.train:run_train",
    "eval": "draftsmith.pipeline.evaluate:run_eval",
    "export": "draftsmith.pipeline.export:run_export",
    "import": "draftsmith.pipeline.export:run_import",
    "run": "draftsmith.pipeline.run:run_all",
    "plan": "draftsmith.pipeline.plan:run_plan",
}


def _stage(name: str):
    import importlib

    module, function = ENTRY_POINTS[name].split(":")
    return getattr(importlib.import_module(module), function)


STAGES = {
    "prepare": "ingest datasets, apply the chat template, compute assistant loss masks, split train/holdout",
    "generate": "regenerate every assistant turn with the target (on-policy), optionally self-synthesizing prompts",
    "collect": "run the target over the records and store its aux-layer and final hidden states (feature store)",
    "train": "train the drafters of train.drafters (EAGLE-3 with training-time test, DSpark block drafter) on the features, with accelerate / DeepSpeed",
    "eval": "measure acceptance length per domain and speedup with the exact speculative-decoding verifier",
    "export": "write the drafters for vLLM / SGLang (eagle3/), in the speculators format (speculators/) and DSpark (dspark/)",
    "import": "load an exported drafter directory (--from DIR) back into draftsmith (RUN_DIR/imported)",
    "run": "run every stage in order into one run directory, skipping or resuming what is already done",
    "plan": "before running: disk for offline features, GPU memory per training rank, FLOPs per training token",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train speculative-decoding drafters for a target LLM.",
        epilog="Overrides use dotted keys, e.g. `draftsmith generate configs/smollm2-eagle3.yaml generate.temperature=0.7`.",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, help_text in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="YAML run recipe (see configs/)")
        p.add_argument("overrides", nargs="*", help="key.path=value overrides applied on top of the YAML")
        if name == "train":
            p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in RUN_DIR/train")
        if name in ("eval", "export"):
            p.add_argument("--drafter", metavar="DIR", help="trained drafter directory (default RUN_DIR/train/best)")
        if name == "import":
            p.add_argument("--from", dest="source", required=True, metavar="DIR", help="exported drafter directory")
        if name == "eval":
            p.add_argument(
                "--datasets", metavar="A,B", help="builtin prompt sets, e.g. mtbench,humaneval (overrides eval.sources)"
            )
            p.add_argument("--temperature", metavar="T,T", help="temperatures, e.g. 0,1 (overrides eval.temperatures)")
            p.add_argument("--target", metavar="MODEL", help="target model (overrides model.target)")
        if name == "plan":
            p.add_argument("--tokens", type=int, metavar="N", help="training tokens (default: counted or estimated)")
            p.add_argument("--records", type=int, metavar="N", help="conversations, to estimate tokens from")
            p.add_argument(
                "--prompt-tokens", type=int, default=256, metavar="N", help="mean prompt tokens per record (estimate)"
            )
            p.add_argument("--world-size", type=int, default=8, metavar="N", help="training ranks (GPUs), default 8")
            p.add_argument(
                "--zero-stage", type=int, choices=[0, 1, 2, 3], help="default: from train.deepspeed, else 0 (DDP)"
            )
            p.add_argument(
                "--target-config", metavar="PATH", help="the target's HF config.json (when not local or bundled)"
            )
            p.add_argument(
                "--gpu-memory",
                dest="gpu_memory_gib",
                type=float,
                default=80.0,
                metavar="GIB",
                help="GPU memory to check against",
            )
            p.add_argument(
                "--gpu-tflops", type=float, default=989.0, metavar="TF", help="peak bf16 TFLOP/s (H100 SXM: 989)"
            )
            p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilization for GPU-hours")
            p.add_argument("--json", dest="json_out", metavar="PATH", help="also write the plan as JSON")
        if name == "collect":
            p.add_argument(
                "--verify",
                type=int,
                default=0,
                metavar="N",
                help="afterwards, recompute N random stored samples and fail above collect.verify_tolerance",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # flags may come before or after the key=value overrides; argparse leaves the later ones over
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(args.overrides) + extra
    setup_logging(args.log_level)
    from draftsmith.data.artifacts import ArtifactError
    from draftsmith.data.chat import ChatTemplateError
    from draftsmith.data.features import FeatureError
    from draftsmith.data.sources import SourceError
    from draftsmith.pipeline.errors import StageError
    from draftsmith.pipeline.target import TargetError

    expected = (ConfigError, ArtifactError, ChatTemplateError, FeatureError, SourceError, StageError, TargetError)
    succeeded = False
    try:
        overrides = list(args.overrides)
        if args.stage == "eval":
            if args.datasets:
                overrides.append(
                    "eval.sources=[" + ",".join(f"{{builtin: {d.strip()}}}" for d in args.datasets.split(",")) + "]"
                )
            if args.temperature:
                overrides.append(f"eval.temperatures=[{args.temperature}]")
            if args.target:
                overrides.append(f"model.target={args.target}")
        cfg = load_config(args.config, overrides)
        from draftsmith.pipeline.dist import dist_state

        if dist_state().is_main_process and args.stage != "plan":  # plan runs nothing and writes nothing
            save_config(cfg, RunLayout.of(cfg).config_file)
        stage_kwargs = {
            "collect": {"verify": getattr(args, "verify", 0)},
            "train": {"resume": getattr(args, "resume", False)},
            "eval": {"drafter": getattr(args, "drafter", None)},
            "export": {"drafter": getattr(args, "drafter", None)},
            "import": {"source": getattr(args, "source", None)},
            "plan": {
                k: getattr(args, k, None)
                for k in (
                    "tokens",
                    "records",
                    "prompt_tokens",
                    "world_size",
                    "zero_stage",
                    "target_config",
                    "json_out",
                    "mfu",
                    "gpu_memory_gib",
                    "gpu_tflops",
                )
            },
        }.get(args.stage, {})
        _stage(args.stage)(cfg, **stage_kwargs)
        succeeded = True
    except expected as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    finally:
        from draftsmith.pipeline.dist import close_process_group

        close_process_group(succeeded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
