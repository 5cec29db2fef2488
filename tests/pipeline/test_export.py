"""Export contracts: every exported tensor maps to exactly one engine parameter of the right shape after
the engine's renames and fusions, nothing would be silently skipped, config fields are present and typed,
d2t invariants hold; export -> import round trips bit-exactly; speculators' own model class loads it."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.drafters.eagle3 import Eagle3Drafter
from draftsmith.drafters.vocab import draft_to_target_ids, select_draft_vocab
from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.export import import_drafter, run_export
from draftsmith.pipeline.families.eagle3 import sglang_refusal
from tests.tiny import save_tiny_target


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("t4"), seed=0, num_layers=4)


@pytest.fixture(scope="module")
def target5(tmp_path_factory):
    """Five layers, so that four aux layers (1..4) stay below L (id L has no engine counterpart)."""
    return save_tiny_target(tmp_path_factory.mktemp("t5"), seed=0, num_layers=5)


def _drafter(target_dir, tmp_path, num_layers=1, aux=(1, 2, 3), D=200):
    from transformers import AutoConfig, AutoModelForCausalLM

    tcfg = AutoConfig.from_pretrained(target_dir)
    embed = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight.detach()
    d2t, t2d = select_draft_vocab(
        torch.randint(0, 100, (tcfg.vocab_size,), generator=torch.Generator().manual_seed(0)), D
    )
    torch.manual_seed(0)
    model = Eagle3Drafter.from_target(tcfg, list(aux), D, embed, d2t, t2d, num_layers=num_layers)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    path = tmp_path / f"drafter-{num_layers}"
    model.save_pretrained(path)
    return model, path


def _export(target_dir, tmp_path, path, *overrides):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.target={target_dir}", *overrides])
    return run_export(cfg, drafter=str(path))


def vllm_expected_params(c):
    """vLLM's LlamaForCausalLMEagle3 parameters (after its q/k/v and gate/up fusion) and their shapes."""
    H, nh, nkv, hd, inter = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["intermediate_size"],
    )
    n_aux = c.get("num_aux_hidden_states", 3)
    out = {
        "model.fc.weight": (H, n_aux * c["target_hidden_size"]),
        "model.norm.weight": (H,),
        "lm_head.weight": (c["draft_vocab_size"], H),
        "draft_id_to_target_id": (c["draft_vocab_size"],),
    }
    for layer in range(c["num_hidden_layers"]):
        width = 2 * H if layer == 0 else H
        p = f"model.layers.{layer}."
        out |= {
            p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, width),
            p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "mlp.gate_up_proj.weight": (2 * inter, H),
            p + "mlp.down_proj.weight": (H, inter),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
        if layer == 0:
            out[p + "hidden_norm.weight"] = (H,)
    return out


def vllm_load(tensors):
    """vLLM's renames and fusions: midlayer. -> layers.0., a `model.` prefix except for lm_head, t2d ignored,
    d2t -> draft_id_to_target_id, q/k/v and gate/up concatenated along the output dim."""
    fused, shards = {}, {}
    for name, t in tensors.items():
        if name == "t2d":
            continue
        if name == "d2t":
            fused["draft_id_to_target_id"] = tuple(t.shape)
            continue
        name = name.replace("midlayer.", "layers.0.")
        if not name.startswith("lm_head"):
            name = "model." + name
        for parts, target in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            for part in parts:
                if f".{part}." in name:
                    key = name.replace(part, target)
                    shards.setdefault(key, {})[part] = t
                    break
            else:
                continue
            break
        else:
            assert name not in fused, f"two tensors load into {name}"
            fused[name] = tuple(t.shape)
    for key, parts in shards.items():
        order = ("q_proj", "k_proj", "v_proj") if "qkv" in key else ("gate_proj", "up_proj")
        assert set(parts) == set(order), f"{key}: incomplete fused shards {sorted(parts)}"
        widths = {p.shape[1] for p in parts.values()}
        assert len(widths) == 1, f"{key}: shards disagree on input width"
        fused[key] = (sum(parts[o].shape[0] for o in order), widths.pop())
    return fused


SGLANG_LAYER = [
    "hidden_norm",
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_vllm_contract(target4, tmp_path, num_layers):
    _, path = _drafter(target4, tmp_path, num_layers)
    out = _export(target4, tmp_path, path)
    c = json.loads((out / "eagle3" / "config.json").read_text())
    tensors = load_file(str(out / "eagle3" / "model.safetensors"))
    assert vllm_load(tensors) == vllm_expected_params(c)  # every tensor lands in exactly one parameter, none missing
    # 1 layer: the architecture both engines load; 2 layers: vLLM's own name, which SGLang refuses (it would compute
    # layers after the first with another norm)
    arch = "LlamaForCausalLMEagle3" if num_layers == 1 else "Eagle3LlamaForCausalLM"
    assert c["architectures"] == [arch] and c["num_hidden_layers"] == num_layers
    for key, typ in [
        ("vocab_size", int),
        ("draft_vocab_size", int),
        ("target_hidden_size", int),
        ("hidden_size", int),
        ("norm_before_residual", bool),
        ("eagle_aux_hidden_state_layer_ids", list),
    ]:
        assert isinstance(c[key], typ), key
    assert c["vocab_size"] == 384 and c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert "embed_tokens.weight" not in tensors  # both engines share the target's embedding
    assert not any(k.startswith("confidence") for k in tensors)


def test_sglang_contract_and_refusal(target4, tmp_path):
    _, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path)
    c = json.loads((out / "eagle3" / "config.json").read_text())
    tensors = load_file(str(out / "eagle3" / "model.safetensors"))
    known = {f"midlayer.{n}.weight" for n in SGLANG_LAYER} | {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    assert set(tensors) == known  # SGLang skips unknown names silently: there must be none
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * c["hidden_size"]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        i - 1 for i in c["eagle_aux_hidden_state_layer_ids"]
    ]
    assert c["norm_before_residual"] is False
    # a 2-layer drafter: written for vLLM only, with the reason
    model2, path2 = _drafter(target4, tmp_path, num_layers=2)
    assert "only 1 layer computes as trained" in sglang_refusal(model2.config)
    out2 = _export(target4, tmp_path / "two", path2)
    c2 = json.loads((out2 / "eagle3" / "config.json").read_text())
    assert "eagle_config" not in c2 and c2["architectures"] == ["Eagle3LlamaForCausalLM"]  # SGLang refuses the name
    assert "Not loadable by SGLang" in (out2 / "README.md").read_text()


def test_any_aux_count_is_written_for_both_engines_with_its_width(tmp_path):
    """fc's width comes from num_aux_hidden_states in both engines (not from the id list), in both layouts: vLLM's
    speculators translation starts the drafter config from transformer_layer_config. SGLang 0.5.23 reads any count."""
    target = save_tiny_target(tmp_path / "t6", seed=0, num_layers=6)
    model, path = _drafter(target, tmp_path, aux=(1, 2, 3, 4, 5))
    assert sglang_refusal(model.config) is None
    out = _export(target, tmp_path, path)
    c = json.loads((out / "eagle3" / "config.json").read_text())
    assert c["num_aux_hidden_states"] == 5 and c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2, 3, 4]
    s = json.loads((out / "speculators" / "config.json").read_text())
    assert s["transformer_layer_config"]["num_aux_hidden_states"] == 5
    assert vllm_load(load_file(str(out / "eagle3" / "model.safetensors"))) == vllm_expected_params(c)


def test_a_full_draft_vocabulary_ships_no_vocabulary_map(target4, tmp_path):
    """vLLM 0.33 creates draft_id_to_target_id only when the vocabularies differ and refuses d2t otherwise; the
    identity is implied, and import restores it."""
    model, path = _drafter(target4, tmp_path, D=384)
    out = _export(target4, tmp_path, path, "export.dtype=float32")
    for fmt in ("eagle3", "speculators"):
        tensors = load_file(str(out / fmt / "model.safetensors"))
        assert "d2t" not in tensors and "t2d" not in tensors, fmt
        again = import_drafter(out / fmt, embed_weight=model.embed_tokens.weight.detach())
        for key, value in model.state_dict().items():
            if not key.startswith(("confidence.", "rotary.")):
                assert torch.equal(again.state_dict()[key], value), (fmt, key)


@pytest.mark.parametrize("aux, why", [((1, 2, 4), "final normed output"), ((3, 1, 2), "ascending order")])
def test_aux_layers_no_engine_feeds_as_trained_are_refused(target4, tmp_path, aux, why):
    """Aux id L (= 4 here) is draftsmith's final normed output, which vLLM captures before the final norm and SGLang
    never; unsorted ids would reach fc permuted. No engine directory is written, and the refusal is recorded."""
    _, path = _drafter(target4, tmp_path, aux=aux)
    out = _export(target4, tmp_path, path)
    assert not (out / "eagle3").exists() and not (out / "speculators").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert why in manifest["refused"]["eagle3"] and manifest["formats"] == {}
    assert "not exported" in (out / "README.md").read_text()


def test_readme_serves_a_local_target_through_its_speculative_config(target4, tmp_path):
    """vLLM 0.33 refuses `vllm serve DIR` when the speculators config names a local verifier: for a local target the
    README names the target and passes the directory as the speculative model."""
    _, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path)
    readme = (out / "README.md").read_text()
    assert f"vllm serve {out / 'speculators'}" not in readme
    assert f'"model": "{out / "speculators"}"' in readme


def test_d2t_invariants_and_readme(target4, tmp_path):
    _, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path)
    for fmt in ("eagle3", "speculators"):
        t = load_file(str(out / fmt / "model.safetensors"))
        d2t, t2d = t["d2t"], t["t2d"]
        ids = draft_to_target_ids(d2t)
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.numel() == 384
        assert (ids[1:] > ids[:-1]).all() and ids.min() >= 0 and ids.max() < 384
        assert torch.equal(ids, t2d.nonzero().squeeze(1))
    readme = (out / "README.md").read_text()
    assert "vllm serve" in readme and "--speculative-algorithm EAGLE3" in readme and '"method": "eagle3"' in readme
    s = json.loads((out / "speculators" / "config.json").read_text())
    assert s["speculators_model_type"] == "eagle3" and s["norm_before_residual"] is False
    assert s["speculators_config"]["proposal_methods"][0]["proposal_type"] == "greedy"
    assert s["transformer_layer_config"]["vocab_size"] == 384


def _ttt_side_by_side(ref, again):
    """Three TTT steps of two EAGLE-3 drafters (a source and its round trip) on the same random features and tokens:
    each one's [(logits, confidence logits)] per step."""
    ref.eval(), again.eval()
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 11, 3 * 64, generator=g).to(ref.fc.weight.dtype)
    ids = torch.randint(0, 384, (2, 11), generator=g)
    with torch.no_grad():
        return ref.ttt_forward(aux, ids, 3), again.ttt_forward(aux, ids, 3)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_round_trip_is_bit_exact(target4, tmp_path, fmt, dtype, num_layers):
    model, path = _drafter(target4, tmp_path, num_layers)
    out = _export(target4, tmp_path, path, f"export.dtype={dtype}")
    again = import_drafter(out / fmt, embed_weight=model.embed_tokens.weight.detach())
    a, b = _ttt_side_by_side(model.to(getattr(torch, dtype)), again)
    for (la, _), (lb, _) in zip(a, b):
        assert torch.equal(la, lb)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_round_trip_keeps_its_calibrated_confidence_head(target4, tmp_path, fmt, dtype):
    """The confidence head the cost schedule reads, and its fitted scaling, travel in both EAGLE-3 directories
    (`draftsmith/confidence.safetensors` and extra config keys): the imported drafter's calibrated confidences equal
    the exported one's bit for bit at the export dtype. Before, neither travelled: the import kept a fresh head."""
    model, path = _drafter(target4, tmp_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a head unlike any fresh initialisation
        for name, p in model.named_parameters():
            if name.startswith("confidence."):
                p.copy_(torch.randn(p.shape, generator=g))
    model.config.confidence_temperatures = [0.5, 1.5, 2.0]
    model.config.confidence_biases = [-1.0, 0.0, 0.5]
    per_sampling = {"1.0": {"temperatures": [1.5, 1.0, 2.0], "biases": [-2.0, 0.0, 0.0]}}
    model.config.sampled_confidence_calibration = per_sampling
    model.save_pretrained(path)
    out = _export(target4, tmp_path, path, f"export.dtype={dtype}")
    assert set(load_file(str(out / fmt / "draftsmith" / "confidence.safetensors"))) == {
        k for k in model.state_dict() if k.startswith("confidence.")
    }
    assert not any(k.startswith("confidence.") for k in load_file(str(out / fmt / "model.safetensors")))
    again = import_drafter(out / fmt, embed_weight=model.embed_tokens.weight.detach())
    assert again.config.confidence_trained and again.config.confidence_temperatures == [0.5, 1.5, 2.0]
    assert again.config.confidence_biases == [-1.0, 0.0, 0.5]
    assert again.config.sampled_confidence_calibration == per_sampling
    a, b = _ttt_side_by_side(model.to(getattr(torch, dtype)), again)
    for i, ((_, ca), (_, cb)) in enumerate(zip(a, b)):
        for sampling in (0.0, 1.0):
            assert torch.equal(model.calibrated(ca, i, sampling), again.calibrated(cb, i, sampling))


def test_an_eagle3_export_without_a_confidence_head_is_drafted_at_fixed_gamma(target4, tmp_path):
    """Another trainer's EAGLE-3 directory has no confidence head: the import says its head is untrained
    (`confidence_trained` false), a re-export writes none, and eval drafts it at fixed γ under eval.schedule=auto and
    refuses the rules that read confidences, naming the drafter."""
    import shutil
    from types import SimpleNamespace

    from draftsmith.eval.proposers import Eagle3Proposer
    from draftsmith.pipeline.evaluate import _schedules

    model, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path, "export.dtype=float32")
    shutil.rmtree(out / "eagle3" / "draftsmith")
    again = import_drafter(out / "eagle3", embed_weight=model.embed_tokens.weight.detach())
    assert again.config.confidence_trained is False and again.config.confidence_temperatures is None
    again.save_pretrained(tmp_path / "imported")
    out2 = _export(target4, tmp_path / "second", tmp_path / "imported", "export.dtype=float32")
    assert not (out2 / "eagle3" / "draftsmith").exists() and not (out2 / "speculators" / "draftsmith").exists()
    for schedule, refused in (("auto", False), ("fixed", False), ("cost", True)):
        proposer = Eagle3Proposer(again)
        decoder = SimpleNamespace(proposers={"eagle3": proposer}, tree=None, gammas={"eagle3": 3})
        cfg = load_config(None, [f"model.target={target4}", f"eval.schedule={schedule}"])
        if refused:
            with pytest.raises(StageError, match="eagle3's confidence head was never trained"):
                _schedules(cfg, decoder, None, {}, [])
            continue
        tables, _ = _schedules(cfg, decoder, None, {}, [])
        assert tables == {} and proposer.schedule is None and proposer.threshold is None


def test_import_refuses_non_exports(tmp_path, target4):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(StageError, match="no drafter family reads this layout"):
        import_drafter(tmp_path / "x")
    _, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path)
    with pytest.raises(StageError, match="pass the target"):
        import_drafter(out / "eagle3")


def test_speculators_reference_class_loads_the_export(target4, tmp_path):
    pytest.importorskip("speculators", reason="installed by `make` from requirements-external.txt")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model, path = _drafter(target4, tmp_path)
    out = _export(target4, tmp_path, path, "export.dtype=float32")
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(out / "speculators"))
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention is GPU-only
    theirs = Eagle3DraftModel(cfg).eval()
    weights = load_file(str(out / "speculators" / "model.safetensors"))
    missing, unexpected = theirs.load_state_dict(weights, strict=False)
    # every exported tensor is a parameter/buffer of theirs (nothing unexpected); what they lack from us is only
    # the verifier's norm/lm_head, which speculators loads from the target itself (listed optional on load)
    assert unexpected == []
    assert sorted(missing) == ["verifier_lm_head.weight", "verifier_norm.weight"]
    assert torch.equal(theirs.d2t, weights["d2t"]) and torch.equal(theirs.t2d, weights["t2d"])
    T = 12
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, 3 * 64, generator=g)
    ids = torch.randint(0, 384, (1, T), generator=g)
    logits = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o))
    with torch.no_grad():  # their step 0 consumes the next tokens directly; positions start at 1 (RoPE is relative)
        theirs(
            hidden_states=aux,
            input_ids=torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=3,
        )
        ours = model.eval().ttt_forward(aux, ids, 3)
    hook.remove()
    for i in range(3):
        valid = T - 1 - i
        torch.testing.assert_close(logits[i][0, :valid], ours[i][0][0, :valid], atol=1e-4, rtol=1e-4)


def _dspark(target_dir, tmp_path, aux=(1, 2, 3, 4), D=200):
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.drafters.dspark import DSparkDrafter

    tcfg = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    d2t, t2d = select_draft_vocab(
        torch.randint(0, 100, (tcfg.vocab_size,), generator=torch.Generator().manual_seed(0)), D
    )
    torch.manual_seed(0)
    model = DSparkDrafter.from_target(
        tcfg,
        list(aux),
        D,
        target.get_input_embeddings().weight.detach(),
        d2t,
        t2d,
        head_weight=target.get_output_embeddings().weight.detach(),
        block_size=4,
        num_layers=2,
        markov_rank=16,
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
        model.markov_head.markov_w1.weight.normal_(0, 1.0)
    path = tmp_path / "dspark"
    model.save_pretrained(path)
    return model, path


def test_dspark_export_is_the_speculators_dspark_layout_and_computes_the_same_block(target5, tmp_path):
    """speculators' DSparkDraftModel built from our config.json takes every exported tensor, and its modules
    compute our block: backbone over [anchor, MASK...] with context K/V from the fused features, Markov bias of
    the previous token, confidence from [hidden ; W1[prev]]."""
    pytest.importorskip("speculators", reason="installed by `make` from requirements-external.txt")
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    model, path = _dspark(target5, tmp_path)
    out = _export(target5, tmp_path, path, "export.dtype=float32", "train.drafters=[dspark]")
    assert not (out / "eagle3").exists() and (out / "dspark" / "config.json").is_file()
    raw = json.loads((out / "dspark" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is True
    assert raw["aux_hidden_state_layer_ids"] == [1, 2, 3, 4] and raw["block_size"] == 4
    cfg = DSparkSpeculatorConfig.from_pretrained(str(out / "dspark"))
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention is GPU-only
    theirs = DSparkDraftModel(cfg).eval()
    weights = load_file(str(out / "dspark" / "model.safetensors"))
    assert "markov_head.markov_w1.weight" in weights and "confidence_head.proj.weight" in weights
    missing, unexpected = theirs.load_state_dict(weights, strict=False)
    assert unexpected == []
    # not exported: the embedding and the verifier's norm/head, which speculators loads from the target itself
    assert sorted(missing) == ["embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"]
    theirs.embed_tokens.weight.data.copy_(model.embed_tokens.weight)

    g = torch.Generator().manual_seed(0)
    P = 9  # anchor position: the context is positions 0..8
    aux = torch.randn(1, P, 4 * 64, generator=g)
    anchor = torch.tensor([17])
    prev = torch.tensor([[17, 40, 41, 42]])  # previous tokens of the 4 slots (the anchor, then drafted tokens)
    with torch.no_grad():
        cache = model.eval().new_cache()
        model.extend_context(cache, aux, torch.arange(P)[None])
        h, base = model.draft_block(cache, anchor, torch.tensor([P]))
        ours_logits, ours_conf = model.heads(h, prev, base)

        # the same block through their modules, wired as their _backbone_forward wires them
        ctx = theirs.hidden_norm(theirs.fc(aux))
        block = torch.full((1, 4), cfg.mask_token_id)
        block[0, 0] = anchor
        x = theirs.embed_tokens(block)
        positions = torch.cat([torch.arange(P), P + torch.arange(4)])[None]
        rope = theirs.rotary_emb(x, positions)
        for layer in theirs.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=rope)
        hidden = theirs.norm(x)
        logits = theirs.lm_head(hidden)
        prev_emb = theirs.markov_head.prev_embeddings(prev)
        logits = logits + theirs.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=prev_emb)
        conf = theirs.confidence_head(torch.cat([hidden, prev_emb], -1))
    torch.testing.assert_close(ours_logits, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_conf, conf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dspark_round_trip_is_bit_exact_with_its_calibration(target5, tmp_path, dtype):
    """export -> import of the dspark layout gives back the same drafter: the same block logits and confidences
    (bit for bit at the export dtype) and the fitted confidence temperatures, carried as an extra config key."""
    model, path = _dspark(target5, tmp_path)
    model.config.confidence_temperatures = [0.5, 1.5, 2.0, 3.0]
    model.config.confidence_biases = [-1.0, 0.0, 0.5, 0.25]
    per_sampling = {"1.0": {"temperatures": [1.5, 1.0, 1.0, 2.0], "biases": [-2.0, 0.0, 0.0, 0.0]}}
    model.config.sampled_confidence_calibration = per_sampling
    model.save_pretrained(path)
    out = _export(target5, tmp_path, path, f"export.dtype={dtype}", "train.drafters=[dspark]")
    with pytest.raises(StageError, match="pass the target"):
        import_drafter(out / "dspark")
    again = import_drafter(out / "dspark", embed_weight=model.embed_tokens.weight.detach())
    assert type(again).__name__ == "DSparkDrafter" and again.config.confidence_temperatures == [0.5, 1.5, 2.0, 3.0]
    assert again.config.confidence_biases == [-1.0, 0.0, 0.5, 0.25]
    assert again.config.sampled_confidence_calibration == per_sampling
    ref = model.to(getattr(torch, dtype)).eval()
    again.eval()
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 9, 4 * 64, generator=g).to(ref.fc.weight.dtype)
    prev = torch.tensor([[17, 40, 41, 42]])
    outputs = []
    for m in (ref, again):
        with torch.no_grad():
            cache = m.new_cache()
            m.extend_context(cache, aux, torch.arange(9)[None])
            h, base = m.draft_block(cache, torch.tensor([17]), torch.tensor([9]))
            logits, conf = m.heads(h, prev, base)
            outputs.append((logits, m.calibrated(conf[0, 1], 1)))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    raw = json.loads((out / "dspark" / "config.json").read_text())
    raw["sample_from_anchor"] = False
    (out / "dspark" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(StageError, match="sample_from_anchor"):
        import_drafter(out / "dspark", embed_weight=model.embed_tokens.weight.detach())


def test_a_full_vocabulary_dspark_ships_no_vocabulary_map(target5, tmp_path):
    model, path = _dspark(target5, tmp_path, D=384)
    out = _export(target5, tmp_path, path, "export.dtype=float32", "train.drafters=[dspark]")
    tensors = load_file(str(out / "dspark" / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors
    again = import_drafter(out / "dspark", embed_weight=model.embed_tokens.weight.detach())
    for key, value in model.state_dict().items():
        if not key.startswith("rotary."):
            assert torch.equal(again.state_dict()[key], value), key
