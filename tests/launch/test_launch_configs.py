"""Every file in launch/ and every recipe in configs/ is loaded and validated: accelerate YAML keys as accelerate
itself checks them, the DeepSpeed JSON each YAML names exists and parses with DeepSpeed's own ZeRO schema, bf16
is set consistently, batch arithmetic adds up, recipes load and their aux layers fit the architecture, and the
shell scripts parse."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from draftsmith.pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
YAMLS = sorted(LAUNCH.glob("*.yaml"))
JSONS = sorted(LAUNCH.glob("*.json"))
RECIPES = sorted((REPO / "configs").glob("*.yaml"))


def _deepspeed_yaml_keys() -> set[str]:
    """The keys accelerate accepts under `deepspeed_config`: the dests of `accelerate launch`'s DeepSpeed group."""
    from accelerate.commands.launch import launch_command_parser

    group = next(g for g in launch_command_parser()._action_groups if g.title == "DeepSpeed Arguments")
    return {a.dest for a in group._group_actions}


def _deepspeed_top_level_keys() -> set[str]:
    from deepspeed.runtime import constants

    return {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | {"zero_optimization"}


def resolved_batch(ds: dict, world: int, grad_accum: int) -> tuple[int, int, int, int]:
    """(train_batch_size, micro, accumulation, world) as the trainer resolves "auto" (pipeline/train.py: a
    micro-batch is one variable-length token bucket per rank, accumulation comes from train.gradient_accumulation)."""
    micro = ds.get("train_micro_batch_size_per_gpu", "auto")
    micro = 1 if micro == "auto" else micro
    accum = ds.get("gradient_accumulation_steps", "auto")
    accum = grad_accum if accum == "auto" else accum
    total = ds.get("train_batch_size", "auto")
    total = micro * accum * world if total == "auto" else total
    return total, micro, accum, world


def check_batch_arithmetic(ds: dict, world: int, grad_accum: int = 1) -> None:
    total, micro, accum, world = resolved_batch(ds, world, grad_accum)
    if total != micro * accum * world:
        raise ValueError(f"train_batch_size {total} != micro {micro} x accumulation {accum} x world {world}")


def test_there_is_something_to_check():
    names = {p.name for p in YAMLS} | {p.name for p in JSONS}
    assert {
        "accelerate_ddp.yaml",
        "accelerate_zero2.yaml",
        "accelerate_zero3_multinode.yaml",
        "ds_zero2.json",
        "ds_zero3_offload.json",
    } <= names
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_accelerate_yaml_is_valid(path):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(path)  # refuses unknown top-level keys
    raw = yaml.safe_load(path.read_text())
    assert _value(cfg.compute_environment) == "LOCAL_MACHINE"
    assert cfg.num_processes % cfg.num_machines == 0, "processes must split evenly over the machines"
    assert 0 <= cfg.machine_rank < cfg.num_machines
    assert not cfg.use_cpu
    if _value(cfg.distributed_type) == "DEEPSPEED":
        extra = set(raw["deepspeed_config"]) - _deepspeed_yaml_keys()
        assert not extra, f"unknown deepspeed_config keys {extra}"
        # with a deepspeed_config_file accelerate refuses a mixed_precision key (and the other values the JSON owns)
        assert "mixed_precision" not in raw, 'bf16 belongs in the DeepSpeed JSON ("bf16": {"enabled": "auto"})'
        owned = {
            "gradient_accumulation_steps",
            "gradient_clipping",
            "zero_stage",
            "offload_optimizer_device",
            "offload_param_device",
            "zero3_save_16bit_model",
        }
        assert not owned & set(raw["deepspeed_config"])
        ds_path = REPO / raw["deepspeed_config"]["deepspeed_config_file"]
        assert ds_path.is_file(), f"{path.name} points to a missing {ds_path}"
        ds = json.loads(ds_path.read_text())
        assert ds["bf16"]["enabled"] in ("auto", True) and not ds.get("fp16", {}).get("enabled", False)
        check_batch_arithmetic(ds, cfg.num_processes)
        if cfg.num_machines > 1:
            assert raw["deepspeed_config"].get("deepspeed_multinode_launcher") == "standard"
    else:
        assert _value(cfg.distributed_type) == "MULTI_GPU"
        assert _value(cfg.mixed_precision) == "bf16"


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.name)
def test_deepspeed_json_is_valid(path):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = json.loads(path.read_text())
    unknown = set(ds) - _deepspeed_top_level_keys()
    assert not unknown, f"unknown DeepSpeed keys {unknown}"
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])  # DeepSpeed's own schema: refuses unknown keys
    assert zero.stage in (1, 2, 3)
    assert ds["bf16"] == {"enabled": "auto"}, "bf16 follows train.mixed_precision (bf16 on CUDA)"
    # bf16 weights, fp32 gradient accumulation: summing micro-batches in bf16 loses their low bits
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    from deepspeed.runtime.config import DeepSpeedConfig  # DeepSpeed's own reading of the key

    assert (
        DeepSpeedConfig(
            {
                **ds,
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 8,
                "gradient_clipping": 1.0,
                "bf16": {"enabled": True},
            }
        ).grad_accum_dtype
        == "fp32"
    )
    for key in (
        "train_micro_batch_size_per_gpu",
        "train_batch_size",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert ds[key] == "auto", f"{key}: the trainer resolves it from the run config"
    for world in (1, 2, 8, 16):
        check_batch_arithmetic(ds, world, grad_accum=4)
    offload = {_value(part.device) for part in (zero.offload_optimizer, zero.offload_param) if part is not None}
    if "cpu" in offload:  # the trainer's own torch AdamW steps the CPU partitions
        assert ds.get("zero_force_ds_cpu_optimizer") is False


def test_batch_arithmetic_check_catches_a_mismatch():
    check_batch_arithmetic(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8
    )
    with pytest.raises(ValueError, match="train_batch_size 7"):
        check_batch_arithmetic(
            {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}, 8
        )


@pytest.mark.parametrize("path", sorted(LAUNCH.glob("*.sh")) + sorted(LAUNCH.glob("*.sbatch")), ids=lambda p: p.name)
def test_shell_scripts_parse(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_slurm_script_reads_its_layout_from_slurm():
    text = (LAUNCH / "slurm_train.sbatch").read_text()
    for needle in (
        "SLURM_NODEID",
        "scontrol show hostnames",
        "SLURM_NNODES",
        "--machine_rank",
        "--main_process_ip",
        "--num_machines",
        "--num_processes",
        "srun --ntasks-per-node=1",
        "accelerate launch",
        "draftsmith",
    ):
        assert needle in text, needle


# ------------------------------------------------------------------------------------------- recipes


def _value(x):
    """An enum's value, or the string itself (accelerate and DeepSpeed use both)."""
    return getattr(x, "value", x)


def _aux_fits(ids, layers):
    return all(0 <= i <= layers for i in ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_fits_its_target(path):
    from draftsmith.pipeline.plan import bundled_target_config, load_target_config, make_plan
    from draftsmith.pipeline.target import resolve_target

    cfg = load_config(path)
    if cfg.train.deepspeed:
        assert (REPO / cfg.train.deepspeed).is_file()
    if resolve_target(cfg.model).kind != "hub":
        return  # local targets (SmolLM2) are covered by the pipeline tests
    assert bundled_target_config(cfg.model.target), (
        f"add configs/targets/ for {cfg.model.target} so `plan` works offline"
    )
    config = load_target_config(cfg)
    L = config.num_hidden_layers
    aux = cfg.collect.aux_layer_ids
    assert aux is not None and _aux_fits(aux, L), f"aux ids {aux} do not fit {L} layers"
    families = cfg.train.drafters
    if "eagle3" in families:
        assert aux == [2, L // 2, L - 3], "EAGLE-3 recipes use the default [2, L//2, L-3]"
    if "dspark" in families and cfg.train.dspark.aux_layer_ids is not None:
        assert set(cfg.train.dspark.aux_layer_ids) <= set(aux)
    assert all(s.hf for s in cfg.data.sources), "recipes train on the published HF mixtures"
    assert cfg.generate.backend == "vllm"
    plan = make_plan(cfg, target_config=config, records=100_000, world=8)
    for d in plan.drafters:
        assert d["memory_total_bytes"] < 0.9 * 80 * 2**30, f"{d['family']} does not fit an 80 GB GPU"


def test_recipes_cover_the_issue():
    names = {p.stem for p in RECIPES}
    assert {
        "llama3.1-8b-eagle3",
        "llama3.1-8b-dspark",
        "qwen3-8b-eagle3",
        "qwen3-8b-dspark",
        "llama3.3-70b-eagle3",
    } <= names
    for stem, layers in (("llama3.1-8b-dspark", 32), ("qwen3-8b-dspark", 36)):
        cfg = load_config(REPO / "configs" / f"{stem}.yaml")
        assert cfg.train.drafters == ["dspark"] and len(cfg.collect.aux_layer_ids) == 5
        assert _aux_fits(cfg.collect.aux_layer_ids, layers)
