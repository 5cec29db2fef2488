"""`draftsmith run` end to end on the tiny random target (prompts from a file plus self-synthesized ones, all
answered on-policy), checking every artifact and that the trained drafter is accepted (τ > 1) when the
target answers the prompts it was trained on; a second run skips what is complete."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.pipeline.cli import main
from tests.tiny import save_tiny_target


@pytest.fixture
def tiny_recipe(tmp_path):
    """A run recipe over a 4-layer tiny target: file prompts plus self-synthesis, both drafter families."""
    target = save_tiny_target(tmp_path / "target", seed=0, num_layers=4)
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"e{i}",
                    "prompt": f"Question {i}: explain the sum of numbers.",
                    "topic": ["math", "chat"][i % 2],
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"""
name: tiny
model: {{target: {target}}}
generate: {{synthesize: 8, max_new_tokens: 48, batch_size: 16, chunk_size: 8,
            synth: {{round_size: 32, max_new_tokens: 12, min_chars: 3}}}}
data: {{sources: [{{path: {prompts}, domain_field: topic}}], holdout_fraction: 0.2}}
collect: {{aux_layer_ids: [1, 2, 3], dtype: float32}}
train: {{drafters: [eagle3, dspark], eagle3: {{ttt_steps: 3}}, draft_vocab_size: 384, batch_tokens: 512, lr: 0.005, epochs: 40, eval_every: 50,
        log_every: 25, dspark: {{block_size: 4, num_layers: 1, markov_rank: 16, anchors_per_sequence: 16}}}}
eval: {{sources: [{{path: {prompts}, domain_field: topic}}], temperatures: [0.0], max_new_tokens: 32, draft_length: 3, batch_size: 1,
       schedule: fixed}}
export: {{dtype: float32}}
""")
    return recipe


def test_run_end_to_end_and_resume(tmp_path, tiny_recipe):
    recipe = tiny_recipe
    run = tmp_path / "run"
    started = time.perf_counter()
    assert main(["run", str(recipe), f"run_dir={run}"]) == 0
    first = time.perf_counter() - started
    for artifact, kind in [
        ("prepared", "prepared"),
        ("generated", "generated"),
        ("features", "features"),
        ("train/eagle3", "drafter"),
        ("train/dspark", "drafter"),
        ("eval", "eval"),
        ("export", "export"),
    ]:
        assert json.loads((run / artifact / "manifest.json").read_text())["kind"] == kind, artifact
    for family in ("eagle3", "dspark"):
        assert (run / "train" / family / "final" / "model.safetensors").is_file()
    calibration = json.loads((run / "train" / "dspark" / "final" / "calibration.json").read_text())
    assert len(calibration["temperatures"]) == 4
    # EAGLE-3's confidences too, one temperature per TTT step (what eval's cost schedule predicts from)
    calibration = json.loads((run / "train" / "eagle3" / "final" / "calibration.json").read_text())
    assert len(calibration["temperatures"]) == 3
    # fitted again at every sampling temperature of `calibrate_at` (0 and 1), on that temperature's acceptance
    for family, steps in (("eagle3", 3), ("dspark", 4)):
        drafter = json.loads((run / "train" / family / "final" / "config.json").read_text())
        fitted = drafter["sampled_confidence_calibration"]
        assert sorted(fitted) == ["0.0", "1.0"], family
        assert all(len(f["temperatures"]) == len(f["biases"]) == steps for f in fitted.values()), family
        report = json.loads((run / "train" / family / "final" / "calibration.json").read_text())
        trained = fitted[str(float(report["temperature"]))]  # the training temperature's is also the top-level one
        assert trained["temperatures"] == drafter["confidence_temperatures"], family
        assert trained["biases"] == drafter["confidence_biases"], family
        at = report["by_sampling_temperature"]
        assert at["0.0"]["first_slot_accepted"] != at["1.0"]["first_slot_accepted"], family  # another target
        # and at each temperature above 0 on the acceptance of the argmax drafted (eval.draft_sample_method=greedy)
        greedy = drafter["greedy_confidence_calibration"]
        assert sorted(greedy) == ["1.0"] and len(greedy["1.0"]["temperatures"]) == steps, family
        greedy_at = report["greedy_drafts_by_sampling_temperature"]["1.0"]
        assert greedy_at["first_slot_accepted"] != at["1.0"]["first_slot_accepted"], family  # p(argmax q), not Σ min
    for fmt in ("eagle3", "speculators", "dspark"):
        assert (run / "export" / fmt / "config.json").is_file(), fmt
    ev = json.loads((run / "eval" / "eval.json").read_text())
    overall = ev["runs"][0]["overall"]
    assert overall["none"]["tau"] == 1.0
    assert overall["eagle3"]["tau"] > 1.0, overall["eagle3"]
    assert overall["dspark"]["tau"] > 1.0, overall["dspark"]
    assert set(ev["runs"][0]["domains"]) == {"math", "chat"}
    assert "τ" in (run / "export" / "README.md").read_text()  # the measured τ travels with the export
    # everything is complete: the second run skips or returns at once
    started = time.perf_counter()
    assert main(["run", str(recipe), f"run_dir={run}"]) == 0
    assert time.perf_counter() - started < first / 2
    assert json.loads((run / "eval" / "eval.json").read_text()) == ev
    # both trained drafters decode batches of prompts too (rows accepting different lengths per round), here with
    # adaptive draft length (rows drafting different lengths per round)
    assert (
        main(
            [
                "eval",
                str(recipe),
                f"run_dir={run}",
                "eval.batch_size=4",
                "eval.output=eval-batched",
                "eval.confidence_threshold=0.2",
            ]
        )
        == 0
    )
    batched = json.loads((run / "eval-batched" / "eval.json").read_text())["runs"][0]
    assert batched["greedy_divergence"]["dspark"]["of"] == 24
    for family in ("eagle3", "dspark"):
        assert batched["overall"][family]["tau"] > 1.0, (family, batched["overall"][family])
    # launch/recalibrate.py fits the finished drafters again into a new run, at other sampling temperatures, without
    # touching this one; the new run's manifests list its files and say where it came from
    again = tmp_path / "recalibrated"
    script = Path(__file__).parents[2] / "launch" / "recalibrate.py"
    args = [str(run / "config.yaml"), "--out", str(again), "train.eagle3.calibrate_at=[0.5]"]
    subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, timeout=600)
    before = json.loads((run / "train" / "eagle3" / "final" / "config.json").read_text())
    after = json.loads((again / "train" / "eagle3" / "final" / "config.json").read_text())
    trained = str(
        float(json.loads((run / "train" / "eagle3" / "final" / "calibration.json").read_text())["temperature"])
    )
    assert sorted(before["sampled_confidence_calibration"]) == ["0.0", "1.0"]
    assert sorted(after["sampled_confidence_calibration"]) == sorted({trained, "0.5"})
    assert (again / "features").resolve() == (run / "features").resolve()  # linked, not copied
    manifest = json.loads((again / "train" / "eagle3" / "manifest.json").read_text())
    assert manifest["recalibrated"]["from"] == str(run / "train" / "eagle3")
    listed = {f["file"]: f["sha256"] for f in manifest["files"]}
    written = (again / "train" / "eagle3" / "final" / "config.json").read_bytes()
    assert listed["final/config.json"] == hashlib.sha256(written).hexdigest()


def test_cli_closes_the_process_group_it_ran_in(tmp_path):
    """Every stage ends with the process group destroyed (gloo threads left to interpreter teardown can abort a
    rank after its work is done), on the error path too."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert main(["plan", "model.no_such_field=1"]) == 2  # a config error, after the group exists
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_run_under_torchrun_shares_the_stages_out(tmp_path, tiny_recipe):
    """`torchrun --nproc_per_node 2 -m draftsmith run`: generation, collection, training and eval are shared over
    the ranks, prepare and export are written once, one rank prints the summary; a second launch skips it all."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
    run = tmp_path / "run2"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "draftsmith",
        "run",
        str(tiny_recipe),
        f"run_dir={run}",
        "train.epochs=10",
    ]
    for attempt in ("first", "again"):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = proc.stdout + proc.stderr  # (the console writes to stderr)
        assert printed.count("draftsmith run: done") == 1, attempt
    assert "prepare skipped, generate complete, collect complete, train skipped, eval skipped" in " ".join(
        printed.split()
    )
    for artifact in ("prepared", "generated", "features", "train/eagle3", "train/dspark", "eval", "export"):
        assert (run / artifact / "manifest.json").is_file(), artifact
    ev = json.loads((run / "eval" / "eval.json").read_text())
    assert ev["settings"]["processes"] == 2 and ev["runs"][0]["overall"]["none"]["prompts"] == 24
    assert json.loads((run / "train" / "eagle3" / "manifest.json").read_text())["world_size"] == 2
    # DSpark's calibration is shared over the ranks too (one rank alone would keep the other waiting in a collective)
    assert json.loads((run / "train" / "dspark" / "final" / "calibration.json").read_text())["ranks"] == 2
