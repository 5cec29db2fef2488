"""The variants the engine conformance tests export, and the reference numbers draftsmith computes for them.

Every variant is a real draftsmith drafter (`Eagle3Drafter.from_target` / `DSparkDrafter.from_target` on a tiny
target, norms randomised so that a mis-wired norm shows), saved and exported by `run_export`, the `export` stage
itself. For EAGLE-3, draftsmith's own numbers are computed here, in the test process, the way the pipeline
computes them: the HF target runs with `AuxHooks` (the feature capture of `collect`), and the drafter's
`ttt_forward` gives the step-0 logits. The engines' probes (subprocesses) get the exported directories, the token
ids and, for SGLang, the inputs of every target layer (SGLang's capture point); they never import draftsmith.
For DSpark the test computes draftsmith's numbers itself (from the source drafter, on `target_features`); the
manifest gives vLLM's probe the context token ids (`dspark_context_ids`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tests.tiny import save_tiny_target, tiny_tokenizer

NUM_TARGET_LAYERS = 8
HIDDEN = 64
SMALL_VOCAB = 200  # the tiny tokenizer has 384 tokens; the "full" variants use all of them
TOKENS = 128  # speculators' FlexAttention block masks on CPU need a multiple of 128
# float32 on both sides, relative to the largest |logit|: only the order of operations differs (the engine's own
# fused residual adds and norms, through the 8 target layers of a random target with wide weights)
ENGINE_RTOL = 1e-4


@dataclass(frozen=True)
class Variant:
    name: str
    family: str  # "eagle3" or "dspark"
    target: str  # "llama" or "qwen3" (Qwen3: head_dim 32 != hidden / heads = 16)
    layers: int
    aux: tuple[int, ...]
    full_vocab: bool = False
    norm_before_residual: bool = False

    @property
    def refused(self) -> str | None:
        """Why no EAGLE-3 engine directory may be written (the engines' capture differs from ours), or None."""
        if self.family != "eagle3":
            return None
        if NUM_TARGET_LAYERS in self.aux:
            return "aux id L: the final normed state here, pre-norm in vLLM, never captured by SGLang"
        if list(self.aux) != sorted(self.aux):
            return "aux ids not ascending: the engines concatenate in layer order"
        return None

    @property
    def sglang(self) -> bool:
        """SGLang 0.5.23's EAGLE-3 drafter computes this one: 1 layer, norm after the residual, aux ids >= 1."""
        return self.layers == 1 and not self.norm_before_residual and min(self.aux) >= 1 and self.refused is None


L = NUM_TARGET_LAYERS
EAGLE3 = [
    Variant("e3-llama-1l-aux3-small", "eagle3", "llama", 1, (2, 4, 5)),
    Variant("e3-llama-1l-aux3-full", "eagle3", "llama", 1, (2, 4, 5), full_vocab=True),
    Variant("e3-llama-2l-aux4-small", "eagle3", "llama", 2, (1, 3, 5, 7)),
    Variant("e3-llama-1l-aux5-full", "eagle3", "llama", 1, (1, 2, 4, 6, 7), full_vocab=True),
    Variant("e3-llama-1l-aux3-nbr", "eagle3", "llama", 1, (2, 4, 5), norm_before_residual=True),
    Variant("e3-llama-1l-aux0", "eagle3", "llama", 1, (0, 3, 6)),
    Variant("e3-qwen3-1l-aux4-small", "eagle3", "qwen3", 1, (1, 3, 5, 6)),
    Variant("e3-qwen3-2l-aux3-full", "eagle3", "qwen3", 2, (2, 4, 5), full_vocab=True),
    Variant("e3-qwen3-1l-aux5-small", "eagle3", "qwen3", 1, (1, 2, 3, 5, 7)),
    # refused at export: their engine directories would load and compute something else
    Variant("e3-llama-auxL", "eagle3", "llama", 1, (2, 4, L)),
    Variant("e3-llama-unsorted", "eagle3", "llama", 1, (4, 2, 5)),
]
DSPARK = [
    Variant("ds-qwen3-2l-aux4-small", "dspark", "qwen3", 2, (1, 3, 5, 7)),
    Variant("ds-qwen3-1l-aux3-full", "dspark", "qwen3", 1, (2, 4, 5), full_vocab=True),
    Variant("ds-llama-2l-aux5-full", "dspark", "llama", 2, (1, 2, 4, 6, 7), full_vocab=True),
    Variant("ds-llama-1l-aux3-small", "dspark", "llama", 1, (2, 4, 5)),
]
VARIANTS = {v.name: v for v in EAGLE3 + DSPARK}
WRITTEN_EAGLE3 = [v for v in EAGLE3 if v.refused is None]


def save_tiny_qwen3_target(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 target (per-head q/k norms, head_dim 32 while hidden / heads is 16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tiny_tokenizer(seed)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=NUM_TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def _build(v: Variant, target_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from draftsmith.drafters.dspark import DSparkDrafter
    from draftsmith.drafters.eagle3 import Eagle3Drafter
    from draftsmith.drafters.vocab import select_draft_vocab

    tcfg = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    D = tcfg.vocab_size if v.full_vocab else SMALL_VOCAB
    counts = torch.randint(0, 100, (tcfg.vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = select_draft_vocab(counts, D)
    torch.manual_seed(0)
    if v.family == "eagle3":
        model = Eagle3Drafter.from_target(
            tcfg, list(v.aux), D, embed, d2t, t2d, num_layers=v.layers, head_weight=head,
            norm_before_residual=v.norm_before_residual,
        )  # fmt: skip
    else:
        model = DSparkDrafter.from_target(
            tcfg, list(v.aux), D, embed, d2t, t2d, head_weight=head, block_size=4, num_layers=v.layers, markov_rank=16
        )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
        if v.family == "dspark":
            model.markov_head.markov_w1.weight.normal_(0, 1.0)
    # calibrated, as trained: the scaling rides along as extra config keys the engines must accept (and EAGLE-3's
    # confidence head as draftsmith/confidence.safetensors, a file their loaders must not pick up)
    model.config.confidence_temperatures = [2.0, 1.5, 1.0, 1.0]
    model.config.confidence_biases = [-1.0, -0.5, 0.0, 0.0]
    model.config.sampled_confidence_calibration = {
        "0.0": {"temperatures": [2.0, 1.5, 1.0, 1.0], "biases": [-1.0, -0.5, 0.0, 0.0]},
        "1.0": {"temperatures": [3.0, 1.0, 1.0, 1.0], "biases": [-1.5, 0.0, 0.0, 0.0]},
    }
    return model.eval(), target.eval()


def export_variant(v: Variant, target_dir: Path, work: Path, dtype: str = "float32") -> Path:
    """Build, save and export one variant; returns its RUN_DIR/export/."""
    from draftsmith.pipeline.config import load_config
    from draftsmith.pipeline.export import run_export

    model, target = _build(v, target_dir)
    model.save_pretrained(work / "drafter")
    overrides = [f"run_dir={work / 'run'}", f"model.target={target_dir}", f"export.dtype={dtype}"]
    if v.family == "dspark":
        overrides.append("train.drafters=[dspark]")
    out = run_export(load_config(None, overrides), drafter=str(work / "drafter"))
    if v.family == "eagle3":
        _reference(v, model.to(getattr(torch, dtype)), target, work)
    return out


def _reference(v: Variant, model, target, work: Path) -> None:
    """draftsmith's step-0 logits on the target's own features, and what the probes need to compute theirs."""
    from draftsmith.data.features import AuxHooks, decoder_of

    ids = torch.randint(0, target.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    base = decoder_of(target)
    with torch.no_grad(), AuxHooks(base, list(range(NUM_TARGET_LAYERS))) as layer_inputs:
        ours = AuxHooks(base, list(v.aux))
        with ours:
            target(ids)
        features = ours.concat().to(model.fc.weight.dtype)
        logits = model.ttt_forward(features, ids, steps=1)[0][0][0]
    torch.save(
        {
            "input_ids": ids[0],
            "logits": logits,
            "features": features[0],
            "layer_inputs": torch.stack([layer_inputs[i][0] for i in range(NUM_TARGET_LAYERS)]),
            "embed": target.get_input_embeddings().weight.detach(),
        },
        work / "reference.pt",
    )


# the context vLLM's DSpark proposer drafts a block after (tests/engines/probe_vllm.py): a prefill of this many tokens,
# not a multiple of the emulated KV cache's block size, so context and block straddle a block boundary
DSPARK_CONTEXT = 45


def dspark_context_ids(vocab_size: int) -> list[int]:
    return torch.randint(0, vocab_size, (DSPARK_CONTEXT,), generator=torch.Generator().manual_seed(2)).tolist()


def target_features(target_dir: str, aux: list[int], ids: torch.Tensor):
    """The HF target on ids [T]: (aux features [T, n_aux*H] with draftsmith's capture (`AuxHooks`, as `collect`),
    the final decoder state before the final norm [T, H], the target's logits [T, V])."""
    from transformers import AutoModelForCausalLM

    from draftsmith.data.features import AuxHooks, decoder_of

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    base = decoder_of(target)
    final = []
    hook = base.norm.register_forward_pre_hook(lambda _m, args: final.append(args[0]))
    capture = AuxHooks(base, aux)
    with torch.no_grad(), capture:
        logits = target(ids[None]).logits[0]
    hook.remove()
    return capture.concat()[0], final[0][0], logits


BF16 = ["e3-llama-1l-aux3-small", "e3-qwen3-2l-aux3-full"]  # also exported in bfloat16, for speculators
BF16_DSPARK = [v.name for v in DSPARK]  # every DSpark variant too (speculators' DSpark forward in bfloat16)


def build_all(root: Path) -> dict[str, dict]:
    """Both targets and every variant under `root` (and the BF16 and BF16_DSPARK ones again as `<name>@bf16`);
    returns the manifest the probes read (also root/variants.json). `drafter` is the draftsmith checkpoint each
    export was made from; a DSpark entry has `context_ids`, the prefill vLLM's DSpark proposer drafts after."""
    from transformers import AutoConfig

    targets = {
        "llama": save_tiny_target(root / "target-llama", seed=0, num_layers=NUM_TARGET_LAYERS, hidden_size=HIDDEN),
        "qwen3": save_tiny_qwen3_target(root / "target-qwen3"),
    }
    manifest = {}
    runs = [(v, v.name, "float32") for v in VARIANTS.values()]
    runs += [(VARIANTS[n], n + "@bf16", "bfloat16") for n in BF16 + BF16_DSPARK]
    for v, key, dtype in runs:
        work = root / key
        out = export_variant(v, targets[v.target], work, dtype)
        manifest[key] = {
            **asdict(v),
            "dtype": dtype,
            "refused": v.refused,
            "sglang": v.sglang,
            "target_dir": str(targets[v.target]),
            "export": str(out),
            "drafter": str(work / "drafter"),
            "reference": str(work / "reference.pt") if v.family == "eagle3" else None,
        }
        if v.family == "dspark":
            manifest[key]["context_ids"] = dspark_context_ids(AutoConfig.from_pretrained(targets[v.target]).vocab_size)
    (root / "variants.json").write_text(json.dumps(manifest, indent=1))
    return manifest
