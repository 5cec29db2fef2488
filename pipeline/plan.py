"""`draftsmith plan CONFIG`: what a run will need, worked out before anything runs.

From the recipe and the target's HF config alone (no weights, no network) it prints:

- disk for offline features: bytes/token (what `collect` stores per token) x tokens;
- GPU memory per training rank: drafter weights + gradients + AdamW state under the ZeRO stage, activations of
  one micro-batch (the TTT unroll for EAGLE-3, the anchor blocks for DSpark), the teacher head, and the frozen
  target when `train.features=online` (replicated, or sharded by model.zero3 / model.tp_size), and the teacher
  cache that keeps each record's full-vocabulary teacher statistics between epochs;
- FLOPs per training token, and the GPU-hours per epoch they imply at an assumed MFU. The teacher head's
  full-vocabulary product is counted every epoch, as in the first: later epochs take it from the teacher cache
  (up to its cap), so the figure is an upper bound by that share.

Every figure is an estimate from closed-form counts (docs/scaling.md derives them); the parameter counts are
exact for the drafters draftsmith builds. The formulas live in small functions so tests can check them against
hand-computed numbers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.layout import MANIFEST, RunLayout

GIB = 2**30
CONFIDENCE_HIDDEN = 256  # width of EAGLE-3's confidence MLP (drafters/eagle3.py)
TEACHER_CHUNK = 2048  # positions per chunk of the full-vocabulary teacher head (drafters/losses.py)
BUNDLED_TARGETS = Path(__file__).resolve().parents[1] / "configs" / "targets"


class PlanError(ValueError):
    """The plan cannot be made (e.g. the target's config cannot be found offline)."""


# ------------------------------------------------------------------------------------------ the target


@dataclass(frozen=True)
class TargetShape:
    """The numbers of the target's architecture the estimates need."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    """Every parameter of the target (tied embeddings counted once)."""
    body_params: int
    """Parameters a feature forward uses: all but the input embedding and the lm_head."""


def _count_params(config) -> tuple[int, int]:
    """(total, without embedding and lm_head), from the model built on the meta device: exact for any
    architecture transformers knows, and allocates nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    outer = sum(p.numel() for p in model.parameters() if id(p) in ends)
    return total, total - outer


def target_shape(config) -> TargetShape:
    heads = config.num_attention_heads
    total, body = _count_params(config)
    return TargetShape(
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        params=total,
        body_params=body,
    )


def _config_from_json(path: Path):
    from transformers import AutoConfig

    raw = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}  # `_source` notes
    if "model_type" not in raw:
        raise PlanError(f"{path}: an HF config.json needs a model_type")
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def bundled_target_config(name: str) -> Path | None:
    """configs/targets/<org>__<name>.json for a hub id, if shipped (so plans work without the network)."""
    path = BUNDLED_TARGETS / (name.replace("/", "__") + ".json")
    return path if path.is_file() else None


def load_target_config(cfg: RunConfig, explicit: str | None = None):
    """The target's HF config: an explicit config.json (or model directory), the local target, the HF cache, or
    the copy bundled in configs/targets/ — never the network."""
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"--target-config: {path} not found")
        return _config_from_json(path)
    from draftsmith.pipeline.target import TargetError, load_config_of, resolve_target

    spec = resolve_target(cfg.model)
    if spec.kind != "hub":
        return load_config_of(cfg.model, spec)
    bundled = bundled_target_config(spec.name)
    if bundled:
        return _config_from_json(bundled)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(spec.location, revision=spec.revision, local_files_only=True)
    except (OSError, ValueError, TargetError) as exc:
        raise PlanError(
            f"the config of {spec.name!r} is neither in the HF cache nor in {BUNDLED_TARGETS}; "
            f"pass --target-config PATH/config.json ({exc.__class__.__name__})"
        ) from None


# --------------------------------------------------------------------------------------- the drafters


@dataclass(frozen=True)
class DrafterShape:
    """Sizes of one drafter's layers (the drafters default each to the target's)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    n_aux: int
    draft_vocab: int
    vocab: int
    markov_rank: int = 0
    block_size: int = 0
    anchors: int = 0


@dataclass(frozen=True)
class ParamCount:
    trainable: int
    frozen: int
    lookup: int = 0
    """Trainable parameters used as a lookup table (no matmul FLOPs): DSpark's Markov W1."""

    @property
    def total(self) -> int:
        return self.trainable + self.frozen


def eagle3_params(d: DrafterShape) -> ParamCount:
    """EAGLE-3 (drafters/eagle3.py): fc fuses n_aux features; the first layer's attention reads the 2H-wide
    [embedding; hidden] input and has three norms; later layers are plain Llama layers; lm_head over the draft
    vocabulary is trained; the embedding is the target's, frozen; a 2H -> 256 -> 1 confidence MLP."""
    H, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    mlp = 3 * H * d.intermediate
    first = 2 * H * q + 2 * (2 * H * kv) + q * H + mlp + 3 * H
    other = H * q + 2 * H * kv + q * H + mlp + 2 * H
    confidence = (2 * H * CONFIDENCE_HIDDEN + CONFIDENCE_HIDDEN) + (CONFIDENCE_HIDDEN + 1)
    trainable = d.n_aux * H * H + first + (d.layers - 1) * other + H + d.draft_vocab * H + confidence
    return ParamCount(trainable=trainable, frozen=d.vocab * H)


def dspark_params(d: DrafterShape) -> ParamCount:
    """DSpark-style block drafter: fc + hidden_norm fuse the features; Qwen3-style layers (q/k norms); the
    lm_head is the target's rows of the draft vocabulary and stays frozen, like the embedding; the Markov bias
    W1 [V, r] (a lookup) and W2 [r, D] and the confidence head w over [h; W1[x]] are trained."""
    H, q, kv, r = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.markov_rank
    layer = H * q + 2 * H * kv + q * H + 2 * d.head_dim + 3 * H * d.intermediate + 2 * H
    markov_w1 = d.vocab * r
    trainable = d.n_aux * H * H + H + d.layers * layer + H + markov_w1 + r * d.draft_vocab + (H + r) + 1
    return ParamCount(trainable=trainable, frozen=d.draft_vocab * H + d.vocab * H, lookup=markov_w1)


def drafter_shapes(cfg: RunConfig, t: TargetShape) -> list[DrafterShape]:
    train = cfg.train
    families = list(train.drafters)
    n_aux = len(cfg.collect.aux_layer_ids) if cfg.collect.aux_layer_ids is not None else 3
    D = min(train.draft_vocab_size, t.vocab)
    shapes = []
    for family in families:
        s: Any = train.section(family)  # the family's own settings class (Eagle3Settings, DSparkSettings)
        if family == "eagle3":
            shapes.append(
                DrafterShape(
                    "eagle3",
                    t.hidden,
                    s.num_layers,
                    s.num_attention_heads or t.heads,
                    s.num_key_value_heads or t.kv_heads,
                    s.head_dim or t.head_dim,
                    s.intermediate_size or t.intermediate,
                    len(s.aux_layer_ids) if s.aux_layer_ids else n_aux,
                    D,
                    t.vocab,
                )
            )
        elif family == "dspark":
            ds = s
            shapes.append(
                DrafterShape(
                    "dspark",
                    t.hidden,
                    ds.num_layers,
                    ds.num_attention_heads or t.heads,
                    ds.num_key_value_heads or t.kv_heads,
                    ds.head_dim or t.head_dim,
                    ds.intermediate_size or t.intermediate,
                    len(ds.aux_layer_ids) if ds.aux_layer_ids else n_aux,
                    D,
                    t.vocab,
                    markov_rank=ds.markov_rank,
                    block_size=ds.block_size,
                    anchors=ds.anchors_per_sequence,
                )
            )
        else:
            # the formulas below are per architecture: a family they do not know gets no guessed figures
            raise PlanError(f"no plan formulas for drafter family {family!r} (plan knows eagle3 and dspark)")
    return shapes


def drafter_params(d: DrafterShape) -> ParamCount:
    return eagle3_params(d) if d.family == "eagle3" else dspark_params(d)


# --------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """How training is spread: ranks, ZeRO stage, precision, offload, and the frozen target's placement."""

    world: int
    zero_stage: int
    """0 = DDP (accelerate autocast over fp32 weights); 1/2/3 = DeepSpeed ZeRO."""
    bf16: bool
    offload_optimizer: bool = False
    offload_params: bool = False
    online: bool = False
    target_shards: int = 1
    """Ways the frozen target is split across GPUs (1 = a whole copy per rank); 0 = kept in CPU memory."""


def deepspeed_settings(path: str | None) -> dict[str, Any]:
    """ZeRO stage and offload devices from a DeepSpeed JSON (empty without one)."""
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"train.deepspeed: {p} not found")
    zero = json.loads(p.read_text()).get("zero_optimization", {})
    return {
        "zero_stage": int(zero.get("stage", 0)),
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none") == "cpu",
        "offload_params": zero.get("offload_param", {}).get("device", "none") == "cpu",
    }


def make_layout(cfg: RunConfig, world: int, zero_stage: int | None) -> Layout:
    ds = deepspeed_settings(cfg.train.deepspeed)
    stage = zero_stage if zero_stage is not None else ds.get("zero_stage", 0)
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage must be 0..3, got {stage}")
    online = cfg.train.features == "online"
    shards = 1
    if online:
        if cfg.model.zero3 == "gpu":
            shards = world
        elif cfg.model.zero3 == "cpu":
            shards = 0
        elif (cfg.model.tp_size or 1) > 1:
            shards = cfg.model.tp_size or 1
    return Layout(
        world=world,
        zero_stage=stage,
        bf16=cfg.train.mixed_precision != "no",
        offload_optimizer=bool(ds.get("offload_optimizer")) and stage > 0,
        offload_params=bool(ds.get("offload_params")) and stage == 3,
        online=online,
        target_shards=shards,
    )


# --------------------------------------------------------------------------------------------- memory


def state_bytes(p: ParamCount, lay: Layout) -> dict[str, float]:
    """Per-rank bytes of the drafter's weights, gradients and AdamW state.

    DDP (stage 0): fp32 weights under autocast, fp32 gradients, two fp32 moments: 16 B per trainable parameter.
    DeepSpeed bf16: bf16 weights and gradients, an fp32 master copy and two fp32 moments (2+2+4+8 = 16 B);
    stage 1 partitions master+moments over the ranks, stage 2 also the gradients, stage 3 also the weights.
    """
    W, s = lay.world, lay.zero_stage
    if s == 0 or not lay.bf16:
        w = g = 4.0
        master = 0.0
    else:
        w = g = 2.0
        master = 4.0
    moments = 8.0

    def part(stage: int) -> int:  # the ZeRO stage from which a tensor is partitioned over W ranks
        return W if s >= stage else 1

    weights = p.trainable * w / part(3)
    frozen = p.frozen * (4.0 if s == 0 else w) / part(3)
    if lay.offload_params:
        weights = frozen = 0.0
    optimizer = p.trainable * (master + moments) / part(1)
    if lay.offload_optimizer:
        optimizer = 0.0
    return {
        "drafter weights": weights,
        "frozen drafter weights": frozen,
        "gradients": p.trainable * g / part(2),
        "optimizer (master + moments)": optimizer,
    }


def eagle3_activation_bytes(
    d: DrafterShape,
    steps: int,
    batch_tokens: int,
    feature_bytes: int,
    act: int,
    checkpointing: bool,
    exact_teacher: bool = True,
    attention: str = "flex",
) -> float:
    """The peak of one micro-batch's forward: the TTT unroll (drafters/eagle3.py) as kept for backward, and the
    objective's losses (drafters/objectives.py). T = batch_tokens, a = activation bytes (2 in bf16). Every term
    is linear in T: no score matrix is kept (drafters/ttt_attention.py). Counted tensor by tensor and checked
    against measured peaks (launch/bench_ttt_memory.py, hidden 256: within 5% at T = 1k..8k).

    - inputs: the features (n_aux + 1 states per token), fc's output, the teacher's draft-vocab probabilities
      (T x D x 4) and, at temperature > 0 (`exact_teacher`), its full-vocabulary probabilities on the draft
      columns as well (T x D x 4, for the acceptance targets);
    - per step and layer, the Llama layer: T x a x (9H [first layer: the embedding, two RMSNorms' intermediates
      and the 2H-wide input] or 6H, + 4 x MLP width [gate, its SiLU, up, their product]) + attention: step 0
      (causal SDPA over GQA-repeated k/v) keeps q, the repeated k/v, the output and o_proj's copy of it, and
      k, v ((5 heads + 2 kv_heads) x head_dim); steps >= 1 keep q, k, v and o_proj's input ((2 heads +
      2 kv_heads) x head_dim) and an fp32 log-sum-exp per row and head (heads x 4 B);
    - `attention="flex"` (CUDA): flex_attention also keeps its output (heads x head_dim) and, at step i >= 1, the
      keys/values of steps 0..i laid end to end ((1 + i) x 2 x kv_heads x head_dim). `"chunked"` (CPU) keeps
      nothing more (it reads the steps' own k/v); its working set, a query chunk's scores, is bounded
      (CHUNK_ELEMENTS) and left out;
    - per step the draft-vocab logits: T x D x a (the fused step terms, drafters/losses.py `step_terms`, keep
      only a log-sum-exp per row beside them); the final norm, the confidence MLP's input and hidden:
      T x (4H + 2 x 256) x a;
    - in bf16 (a = 2) every RMSNorm (3 in the first layer, 2 in others, the final one) also keeps the fp32 copy of
      its input it computes in: T x H x 4 each;
    - when backward starts, with all of that alive: the gradient of the last step's logits, T x D x a (the fused
      terms' own temporaries are one chunk of rows, bounded by losses.CHUNK_ELEMENTS, and left out).

    With gradient checkpointing only each step's layer inputs (2H) and the k/v the later steps attend to stay,
    and one step (the last, the largest) is rebuilt at a time."""
    if attention not in ("flex", "chunked"):
        raise ValueError(f"attention must be flex or chunked, got {attention!r}")
    T, H, hd, D, nl = batch_tokens, d.hidden, d.head_dim, d.draft_vocab, d.layers

    def attention_bytes(i: int) -> float:  # per token and layer, TTT step i's attention
        if i == 0:
            return (5 * d.heads + 2 * d.kv_heads) * hd * act
        kept = (2 * d.heads + 2 * d.kv_heads) * hd * act + d.heads * 4  # + the rows' log-sum-exp
        if attention == "flex":
            kept += d.heads * hd * act + (1 + i) * 2 * d.kv_heads * hd * act  # its output; k/v of steps 0..i
        return kept

    norm_copy = 4 if act < 4 else 0  # an RMSNorm's fp32 copy of a bf16 input

    def layers(i: int) -> float:  # TTT step i's layer activations
        first = T * (act * (9 * H + 4 * d.intermediate) + 3 * H * norm_copy + attention_bytes(i))
        other = T * (act * (6 * H + 4 * d.intermediate) + 2 * H * norm_copy + attention_bytes(i))
        return first + (nl - 1) * other

    if checkpointing:
        kept = steps * nl * T * act * (2 * H + 2 * d.kv_heads * hd) + layers(steps - 1)
    else:
        kept = sum(layers(i) for i in range(steps))
    heads = steps * (T * D * act + T * ((4 * H + 2 * CONFIDENCE_HIDDEN) * act + H * norm_copy))
    losses = T * D * act
    teacher = T * D * 4 * (2 if exact_teacher else 1)
    inputs = T * (d.n_aux + 1) * H * feature_bytes + T * H * act + teacher
    return float(inputs + kept + heads + losses)


def teacher_logits_bytes(batch_tokens: int, vocab: int) -> float:
    """The teacher's full-vocabulary logits of one chunk (drafters/losses.py): fp32, and one fp32 temporary."""
    return float(min(TEACHER_CHUNK, batch_tokens) * vocab * 8)


def eagle3_step_peak_bytes(
    d: DrafterShape,
    steps: int,
    batch_tokens: int,
    act: int,
    lay: Layout | None = None,
    exact_teacher: bool = True,
    checkpointing: bool = False,
    attention: str = "flex",
) -> float:
    """What one EAGLE-3 training step adds to the memory held between steps (weights, AdamW state, teacher head,
    the batch's features): the gradients (`lay`, default one fp32 DDP process; counted whole, as if all were
    alive at the forward's peak) and the larger of the teacher's logits of one chunk and the forward's peak,
    which are never alive together (the teacher is computed, and its logits freed, before the unroll).
    launch/bench_ttt_memory.py measures the same quantity."""
    lay = lay or Layout(world=1, zero_stage=0, bf16=act == 2)
    gradients = state_bytes(eagle3_params(d), lay)["gradients"]
    activations = eagle3_activation_bytes(d, steps, batch_tokens, 0, act, checkpointing, exact_teacher, attention)
    return gradients + max(activations, teacher_logits_bytes(batch_tokens, d.vocab))


def dspark_slots(d: DrafterShape, batch_tokens: int, seq: int) -> tuple[int, int, int]:
    """(sequences, anchors per sequence, block slots) of one micro-batch: every anchor (at most one per
    position) drafts a block of block_size slots."""
    sequences = max(1, batch_tokens // seq)
    anchors = min(d.anchors, seq)
    return sequences, anchors, sequences * anchors * d.block_size


def dspark_activation_bytes(d: DrafterShape, batch_tokens: int, seq: int, feature_bytes: int, act: int) -> float:
    """One micro-batch of the packed block forward (drafters/dspark.py), as kept for backward. Tb = block slots;
    each row's keys are its S context positions followed by its A x block_size slots:

    - inputs: the features, fc's output and its norm (2 x T x H x a);
    - per layer: the context K/V (T x 2 kv_heads x head_dim x a), the block slots' layer activations
      (Tb x a x (4H + (2 heads + 2 kv_heads) x head_dim + 3 x MLP width)) and the attention's fp32 log-sum-exp per
      slot and head (Tb x heads x 4); the packed attention (drafters/dspark.py: chunked on the CPU, flex on CUDA)
      keeps no score matrix, no mask over every block and no GQA-repeated keys;
    - heads: the block logits with fp32 log-softmax/softmax (Tb x D x (a + 8)), the Markov rows and bias
      (Tb x (r + D) x a), the teacher's probabilities (Tb x D x 4) and the confidence input (Tb x (H + r) x a)."""
    T, H, hd, D, r = batch_tokens, d.hidden, d.head_dim, d.draft_vocab, d.markov_rank
    _, _, Tb = dspark_slots(d, T, seq)
    per_layer = (
        T * 2 * d.kv_heads * hd * act
        + Tb * act * (4 * H + (2 * d.heads + 2 * d.kv_heads) * hd + 3 * d.intermediate)
        + Tb * d.heads * 4
    )
    heads = Tb * D * (act + 8) + Tb * (r + D) * act + Tb * D * 4 + Tb * (H + r) * act
    inputs = T * (d.n_aux + 1) * H * feature_bytes + 2 * T * H * act
    return float(inputs + d.layers * per_layer + heads)


def target_bytes(t: TargetShape, lay: Layout, batch_tokens: int, n_aux: int) -> dict[str, float]:
    """The frozen target in the training process (features=online): bf16 weights, whole or sharded, plus one
    forward's working set (the captured aux + final states and a layer's activations; no KV cache, no logits)."""
    if not lay.online:
        return {}
    weights = 0.0 if lay.target_shards == 0 else t.params * 2.0 / lay.target_shards
    forward = batch_tokens * ((n_aux + 1) * t.hidden + 4 * t.hidden + 2 * t.intermediate) * 2.0
    return {"target weights (bf16)": weights, "target forward": forward}


# ---------------------------------------------------------------------------------------------- FLOPs


def eagle3_flops(d: DrafterShape, p: ParamCount, t: TargetShape, steps: int, seq: float) -> dict[str, float]:
    """Per training token (seq = mean record length): 6 x trainable parameters per TTT step (forward +
    backward); attention per layer and step: causal over step 0's keys (4 x heads x head_dim x seq/2 forward,
    x3 with backward = 6 x heads x head_dim x seq), at step 0 by SDPA and at steps >= 1 by flex_attention's
    block mask or the chunked path, which skip the masked keys (drafters/ttt_attention.py; the diagonal keys,
    i per token, are negligible); the frozen teacher head over the full vocabulary, forward only (2 x V x H)."""
    attention = d.layers * d.heads * d.head_dim * seq * 6 * steps
    return {
        "drafter": 6.0 * p.trainable * steps,
        "drafter attention": float(attention),
        "teacher head": 2.0 * t.vocab * t.hidden,
    }


def dspark_flops(d: DrafterShape, p: ParamCount, t: TargetShape, seq: float) -> dict[str, float]:
    """Per context token (seq = mean record length, A = min(anchors, seq) blocks per sequence, ρ = A x block /
    seq block slots per context token): every token goes through fc and each layer's K/V projection (context
    injection); the block slots go through the rest of the backbone (all trainable parameters but fc and the
    Markov W1 lookup), attend to all seq + A x block keys of their row (12 x heads x head_dim per key and
    layer, forward + backward), and pass the frozen lm_head (forward + input gradient, 4 x D x H) and the
    teacher head (2 x V x H)."""
    H, kv = d.hidden, d.kv_heads * d.head_dim
    anchors = min(d.anchors, seq)
    rho = anchors * d.block_size / seq
    context = d.n_aux * H * H + d.layers * 2 * H * kv
    block = p.trainable - p.lookup - d.n_aux * H * H
    return {
        "drafter (context)": 6.0 * context,
        "drafter (blocks)": rho * 6.0 * block,
        "drafter attention": rho * 12.0 * d.heads * d.head_dim * (seq + anchors * d.block_size) * d.layers,
        "frozen lm_head": rho * 4.0 * d.draft_vocab * H,
        "teacher head": rho * 2.0 * t.vocab * t.hidden,
    }


def online_flops(t: TargetShape, seq: float) -> dict[str, float]:
    """The target's forward per token when features are online (no lm_head: features only)."""
    return {"target forward": 2.0 * t.body_params + 2.0 * t.layers * t.heads * t.head_dim * seq}


# ------------------------------------------------------------------------------------- per-step totals

LONG_SEQUENCES = (4096, 8192, 16384)
"""Sequence lengths the plan also gives EAGLE-3's memory for (one sequence per micro-batch)."""
TEACHER_LOGITS = "teacher logits (one chunk)"
EAGLE3_ACTIVATIONS = "activations (TTT unroll)"


def element_bytes(cfg: RunConfig, lay: Layout) -> tuple[int, int]:
    """(bytes of a stored feature element in training memory, bytes of an activation element): online features
    are not stored; activations are bf16 under mixed precision."""
    feature_bytes = 0 if lay.online else (2 if cfg.collect.dtype == "bfloat16" else 4)
    return feature_bytes, 2 if lay.bf16 else 4


def eagle3_memory(cfg: RunConfig, d: DrafterShape, t: TargetShape, lay: Layout, batch_tokens: int) -> dict[str, float]:
    """Per-rank bytes of EAGLE-3 training with micro-batches of `batch_tokens`, item by item."""
    train = cfg.train
    s: Any = train.section("eagle3")
    n_aux_store = len(cfg.collect.aux_layer_ids) if cfg.collect.aux_layer_ids is not None else 3
    feature_bytes, act = element_bytes(cfg, lay)
    memory = state_bytes(drafter_params(d), lay)
    memory[EAGLE3_ACTIVATIONS] = eagle3_activation_bytes(
        d, s.ttt_steps, batch_tokens, feature_bytes, act, train.gradient_checkpointing, train.temperature > 0
    )
    memory["teacher lm_head (fp32)"] = 4.0 * t.vocab * t.hidden  # fp32: the teacher's logits are never rounded
    memory[TEACHER_LOGITS] = teacher_logits_bytes(batch_tokens, t.vocab)
    memory.update(target_bytes(t, lay, batch_tokens, n_aux_store))
    return memory


def teacher_cache_bytes(cfg: RunConfig, tokens: int | None) -> float:
    """The trainer's teacher cache (drafters/teacher_cache.py) at its fullest on one rank: 8 B a position (the
    argmax as int32, the logsumexp as fp32; 4 B at temperature 0) for every position of the run, holdout included,
    up to `train.teacher_cache_tokens`. Every position, not a rank's share: the records move between ranks from
    one epoch to the next, so a rank meets most of them. At the cap when the run's tokens are not known."""
    train = cfg.train
    per_position = 8 if train.temperature > 0 else 4
    kept = train.teacher_cache_tokens if tokens is None else min(tokens, train.teacher_cache_tokens)
    return float(per_position * kept)


def peak_total(memory: dict[str, float]) -> float:
    """The peak of a training step from its items: their sum, except that EAGLE-3's teacher logits (computed, and
    freed, before the unroll starts) and the unroll's activations count only the larger of the two."""
    total = sum(memory.values())
    if TEACHER_LOGITS in memory and EAGLE3_ACTIVATIONS in memory:
        total -= min(memory[TEACHER_LOGITS], memory[EAGLE3_ACTIVATIONS])
    return total


# ------------------------------------------------------------------------------------------ the plan


@dataclass
class Plan:
    target: dict[str, Any]
    tokens: int | None
    tokens_source: str
    seq_len: int
    """Longest sequence in a micro-batch (attention scores scale with it)."""
    mean_len: float
    feature_bytes_per_token: int
    feature_disk_bytes: int | None
    layout: dict[str, Any]
    drafters: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def estimate_tokens(
    cfg: RunConfig, tokens: int | None, records: int | None, prompt_tokens: int
) -> tuple[int | None, str, float]:
    """(training tokens, where the number comes from, mean tokens per record)."""
    per_record = float(min(cfg.data.max_length, prompt_tokens + cfg.generate.max_new_tokens))
    if tokens is not None:
        return tokens, "--tokens", per_record
    counted = _tokens_in_run(cfg)
    if counted is not None:
        n, total, where = counted
        return total, f"counted in {where}", total / max(n, 1)
    if records is None and cfg.data.sources and all(s.limit for s in cfg.data.sources):
        records = sum(s.limit for s in cfg.data.sources)  # type: ignore[misc]
    records = (records or 0) + cfg.generate.synthesize
    if not records:
        return None, "unknown: pass --tokens N or --records N (or set data.sources[*].limit)", per_record
    est = int(records * per_record)
    return (
        est,
        (
            f"{records:,} records x {per_record:.0f} tokens (min(data.max_length, {prompt_tokens} prompt tokens "
            f"+ generate.max_new_tokens); set --prompt-tokens / --tokens to refine)"
        ),
        per_record,
    )


def _tokens_in_run(cfg: RunConfig) -> tuple[int, int, str] | None:
    """(records, tokens) of the run's generated records, when generate already ran."""
    directory = RunLayout.of(cfg).generated
    if not (directory / MANIFEST).is_file():
        return None
    import pyarrow.parquet as pq

    manifest = json.loads((directory / MANIFEST).read_text())
    n = total = 0
    for shard in manifest.get("shards", []):
        table = pq.read_table(directory / shard["file"], columns=["num_tokens", "num_supervised"]).to_pydict()
        for tokens, supervised in zip(table["num_tokens"], table["num_supervised"]):
            if supervised > 0:
                n, total = n + 1, total + tokens
    return (n, total, str(directory)) if n else None


def make_plan(
    cfg: RunConfig,
    *,
    target_config=None,
    tokens: int | None = None,
    records: int | None = None,
    prompt_tokens: int = 256,
    world: int = 8,
    zero_stage: int | None = None,
    gpu_tflops: float = 989.0,
    mfu: float = 0.35,
) -> Plan:
    from draftsmith.data.feature_store import bytes_per_token

    config = target_config if target_config is not None else load_target_config(cfg)
    t = target_shape(config)
    lay = make_layout(cfg, world, zero_stage)
    train = cfg.train
    n_aux_store = len(cfg.collect.aux_layer_ids) if cfg.collect.aux_layer_ids is not None else 3
    bpt = bytes_per_token(n_aux_store, t.hidden, cfg.collect.dtype)
    total, source, mean_len = estimate_tokens(cfg, tokens, records, prompt_tokens)
    seq = min(cfg.data.max_length, train.batch_tokens)
    feature_bytes, act = element_bytes(cfg, lay)
    plan = Plan(
        target=asdict(t),
        tokens=total,
        tokens_source=source,
        seq_len=seq,
        mean_len=mean_len,
        feature_bytes_per_token=bpt,
        feature_disk_bytes=None if total is None else bpt * total,
        layout=asdict(lay),
    )
    cache = teacher_cache_bytes(cfg, total)  # the same for every family
    for d in drafter_shapes(cfg, t):
        p = drafter_params(d)
        s: Any = train.section(d.family)
        long_sequences: dict[str, float] = {}
        if d.family == "eagle3":
            memory = eagle3_memory(cfg, d, t, lay, train.batch_tokens)
            # one sequence of L tokens per micro-batch: what long-context training needs
            long_sequences = {str(n): peak_total(eagle3_memory(cfg, d, t, lay, n)) + cache for n in LONG_SEQUENCES}
            flops = eagle3_flops(d, p, t, s.ttt_steps, mean_len)
        else:
            memory = state_bytes(p, lay)
            memory["activations (anchor blocks)"] = dspark_activation_bytes(
                d, train.batch_tokens, seq, feature_bytes, act
            )
            memory["teacher lm_head (fp32)"] = 4.0 * t.vocab * t.hidden
            memory.update(target_bytes(t, lay, train.batch_tokens, n_aux_store))
            flops = dspark_flops(d, p, t, mean_len)
        memory["teacher cache"] = cache
        if lay.online:
            flops.update(online_flops(t, mean_len))
        per_token = sum(flops.values())
        gpu_hours = None
        if total is not None:
            epochs = train.epochs_for(d.family)
            gpu_hours = total * epochs * per_token / (gpu_tflops * 1e12 * mfu) / 3600
        plan.drafters.append(
            {
                "family": d.family,
                "shape": asdict(d),
                "params": {**asdict(p), "total": p.total},
                "memory_bytes": memory,
                "memory_total_bytes": peak_total(memory),
                "long_sequence_memory_bytes": long_sequences,
                "flops_per_token": flops,
                "flops_per_token_total": per_token,
                "gpu_hours": gpu_hours,
                "assumed_gpu_tflops": gpu_tflops,
                "assumed_mfu": mfu,
            }
        )
    return plan


# -------------------------------------------------------------------------------------------- report


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB"


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


def _verdict(total: float, gpu_memory_gib: float) -> str:
    fits = "fits" if total <= gpu_memory_gib * GIB * 0.9 else "does NOT fit"
    return f"{fits} in {gpu_memory_gib:g} GiB with 10% headroom"


def render(plan: Plan, gpu_memory_gib: float) -> str:
    t, lay = plan.target, plan.layout
    lines = [
        (
            f"target: {t['layers']} layers, hidden {t['hidden']}, {t['heads']}/{t['kv_heads']} heads x {t['head_dim']}, "
            f"MLP {t['intermediate']}, vocab {t['vocab']:,}; {t['params'] / 1e9:.2f} B parameters"
        ),
        "",
        "offline features (collect)",
        f"  bytes/token: {plan.feature_bytes_per_token:,}  (aux + final hidden states, token id int32, mask byte)",
        f"  tokens:      {'?' if plan.tokens is None else f'{plan.tokens:,}'}  ({plan.tokens_source})",
        "  disk:        "
        + (
            "?"
            if plan.feature_disk_bytes is None
            else f"{plan.feature_disk_bytes / GIB:,.1f} GiB ({plan.feature_disk_bytes / 1e12:,.2f} TB); "
            "features=online needs none"
        ),
        "",
        f"training layout: {lay['world']} rank(s), "
        + ("DDP" if lay["zero_stage"] == 0 else f"DeepSpeed ZeRO-{lay['zero_stage']}")
        + (", optimizer offloaded to CPU" if lay["offload_optimizer"] else "")
        + (", weights offloaded to CPU" if lay["offload_params"] else "")
        + (", bf16" if lay["bf16"] else ", fp32")
        + (
            ", features online (target "
            + (
                "in CPU memory"
                if lay["target_shards"] == 0
                else "replicated"
                if lay["target_shards"] == 1
                else f"split {lay['target_shards']} ways"
            )
            + ")"
            if lay["online"]
            else ", features offline"
        )
        + f"; longest sequence {plan.seq_len}, mean record {plan.mean_len:.0f} tokens",
    ]
    for d in plan.drafters:
        p = d["params"]
        lines += [
            "",
            f"{d['family']}: {p['trainable'] / 1e6:,.1f} M trainable + {p['frozen'] / 1e6:,.1f} M frozen parameters",
        ]
        lines.append("  GPU memory per rank:")
        for name, value in d["memory_bytes"].items():
            lines.append(f"    {name:32s} {_gib(value)}")
        total = d["memory_total_bytes"]
        lines.append(f"    {'total':32s} {_gib(total)}   ({_verdict(total, gpu_memory_gib)})")
        if TEACHER_LOGITS in d["memory_bytes"]:
            lines.append("    (the teacher's logits are freed before the unroll starts: the total counts the larger)")
        if d["long_sequence_memory_bytes"]:
            lines.append("  GPU memory per rank, one sequence of L tokens per micro-batch (activations linear in L):")
            for n, value in d["long_sequence_memory_bytes"].items():
                lines.append(f"    {'L = ' + f'{int(n):,}':32s} {_gib(value)}   ({_verdict(value, gpu_memory_gib)})")
        lines.append("  FLOPs per training token:")
        for name, value in d["flops_per_token"].items():
            lines.append(f"    {name:32s} {_si(value)}FLOP")
        lines.append(f"    {'total':32s} {_si(d['flops_per_token_total'])}FLOP")
        if d["gpu_hours"] is not None:
            lines.append(
                f"  ≈ {d['gpu_hours']:,.1f} GPU-hours for the planned epochs at {d['assumed_mfu']:.0%} MFU of "
                f"{d['assumed_gpu_tflops']:g} TFLOP/s"
            )
    return "\n".join(lines)


def run_plan(
    cfg: RunConfig,
    tokens: int | None = None,
    records: int | None = None,
    prompt_tokens: int = 256,
    world_size: int = 8,
    zero_stage: int | None = None,
    target_config: str | None = None,
    gpu_memory_gib: float = 80.0,
    gpu_tflops: float = 989.0,
    mfu: float = 0.35,
    json_out: str | None = None,
) -> Plan:
    """The `draftsmith plan` stage: compute, print, and optionally write the plan as JSON."""
    from draftsmith.pipeline.console import console
    from draftsmith.pipeline.errors import StageError

    try:
        config = load_target_config(cfg, target_config)
        plan = make_plan(
            cfg,
            target_config=config,
            tokens=tokens,
            records=records,
            prompt_tokens=prompt_tokens,
            world=world_size,
            zero_stage=zero_stage,
            gpu_tflops=gpu_tflops,
            mfu=mfu,
        )
    except PlanError as exc:
        raise StageError(str(exc)) from None
    console.print(render(plan, gpu_memory_gib), highlight=False, markup=False, soft_wrap=True)
    if json_out:
        Path(json_out).write_text(plan.to_json())
    return plan
