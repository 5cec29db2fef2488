"""Engine conformance tests: fixtures shared by the modules (the exports, built once per session, and the engine
install every probe subprocess runs from)."""

from __future__ import annotations

import pytest

from tests.engines.probe import ENGINES


@pytest.fixture(scope="session")
def engines():
    """.engines/ (`make engines`): vLLM 0.33.0 and SGLang 0.5.23 as released, outside the venv."""
    if not (ENGINES / ".installed").is_file():
        pytest.skip(f"{ENGINES} is not installed: `make engines` (requirements-engines.txt) installs vLLM and SGLang")
    return ENGINES


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Every variant of tests/engines/exports.py exported by draftsmith's export stage: {name: manifest entry}."""
    from tests.engines.exports import build_all

    return build_all(tmp_path_factory.mktemp("engine-exports"))
