"""speculators 0.9.0 (vllm-project/speculators, in the venv from requirements-external.txt) on draftsmith's exports,
through its public loading path: `SpeculatorModel.from_pretrained(dir)`, which resolves the class from
`speculators_model_type`, loads the checkpoint, the vocabulary mappings and the verifier's weights (the verifier is
our tiny target, a local directory, so nothing is fetched), then through the loaded model's own `forward`, compared
with draftsmith's numbers (EAGLE-3 and DSpark, float32 and bfloat16 exports).

It runs in the test process: speculators is a venv dependency already (tests/pipeline/test_export.py imports it),
unlike vLLM and SGLang, whose pinned dependencies stay in .engines/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.engines.exports import (
    BF16,
    BF16_DSPARK,
    DSPARK,
    ENGINE_RTOL,
    HIDDEN,
    TOKENS,
    WRITTEN_EAGLE3,
    target_features,
)

pytest.importorskip("speculators", reason="installed by `make` from requirements-external.txt")

# bfloat16 on both sides: an 8-bit mantissa (unit roundoff 2^-8 = 0.4 %), rounded after every matmul, norm and
# residual add of fc + 1-2 layers + head, in a different order on each side (speculators' eager attention vs our
# SDPA, its fused q/k/v layout): the step-0 logits agree to a few percent of their scale and nearly always on the
# argmax. A mis-mapped tensor or aux column is off by the order of the scale itself.
BF16_RTOL = 0.05


def _speculators_logits(directory: Path, features: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype):
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(directory)).to(dtype).eval()
    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    T = ids.shape[0]
    with torch.no_grad():  # FlexAttention (its default) runs on CPU only without autograd, in blocks of 128
        model(
            hidden_states=features[None],
            input_ids=F.pad(ids[1:], (0, 1))[None],  # its inputs are pre-shifted: step 0 reads token t+1 at t
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=1,
        )
    hook.remove()
    return model, captured[0][0]


@pytest.mark.parametrize(
    "key", [v.name for v in WRITTEN_EAGLE3] + [n + "@bf16" for n in BF16], ids=lambda k: k.replace("@", "-")
)
def test_speculators_eagle3_forward_matches_ours(exported, key):
    """speculators/ through `SpeculatorModel.from_pretrained` (its Eagle3DraftModel, with d2t/t2d loaded only for a
    reduced vocabulary and the verifier's embedding from our target), then its own `forward` (ttt_steps=1, the
    public training/drafting forward) on draftsmith's features; the step-0 `lm_head` output (captured with a hook:
    forward returns only argmax tokens) equals draftsmith's `ttt_forward` step 0. float32: to 1e-4 of the logit
    scale; bfloat16 export and model: to BF16_RTOL of it, with the argmax agreeing on >= 90 % of positions."""
    entry = exported[key]
    ref = torch.load(entry["reference"])
    dtype = getattr(torch, entry["dtype"])
    assert ref["input_ids"].shape[0] == TOKENS
    directory = Path(entry["export"]) / "speculators"
    model, theirs = _speculators_logits(directory, ref["features"].to(dtype), ref["input_ids"], dtype)
    raw = json.loads((directory / "config.json").read_text())
    assert model.config.eagle_aux_hidden_state_layer_ids == raw["eagle_aux_hidden_state_layer_ids"]
    ours = ref["logits"]
    scale = ours.float().abs().max().item()
    rtol = ENGINE_RTOL if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(theirs.float(), ours.float(), atol=rtol * scale, rtol=0)
    agree = (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item()
    assert agree >= (0.99 if dtype == torch.float32 else 0.9), agree


@pytest.mark.parametrize("name", [v.name for v in DSPARK])
def test_speculators_dspark_loads_every_tensor(exported, name):
    """dspark/ through `SpeculatorModel.from_pretrained` (its DSparkDraftModel): every exported tensor is in the
    loaded model, unchanged (the embedding and, for a full vocabulary, lm_head are re-read from the verifier by
    speculators' DFlash loader: ours are the target's, so they are equal too), with no unexpected keys. What the
    loaded model computes is compared by test_speculators_dspark_forward_matches_ours (its own `forward`, end to
    end)."""
    from speculators import SpeculatorModel

    directory = Path(exported[name]["export"]) / "dspark"
    model = SpeculatorModel.from_pretrained(str(directory))
    assert type(model).__name__ == "DSparkDraftModel"
    state = model.state_dict()
    weights = load_file(str(directory / "model.safetensors"))
    missing = [k for k in weights if k not in state]
    assert missing == [], f"exported but not in speculators' model: {missing}"
    differs = [k for k in weights if not torch.equal(state[k].to(weights[k].dtype), weights[k])]
    assert differs == [], f"loaded with other values: {differs}"


# speculators' DSpark training forward, as its trainer calls it: `--max-anchors` blocks per packed batch (32 x block 4
# = 128 query slots, a whole FlexAttention block on CPU) and `--loss-implementation eager` (the default, fused, needs
# Triton: "use --loss-implementation eager for compatibility testing")
DSPARK_ANCHORS = 32
DSPARK_PROMPT = 16  # leading positions outside the loss mask (a prompt): no anchor may be drawn there


def _speculators_batch(features, last, ids, dtype):
    """The packed batch speculators' trainer feeds its model, built by its own code: one dataset item in the layout
    of `ArrowDataset._get_raw_data` + `BaseDataset.__getitem__` (emulated here: aux states concatenated in
    aux-id order, the verifier's last state, the loss mask, lengths, position_ids), packed by its `CollateFn`
    (hidden states cast to the trainer's `hidden_states_dtype`, document_ids, error_records)."""
    from speculators.train.data import CollateFn

    T = ids.shape[0]
    loss_mask = torch.ones(T, dtype=torch.bool)
    loss_mask[:DSPARK_PROMPT] = False
    item = {
        "hidden_states": features,
        "input_ids": ids,
        "verifier_last_hidden_states": last,
        "loss_mask": loss_mask,
        "lengths": torch.tensor([T]),
        "position_ids": torch.arange(T),
    }
    collate = CollateFn(max_len=T, hidden_size=HIDDEN, num_target_layers=features.shape[-1] // HIDDEN, dtype=dtype)
    return collate([item])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    "key", [v.name for v in DSPARK] + [n + "@bf16" for n in BF16_DSPARK], ids=lambda k: k.replace("@", "-")
)
def test_speculators_dspark_forward_matches_ours(exported, monkeypatch, key):
    """dspark/ through speculators' public path, end to end: `SpeculatorModel.from_pretrained` (DSparkDraftModel,
    the attention implementation set on the config first as its trainer's `--from-pretrained` does; its default,
    simple_flex_attention), `DSparkDraftModel.get_trainer_kwargs` (`--max-anchors DSPARK_ANCHORS`,
    `--loss-implementation eager`), then `model(**batch, **train_call_kwargs)` as `Trainer.train_epoch` calls it,
    on a batch packed by its `CollateFn` (see _speculators_batch: one document of TOKENS tokens, the first
    DSPARK_PROMPT outside the loss mask). Everything it computes is its code: the anchor sampling
    (`select_anchors`, seeded), the anchor-block mask, the backbone, the Markov bias, the confidence head, the loss.
    Nothing is replaced; two recorders only look: `model._backbone_forward` wrapped (the anchored block indices it
    sampled, its normed hidden states, its backbone logits and verifier targets) and `compute_metrics`, the
    module-level name in speculators.models.dspark.core, wrapped (the biased `logits` and `confidence_logits`
    it receives; the real function still computes the returned loss, checked finite).

    Emulated: the dataset item (the target's aux states from draftsmith's `AuxHooks`, as `collect` captures them,
    where speculators reads vLLM's hidden-states extraction; `verifier_last_hidden_states` the final decoder state
    before the final norm, which speculators' frozen `verifier_norm` + `verifier_lm_head` turn into the targets:
    checked to equal the target's own logits on the draft vocabulary, so the layout is the one it expects) and
    eval mode under no_grad where the trainer trains (FlexAttention runs on CPU only without autograd; the draft
    layers have no dropout, so the forward computes the same numbers).
    bfloat16: the bf16 export, loaded by from_pretrained in bf16 (its torch_dtype), run under
    `torch.autocast(bfloat16)` with bf16 hidden states, as the trainer runs `--hidden-states-dtype bfloat16`.
    `conditional_torch_compile` compiles `forward` only where CUDA is available (not in this CPU-only torch): it
    runs eagerly; speculators' compiled `create_block_mask` is used as it is.

    Ours: the draftsmith drafter the export was made from (`DSparkDrafter.from_pretrained`, cast to the export
    dtype), its packed training forward on the same features and ids, at the anchors speculators sampled. The
    normed block hidden states, the backbone logits, the biased logits and the confidence logits of every block
    slot agree: float32 to ENGINE_RTOL of each one's scale, bfloat16 to BF16_RTOL; the biased argmax on >= 99 %
    (float32) / 90 % (bfloat16) of the slots."""
    import speculators.models.dspark.core as dspark_core
    from speculators import SpeculatorModel
    from speculators.models.dspark import DSparkDraftModel

    from draftsmith.drafters.dspark import DSparkDrafter

    entry = exported[key]
    dtype = getattr(torch, entry["dtype"])
    directory = Path(entry["export"]) / "dspark"
    raw = json.loads((directory / "config.json").read_text())
    aux, block = raw["aux_hidden_state_layer_ids"], raw["block_size"]
    assert aux == list(entry["aux"]) and raw["sample_from_anchor"] is True

    ids = torch.randint(
        0, raw["transformer_layer_config"]["vocab_size"], (TOKENS,), generator=torch.Generator().manual_seed(1)
    )
    features, last, target_logits = target_features(entry["target_dir"], aux, ids)
    batch = _speculators_batch(features, last, ids, dtype)

    config = DSparkDraftModel.config_class.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "simple_flex_attention"  # its --draft-attn-impl default
    model = SpeculatorModel.from_pretrained(str(directory), config=config).eval()
    assert type(model).__name__ == "DSparkDraftModel" and model.fc.weight.dtype == dtype
    train_kwargs, _ = DSparkDraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", max_anchors=DSPARK_ANCHORS
    )

    seen = {}
    backbone, compute_metrics = model._backbone_forward, dspark_core.compute_metrics

    def recorded_backbone(*args, **kwargs):
        seen["backbone"] = out = backbone(*args, **kwargs)
        return out

    def recorded_metrics(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return compute_metrics(logits, targets, confidence_logits, *args, **kwargs)

    model._backbone_forward = recorded_backbone  # (an instance attribute: forward calls self._backbone_forward)
    monkeypatch.setattr(dspark_core, "compute_metrics", recorded_metrics)
    torch.manual_seed(0)  # select_anchors' permutation
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        draft_tokens, loss, metrics = model(**batch, **train_kwargs)
    assert draft_tokens is None and torch.isfinite(loss).all() and metrics, loss
    hidden, base_logits, targets, aligned_mask, indices = seen["backbone"]

    # the blocks it drew: DSPARK_ANCHORS distinct anchors inside the loss mask, each a whole block of slots
    blocks = indices.view(DSPARK_ANCHORS, block)
    anchors = blocks[:, 0]
    assert torch.equal(blocks, anchors[:, None] + torch.arange(block))
    assert len(anchors.unique()) == DSPARK_ANCHORS
    assert anchors.min() >= DSPARK_PROMPT and anchors.max() < TOKENS - block
    assert aligned_mask.bool().all()  # every slot valid and trained: all are compared
    # its targets are the target's own next-token logits (draft vocabulary) at the block positions
    d2t = load_file(str(directory / "model.safetensors")).get("d2t")
    draft_ids = torch.arange(raw["draft_vocab_size"]) + (d2t if d2t is not None else 0)
    expected_targets = target_logits[indices][:, draft_ids]

    ours = DSparkDrafter.from_pretrained(entry["drafter"]).to(dtype).eval()
    taps = {}
    hooks = [
        ours.norm.register_forward_hook(lambda _m, _i, out: taps.__setitem__("hidden", out)),
        ours.lm_head.register_forward_hook(lambda _m, _i, out: taps.__setitem__("base", out)),
    ]
    with torch.no_grad():
        logits, confidence, _prev = ours(
            features[None].to(dtype), ids[None], torch.ones(1, TOKENS, dtype=torch.long), anchors[None]
        )
    for h in hooks:
        h.remove()

    rtol = ENGINE_RTOL if dtype == torch.float32 else BF16_RTOL
    pairs = {
        "targets": (targets[0], expected_targets),
        "hidden": (hidden[0], taps["hidden"].reshape(-1, HIDDEN)),
        "backbone logits": (base_logits[0], taps["base"].reshape(-1, taps["base"].shape[-1])),
        "logits": (seen["logits"][0], logits.reshape(-1, logits.shape[-1])),
        "confidence": (seen["confidence"][0], confidence.reshape(-1)),
    }
    for what, (theirs, mine) in pairs.items():
        scale = mine.float().abs().max().item()
        diff = (theirs.float() - mine.float()).abs().max().item()
        assert diff <= rtol * scale, f"{what}: max |theirs - ours| {diff:.3g} > {rtol} x scale {scale:.3g}"
    agree = (seen["logits"][0].argmax(-1) == logits.reshape(-1, logits.shape[-1]).argmax(-1)).float().mean().item()
    assert agree >= (0.99 if dtype == torch.float32 else 0.9), agree
