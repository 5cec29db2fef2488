"""The frozen target sharded for online training at scale: ZeRO-3 inference (weights split over the ranks, each
rank running its own batches) and transformers tensor parallelism load the tiny target and compute the same
features as the whole model; model.device_map for single-process stages; clear errors for combinations that
cannot work."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.config import ConfigError, ModelConfig, load_config
from draftsmith.pipeline.target import (
    TargetError,
    data_parallel_rank,
    load_model,
    resolve_target,
    sharding_mode,
)

WORKER = Path(__file__).with_name("shard_worker.py")


def test_sharded_loads_compute_the_features_of_the_whole_model(tiny_target_dir, tmp_path):
    """Under torchrun with 2 gloo ranks. (ZeRO-3 with the partitions on the device, model.zero3=gpu, is what
    tests/launch/test_multiprocess.py trains with end to end.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(WORKER),
            str(tiny_target_dir),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [line.split() for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines()]
    assert sorted((r[1], r[2]) for r in results) == [
        ("tp", "rank=0"),
        ("tp", "rank=1"),
        ("zero3-cpu", "rank=0"),
        ("zero3-cpu", "rank=1"),
    ]
    for _, label, _, weights, diff in results:
        assert weights == "weights_equal=True", label
        bound = 0.0 if label.startswith("zero3") else 1e-4  # TP sums partial products in another order
        assert float(diff.split("=")[1]) <= bound, (label, diff)


def test_choose_one_way_to_shard():
    with pytest.raises(ConfigError, match="choose one way to shard the target"):
        load_config(None, ["model.zero3=gpu", "model.tp_size=2"])
    with pytest.raises(ConfigError, match="device_map"):
        load_config(None, ["model.device_map=auto", "model.device=cpu"])
    assert load_config(None, ["model.zero3=cpu"]).model.zero3 == "cpu"
    with pytest.raises(ConfigError, match="model.zero3"):
        load_config(None, ["model.zero3=on"])  # YAML reads `on` as true: the values are none / gpu / cpu


def test_sharding_mode_follows_the_process_layout(tiny_target_dir, monkeypatch, caplog):
    spec = resolve_target(ModelConfig(target=str(tiny_target_dir)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    zero3 = ModelConfig(target=str(tiny_target_dir), zero3="gpu")
    assert sharding_mode(zero3, spec, shard=True) == "zero3"
    with caplog.at_level(logging.INFO, logger="draftsmith.pipeline.target"):
        assert sharding_mode(zero3, spec, shard=False) == "none"  # generate / collect: whole target per rank
    assert "applies to online training only" in caplog.text
    assert sharding_mode(ModelConfig(target=str(tiny_target_dir), tp_size=2), spec, shard=True) == "tp"
    with pytest.raises(TargetError, match="tp_size=4 needs exactly 4 processes"):
        sharding_mode(ModelConfig(target=str(tiny_target_dir), tp_size=4), spec, shard=True)
    with pytest.raises(TargetError, match="spreads the target over every GPU"):
        sharding_mode(ModelConfig(target=str(tiny_target_dir), device_map="auto"), spec, shard=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sharding_mode(ModelConfig(target=str(tiny_target_dir), device_map="auto"), spec, shard=False) == "device_map"
    assert sharding_mode(zero3, spec, shard=True) == "none"  # one process: nothing to split over


def test_gguf_targets_cannot_be_sharded(monkeypatch, tmp_path):
    from draftsmith.pipeline.target import TargetSpec

    monkeypatch.setenv("WORLD_SIZE", "2")
    spec = TargetSpec("x.gguf", "gguf", str(tmp_path), "x.gguf", None)
    with pytest.raises(TargetError, match="needs an HF safetensors target"):
        sharding_mode(ModelConfig(target="x.gguf", zero3="gpu"), spec, shard=True)


def test_device_map_loads_in_one_process(tiny_target_dir):
    """On a CPU machine `auto` places everything on the CPU; the point is that transformers places the model
    (no .to(device) afterwards) and it comes back frozen."""
    model = load_model(ModelConfig(target=str(tiny_target_dir), dtype="float32", device_map="auto"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_tensor_parallel_ranks_share_batches():
    tp = ModelConfig(tp_size=8)
    assert [data_parallel_rank(tp, r, 8) for r in (0, 7)] == [(0, 1), (0, 1)]
    assert data_parallel_rank(ModelConfig(zero3="gpu"), 5, 8) == (5, 8)  # ZeRO-3 keeps ranks independent
