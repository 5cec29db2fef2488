"""Target resolution, identity, device/dtype choice, and the tiny random target factory."""

import pytest
import torch

from draftsmith.eval.cpu_linear import CpuLinear
from draftsmith.pipeline.config import ModelConfig
from draftsmith.pipeline.target import TargetError, load_target, resolve_target


def test_alias_resolves_to_the_packaged_gguf():
    spec = resolve_target(ModelConfig(target="smollm2-135m-instruct"))
    assert spec.kind == "gguf" and spec.gguf_file.endswith(".gguf")
    ident = spec.identity()
    assert ident["name"] == "smollm2-135m-instruct" and len(ident["sha256"]) == 64


def test_local_dir_identity_changes_with_weights(tiny_target_dir, tmp_path):
    from tests.tiny import save_tiny_target

    a = resolve_target(ModelConfig(target=str(tiny_target_dir))).identity()
    assert a == resolve_target(ModelConfig(target=str(tiny_target_dir))).identity()
    other = save_tiny_target(tmp_path / "other", seed=1)
    b = resolve_target(ModelConfig(target=str(other))).identity()
    assert a["kind"] == "dir" and a["sha256"] != b["sha256"]


def test_hub_ids_and_bad_paths():
    spec = resolve_target(ModelConfig(target="meta-llama/Llama-3.1-8B-Instruct", revision="abc"))
    assert spec.kind == "hub" and spec.identity() == {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "kind": "hub",
        "revision": "abc",
    }
    with pytest.raises(TargetError, match="GGUF file not found"):
        resolve_target(ModelConfig(target="/nonexistent/model.gguf"))
    with pytest.raises(TargetError, match="path not found"):
        resolve_target(ModelConfig(target="./nonexistent-dir"))


def test_dir_without_config_is_refused(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        resolve_target(ModelConfig(target=str(tmp_path)))


def test_tiny_target_loads_through_the_real_path(tiny_target_dir):
    t = load_target(ModelConfig(target=str(tiny_target_dir), dtype="float64"))
    assert t.model.dtype == torch.float64 and t.device.type == "cpu"
    assert t.model.config.num_hidden_layers == 2 and t.model.config.hidden_size == 64
    assert t.tokenizer.chat_template and "<|im_start|>" in t.tokenizer.chat_template
    assert not any(p.requires_grad for p in t.model.parameters())


def test_tiny_factory_is_seeded():
    from tests.tiny import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer(seed=0)
    assert tok.get_vocab() == tiny_tokenizer(seed=0).get_vocab()
    a, b, c = tiny_llama(tok, seed=3), tiny_llama(tok, seed=3), tiny_llama(tok, seed=4)
    x = torch.tensor([[1, 5, 9, 30]])
    assert torch.equal(a(x).logits, b(x).logits) and not torch.equal(a(x).logits, c(x).logits)


def test_missing_chat_template_is_refused(tiny_target_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "no-template"
    shutil.copytree(tiny_target_dir, d)
    cfg_path = d / "tokenizer_config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("chat_template", None)
    cfg_path.write_text(json.dumps(data))
    for f in d.glob("chat_template.*"):
        f.unlink()
    with pytest.raises(TargetError, match="no chat template"):
        load_target(ModelConfig(target=str(d)), with_model=False)
    # an explicit template fixes it
    t = load_target(ModelConfig(target=str(d), chat_template="{{ messages[0]['content'] }}"), with_model=False)
    assert t.tokenizer.chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.slow
def test_smollm2_gguf_loads_dense_and_answers():
    from draftsmith.data.chat import prompt_ids

    # dtype auto: fp32 in the suite (bf16 is ~30x slower on AVX2-only CPUs; tests/pipeline/test_precision.py covers the choice)
    t = load_target(ModelConfig(target="smollm2-135m-instruct"))
    cfg = t.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    # dequantized: nn.Linear layers with dense float weights (hooks and bf16 kernels work as on any HF model); on the
    # CPU they are eval.cpu_linear's CpuLinear, the same layer computing decoding's few-row products by a faster path
    up = t.model.model.layers[0].mlp.up_proj
    assert type(up) is CpuLinear and up.weight.dtype == torch.float32 and up.weight.shape == (1536, 576)
    ids = prompt_ids(t.tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    out = t.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "4" in t.tokenizer.decode(out[0, len(ids) :])
