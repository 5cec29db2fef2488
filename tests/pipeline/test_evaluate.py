"""`draftsmith eval` end to end on a tiny target: a trained drafter, prompt lookup and plain decoding,
greedy and sampled, with eval.json / report.md / plots, and exactness visible in the report; the same eval
shared over 2 processes, and export under that launch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.cli import main
from draftsmith.pipeline.collect import run_collect
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.prepare import run_prepare
from draftsmith.pipeline.train import run_train
from tests.tiny import save_tiny_target, write_two_domain_chats


def test_eval_stage(tmp_path):
    target = save_tiny_target(tmp_path / "target", seed=0, num_layers=4)
    data = write_two_domain_chats(tmp_path / "chat.jsonl")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{target: {target}, dtype: float64}}\n"
        f"data: {{sources: [{{path: {data}, domain_field: category}}], holdout_fraction: 0.3}}\n"
        "collect: {aux_layer_ids: [1, 2, 4], dtype: float32}\n"
        "train: {max_steps: 3, batch_tokens: 256, draft_vocab_size: 300, eagle3: {ttt_steps: 2}, eval_every: 1000}\n"
        f"eval: {{sources: [{{path: {data}, domain_field: category}}], max_new_tokens: 12, draft_length: 3, "
        "schedule: fixed}\n"
    )
    cfg = load_config(recipe, [f"run_dir={tmp_path / 'run'}"])
    run_prepare(cfg)
    run_collect(cfg)
    run_train(cfg)
    assert main(["eval", str(recipe), f"run_dir={tmp_path / 'run'}", "--temperature", "0,1"]) == 0
    out = tmp_path / "run" / "eval"
    ev = first = json.loads((out / "eval.json").read_text())
    assert [r["temperature"] for r in ev["runs"]] == [0.0, 1.0]
    for run in ev["runs"]:
        assert set(run["domains"]) == {"math", "code"}
        assert run["drafters"] == ["none", "prompt_lookup", "eagle3"]
        for row in run["domains"].values():
            assert row["none"]["tau"] == 1.0 and row["none"]["drafted"] == 0
            assert row["none"]["target_passes"] == row["none"]["rounds"] + row["none"]["prompts"]
            e3 = row["eagle3"]
            assert e3["tau"] == (e3["accepted"] + e3["rounds"]) / e3["rounds"]
            assert e3["speedup"] > 0 and len(e3["survival"]) == 3
        assert run["overall"]["eagle3"]["calibration"]["positions"] > 0
    # float64 target: greedy speculative decoding reproduces plain decoding exactly
    assert ev["runs"][0]["greedy_divergence"] == {
        "prompt_lookup": {"prompts": 0, "of": 8},
        "eagle3": {"prompts": 0, "of": 8},
    }
    for f in (
        "report.md",
        "tau_by_domain_T0.png",
        "first_slot_T1.png",
        "survival_T1.png",
        "reliability_T0.png",
        "manifest.json",
    ):
        assert (out / f).is_file(), f
    report = (out / "report.md").read_text()
    assert "| math |" in report and "| eagle3 first slot |" in report and "First slot: the share" in report

    # tree drafting for the trained drafter (one prompt at a time), still exact under greedy decoding
    assert (
        main(
            [
                "eval",
                str(recipe),
                f"run_dir={tmp_path / 'run'}",
                "--temperature",
                "0",
                "eval.batch_size=1",
                "eval.tree_depth=3",
                "eval.tree_top_k=2",
                "eval.tree_nodes=6",
                "eval.max_prompts=3",
            ]
        )
        == 0
    )
    ev = json.loads((out / "eval.json").read_text())
    assert ev["runs"][0]["greedy_divergence"]["eagle3"] == {"prompts": 0, "of": 3}
    assert "tree depth 3" in (out / "report.md").read_text()

    # a per-domain prompt cap, and a second evaluation written beside the first (eval.output)
    assert (
        main(
            [
                "eval",
                str(recipe),
                f"run_dir={tmp_path / 'run'}",
                "--temperature",
                "0",
                "eval.batch_size=1",
                "eval.max_prompts_per_domain=1",
                "eval.output=eval-one-each",
                "eval.drafters=[none,trained]",
            ]
        )
        == 0
    )
    one = json.loads((tmp_path / "run" / "eval-one-each" / "eval.json").read_text())
    assert {d: row["none"]["prompts"] for d, row in one["runs"][0]["domains"].items()} == {"math": 1, "code": 1}
    e3 = one["runs"][0]["overall"]["eagle3"]
    assert e3["draft_ms_per_round"] > 0 and e3["verify_ms_per_pass"] > 0
    assert abs(e3["draft_cost_vs_target_pass"] - e3["draft_ms_per_round"] / e3["verify_ms_per_pass"]) < 1e-9
    assert json.loads((out / "eval.json").read_text()) == ev  # the first evaluation is untouched

    # the cost schedule: a cost table measured through the engine at the batch sizes eval runs, in the record and
    # the report; greedy output still the target's own. With the batch curve: plain decoding, fixed γ and the
    # schedule at batch 1 and 3, at both temperatures, in the record, the report and its plot.
    argv = ["eval", str(recipe), f"run_dir={tmp_path / 'run'}", "--temperature", "0,1", "eval.schedule=cost"]
    curve_args = [
        "eval.batch_size=2",
        "eval.output=eval-cost",
        "eval.drafters=[none,trained]",
        "eval.batch_curve=[1,3]",
    ]
    assert main([*argv, *curve_args]) == 0
    cost = json.loads((tmp_path / "run" / "eval-cost" / "eval.json").read_text())
    table = cost["costs"]["eagle3"]
    assert set(table["verify"]) == {"1", "2", "3"} and set(table["verify"]["2"]) == {"1", "2", "3", "4"}
    assert all(v > 0 for row in table["verify"].values() for v in row.values()) and not table["cached"]
    assert cost["settings"]["schedule"] == "cost" and cost["runs"][0]["greedy_divergence"]["eagle3"]["prompts"] == 0
    # what the rounds eval timed said against the table (eval's batches of 2, the curve's of 1 and 3: the curve
    # switches back to eval's own schedule), recorded and reported
    timed = table["corrections"]
    assert set(timed) == {"1", "2", "3"} and sum(c["rounds"] for k in timed.values() for c in k.values()) > 0
    assert "Timed during eval at batch" in (tmp_path / "run" / "eval-cost" / "report.md").read_text()
    curve = {(p["temperature"], p["batch"], p["drafter"], p["schedule"]): p for p in cost["batch_curve"]}
    assert set(curve) == {
        (t, b, d, m)
        for t in (0.0, 1.0)
        for b in (1, 3)
        for d, m in (("none", "-"), ("eagle3", "fixed"), ("eagle3", "cost"))
    }
    for (t, b, d, m), p in curve.items():
        assert p["rows"] == 8 and p["tokens_per_s"] > 0 and p["tau"] >= 1.0, (t, b, d, m)
        plain = curve[(t, b, "none", "-")]
        assert abs(p["speedup"] - p["tokens_per_s"] / plain["tokens_per_s"]) < 1e-9
        assert p["slots_per_row_round"] == (0.0 if d == "none" else p["slots_per_row_round"])
    assert all(curve[(t, b, "eagle3", "fixed")]["slots_per_row_round"] > 0 for t in (0.0, 1.0) for b in (1, 3))
    report = (tmp_path / "run" / "eval-cost" / "report.md").read_text()
    assert "Cost table: eagle3" in report and "Batch curve, T = 1.0" in report and "| 3 |" in report
    assert (tmp_path / "run" / "eval-cost" / "batch_curve.png").is_file()

    # under torchrun (2 gloo ranks) each rank decodes a share of the batches; the merged greedy results are the
    # single process's, count for count; then export (a single-writer stage) under the same launch
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
    for stage in (
        [
            "eval",
            str(recipe),
            f"run_dir={tmp_path / 'run'}",
            "--temperature",
            "0",
            "eval.output=eval-2ranks",
            "eval.batch_curve=[1,3]",
        ],
        ["export", str(recipe), f"run_dir={tmp_path / 'run'}", "export.dtype=float32"],
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                "-m",
                "draftsmith",
                *stage,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "run" / "eval-2ranks" / "eval.json").read_text())
    assert two["settings"]["processes"] == 2
    # each rank's cost schedule timed its own rounds: both kept, and merged weighted by their rounds
    ranks = two["costs"]["eagle3"]["corrections_by_rank"]
    merged = two["costs"]["eagle3"]["corrections"]
    assert len(ranks) == 2 and all(ranks)
    for b, kinds in merged.items():
        for kind, c in kinds.items():
            parts = [r[b][kind] for r in ranks if kind in r.get(b, {})]
            assert c["rounds"] == sum(p["rounds"] for p in parts)
            assert c["excess_s"] == pytest.approx(sum(p["excess_s"] * p["rounds"] for p in parts) / c["rounds"])
            for count in ("checks", "probes", "explores"):
                assert c.get(count, 0) == sum(p.get(count, 0) for p in parts)
    # the speedup's interval over the prompts of both ranks, paired by prompt after the gather
    for name, stats in two["runs"][0]["overall"].items():
        if name != "none":
            lo, hi = stats["speedup_interval"]
            assert lo <= stats["speedup"] <= hi, name
    counts = ("prompts", "rounds", "drafted", "accepted", "target_passes", "new_tokens", "acceptance_by_position")
    for domain, row in first["runs"][0]["domains"].items():  # the first evaluation's T = 0 run, same settings
        for name, stats in row.items():
            assert {k: two["runs"][0]["domains"][domain][name][k] for k in counts} == {k: stats[k] for k in counts}, (
                domain,
                name,
            )
    assert two["runs"][0]["greedy_divergence"] == first["runs"][0]["greedy_divergence"]
    # the batch curve's groups split over the ranks and merged: the same rows and (greedy) tokens as one process,
    # and where no schedule decides from timings, the same verified slots
    for p in two["batch_curve"]:
        one = curve[(p["temperature"], p["batch"], p["drafter"], p["schedule"])]
        assert p["rows"] == one["rows"]
        if p["schedule"] != "cost":
            assert (p["tau"], p["slots_per_row_round"]) == (one["tau"], one["slots_per_row_round"])
    assert json.loads((tmp_path / "run" / "export" / "manifest.json").read_text())["kind"] == "export"

    # a drafter whose confidence head was never trained (as `draftsmith import` marks another trainer's EAGLE-3
    # directory, which carries none: tests/pipeline/test_export.py): eval drafts it at fixed γ under the default
    # schedule, batch curve included, says so in the report, reports no calibration for it and refuses the cost rule
    foreign = tmp_path / "foreign" / "eagle3"
    shutil.copytree(tmp_path / "run" / "train" / "eagle3" / "final", foreign)
    raw = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps(raw | {"confidence_trained": False}))
    imported = str(foreign)
    argv = ["eval", str(recipe), f"run_dir={tmp_path / 'run'}", "--drafter", imported, "--temperature", "0"]
    assert main([*argv, "eval.schedule=auto", "eval.output=eval-imported", "eval.batch_curve=[1]"]) == 0
    ev = json.loads((tmp_path / "run" / "eval-imported" / "eval.json").read_text())
    assert ev["settings"]["no_confidence_head"] == ["eagle3"] and ev["costs"] == {}
    assert ev["runs"][0]["overall"]["eagle3"]["calibration"] is None
    assert {p["schedule"] for p in ev["batch_curve"] if p["drafter"] == "eagle3"} == {"fixed"}
    assert (
        "eagle3: fixed γ, no trained confidence head" in (tmp_path / "run" / "eval-imported" / "report.md").read_text()
    )
    assert main([*argv, "eval.schedule=cost", "eval.output=eval-imported-cost"]) != 0


def _lookup_only_recipe(tmp_path, device):
    """An eval of plain decoding and prompt lookup (no trained drafter needed) on a tiny target."""
    target = save_tiny_target(tmp_path / "target", seed=0, num_layers=2)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: say it twice. " * 2}) + "\n" for i in range(3))
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{target: {target}, device: {device}}}\n"
        f"eval: {{sources: [{{path: {data}}}], drafters: [none, prompt_lookup], max_new_tokens: 12, "
        f"temperatures: [0.0, 1.0], top_p: 0.9, top_k: 20, batch_size: 1}}\n"
    )
    return load_config(recipe, [f"run_dir={tmp_path / 'run'}"])


def test_eval_warms_up_every_drafter_samples_on_the_targets_device_and_keeps_finished_temperatures(
    tmp_path, monkeypatch, test_device
):
    import pytest
    import torch

    import draftsmith.pipeline.evaluate as evaluate
    from draftsmith.pipeline.completion import stage_completion

    def _eval_matches(cfg):
        return stage_completion(cfg, "eval").complete

    cfg = _lookup_only_recipe(tmp_path, test_device)
    calls = []
    real_decoding = evaluate.decoding

    def spy(target, proposer, prompts, params, gamma, max_new_tokens, stops, gens, **kw):
        calls.append((type(proposer).__name__, params.temperature, max_new_tokens))
        # one generator per row, on the target's device: multinomial on CUDA needs it
        assert len(gens) == len(prompts)
        assert all(isinstance(g, torch.Generator) and g.device.type == target.device.type for g in gens)
        if params.temperature == 1.0 and max_new_tokens == 12:
            raise RuntimeError("a failure at the second temperature")
        return real_decoding(target, proposer, prompts, params, gamma, max_new_tokens, stops, gens, **kw)

    monkeypatch.setattr(evaluate, "decoding", spy)
    with pytest.raises(RuntimeError, match="second temperature"):
        evaluate.run_eval(cfg)
    # every drafter ran untimed (short) at both temperatures before the first timed decode
    first_timed = next(i for i, c in enumerate(calls) if c[2] == 12)
    assert {(name, t) for name, t, n in calls[:first_timed]} == {
        (n, t) for n in ("NoDraft", "PromptLookup") for t in (0.0, 1.0)
    }
    assert all(n == 8 for _, _, n in calls[:first_timed])
    # the T = 0 results were written before T = 1 failed, marked incomplete, so `draftsmith run` will not skip eval
    ev = json.loads((cfg.run_path / "eval" / "eval.json").read_text())
    assert ev["complete"] is False and [r["temperature"] for r in ev["runs"]] == [0.0]
    assert ev["runs"][0]["overall"]["prompt_lookup"]["prompts"] == 3
    assert not _eval_matches(cfg)
    monkeypatch.setattr(evaluate, "decoding", real_decoding)
    evaluate.run_eval(cfg)
    ev = json.loads((cfg.run_path / "eval" / "eval.json").read_text())
    assert ev["complete"] is True and [r["temperature"] for r in ev["runs"]] == [0.0, 1.0] and _eval_matches(cfg)
