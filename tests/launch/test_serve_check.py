"""launch/serve_check.py, the GPU serve check, as far as it runs without vLLM or SGLang: which engine runs an export
allows, and the refusals when there is nothing to serve or nothing to serve it with."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
import serve_check  # noqa: E402


def _export(root: Path, sglang_loads: bool) -> Path:
    export = root / "export"
    for name, config in [
        ("eagle3", {"architectures": ["LlamaForCausalLMEagle3" if sglang_loads else "Eagle3LlamaForCausalLM"]}),
        ("speculators", {"speculators_model_type": "eagle3"}),
        ("dspark", {"speculators_model_type": "dspark", "block_size": 7}),
    ]:
        (export / name).mkdir(parents=True)
        (export / name / "config.json").write_text(json.dumps(config))
    (export / "manifest.json").write_text("{}")
    return export


@pytest.mark.parametrize("sglang_loads", [True, False])
def test_the_runs_an_export_allows(tmp_path, monkeypatch, sglang_loads):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: name in ("vllm", "sglang") or None)
    export = _export(tmp_path, sglang_loads)
    runs = {(e, n): s for e, n, s in serve_check._engine_runs(export, 5)}
    assert runs[("vllm", "plain")] is None and runs[("sglang", "plain")] is None
    assert runs[("vllm", "eagle3")] == {
        "method": "eagle3",
        "model": str(export / "eagle3"),
        "num_speculative_tokens": 5,
    }
    assert runs[("vllm", "speculators")]["model"] == str(export / "speculators")
    assert runs[("vllm", "dspark")]["num_speculative_tokens"] == 7  # a block drafter drafts its block
    # SGLang is never handed a directory the export wrote for vLLM only
    assert (("sglang", "eagle3") in runs) == sglang_loads


def test_refuses_without_an_export_or_an_engine(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"run_dir: {tmp_path / 'run'}\n")
    assert serve_check.main([str(recipe)]) == 2
    assert "run `draftsmith export` first" in capsys.readouterr().err
    _export(tmp_path / "run", sglang_loads=True)
    if importlib.util.find_spec("vllm") or importlib.util.find_spec("sglang"):
        pytest.skip("an engine is importable here: the refusal cannot be shown")
    assert serve_check.main([str(recipe)]) == 2
    assert "neither vLLM nor SGLang is importable" in capsys.readouterr().err
