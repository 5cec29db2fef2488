"""The import layers of the library, checked on the source (`ast`, nothing is imported).

Every module of the installed package belongs to one layer of `LAYERS`, lowest first. A module may import
modules of its own layer or of lower layers, never of a higher one; a stage never imports another stage (what
stages share lives in the `shared` layer); no module imports another module's private (`_x`) names; and every
import of the package is spelled `draftsmith.…` (the repository folders are not importable under their own names
once installed). A new module of pipeline/ has to be given a layer here, or the test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# repository folder -> the package it is installed as (pyproject.toml's package-dir)
PACKAGES = {
    "draftsmith": "draftsmith",
    "pipeline": "draftsmith.pipeline",
    "data": "draftsmith.data",
    "drafters": "draftsmith.drafters",
    "eval": "draftsmith.eval",
}

# The layers, lowest first. An entry names one module, or (`pkg.*`) a package and every module in it.
LAYERS: list[tuple[str, list[str]]] = [
    # models, losses, vocabularies; ingestion, chat templates, records, artifacts, feature store
    ("base", ["draftsmith.drafters.*", "draftsmith.data.*"]),
    # the exact verifier, proposers, metrics, reports
    ("eval", ["draftsmith.eval.*"]),
    # what several stages share: config types, target loading and identity, the run directory's layout and the
    # completion rule, reading a run's artifacts back (records, trained drafters), per-family train settings
    (
        "shared",
        [
            "draftsmith.pipeline",  # (the package's __init__)
            "draftsmith.pipeline.config",
            "draftsmith.pipeline.console",
            "draftsmith.pipeline.dist",
            "draftsmith.pipeline.errors",
            "draftsmith.pipeline.precision",
            "draftsmith.pipeline.target",
            "draftsmith.pipeline.families.*",  # the drafter families: one module each, registered in __init__
            "draftsmith.pipeline.inputs",
            "draftsmith.pipeline.layout",
            "draftsmith.pipeline.completion",
        ],
    ),
    # one command each; they talk to each other only through the run directory
    (
        "stages",
        [
            "draftsmith.pipeline.prepare",
            "draftsmith.pipeline.generate",
            "draftsmith.pipeline.collect",
            "draftsmith.pipeline.train",
            "draftsmith.pipeline.evaluate",
            "draftsmith.pipeline.export",
            "draftsmith.pipeline.plan",
            "draftsmith.pipeline.budget",
        ],
    ),
    # what runs the stages: `draftsmith run`, the CLI, `python -m draftsmith`
    ("entry", ["draftsmith.pipeline.run", "draftsmith.pipeline.cli", "draftsmith", "draftsmith.__main__"]),
]
STAGE_LAYER = "stages"
BARE_NAMES = {folder for folder in PACKAGES if folder != "draftsmith"}  # `import pipeline` etc.


def library_files(root: Path = REPO) -> dict[str, Path]:
    """module name -> source file, for every .py file of the installed package."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def layer_of(module: str) -> str | None:
    """The layer whose entry names `module` (itself, or its package with `.*`); None when none does."""
    for name, entries in LAYERS:
        for entry in entries:
            package = entry.removesuffix(".*")
            if module == package or (entry.endswith(".*") and module.startswith(package + ".")):
                return name
    return None


RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def _imports(tree: ast.AST, module: str, known: set[str]):
    """(line, imported module, imported names, how it was written) for every import in the file, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, [], f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            written = "." * node.level + (node.module or "")
            names = [a.name for a in node.names]
            text = f"from {written} import {', '.join(names)}"
            if node.level:  # relative: resolved only to be reported
                yield node.lineno, None, names, text
                continue
            base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod
            submodules = [n for n in names if f"{base}.{n}" in known]
            for n in submodules:
                yield node.lineno, f"{base}.{n}", [], text
            rest = [n for n in names if n not in submodules]
            if rest:
                yield node.lineno, base, rest, text


def violations(sources: dict[str, str]) -> list[str]:
    """Every layering violation in `sources` (module name -> source text)."""
    known = set(sources)
    found = []
    for module, text in sorted(sources.items()):
        layer = layer_of(module)
        if layer is None:
            found.append(f"{module}: has no layer in LAYERS (add it to the table)")
            continue
        for line, target, names, written in _imports(ast.parse(text), module, known):
            where = f"{module}:{line}: `{written}`"
            if target is None:
                found.append(f"{where}: relative import (write draftsmith.…)")
                continue
            top = target.split(".")[0]
            if top in BARE_NAMES:
                found.append(f"{where}: bare `{top}` import (the installed name is draftsmith.{top})")
                continue
            if top != "draftsmith":
                continue  # a third-party or standard-library module
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                found.append(f"{where}: imports private name(s) {private} from another module")
            if target == module:
                continue
            their_layer = layer_of(target)
            if their_layer is None:
                found.append(f"{where}: {target} has no layer in LAYERS")
            elif RANK[their_layer] > RANK[layer]:
                found.append(f"{where}: {layer} layer imports {target} of the higher {their_layer} layer")
            elif layer == STAGE_LAYER and their_layer == STAGE_LAYER:
                found.append(f"{where}: a stage imports another stage ({target}); move what they share to 'shared'")
    return found


def test_the_library_keeps_its_layers():
    files = library_files()
    assert "draftsmith.pipeline.cli" in files and "draftsmith.eval.engine" in files  # the walk found the package
    found = violations({m: p.read_text() for m, p in files.items()})
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_layer_table_names_existing_modules():
    files = library_files()
    stale = [e for _, entries in LAYERS for e in entries if e.removesuffix(".*") not in files]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_the_check_finds_each_kind_of_violation():
    """The checker itself, on made-up modules: each rule fires, and allowed imports pass."""
    sources = {
        "draftsmith.data.sources": "from draftsmith.pipeline.config import RunConfig\n",  # base -> shared
        "draftsmith.eval.engine": "def f():\n    from draftsmith.pipeline.train import run_train\n",  # eval -> stage
        "draftsmith.pipeline.train": "from draftsmith.pipeline.collect import input_records\n",  # stage -> stage
        "draftsmith.pipeline.collect": "from draftsmith.data.features import _private\n",  # a private name
        "draftsmith.pipeline.prepare": "import pipeline.config\nfrom data import chat\n",  # bare names
        "draftsmith.pipeline.export": "from .train import x\n",  # relative
        "draftsmith.pipeline.shiny": "import json\n",  # not in the table
        # allowed: downward, within a layer outside the stages, third-party, an own private name
        "draftsmith.pipeline.run": "from draftsmith.pipeline.train import run_train\nimport torch\n",
        "draftsmith.pipeline.config": "from draftsmith.data.config import SourceConfig\n",
        "draftsmith.drafters.dspark": "from draftsmith.drafters.eagle3 import KVCache\n",
        "draftsmith.data.features": "_private = 1\nfrom draftsmith.data.features import _private\n",
    }
    found = violations(sources)
    assert len(found) == 8, "\n".join(found)
    expected = [
        "data.sources:1",
        "eval.engine:2",
        "train:1",
        "collect:1",
        "prepare:1",
        "prepare:2",
        "export:1",
        "shiny: has no layer",
    ]
    for key in expected:
        assert any(key in f for f in found), (key, found)
