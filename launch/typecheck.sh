#!/usr/bin/env bash
# Type-check the library: `mypy -p draftsmith` over the installed package's layout (settings: pyproject.toml,
# [tool.mypy]). Part of `make check`, which `make test` runs first.
#
# Why a symlink farm: the package `draftsmith` is assembled at install time from the repository's top-level
# folders (pyproject.toml, [tool.setuptools.package-dir]: draftsmith.pipeline = pipeline/, ...). mypy resolves
# modules from the file system and cannot follow that mapping (nor the editable install's import hook), and
# checking the folders as they lie would give them the wrong module names (`pipeline.config` rather than
# `draftsmith.pipeline.config`, which is what the code imports). So a temporary directory gets the package as
# it is installed, made of links to the repository's files, and mypy runs from there with the venv's python,
# so that third-party imports (torch, transformers, pydantic...) resolve to the installed ones. Reported paths
# are mapped back to the repository's (draftsmith/pipeline/x.py -> pipeline/x.py).
#
# Usage: bash launch/typecheck.sh [extra mypy arguments]   (PYTHON=... for another interpreter than .venv's)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
if [[ "$PYTHON" == */* && "$PYTHON" != /* ]]; then PYTHON="$PWD/$PYTHON"; fi
TMP="$(mktemp -d "${TMPDIR:-/tmp}/draftsmith-typecheck.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

mkdir "$TMP/draftsmith"
ln -s "$ROOT/draftsmith/__init__.py" "$TMP/draftsmith/__init__.py"
ln -s "$ROOT/draftsmith/__main__.py" "$TMP/draftsmith/__main__.py"
for sub in pipeline drafters data eval; do
  ln -s "$ROOT/$sub" "$TMP/draftsmith/$sub"
done

cd "$TMP"
status=0
out="$("$PYTHON" -m mypy --config-file "$ROOT/pyproject.toml" --python-executable "$PYTHON" \
  --cache-dir "$TMP/.mypy_cache" -p draftsmith "$@" 2>&1)" || status=$?
out="$(printf '%s\n' "$out" | sed -E 's#^draftsmith/(pipeline|drafters|data|eval)/#\1/#')"
printf '%s\n' "$out"
exit "$status"  # 0 clean, 1 type errors, 2 mypy could not check at all
