"""EAGLE-3 training throughput: draftsmith's training step against speculators 0.9.0's, side by side (issue 20).

    python launch/bench_vs_speculators.py                          # SmolLM2-135M shape, T=1024, fp32, k=7
    python launch/bench_vs_speculators.py --seq-len 2048 --precision bf16 --memory
    python launch/bench_vs_speculators.py --tiny                   # small shapes, 2 steps each (the test's smoke run)

One process builds, for the same drafter shape and the same synthetic data, both training steps, and times them
alternately (after warm-up: draftsmith, speculators, draftsmith, speculators, ...) so that drift of the machine hits
both. It prints the median seconds per step, training tokens/s (the T positions of the packed sequence per step)
and the ratio draftsmith / speculators; the process's peak RSS, and with --memory each step's own peak (a fresh
subprocess per side).

The data (seeded, shared). One packed sequence of T+1 raw tokens x (random ids), the target's aux-layer features g
([T+1, 3H], random normal), its last decoder state y before the final norm ([T+1, H]) and a loss mask (0 on the
first quarter, "the prompt", 1 after). The target's embedding, LM head and final-norm weight are random tensors of
the target's shape. The draft vocabulary is D target ids drawn at random (the same d2t / t2d on both sides).

- speculators gets what its data pipeline gives its trainer: the raw item as `Eagle3SampleFileDataset` returns it
  (input_ids, hidden_states, verifier_last_hidden_states, loss_mask, lengths, position_ids), packed by its
  `CollateFn(max_len=T, preprocess=shift_batch)` into one [1, T] row (document_ids all 0). Its teacher is its own
  frozen `verifier_norm` + `verifier_lm_head` over y, read from a verifier checkpoint written to a temp dir
  (config.json of the target shape plus model.safetensors holding only embed_tokens, lm_head and model.norm: all
  it loads). The model is built as `speculators.train.cli` builds it (`create_transformer_layer_config`,
  `Eagle3DraftModel.from_training_args` with its eagle3 CLI defaults: norm_before_fc, norm_output and
  norm_before_residual on, frozen embedding and lm_head), the call kwargs from `Eagle3DraftModel.get_trainer_kwargs`
  (--ttt-steps, --ttt-step-loss-decay 1.0, --loss-fn kl_div: its defaults except the step count), and the step is
  `Trainer.train_epoch`'s body: model(**batch, **train_call_kwargs) under autocast, zero_grad, backward,
  clip_grad_norm_(1.0), AdamW (lr 1e-3, weight decay 0.01) step, linear-warm-up scheduler step, and its per-step
  metrics read (`.item()`, log_freq 1).
  On the CPU its default attention, simple_flex_attention, has no backward, so --spec-attn picks one of the two
  other implementations its --draft-attn-impl accepts: `sdpa` (default here; a dense boolean [T, (i+1)T] mask from
  `create_mask`, extended by a diagonal block per TTT step; keys/values of every step kept in a DynamicCache) or
  `eager` (the same mask as an additive float mask from `create_float_mask`). Its loss, kl_div, is run through
  `--loss-implementation eager` (its `fused` losses are Triton kernels). Its draft layer uses full causal attention
  (--full-attention-indices 0; its CLI default is a sliding window of 2048, the same mask for T <= 2048).
- draftsmith gets the first T positions of the same raw sequence as its `TrainBatch` ([1, T] ids, loss mask, aux
  features g, and final *normed* states: y through the same final norm, as `collect` stores them), the drafter from
  its eagle3 family's `build` (`Eagle3Drafter.from_target`, lm_head initialized from the target's rows and
  trained, plus its confidence head), the objective `eagle3_objective` (teacher from the full-vocabulary head,
  TTT unroll, soft cross-entropy = forward KL + const, the confidence head's BCE, statistics), and the step is
  `Trainer.train`'s body (the batch with `supervised_from`, as `Trainer.batch` adds it): autocast, objective, backward, clip_grad_norm_, AdamW (betas 0.9/0.95), cosine scheduler
  step, zero_grad, statistics summed on the device (`DeviceSums.add`). Its TTT attention is the automatic choice
  (drafters/ttt_attention.py: the chunked exact path on the CPU).

Both: batch 1, the same TTT steps (--ttt-steps, default 7), fp32 weights; --precision bf16 runs both forwards under
torch.autocast(bfloat16) with bf16 features (as speculators' --hidden-states-dtype bfloat16 and draftsmith's
mixed_precision bf16 do). What each step does beyond the other is printed with the results (see `DIFFERENCES`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIFFERENCES = (
    "draftsmith trains lm_head (speculators 0.9.0 freezes it at the verifier's rows) and a confidence head (+BCE)",
    "draftsmith's teacher is the full-vocabulary head (argmax, exact acceptance); speculators' only the draft rows",
    "loss: draftsmith soft CE (forward KL + const, step decay 0.8); speculators kl_div (decay 1.0, its default)",
    "attention: draftsmith chunked exact TTT attention (linear memory); speculators --spec-attn over a dense mask",
    "draftsmith computes no logits for the prompt slots no TTT step supervises (the first quarter less k+1 here)",
    "draftsmith's per-step loss, acceptance and accuracy are one fused chunked pass over the logits (step_terms)",
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    """The target's decoder layers (aux ids are [2, L//2, L-3] as both projects default)."""

    @property
    def aux_ids(self) -> list[int]:
        return [2, self.layers // 2, self.layers - 3]


SMOLLM2_135M = Shape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152, layers=30)
TINY = Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, layers=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024, help="T: positions of the packed sequence per step")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, bf16 features")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (draftsmith's default)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side (after --warmup each)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--spec-attn", choices=("sdpa", "eager"), default="sdpa", help="speculators' attention")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--draftsmith-frozen-head",
        action="store_true",
        help="freeze draftsmith's lm_head as speculators does (not a draftsmith option: isolates that difference)",
    )
    ap.add_argument("--memory", action="store_true", help="also each side's step peak RSS, in a fresh subprocess")
    ap.add_argument("--tiny", action="store_true", help="small shapes, T=64, draft vocab 128, 2 steps each")
    ap.add_argument("--worker", choices=("draftsmith", "speculators"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq_len, args.draft_vocab, args.steps, args.warmup = 64, 128, 2, 1
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return TINY if args.tiny else SMOLLM2_135M


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Data:
    """The shared synthetic sequence and target weights (module docstring)."""

    ids: Any  # [T+1] long
    aux: Any  # [T+1, 3H] float32
    last: Any  # [T+1, H] float32, the last decoder state before the final norm
    loss_mask: Any  # [T+1] long
    embed: Any  # [V, H]
    head: Any  # [V, H]
    norm: Any  # [H]
    d2t: Any  # [D] long, offsets (target id = i + d2t[i])
    t2d: Any  # [V] bool
    target_config: Any  # transformers LlamaConfig of the target


def make_data(args: argparse.Namespace) -> Data:
    import torch
    from transformers import LlamaConfig

    s, T = shape_of(args), args.seq_len
    g = torch.Generator().manual_seed(args.seed)
    D = min(args.draft_vocab, s.vocab)
    draft = torch.randperm(s.vocab, generator=g)[:D].sort().values
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[draft] = True
    loss_mask = torch.ones(T + 1, dtype=torch.long)
    loss_mask[: (T + 1) // 4] = 0
    config = LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max(8192, 2 * T),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    return Data(
        ids=torch.randint(0, s.vocab, (T + 1,), generator=g),
        aux=torch.randn(T + 1, 3 * s.hidden, generator=g),
        last=torch.randn(T + 1, s.hidden, generator=g) * 4,
        loss_mask=loss_mask,
        embed=torch.randn(s.vocab, s.hidden, generator=g) * 0.02,
        head=torch.randn(s.vocab, s.hidden, generator=g) * 0.1,
        norm=1 + 0.1 * torch.randn(s.hidden, generator=g),
        d2t=draft - torch.arange(D),
        t2d=t2d,
        target_config=config,
    )


def feature_dtype(args: argparse.Namespace):
    import torch

    return torch.bfloat16 if args.precision == "bf16" else torch.float32


def autocast(args: argparse.Namespace):
    import torch

    if args.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------- draftsmith


class DraftsmithStep:
    """draftsmith's EAGLE-3 training step, as `pipeline.train.Trainer.train` runs one micro-batch (accumulation 1)."""

    name = "draftsmith"

    def __init__(self, args: argparse.Namespace, data: Data):
        import torch
        from transformers import get_cosine_schedule_with_warmup

        from draftsmith.drafters.objectives import supervised_from
        from draftsmith.drafters.ttt_attention import selected_impl
        from draftsmith.pipeline.config import TrainConfig
        from draftsmith.pipeline.families import get_family
        from draftsmith.pipeline.families.base import TargetParts
        from draftsmith.pipeline.train import DeviceSums

        self.args = args
        T, dtype = args.seq_len, feature_dtype(args)
        train = TrainConfig()
        self.family = get_family("eagle3")
        section = self.family.settings(ttt_steps=args.ttt_steps)
        torch.manual_seed(args.seed)
        parts = TargetParts(
            data.target_config,
            shape_of(args).aux_ids,
            int(data.d2t.numel()),
            data.embed,
            data.head,
            data.d2t,
            data.t2d,
        )
        self.model = self.family.build(parts, section)
        if args.draftsmith_frozen_head:
            self.model.lm_head.weight.requires_grad_(False)
        self.model.train()
        self.head_weight = data.head.to(torch.float32)
        self.settings = self.family.objective_settings(train, section, args.seed)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(
            params, lr=train.lr_for("eagle3"), weight_decay=train.weight_decay, betas=(0.9, 0.95)
        )
        total = 1000
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, int(train.warmup_ratio * total), total)
        self.max_grad_norm = train.max_grad_norm
        self.window = DeviceSums(torch.device("cpu"))
        # the final *normed* states, as collect stores them: y through the target's final norm (fp32)
        y = data.last[:T].float()
        final = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + data.target_config.rms_norm_eps) * data.norm
        self.batch = {
            "input_ids": data.ids[None, :T].clone(),
            "loss_mask": data.loss_mask[None, :T].to(torch.uint8),
            "attention_mask": torch.ones(1, T, dtype=torch.bool),
            "aux": data.aux[None, :T].to(dtype),
            "final": final[None].to(dtype),
            "ids": ["bench"],
            "domains": ["bench"],
            "epoch": 0,
        }
        self.batch["supervised_from"] = supervised_from(self.batch["loss_mask"])  # as Trainer.batch adds it
        self.attention = selected_impl(torch.zeros(1, 1, 1, 1))
        self.describe = (
            f"eagle3 family build + eagle3_objective (loss {self.settings.loss}, step decay {self.settings.step_decay}, "
            f"confidence BCE weight {self.settings.confidence_weight}), TTT attention '{self.attention}', "
            f"AdamW betas (0.9, 0.95), clip {self.max_grad_norm}, cosine schedule"
        )

    def __call__(self) -> float:
        import torch

        with autocast(self.args):
            loss, stats = self.family.objective(self.model, self.batch, self.head_weight, self.settings, self.model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.window.add({**stats, "loss_total": loss.detach()})
        return float(loss.detach())


# --------------------------------------------------------------------------------------- speculators


def write_verifier(directory: Path, data: Data) -> None:
    """A verifier checkpoint of the target's shape holding only what speculators loads from it."""
    from safetensors.torch import save_file

    data.target_config.save_pretrained(str(directory))
    save_file(
        {
            "model.embed_tokens.weight": data.embed.contiguous(),
            "lm_head.weight": data.head.contiguous(),
            "model.norm.weight": data.norm.contiguous(),
        },
        str(directory / "model.safetensors"),
    )


class SpeculatorsStep:
    """speculators 0.9.0's EAGLE-3 training step, as `speculators.train.trainer.Trainer.train_epoch` runs one batch."""

    name = "speculators"

    def __init__(self, args: argparse.Namespace, data: Data, verifier: Path):
        import logging
        import warnings

        import torch
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.cli import create_transformer_layer_config
        from speculators.train.data import CollateFn
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig
        from transformers import get_linear_schedule_with_warmup

        logging.getLogger("speculators").setLevel(logging.ERROR)
        with contextlib.suppress(ImportError):  # its loader logs through loguru (and warns: a single-file checkpoint)
            from loguru import logger

            logger.disable("speculators")
        self.args = args
        T, dtype = args.seq_len, feature_dtype(args)
        s = shape_of(args)
        # as speculators.train.cli.build_draft_model with no --draft-config / --from-pretrained
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer_config = create_transformer_layer_config(
                verifier_name_or_path=str(verifier),
                num_layers=1,
                draft_arch="llama",
                hidden_act=None,
                sliding_window=2048,
                full_attention_indices=[0],
                mrope_full_head_hack=True,
            )
            torch.manual_seed(args.seed)
            self.model = Eagle3DraftModel.from_training_args(
                verifier_config=layer_config,
                t2d=data.t2d,
                d2t=data.d2t,
                verifier_name_or_path=str(verifier),
                target_layer_ids=s.aux_ids,
                draft_attn_impl=args.spec_attn,
                draft_vocab_size=int(data.d2t.numel()),
                norm_before_residual=True,
                norm_before_fc=True,
                fc_norm=False,
                norm_output=True,
                embed_requires_grad=False,
                ttt_steps=args.ttt_steps,
            )
        self.model.train()
        self.train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
            ttt_steps=args.ttt_steps, ttt_step_loss_decay=1.0, loss_fn="kl_div", loss_implementation="eager"
        )
        config = TrainerConfig(lr=1e-3, num_epochs=1, save_path="", hidden_states_dtype=dtype)
        self.optimizers = build_optimizers(self.model, config)
        self.schedulers = [get_linear_schedule_with_warmup(opt, 10, 1000) for opt in self.optimizers]
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        # the dataset item (Eagle3SampleFileDataset.__getitem__ on T+1 raw tokens), packed by its collate function
        item = {
            "input_ids": data.ids.clone(),
            "hidden_states": data.aux.clone(),
            "verifier_last_hidden_states": data.last.clone(),
            "loss_mask": data.loss_mask.clone(),
            "lengths": torch.tensor([T + 1], dtype=torch.long),
            "position_ids": torch.arange(T + 1, dtype=torch.long),
        }
        collate = CollateFn(max_len=T, hidden_size=s.hidden, num_target_layers=3, dtype=dtype, preprocess=shift_batch)
        self.batch = collate([item])
        assert self.batch["input_ids"].shape == (1, T) and bool((self.batch["document_ids"] == 0).all())
        self.describe = (
            f"Eagle3DraftModel.from_training_args + forward (loss kl_div eager, ttt_step_loss_decay 1.0), "
            f"attention '{args.spec_attn}' (dense mask), AdamW (lr 1e-3, wd 0.01), clip 1.0, linear schedule"
        )

    def __call__(self) -> float:
        import torch

        batch = dict(self.batch)
        batch.pop("__recovery_metadata__", None)
        with autocast(self.args):
            _draft_tokens, loss, metrics = self.model(**batch, **self.train_kwargs)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for opt in self.optimizers:
            opt.step()
        for sched in self.schedulers:
            sched.step()
        {k: v.item() for k, v in metrics.items()}  # its per-step metric read (log_freq 1)
        return float(loss.detach())


# -------------------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def worker(args: argparse.Namespace) -> None:
    """One side in a fresh process: build, a warm-up step (AdamW state), then one step's peak RSS above the RSS
    before it (the kernel's high-water mark reset through /proc/self/clear_refs; without it, the first step's peak
    over the process's resident set before it)."""
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated")
    data = make_data(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.worker == "speculators":
            write_verifier(Path(tmp), data)
            step: Any = SpeculatorsStep(args, data, Path(tmp))
        else:
            step = DraftsmithStep(args, data)
        del data
        try:
            step()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            method = "steady step, VmHWM reset"
        except OSError:
            method = "first step"
        before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
        peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - before) / 1024, "held_mib": before / 1024, "s": seconds, "how": method}))


def measure_memory(args: argparse.Namespace, side: str) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", side, "--seq-len", str(args.seq_len)]
    argv += ["--precision", args.precision, "--draft-vocab", str(args.draft_vocab), "--ttt-steps", str(args.ttt_steps)]
    argv += ["--spec-attn", args.spec_attn, "--threads", str(args.threads), "--seed", str(args.seed)]
    argv += ["--tiny"] * args.tiny + ["--draftsmith-frozen-head"] * args.draftsmith_frozen_head
    # every large tensor its own mapping, returned to the OS when freed: the resident set follows live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} memory worker failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    # speculators passes `past_key_values` to transformers 5's LlamaAttention (renamed `cache`; still honoured)
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated")

    s, T = shape_of(args), args.seq_len
    data = make_data(args)
    with tempfile.TemporaryDirectory() as tmp:
        write_verifier(Path(tmp), data)
        t0 = time.perf_counter()
        steps: list[Any] = [DraftsmithStep(args, data), SpeculatorsStep(args, data, Path(tmp))]
        built = time.perf_counter() - t0
    print(
        f"settings: target shape hidden {s.hidden}, {s.heads} heads / {s.kv_heads} kv x {s.head_dim}, MLP "
        f"{s.intermediate}, vocab {s.vocab}{' (tiny)' if args.tiny else ' (SmolLM2-135M)'}; drafter 1 layer, aux "
        f"layers {s.aux_ids}, draft vocab {int(data.d2t.numel())}; TTT steps {args.ttt_steps}; batch 1 packed "
        f"sequence of T={T}; {args.precision}{' (autocast bf16, bf16 features)' if args.precision == 'bf16' else ''}; "
        f"threads {torch.get_num_threads()}; torch {torch.__version__}, speculators {version('speculators')}; "
        f"{args.warmup} warm-up + {args.steps} timed steps each, alternating (built in {built:.1f} s)"
    )
    for step in steps:
        print(f"  {step.name:<12} {step.trainable / 1e6:6.2f}M trainable: {step.describe}")
    for diff in DIFFERENCES:
        print(f"  differs: {diff}")

    losses: dict[str, float] = {}
    for _ in range(args.warmup):
        for step in steps:
            losses[step.name] = step()
    times: dict[str, list[float]] = {step.name: [] for step in steps}
    for i in range(args.steps):
        for step in steps if i % 2 == 0 else steps[::-1]:  # a, b, b, a, ...: neither always runs first
            t0 = time.perf_counter()
            losses[step.name] = step()
            times[step.name].append(time.perf_counter() - t0)
    for name, loss in losses.items():
        if loss != loss or abs(loss) == float("inf"):
            raise SystemExit(f"{name}: loss is not finite ({loss})")

    memory = {step.name: measure_memory(args, step.name) for step in steps} if args.memory else {}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"{'':<12} {'s/step':>9} {'min':>9} {'max':>9} {'tokens/s':>10} {'step peak MiB':>14}")
    for name, ts in times.items():
        peak = f"{memory[name]['peak_mib']:14.0f}" if name in memory else f"{'-':>14}"
        print(f"{name:<12} {median[name]:9.4f} {min(ts):9.4f} {max(ts):9.4f} {T / median[name]:10.1f} {peak}")
    ratio = median["speculators"] / median["draftsmith"]
    print(f"ratio (draftsmith tokens/s / speculators tokens/s): {ratio:.2f}x")
    if memory:
        print(f"step peak: RSS above the held state during one training step ({memory['draftsmith']['how']})")
    print(f"process peak RSS (both sides built): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
