"""The launch/ benches of a run's trained drafters, on a tiny trained run. Issue 19's figures all come from
launch/bench_schedule.py, so its whole path runs here: the shared setup (`pipeline.evaluate.bench_inputs`), the cost
tables, the per-domain tables with plain decoding run before and after every schedule, the batch curve and its plot, and
the JSON the figures are read from. The other benches that start from `bench_inputs` run through once each."""

import json
import runpy
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.collect import run_collect
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.evaluate import bench_inputs
from draftsmith.pipeline.prepare import run_prepare
from draftsmith.pipeline.train import run_train
from tests.tiny import save_tiny_target, write_two_domain_chats

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A tiny target, chats in two domains, both families trained for a few steps: the recipe, with its run_dir
    inside (two of the benches take no overrides: they are pointed at a finished run's config.yaml)."""
    tmp_path = tmp_path_factory.mktemp("bench-run")
    target = save_tiny_target(tmp_path / "target", seed=0, num_layers=4)
    data = write_two_domain_chats(tmp_path / "chat.jsonl")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"run_dir: {tmp_path / 'run'}\n"
        f"model: {{target: {target}, dtype: float32}}\n"
        f"data: {{sources: [{{path: {data}, domain_field: category}}], holdout_fraction: 0.25}}\n"
        "collect: {aux_layer_ids: [1, 2, 3]}\n"
        "train: {drafters: [eagle3, dspark], max_steps: 2, batch_tokens: 256, draft_vocab_size: 300, eval_every: 1000,"
        " eagle3: {ttt_steps: 2}, dspark: {num_layers: 1, block_size: 3}}\n"
        f"eval: {{sources: [{{path: {data}, domain_field: category}}], max_new_tokens: 8, draft_length: 3,"
        " cost_rounds: 2}\n"
    )
    with pytest.MonkeyPatch.context() as mp:  # the module's run keeps its caches to itself, as every test's does
        mp.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
        cfg = load_config(recipe)
        run_prepare(cfg)
        run_collect(cfg)
        run_train(cfg)
    return recipe


def _run_script(name: str, argv: list[str], monkeypatch) -> None:
    script = LAUNCH / name
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    runpy.run_path(str(script), run_name="__main__")


def test_bench_inputs_loads_the_runs_drafters_beside_its_target(trained_run):
    inputs = bench_inputs(trained_run, ["eval.max_prompts_per_domain=3"], 1)  # the bench's own flag wins
    assert sorted(inputs.drafters) == ["dspark", "eagle3"] and len(inputs.prompts) == 2
    assert all(
        not d.training and next(d.parameters()).dtype == inputs.target.model.dtype for d in inputs.drafters.values()
    )
    assert bench_inputs(trained_run, [], 1, []).drafters == {}
    with pytest.raises(StageError, match="no trained drafter"):
        bench_inputs(trained_run, [], 1, ["eagle3", "no-such-family"])


def test_bench_schedule_measures_every_schedule_beside_plain_decoding(trained_run, tmp_path, monkeypatch):
    out = tmp_path / "bench"
    argv = [str(trained_run), "--per-domain", "1", "--max-new-tokens", "6", "--temperatures", "0,1", "--out", str(out)]
    argv += ["--batches", "1,2", "--schedules", "fixed,cost,cost-last", "--curve-schedules", "fixed,cost,cost-last"]
    _run_script("bench_schedule.py", argv, monkeypatch)

    record = json.loads((out / "bench_schedule.json").read_text())
    columns = [
        "none",
        *(f"{d}/{m}" for d in ("eagle3", "dspark") for m in ("fixed", "cost", "cost-last")),
        "none/again",
    ]
    assert [run["temperature"] for run in record["per_domain"]] == [0.0, 1.0]
    for run in record["per_domain"]:
        assert run["drafters"] == columns and set(run["domains"]) == {"math", "code"}
        for row in [*run["domains"].values(), run["overall"]]:
            assert row["none"]["drafted"] == 0 and row["none/again"]["drafted"] == 0
            for name in columns[1:-1]:  # each against plain decoding run before and after it, pooled
                assert row[name]["pooled"]["speedup"] > 0
        # what each cost schedule timed at that temperature: its own rounds, every one (a plain or a wider pass)
        assert set(run["regime_corrections"]) == {
            f"{d}/{m}" for d in ("eagle3", "dspark") for m in ("cost", "cost-last")
        }
        timed = run["regime_corrections"]["eagle3/cost"]["1"]
        passes = sum(timed.get(kind, {}).get("rounds", 0) for kind in ("plain", "wide"))
        if run["temperature"] == 1.0:  # (T = 0's regime also timed the untimed warm-up's greedy rounds)
            assert passes == run["overall"]["eagle3/cost"]["rounds"]
    assert {(p["batch"], p["temperature"]) for p in record["batch_curve"]} == {(1, 0.0), (2, 0.0)}
    assert set(record["costs"]) == {"eagle3", "dspark"}
    assert all({1, 2} <= {int(b) for b in table["verify"]} for table in record["costs"].values())
    assert (out / "batch_curve.png").is_file()


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("log_first_slots.py", ["--temperatures", "0", "--drafters", "dspark"], "dspark T = 0:"),
        ("bench_probe_acceptance.py", ["--drafter", "eagle3", "--every", "1,2"], "every  2 round(s)"),
        ("bench_deeper_slots.py", ["--drafter", "eagle3"], "| configuration |"),
        ("bench_skip_overhead.py", ["--batches", "1"], "of plain decoding"),
        ("bench_confidence.py", [], "wrote"),
        ("bench_vocab_coverage.py", ["--sizes", "64,128"], "in draft vocab"),
        ("bench_draft_sampling.py", ["--drafters", "eagle3"], "| all |"),
    ],
)
def test_each_bench_of_a_runs_drafters_runs_on_it(trained_run, tmp_path, monkeypatch, capsys, script, argv, says):
    """The other launch/ benches that start from `bench_inputs` run through on the tiny run (each was written for the
    demo's drafters and run by hand; nothing else would show one broken)."""
    if script in ("log_first_slots.py", "bench_confidence.py", "bench_draft_sampling.py"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    _run_script(script, [str(trained_run), *argv, "--per-domain", "1", "--max-new-tokens", "6"], monkeypatch)
    assert says in capsys.readouterr().out
