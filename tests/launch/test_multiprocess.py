"""The real trainer started by the repository's own launch machinery, 2 processes on CPU (gloo), a few steps each,
with every rank's parameters compared at the end:

- DDP: `accelerate launch --config_file <launch/accelerate_ddp.yaml, num_processes 2> ... train CONFIG`;
- DeepSpeed ZeRO-2: `accelerate launch --config_file <launch/accelerate_zero2.yaml, num_processes 2> ... train
  CONFIG train.deepspeed=launch/ds_zero2.json`;
- DeepSpeed ZeRO-3 with CPU offload, through `launch/slurm_train.sbatch` itself (stand-ins for `srun` and
  `scontrol`: one node of 2 processes) over a copy of launch/accelerate_zero3_multinode.yaml ->
  launch/ds_zero3_offload.json, training on online features from a frozen target that ZeRO-3 inference splits
  over the two ranks (model.zero3=gpu);
- and launch/torchrun_train.sh's command line (a dry run with `echo` as the interpreter).

What the copies change, and why: `num_processes: 2` / `num_machines: 1` (one CPU box); the DDP copy sets
`mixed_precision: 'no'` (no bf16 autocast on CPU). They keep `distributed_type: MULTI_GPU` / `DEEPSPEED` and
`use_cpu: false`: accelerate's `use_cpu` path starts multi-process CPU runs through mpirun, which the machine does
not have, while the MULTI_GPU / DEEPSPEED launchers run torchrun, under which the trainer joins a gloo group
(accelerate picks gloo without CUDA; with train.deepspeed set, pipeline/train.py asks for gloo explicitly so
DeepSpeed, on DS_ACCELERATOR=cpu, counts both ranks). DeepSpeed runs also pass train.deepspeed, as the README
commands do: the trainer resolves the JSON's "auto" batch fields itself.

The launched program is tests/launch/sync_worker.py: the real CLI plus a per-rank dump of the trained parameters.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

# one pytest-xdist worker runs all of these (`make test` uses --dist loadgroup): they pick free ports for their
# rendezvous, and two workers picking at once could pick the same one
pytestmark = pytest.mark.xdist_group("fixed_ports")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sync_worker.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
STEPS = 3


def train_output(run_dir: Path, family: str = "eagle3") -> Path:
    """Where training writes its manifest: RUN_DIR/train/<family>/ (RUN_DIR/train/ before per-family outputs)."""
    per_family = Path(run_dir) / "train" / family
    return per_family if (per_family / "manifest.json").is_file() else Path(run_dir) / "train"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, write_chats):
    """A tiny 4-layer target, prepared records and an fp32 feature store, plus the recipe every launch trains."""
    from draftsmith.pipeline.collect import run_collect
    from draftsmith.pipeline.config import load_config
    from draftsmith.pipeline.prepare import run_prepare
    from tests.tiny import save_tiny_target

    root = tmp_path_factory.mktemp("launch-ws")
    target = save_tiny_target(root / "target", seed=0, num_layers=4)
    write_chats(root / "chat.jsonl", 16)
    recipe = {
        "name": "launch-test",
        "run_dir": str(root / "run"),
        "model": {"target": str(target)},
        "data": {"sources": [{"path": str(root / "chat.jsonl")}], "holdout_fraction": 0.25},
        "collect": {"aux_layer_ids": [1, 2, 3], "dtype": "float32"},
        "train": {
            "batch_tokens": 160,
            "eagle3": {"ttt_steps": 3},
            "draft_vocab_size": 384,
            "max_steps": STEPS,
            "lr": 2e-3,
            "log_every": 1,
            "eval_every": 1000,
            "save_every": 1000,
        },
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cfg = load_config(root / "recipe.yaml")
    run_prepare(cfg)
    run_collect(cfg)
    return root


def _new_run(workspace: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the prepared run (no training output) and a recipe pointing at it."""
    run = tmp_path / name / "run"
    shutil.copytree(workspace / "run", run, ignore=shutil.ignore_patterns("train"))
    raw = yaml.safe_load((workspace / "recipe.yaml").read_text())
    raw["run_dir"] = str(run)
    recipe = tmp_path / name / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def _two_process_copy(name: str, out: Path, **changes) -> Path:
    """launch/<name> with one machine of 2 processes (plus `changes`), written to `out`."""
    raw = yaml.safe_load((REPO / "launch" / name).read_text())
    raw.update(num_machines=1, num_processes=2, machine_rank=0, **changes)
    out.write_text(yaml.safe_dump(raw))
    return out


def _env(sync_dir: Path, **extra) -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        SYNC_DIR=str(sync_dir),
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
    )
    # the venv's tools (accelerate) go at the END of PATH: a venv `ninja` ahead of the system one would make
    # DeepSpeed rebuild its CPU communication op (~1 minute) whenever the two ninjas alternate on the build cache
    env["PATH"] = f"{env.get('PATH', '')}{os.pathsep}{Path(sys.executable).parent}"
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=420)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _ranks(sync_dir: Path) -> dict[str, torch.Tensor]:
    """Rank 0's parameters, after checking rank 1 holds exactly the same."""
    r0, r1 = load_file(str(sync_dir / "rank0.safetensors")), load_file(str(sync_dir / "rank1.safetensors"))
    assert r0.keys() == r1.keys() and r0
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks diverged on {k}"
    return r0


def _check_run(stdout: str, recipe: Path, sync_dir: Path, engine: str, zero: int | None) -> dict[str, torch.Tensor]:
    assert stdout.count(f"SYNC world=2 engine={engine} zero={zero}") == 2, stdout[-2000:]
    run_dir = Path(yaml.safe_load(recipe.read_text())["run_dir"])
    manifest = json.loads((train_output(run_dir) / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["steps"] == STEPS
    return _ranks(sync_dir)


@pytest.fixture(scope="module")
def ddp_params(workspace, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    recipe = _new_run(workspace, tmp, "ddp")
    config = _two_process_copy("accelerate_ddp.yaml", tmp / "ddp.yaml", mixed_precision="no")
    out = _run(
        [
            str(ACCELERATE),
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(_free_port()),
            str(WORKER),
            "train",
            str(recipe),
        ],
        _env(tmp / "sync"),
    )
    return _check_run(out, recipe, tmp / "sync", "DistributedDataParallel", None)


def _assert_close_to(reference: dict[str, torch.Tensor], params: dict[str, torch.Tensor], what: str) -> None:
    assert params.keys() == reference.keys()
    for k, value in params.items():
        torch.testing.assert_close(value, reference[k], atol=2e-5, rtol=1e-4, msg=f"{what} vs DDP: {k}")


def test_ddp_two_processes_through_the_accelerate_config(ddp_params):
    assert ddp_params  # ranks in sync, world 2, all steps (checked by the fixture)


def test_deepspeed_zero2_through_the_accelerate_config(workspace, tmp_path, ddp_params):
    recipe = _new_run(workspace, tmp_path, "zero2")
    config = _two_process_copy("accelerate_zero2.yaml", tmp_path / "zero2.yaml")
    out = _run(
        [
            str(ACCELERATE),
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(_free_port()),
            str(WORKER),
            "train",
            str(recipe),
            "train.deepspeed=launch/ds_zero2.json",
        ],
        _env(tmp_path / "sync"),
    )
    _assert_close_to(ddp_params, _check_run(out, recipe, tmp_path / "sync", "DeepSpeedEngine", 2), "ZeRO-2")


def test_deepspeed_zero3_offload_online_sharded_target_through_the_slurm_script(workspace, tmp_path, ddp_params):
    """ZeRO-3 with CPU offload, and online features from a target whose weights ZeRO-3 inference splits over
    both ranks (model.zero3=gpu): the tiny target's fp32 features are the same numbers as the offline store's,
    so training matches the offline DDP run."""
    recipe = _new_run(workspace, tmp_path, "zero3")
    shutil.rmtree(Path(yaml.safe_load(recipe.read_text())["run_dir"]) / "features")  # online needs no store
    # DeepSpeed keeps parameters under stage3_param_persistence_threshold (1e5 elements by default) whole on every
    # rank, which is every parameter of a tiny drafter: at 0 each one is really split over the ranks
    ds = json.loads((REPO / "launch" / "ds_zero3_offload.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds_zero3_offload.json").write_text(json.dumps(ds))
    accel = yaml.safe_load((REPO / "launch" / "accelerate_zero3_multinode.yaml").read_text())["deepspeed_config"]
    config = _two_process_copy(
        "accelerate_zero3_multinode.yaml",
        tmp_path / "zero3.yaml",
        deepspeed_config={**accel, "deepspeed_config_file": str(tmp_path / "ds_zero3_offload.json")},
    )
    bin_dir = tmp_path / "bin"  # one-node stand-ins for SLURM's tools
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 SLURM_PROCID=0 exec "$@"\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = _env(
        tmp_path / "sync",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        GPUS_PER_NODE="2",
        ACCEL_CONFIG=str(config),
        MAIN_PORT=str(_free_port()),
        ENTRY=str(WORKER),
        VENV=str(tmp_path / "no-venv"),
    )  # keep PATH as _env set it
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    out = _run(
        ["bash", str(REPO / "launch" / "slurm_train.sbatch"), str(recipe), "train.features=online", "model.zero3=gpu"],
        env,
    )
    assert "1 node(s) x 2 GPU(s), rendezvous localhost" in out and "ds_zero3_offload.json" in out
    params = _check_run(out, recipe, tmp_path / "sync", "DeepSpeedEngine", 3)
    assert out.count("local_params=0") == 2, "ZeRO-3 left whole parameters on a rank"
    _assert_close_to(ddp_params, params, "ZeRO-3 offload, online features from a sharded target")


def test_torchrun_script_builds_the_rendezvous_command(tmp_path):
    """launch/torchrun_train.sh with `echo` as the interpreter: the torchrun command it would run."""
    env = dict(
        os.environ,
        PYTHON="echo",
        NNODES="2",
        NPROC_PER_NODE="8",
        MASTER_ADDR="node0",
        MASTER_PORT="29123",
        RDZV_ID="77",
        DS_CONFIG="launch/ds_zero3.json",
    )
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun_train.sh"), "configs/x.yaml", "train.lr=1e-4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "node0:29123",
        "--rdzv_id",
        "77",
        "-m",
        "draftsmith",
        "train",
        "configs/x.yaml",
        "train.deepspeed=launch/ds_zero3.json",
        "train.lr=1e-4",
    ]
    env.update(STAGE="collect", DS_CONFIG="")  # other stages split their work by rank and take no DeepSpeed JSON
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun_train.sh"), "configs/x.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.split()[-4:] == ["-m", "draftsmith", "collect", "configs/x.yaml"]
