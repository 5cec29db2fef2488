"""What installing draftsmith puts into site-packages: one `draftsmith` package and its entry point, nothing with a
generic top-level name (`pipeline`, `data`, `eval`, `drafters` would shadow or be shadowed by other projects)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def test_the_wheel_installs_one_draftsmith_package_and_its_entry_point(tmp_path):
    src = tmp_path / "src"
    for f in _tracked_files():  # a copy, so the build leaves nothing behind in the checkout
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("draftsmith-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"draftsmith", wheel.name.split("-py")[0] + ".dist-info"}, top
    for sub in ("pipeline", "drafters", "data", "eval"):
        assert f"draftsmith/{sub}/__init__.py" in names
    assert "draftsmith/__main__.py" in names and "draftsmith/pipeline/cli.py" in names
    entry = configparser.ConfigParser()
    entry.read_string(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode())
    assert dict(entry["console_scripts"]) == {"draftsmith": "draftsmith.pipeline.cli:main"}


def test_python_m_draftsmith_runs_from_outside_the_checkout(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "draftsmith", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "STAGE" in out.stdout


def test_no_file_points_outside_the_repository():
    """The repository stands alone: no code or doc refers readers to files that only exist beside it."""
    outside = ("../shared", "shared/reference", "DESIGN.md", "engine-formats.md", "speculative-decoding-chapter")
    found = [
        f"{f}: {needle}"
        for f in _tracked_files()
        if f.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".sbatch", "Makefile"))
        and f != "tests/packaging/test_install.py"
        for needle in outside
        if needle in (REPO / f).read_text(errors="replace")
    ]
    assert not found, found
