"""`draftsmith train`: the trainer every drafter family shares.

accelerate drives devices, data parallelism (DDP or DeepSpeed ZeRO 1/2/3 from a JSON in launch/), mixed
precision and gradient accumulation; the loop itself is written out here. Features come from the offline
store or are computed online by the target; batches are length-bucketed, reshuffled per epoch and sharded
across ranks (`data.features.plan_batches`, each loaded by the source's `load_batch`), so a resumed run sees
exactly the batches the uninterrupted one would have.

Output: RUN_DIR/train/<family>/ for each family in train.drafters, with checkpoints/step-N (accelerate
state + drafter), best/ (highest holdout simulated acceptance length), final/ and a manifest.json once
training completed. What differs per family (its section `train.<family>`, how the drafter is built, its
objective, work after training such as DSpark's confidence calibration) comes from its `Family`
(pipeline/families/); the loop hands each objective a `TrainBatch`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.data.artifacts import atomic_write_text, write_manifest
from draftsmith.data.feature_store import BatchLoader, FeatureStore
from draftsmith.data.features import FeatureSource, OnlineFeatureSource, plan_batches, resolve_aux_ids
from draftsmith.drafters.objectives import TrainBatch, summarize, supervised_from
from draftsmith.drafters.teacher_cache import TeacherCache, record_keys
from draftsmith.drafters.vocab import select_draft_vocab
from draftsmith.pipeline.completion import Status, completion, payload_files, stage_inputs, write_progress
from draftsmith.pipeline.config import RunConfig
from draftsmith.pipeline.console import console
from draftsmith.pipeline.errors import StageError
from draftsmith.pipeline.families import get_family
from draftsmith.pipeline.families.base import TargetParts, engine_refusal
from draftsmith.pipeline.inputs import input_records
from draftsmith.pipeline.layout import MANIFEST, RunLayout
from draftsmith.pipeline.precision import resolve_mixed_precision
from draftsmith.pipeline.target import load_config_of, load_head_weights, load_target, resolve_target

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- inputs


def feature_source(cfg: RunConfig, identity: dict[str, Any], target_config) -> tuple[FeatureSource, list[int], Any]:
    """(source, aux ids, target model or None) for `train.features`."""
    L = target_config.num_hidden_layers
    if cfg.train.features == "offline":
        store_dir = RunLayout.of(cfg).features
        if not (store_dir / MANIFEST).is_file():
            raise StageError(f"no feature store at {store_dir}; run `draftsmith collect` or set train.features=online")
        aux = resolve_aux_ids(cfg.collect.aux_layer_ids, L) if cfg.collect.aux_layer_ids is not None else None
        store = FeatureStore(store_dir, target=identity, aux_ids=aux, hidden_size=target_config.hidden_size)
        return store, store.aux_ids, None
    if (cfg.model.tp_size or 1) > 1:
        # a tensor-parallel group must see the same batches, but batches are planned per rank of the whole world
        raise StageError("model.tp_size is not supported for online training yet; shard the target with model.zero3")
    # shard=True: every rank runs the target once per batch in lockstep, so model.zero3 may shard it
    target = load_target(cfg.model, shard=True)
    _, _, records = input_records(cfg, identity)
    source = OnlineFeatureSource(target.model, records, cfg.collect.aux_layer_ids)
    return source, source.aux_ids, target.model


def token_counts(source: FeatureSource, vocab_size: int) -> torch.Tensor:
    """How often each target id appears as an assistant token in the training split."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i, meta in enumerate(source.meta):
        if meta["split"] != "train":
            continue
        ids, mask = source.tokens(i)
        counts += torch.bincount(ids[mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


class AuxSubset:
    """A feature source seen through a subset of its aux layers (a drafter fusing fewer layers than were captured)."""

    def __init__(self, source: FeatureSource, source_ids: list[int], wanted: list[int], hidden: int):
        missing = [i for i in wanted if i not in source_ids]
        if missing:
            raise StageError(
                f"aux layers {missing} were not captured (the features hold {source_ids}); "
                "collect them with collect.aux_layer_ids"
            )
        self.source, self.meta, self.lengths = source, source.meta, source.lengths
        self.columns = torch.cat(
            [torch.arange(source_ids.index(i) * hidden, (source_ids.index(i) + 1) * hidden) for i in wanted]
        )

    def tokens(self, i: int):
        return self.source.tokens(i)

    def load_batch(self, indices):
        batch = self.source.load_batch(indices)
        batch["aux"] = batch["aux"].index_select(-1, self.columns.to(batch["aux"].device))
        return batch


def plan_epoch(
    source: FeatureSource, cfg: RunConfig, epoch: int, rank: int, world: int, split: str = "train"
) -> list[list[int]]:
    return plan_batches(source, cfg.train.batch_tokens, split, cfg.seed, epoch, rank, world, shuffle=split == "train")


# ---------------------------------------------------------------------------------------- the trainer


def _accelerator(cfg: RunConfig, out: Path):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    cuda = torch.cuda.is_available()
    mp = resolve_mixed_precision(cfg.train.mixed_precision, cuda)
    kwargs: dict[str, Any] = {}
    ds_path = cfg.train.deepspeed
    if not ds_path and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # `accelerate launch --config_file launch/accelerate_zero*.yaml`: take the DeepSpeed JSON it names, so
        # the "auto" batch fields and clipping are resolved here like for train.deepspeed
        ds_path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if ds_path:
        path = Path(ds_path)
        if not path.is_file():
            raise StageError(
                f"DeepSpeed config {path} not found (train.deepspeed or the accelerate config's deepspeed_config_file)"
            )
        ds_config = json.loads(path.read_text())
        # batches are variable-length token buckets, not a DataLoader accelerate could size "auto" fields from
        if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds_config["train_micro_batch_size_per_gpu"] = 1
        if ds_config.get("train_batch_size", "auto") == "auto":
            world = int(os.environ.get("WORLD_SIZE", "1"))
            ds_config["train_batch_size"] = (
                ds_config["train_micro_batch_size_per_gpu"] * cfg.train.gradient_accumulation * world
            )
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=ds_config,
            gradient_accumulation_steps=cfg.train.gradient_accumulation,
            gradient_clipping=cfg.train.max_grad_norm,
        )
        if not cuda:
            # On CPU (DS_ACCELERATOR=cpu) accelerate finds no backend for DeepSpeed and would run every rank as
            # a world of 1; naming gloo makes it initialize DeepSpeed's process group and count the ranks.
            from accelerate.utils import InitProcessGroupKwargs

            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    if cfg.train.report_to == "wandb":
        if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        kwargs["log_with"] = "wandb"
    # DeepSpeed brings its own accelerator (DS_ACCELERATOR=cpu on CPU); cpu=True would make accelerate drop it
    return Accelerator(
        cpu=not cuda and not ds_path,
        mixed_precision=mp,
        gradient_accumulation_steps=cfg.train.gradient_accumulation,
        project_dir=str(out),
        **kwargs,
    )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class DeviceSums:
    """Sums over micro-batches of the objectives' statistics (0-d tensors), kept on the training device: adding a
    micro-batch's statistics is a kernel or two, where reading each one (`float(v)`) was a host sync (issue 20).
    `read` brings them to the host, summed over the ranks, in one transfer. float64, like the Python floats the
    sums used to be (an fp32 statistic converts exactly, and the additions round the same)."""

    def __init__(self, device: torch.device):
        self.keys: list[str] = []
        self._index: dict[str, int] = {}
        self.sums = torch.zeros(0, dtype=torch.float64, device=device)
        self.count = 0
        """Micro-batches added, counted on the host."""

    def add(self, stats: Mapping[str, torch.Tensor]) -> None:
        new = sorted(k for k in stats if k not in self._index)
        if new:  # the first micro-batch, or a statistic first reported later: its sum starts at 0
            self._index.update((k, len(self.keys) + j) for j, k in enumerate(new))
            self.keys += new
            self.sums = torch.cat([self.sums, self.sums.new_zeros(len(new))])
        if len(stats) < len(self.keys):  # a statistic this micro-batch does not report adds 0
            stats = {k: stats[k] if k in stats else self.sums.new_zeros(()) for k in self.keys}
        self.sums.add_(torch.stack([stats[k].detach() for k in self.keys]))
        self.count += 1

    def read(
        self, accelerator, keys: Sequence[str], local: Mapping[str, torch.Tensor | float | None] | None = None
    ) -> dict[str, float]:
        """{key: sum over micro-batches and ranks} for `keys` (0 for a key never added), "micro" (micro-batches, over
        the ranks) and the `local` values as this rank has them (None: NaN), in one read from the device."""
        zero = self.sums.new_zeros(())
        summed = [self.sums[self._index[k]] if k in self._index else zero for k in keys]
        column = accelerator.reduce(torch.stack([*summed, self.sums.new_full((), self.count)]), reduction="sum")
        local = local or {}
        mine = [_scalar(v, column) for v in local.values()]
        values = torch.cat([column, *mine]).tolist()  # the one host read
        return dict(zip([*keys, "micro", *local], values))


def _scalar(value: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor:
    """`value` as a [1] tensor of `like`'s dtype and device (without a host-to-device copy of a Python number)."""
    if torch.is_tensor(value):
        return value.detach().reshape(1).to(like)
    return like.new_full((1,), float("nan") if value is None else float(value))


class Trainer:
    def __init__(self, cfg: RunConfig, family: str = "eagle3"):
        self.cfg = cfg
        t = cfg.train
        self.family = get_family(family)
        self.section = t.section(family)
        self.temperature = t.temperature
        self.epochs, self.max_steps = t.epochs_for(family), t.max_steps_for(family)
        self.dirs = RunLayout.of(cfg).train(family)
        self.out = self.dirs.root
        self.accelerator = _accelerator(cfg, self.out)
        acc = self.accelerator
        self.device = acc.device
        spec = resolve_target(cfg.model)
        self.identity = spec.identity()
        self.inputs = stage_inputs(cfg, "train", identity=self.identity)  # what the manifest records
        target_config = load_config_of(cfg.model, spec)
        self.source, self.aux_ids, target_model = feature_source(cfg, self.identity, target_config)
        wanted = self.section.aux_layer_ids
        if wanted is not None and list(wanted) != list(self.aux_ids):
            self.source = AuxSubset(self.source, list(self.aux_ids), list(wanted), target_config.hidden_size)
            self.aux_ids = list(wanted)
        unservable = engine_refusal(self.aux_ids, target_config)
        if unservable:  # draftsmith's own eval can measure it; no serving engine can run it, so export will refuse
            log.warning(
                "train (%s): %s. `draftsmith export` will write no engine directory for it.", family, unservable
            )
        self._check_source()
        _, head, embed = load_head_weights(cfg.model, model=target_model)
        d2t, t2d = self._draft_vocab(head.shape[0])
        torch.manual_seed(cfg.seed)
        parts = TargetParts(target_config, list(self.aux_ids), self.draft_vocab_size, embed, head, d2t, t2d)
        try:
            model = self.family.build(parts, self.section)
        except ValueError as exc:
            raise StageError(f"train ({family}): {exc}") from None
        # the teacher (the target's lm_head over the final states) is computed in fp32 under any mixed precision
        self.head_weight = head.to(self.device, torch.float32)
        # ... and its full-vocabulary part is computed once per record, not once per epoch
        self.teachers = TeacherCache(self.head_weight, t.temperature, t.teacher_cache_tokens)
        self.settings = self.family.objective_settings(t, self.section, cfg.seed)
        # every rank gets the same number of batches (plan_batches), so this check agrees on all of them
        self.batches_per_epoch = len(plan_epoch(self.source, cfg, 0, acc.process_index, acc.num_processes))
        self._check_steps(self.batches_per_epoch)
        steps_per_epoch = self.batches_per_epoch // t.gradient_accumulation
        self.total_steps = steps_per_epoch * self.epochs if self.max_steps is None else self.max_steps
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=t.lr_for(family), weight_decay=t.weight_decay, betas=(0.9, 0.95))
        from transformers import get_cosine_schedule_with_warmup

        # accelerate steps the scheduler once per process per optimizer step; it expects totals x num_processes
        scheduler = get_cosine_schedule_with_warmup(
            optimizer, int(t.warmup_ratio * self.total_steps) * acc.num_processes, self.total_steps * acc.num_processes
        )
        self.model, self.optimizer, self.scheduler = acc.prepare(model, optimizer, scheduler)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best = -math.inf
        self.history: list[dict[str, Any]] = []

    def _check_source(self) -> None:
        """Refuse a feature source with nothing to train on, or with a sequence no batch can hold."""
        limit = self.cfg.train.batch_tokens
        if not any(m["split"] == "train" for m in self.source.meta):
            raise StageError("the training split is empty (no records with assistant tokens in split 'train')")
        too_long = [(m["id"], n) for m, n in zip(self.source.meta, self.source.lengths) if n > limit]
        if too_long:
            raise StageError(
                f"{len(too_long)} samples do not fit in one batch of train.batch_tokens={limit} tokens "
                f"(e.g. {too_long[0][0]}: {too_long[0][1]} tokens); raise train.batch_tokens or lower data.max_length"
            )

    def _draft_vocab(self, V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t, t2d) of the draft vocabulary: the run's own when resuming, else the most frequent assistant tokens,
        written by the main process (every rank computes the same one from the same counts)."""
        wanted = self.cfg.train.draft_vocab_size
        if wanted > V:
            log.warning("train.draft_vocab_size=%d is larger than the target vocabulary (%d): using %d", wanted, V, V)
        self.draft_vocab_size = min(wanted, V)
        vocab_file, acc = self.dirs.vocab, self.accelerator
        resuming = vocab_file.is_file()  # resume: the vocabulary is part of the run
        acc.wait_for_everyone()  # every rank has looked before the main process may write it
        if resuming:
            from safetensors.torch import load_file

            vocab = load_file(str(vocab_file))
            return vocab["d2t"], vocab["t2d"]
        d2t, t2d = select_draft_vocab(token_counts(self.source, V), self.draft_vocab_size)
        if acc.is_main_process:
            from safetensors.torch import save_file

            self.out.mkdir(parents=True, exist_ok=True)
            partial = vocab_file.with_name(f".{vocab_file.name}.partial")
            save_file({"d2t": d2t, "t2d": t2d}, str(partial))
            partial.replace(vocab_file)
        return d2t, t2d

    def loader(self, plan: list[list[int]]) -> BatchLoader:
        """The training batches of `plan`, in order. Offline features are loaded a batch ahead on a thread (and on
        CUDA copied to the device from pinned memory) while the step computes; online ones when the step asks (the
        target runs in `load_batch`, in step with the other ranks' targets)."""
        return BatchLoader(self.load_batch, plan, self.device, background=not self._online())

    def _online(self) -> bool:
        return isinstance(getattr(self.source, "source", self.source), OnlineFeatureSource)  # (through AuxSubset)

    def load_batch(self, indices: Sequence[int]) -> dict[str, Any]:
        """The source's batch of these sequences, with `supervised_from` read from its loss mask while that is still
        on the host (before a loader copies it to the device)."""
        batch = self.source.load_batch(indices)
        return {**batch, "supervised_from": supervised_from(batch["loss_mask"]), "record_keys": record_keys(batch)}

    def batch(self, indices: list[int], epoch: int) -> TrainBatch:
        """The micro-batch of these sequences, as every family's objective takes it."""
        return {**self.load_batch(indices), "epoch": epoch}  # type: ignore[typeddict-item]

    def _check_steps(self, batches: int) -> None:
        """Refuse an epoch whose batches cannot make one optimizer step (it would loop forever under max_steps,
        or finish untrained)."""
        t, acc = self.cfg.train, self.accelerator
        if batches < t.gradient_accumulation:
            raise StageError(
                f"each optimizer step takes train.gradient_accumulation={t.gradient_accumulation} batches, and a rank gets "
                f"only {batches} per epoch ({acc.num_processes} rank(s), train.batch_tokens={t.batch_tokens}): it would "
                "never step; lower train.gradient_accumulation or train.batch_tokens, or use fewer ranks"
            )

    # ------------------------------------------------------------------------------------ checkpoints

    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def save_drafter(self, directory: Path) -> None:
        """Drafter weights + config (gathered from every rank under ZeRO-3)."""
        acc = self.accelerator
        state = acc.get_state_dict(self.model)
        if acc.is_main_process:
            # the drafter is saved in fp32 however it was trained: DeepSpeed's bf16 mode hands back bf16 weights
            # (its fp32 master copy is in the optimizer state), DDP the fp32 parameters
            state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
            self.unwrapped().save_pretrained(directory, state_dict=state)

    def save_checkpoint(self) -> Path:
        acc = self.accelerator
        ckpt_root = self.dirs.checkpoints
        final = ckpt_root / f"step-{self.step:07d}"
        partial = ckpt_root / f".step-{self.step:07d}.partial"
        if acc.is_main_process:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)  # before any rank writes into it (DeepSpeed ranks save their own shards)
        acc.wait_for_everyone()
        acc.save_state(str(partial))
        self.save_drafter(partial / "drafter")
        acc.wait_for_everyone()  # every rank has finished writing before the directory is renamed
        if acc.is_main_process:
            state = {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "best": self.best,
                "history": self.history,
            }
            (partial / "trainer_state.json").write_text(json.dumps(state, indent=2))
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            kept = sorted(ckpt_root.glob("step-*"))
            for old in kept[: -self.cfg.train.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return final

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.dirs.checkpoints.glob("step-*"))
        return found[-1] if found else None

    def resume(self) -> bool:
        ckpt = self.latest_checkpoint()
        if ckpt is None:
            return False
        self.accelerator.load_state(str(ckpt))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.best, self.history = state["best"], state["history"]
        log.info(
            "train: resumed from %s (step %d, epoch %d, batch %d)", ckpt, self.step, self.epoch, self.batch_in_epoch
        )
        return True

    # ---------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Holdout statistics (τ_sim, per-step accuracy / acceptance), summed over ranks."""
        acc = self.accelerator
        self.model.eval()
        batches = plan_epoch(self.source, self.cfg, 0, acc.process_index, acc.num_processes, split="holdout")
        if self.cfg.train.holdout_batches:
            batches = batches[: self.cfg.train.holdout_batches]
        sums = DeviceSums(self.device)
        for indices in batches:
            # epoch 0: the holdout is judged on the same anchors every time
            batch = self.teachers.fill(self.batch(indices, epoch=0))
            with acc.autocast():
                _, stats = self.family.objective(self.model, batch, self.head_weight, self.settings, self.unwrapped())
            sums.add(stats)
        self.model.train()
        keys = [f"{k}_{i}" for i in range(self.settings.steps) for k in ("n", "loss", "acc", "accept", "bce", "conf")]
        # the same keys on every rank (one with no holdout batch has none of its own): the reduction lines them up
        totals = sums.read(acc, keys + ["tau", "tau_n", "oov", "tokens"])
        if totals["tau_n"] == 0:
            return {}
        return summarize(totals, self.settings.steps)

    # -------------------------------------------------------------------------------------------- train

    def train(self) -> Path:
        cfg, t, acc = self.cfg, self.cfg.train, self.accelerator
        if t.report_to != "none":
            acc.init_trackers(
                t.wandb_project, config=cfg.dump(), init_kwargs={"wandb": {"name": cfg.name, "dir": str(self.out)}}
            )
        self.model.train()
        bar = tqdm(
            total=self.total_steps, initial=self.step, desc="train", unit="step", disable=not acc.is_main_process
        )
        # the step reads nothing from the device: statistics, loss and grad norm stay there until a log reads them
        window = DeviceSums(self.device)
        grad_norm: torch.Tensor | float | None = None
        started, window_start = time.perf_counter(), time.perf_counter()
        done = self.step >= self.total_steps
        # max_steps, when set, decides the length (epochs repeat as needed); otherwise `epochs` does
        while not done and (self.max_steps is not None or self.epoch < self.epochs):
            batches = plan_epoch(self.source, cfg, self.epoch, acc.process_index, acc.num_processes)
            self._check_steps(len(batches))  # the count can change between epochs (length buckets are redrawn)
            usable = len(batches) // t.gradient_accumulation * t.gradient_accumulation
            with self.loader(batches[self.batch_in_epoch : usable]) as loaded:  # (resumed: from where it stopped)
                for features in loaded:
                    features = self.teachers.fill(features)
                    batch: TrainBatch = {**features, "epoch": self.epoch}  # type: ignore[typeddict-item]
                    with acc.accumulate(self.model):
                        with acc.autocast():
                            loss, stats = self.family.objective(
                                self.model, batch, self.head_weight, self.settings, self.unwrapped()
                            )
                        acc.backward(loss)
                        if acc.sync_gradients:
                            grad_norm = acc.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
                        self.optimizer.step()
                        self.scheduler.step()
                        self.optimizer.zero_grad()
                    self.batch_in_epoch += 1
                    window.add({**stats, "loss_total": loss.detach()})
                    if not acc.sync_gradients:
                        continue
                    self.step += 1
                    bar.update(1)
                    if self.step % t.log_every == 0 or self.step == self.total_steps:
                        self._log(window, window_start, grad_norm, bar)
                        window, window_start = DeviceSums(self.device), time.perf_counter()
                    if self.step % t.eval_every == 0 or self.step == self.total_steps:
                        self._evaluate_and_keep_best()
                    if self.step % t.save_every == 0 or self.step == self.total_steps:
                        self.save_checkpoint()
                    if self.step >= self.total_steps:
                        done = True
                        break
            if not done:
                self.epoch += 1
                self.batch_in_epoch = 0
        bar.close()
        result = self._finish(time.perf_counter() - started)
        if t.report_to != "none":
            # not acc.end_training(): it also destroys the process group, which the next family and the later
            # stages of `draftsmith run` still need (the CLI closes it once, at the very end)
            for tracker in acc.trackers:
                tracker.finish()
        return result

    def _log(self, window: DeviceSums, since: float, grad_norm: torch.Tensor | float | None, bar) -> None:
        acc = self.accelerator
        totals = window.read(acc, sorted(window.keys), {"grad_norm": grad_norm})
        # timed after the read, which waits for the device: the steps queued without a sync have all run by now
        seconds = time.perf_counter() - since
        s = summarize(totals, self.settings.steps)
        metrics = {
            "train/loss": totals["loss_total"] / max(totals["micro"], 1),
            "train/tau_sim": s["tau"],
            "train/oov_frac": s["oov_frac"],
            "train/tokens_per_s": totals["tokens"] / max(seconds, 1e-9),
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": totals["grad_norm"],
            "train/peak_memory_mb": _peak_memory_mb(self.device),
        }
        for i in range(self.settings.steps):
            metrics[f"train/acc_{i}"] = s[f"acc_{i}"]
            metrics[f"train/accept_{i}"] = s[f"accept_{i}"]
        self.history.append({"step": self.step, **metrics})
        acc.log(metrics, step=self.step)
        bar.set_postfix(
            loss=f"{metrics['train/loss']:.3f}",
            acc0=f"{s['acc_0']:.2f}",
            tau=f"{s['tau']:.2f}",
            tok_s=f"{metrics['train/tokens_per_s']:.0f}",
        )

    def _evaluate_and_keep_best(self) -> None:
        acc = self.accelerator
        s = self.evaluate()
        if not s:
            return
        metrics = {
            f"holdout/{k}": v for k, v in s.items() if k == "tau" or k.split("_")[0] in ("acc", "accept", "conf")
        }
        self.history.append({"step": self.step, **metrics})
        acc.log(metrics, step=self.step)
        if acc.is_main_process:
            console.print(
                f"step {self.step}: holdout τ_sim={s['tau']:.3f} acc_0={s['acc_0']:.3f} "
                f"accept_0={s['accept_0']:.3f} (OOV {s['oov_frac']:.1%})",
                highlight=False,
            )
        if s["tau"] > self.best:
            self.best = s["tau"]
            best = self.dirs.best
            partial = best.with_name(f".{best.name}.partial")
            self.save_drafter(partial)
            if acc.is_main_process:
                if best.exists():
                    shutil.rmtree(best)
                partial.rename(best)
                atomic_write_text(best / "metrics.json", json.dumps({"step": self.step, **s}, indent=2))
            acc.wait_for_everyone()

    def holdout_share(self):
        """This rank's share of the whole holdout split (planned for one rank, dealt out round robin: every
        sequence to exactly one rank), as batches of epoch 0. For a family's `after_training`.

        Every rank loads the same number of batches: with online features the target runs inside `load_batch`, and
        a sharded target (model.zero3) gathers its layers in collectives that every rank must join, so a rank with
        one batch fewer loads one more (the first) and does not hand it out. Offline, no rank waits for another."""
        acc = self.accelerator
        holdout = plan_epoch(self.source, self.cfg, 0, 0, 1, split="holdout")
        mine = holdout[acc.process_index :: acc.num_processes]
        for indices in mine:
            yield self.teachers.fill(self.batch(indices, epoch=0))  # (kept since the holdout evaluations)
        if self._online() and holdout:
            for _ in range(-(-len(holdout) // acc.num_processes) - len(mine)):
                self.source.load_batch(holdout[0])  # the target's forward, in step with the other ranks

    def _finish(self, seconds: float) -> Path:
        acc = self.accelerator
        self.save_drafter(self.dirs.final)
        acc.wait_for_everyone()  # best/ and final/ are on disk before any rank reads them
        if self.family.after_training is not None:
            for d in (self.dirs.best, self.dirs.final):
                if (d / "config.json").is_file():  # the same answer on every rank: the files exist or not
                    self.family.after_training(self, d)
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_manifest(
                self.out,
                "drafter",
                inputs=self.inputs,
                target=self.identity,
                drafter=self.family.name,
                aux_layer_ids=self.aux_ids,
                draft_vocab_size=self.draft_vocab_size,
                steps=self.step,
                epochs_started=self.epoch + 1,
                best_holdout_tau=self.best if self.best > -math.inf else None,
                config={"train": self.cfg.train.model_dump(mode="json")},
                history=self.history,
                calibration=_read_json(self.dirs.best / "calibration.json")
                or _read_json(self.dirs.final / "calibration.json"),
                files=payload_files(self.out, [self.dirs.best.name, self.dirs.final.name]),
                world_size=acc.num_processes,
                teacher_cache=self.teachers.summary(),  # (the main process's)
                seconds=round(seconds, 1),
            )
            log.info(
                "train: %d steps; final drafter in %s (best holdout τ_sim %.3f in %s)",
                self.step,
                self.dirs.final,
                self.best,
                self.dirs.best,
            )
        acc.wait_for_everyone()
        return self.out


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def run_train(cfg: RunConfig, resume: bool = False, families: list[str] | None = None) -> Path:
    """Train every family of train.drafters (or `families`) in turn. With `resume`, a finished family is
    skipped and an unfinished one continues from its latest checkpoint; either is refused when it was made from
    other inputs (pipeline/completion.py)."""
    families = families or list(cfg.train.drafters)
    layout = RunLayout.of(cfg)
    inputs = stage_inputs(cfg, "train")
    todo = []
    for family in families:
        dirs = layout.train(family)
        found = completion(dirs.root, inputs)
        if dirs.manifest.is_file():
            if found.complete and resume:
                log.info("train: %s is finished, skipped", dirs.root)
                continue
            if found.complete:
                raise StageError(
                    f"{dirs.root} already holds a finished training run; use another run_dir, delete it, or pass --resume"
                )
            raise StageError(
                f"{dirs.root} already holds a finished training run made with other settings or other inputs "
                f"({'; '.join(found.differences)}); use another run_dir or delete it"
            )
        if dirs.checkpoints.is_dir() and any(dirs.checkpoints.glob("step-*")):
            if not resume:
                raise StageError(f"{dirs.root} holds checkpoints of an unfinished run; pass --resume to continue it")
            if found.status is Status.STALE:
                raise StageError(found.refusal("training run"))
        todo.append(family)
    for family in todo:
        if len(families) > 1:
            console.rule(f"train: {family}")
        trainer = Trainer(cfg, family)
        if trainer.accelerator.is_main_process:
            write_progress(trainer.out, trainer.inputs)  # an interrupted run is RESUMABLE with the same inputs
        if resume and not trainer.resume():
            log.info("train: no checkpoint to resume from in %s; starting fresh", trainer.out)
        trainer.train()
        # free this family's engine, optimizer and gradients before the next family builds its own (a DeepSpeed
        # engine keeps its buffers alive through references `del` alone does not reach)
        trainer.accelerator.free_memory()
        del trainer
    return layout.train_root
