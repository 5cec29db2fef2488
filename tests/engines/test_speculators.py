"""speculators 0.9.0 (vllm-project/speculators, in the venv from requirements-external.txt) on draftsmith's exports,
through its public loading path: `SpeculatorModel.from_pretrained(dir)`, which resolves the class from
`speculators_model_type`, loads the checkpoint, the vocabulary mappings and the verifier's weights (the verifier is
our tiny target, a local directory, so nothing is fetched).

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

from tests.engines.exports import BF16, DSPARK, ENGINE_RTOL, TOKENS, WRITTEN_EAGLE3

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
    speculators' DFlash loader: ours are the target's, so they are equal too), with no unexpected keys. Its
    `forward` is not compared: DSparkDraftModel.forward is the training forward (it samples anchor positions and
    returns only a loss and metrics), not a drafting step; draftsmith's block is compared with speculators' own
    modules, wired as its `_backbone_forward` wires them, in tests/pipeline/test_export.py."""
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
