"""A drafter family added from this one file: its model, config section, objective, proposer and export mapping are
defined here and registered, and the unchanged stages train it, evaluate it with the exact verifier and export it.

The toy family is a one-token "feature head": it reads the target's fused aux features at the last verified position
p and the token at p+1, and predicts the token at p+2 (EAGLE-3's first step without the decoder layer).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from pydantic import Field
from torch.nn import functional as F

from draftsmith.drafters.common import DrafterBase
from draftsmith.drafters.losses import (
    acceptance,
    position_losses,
    shift,
    simulated_acceptance_length,
    teacher_from_final,
)
from draftsmith.drafters.vocab import draft_to_target_ids
from draftsmith.eval.proposers import TrainedProposer
from draftsmith.pipeline import families
from draftsmith.pipeline.config import ConfigError, FamilySettings, load_config
from draftsmith.pipeline.families.base import ExportContext, ExportedDirectory, Family, TargetParts
from tests.tiny import save_tiny_target

# ------------------------------------------------------------------------------------------ the family


@dataclass
class ToyConfig:
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    aux_layer_ids: list[int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToyConfig:
        return cls(**d)


class ToyDrafter(DrafterBase):
    name = "toy"
    config_class = ToyConfig

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config  # type: ignore[assignment]
        H = config.hidden_size
        self.fc = torch.nn.Linear(len(config.aux_layer_ids) * H, H, bias=False)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.norm = torch.nn.RMSNorm(H, eps=1e-6)
        self.lm_head = torch.nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, T, D] of the token after `next_ids`, from the features of the position before it."""
        h = self.fc(aux.to(self.fc.weight.dtype)) + self.embed_tokens(next_ids).to(self.fc.weight.dtype)
        return self.lm_head(self.norm(h))


class ToySettings(FamilySettings):
    """The toy feature head (`train.toy`)."""

    loss: Literal["ce", "tv"] = "ce"
    """Per-position loss against the teacher."""
    init_scale: float = Field(0.02, gt=0.0)
    """Standard deviation of the initial fc and lm_head weights."""


@dataclass
class ToyObjectiveSettings:
    loss: str
    temperature: float
    steps: int = 1
    epochs_seen: set[int] | None = None


def build(parts: TargetParts, s: ToySettings) -> ToyDrafter:
    model = ToyDrafter(
        ToyConfig(parts.config.vocab_size, parts.draft_vocab_size, parts.config.hidden_size, parts.aux_ids)
    )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(parts.embed)
        model.d2t.copy_(parts.d2t)
        model.t2d.copy_(parts.t2d)
        for w in (model.fc.weight, model.lm_head.weight):
            w.normal_(0.0, s.init_scale)
    return model


SEEN_EPOCHS: list[int] = []


def objective(model, batch, head_weight, s: ToyObjectiveSettings, buffers=None):
    SEEN_EPOCHS.append(batch["epoch"])  # the declared TrainBatch contract: every batch says its epoch
    inner = buffers if buffers is not None else model
    device = head_weight.device
    ids = batch["input_ids"].to(device)
    mask = shift((batch["loss_mask"].to(device) > 0) & batch["attention_mask"].to(device), 2)
    draft_ids = draft_to_target_ids(inner.d2t)
    teacher = teacher_from_final(batch["final"].to(device), head_weight, draft_ids, s.temperature).shifted(1)
    logits = model(batch["aux"].to(device), F.pad(ids[:, 1:], (0, 1), value=0))  # slot t predicts token t+2
    per_pos = position_losses(logits, teacher, s.loss, s.temperature)
    n = mask.sum()
    loss = (per_pos * mask).sum() / n.clamp_min(1)
    with torch.no_grad():
        alpha = acceptance(logits, teacher, draft_ids, s.temperature)
        correct = (draft_ids[logits.argmax(-1)] == teacher.argmax).float()
        zero = torch.zeros((), device=device)
        stats = {
            "n_0": n.float(),
            "loss_0": (per_pos * mask).sum(),
            "acc_0": (correct * mask).sum(),
            "accept_0": (alpha * mask).sum(),
            "bce_0": zero,
            "conf_0": zero,
            "tau": (simulated_acceptance_length([alpha], [mask]) * mask).sum(),
            "tau_n": mask.sum().float(),
            "oov": (~teacher.in_vocab & mask).sum().float(),
            "tokens": batch["attention_mask"].sum().float().to(device),
        }
    return loss, stats


class ToyProposer(TrainedProposer):
    """One draft per round: the features of the last verified position and the token the target committed after it."""

    name = "toy"

    @torch.no_grad()
    def start(self, prompts, firsts, feats, valid):
        self.last = (feats[:, -1], torch.tensor(list(firsts)))  # left-padded: column -1 is every row's last prompt slot

    @torch.no_grad()
    def propose(self, histories, active, k, params, generators):
        feat, nxt = self.last

        def step(i, x):
            logits = self.drafter(feat[:, None].to(self.device), nxt[:, None].to(self.device))[:, 0]
            return logits, torch.ones(logits.shape[0])

        return self._chain(min(k, 1), active, params, generators, step)

    @torch.no_grad()
    def commit(self, drafts, accepted, news, feats):
        rows = torch.arange(feats.shape[0])
        self.last = (feats[rows, torch.tensor(list(accepted))], torch.tensor(list(news)))


def export(model: ToyDrafter, ctx: ExportContext) -> list[ExportedDirectory]:
    tensors = {k: v.to(ctx.dtype) for k, v in model.state_dict().items() if k in ("fc.weight", "norm.weight")}
    tensors |= {"head.weight": model.lm_head.weight.to(ctx.dtype), "d2t": model.d2t, "t2d": model.t2d}
    config = {"architectures": ["ToyHead"], **model.config.to_dict()}
    return [
        ExportedDirectory("toy", tensors, config, ["## Toy head", "", f"aux layers {model.config.aux_layer_ids}", ""])
    ]


def import_export(directory: Path, raw: dict[str, Any], embed: torch.Tensor | None) -> ToyDrafter | None:
    if raw.get("architectures") != ["ToyHead"]:
        return None
    fields = {k: v for k, v in raw.items() if k != "architectures"}
    return families.base.load_renamed_weights(ToyDrafter(ToyConfig(**fields)), directory, embed, {"head.": "lm_head."})


def toy_family() -> Family:
    return Family(
        name="toy",
        settings=ToySettings,
        model_class=ToyDrafter,
        build=build,
        objective=objective,
        objective_settings=lambda train, s, seed: ToyObjectiveSettings(s.loss, train.temperature),
        proposer=lambda drafter, e: ToyProposer(drafter),
        export=export,
        import_export=import_export,
    )


# ------------------------------------------------------------------------------------------ the tests


@pytest.fixture
def toy():
    family = families.register(toy_family())
    SEEN_EPOCHS.clear()
    yield family
    families.unregister("toy")


def test_the_section_is_typed_and_validated_by_the_registered_family(toy):
    cfg = load_config(None, ["train.drafters=[toy]", "train.toy.loss=tv", "train.toy.lr=0.01"])
    section = cfg.train.section("toy")
    assert isinstance(section, ToySettings) and section.loss == "tv"
    assert cfg.train.lr_for("toy") == 0.01 and cfg.train.lr_for("eagle3") == cfg.train.lr
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["train.drafters=[toy]", "train.toy.loss=kl"])
    assert "train.toy.loss" in str(bad.value) and "Per-position loss against the teacher" in str(bad.value)
    with pytest.raises(ConfigError, match=r"unknown key 'train.toy.bogus'; allowed here: .*init_scale"):
        load_config(None, ["train.toy.bogus=1"])
    with pytest.raises(ConfigError, match="unknown families"):
        load_config(None, ["train.drafters=[toy, nope]"])
    families.unregister("toy")
    with pytest.raises(ConfigError, match=r"unknown key 'train.toy'"):
        load_config(None, ["train.toy.loss=tv"])
    families.register(toy)


def test_a_family_from_one_file_runs_through_train_eval_and_export(toy, tmp_path, write_chats):
    from draftsmith.pipeline.collect import run_collect
    from draftsmith.pipeline.evaluate import run_eval
    from draftsmith.pipeline.export import import_drafter, run_export
    from draftsmith.pipeline.prepare import run_prepare
    from draftsmith.pipeline.train import run_train

    target = save_tiny_target(tmp_path / "target", seed=0, num_layers=4)
    data = tmp_path / "chat.jsonl"
    write_chats(data, 16)
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.target={target}",
            "model.dtype=float32",
            f"data.sources=[{{path: {data}}}]",
            "data.holdout_fraction=0.25",
            "collect.aux_layer_ids=[1,2,3]",
            "collect.dtype=float32",
            "train.drafters=[toy]",
            "train.toy.aux_layer_ids=[1,3]",  # a subset of the captured layers, taken by the generic trainer
            "train.toy.lr=0.02",
            "train.epochs=3",
            "train.batch_tokens=160",
            "train.draft_vocab_size=384",
            "train.mixed_precision='no'",
            "train.eval_every=1000",
            "train.save_every=1000",
            f"eval.sources=[{{path: {data}}}]",
            "eval.max_prompts=4",
            "eval.temperatures=[0.0, 1.0]",
            "eval.max_new_tokens=12",
            "eval.batch_size=2",
            "eval.drafters=[trained]",
            "export.dtype=float32",
        ],
    )
    run_prepare(cfg)
    run_collect(cfg)
    run_train(cfg)
    manifest = json.loads((tmp_path / "run" / "train" / "toy" / "manifest.json").read_text())
    assert manifest["drafter"] == "toy" and manifest["aux_layer_ids"] == [1, 3]
    assert {0, 1, 2} <= set(SEEN_EPOCHS)  # every epoch reached the objective as batch["epoch"]
    drafter = families.load_drafter(tmp_path / "run" / "train" / "toy" / "final")
    assert isinstance(drafter, ToyDrafter)

    run_eval(cfg)
    ev = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    for run in ev["runs"]:
        toy_stats, plain = run["overall"]["toy"], run["overall"]["none"]
        assert plain["tau"] == 1.0 and 1.0 <= toy_stats["tau"] <= 2.0  # one draft per round: τ ≤ 2
    greedy = next(r for r in ev["runs"] if r["temperature"] == 0.0)
    assert greedy["greedy_divergence"]["toy"]["prompts"] == 0  # the verifier keeps the output the target's own

    out = run_export(cfg)
    assert (out / "toy" / "model.safetensors").is_file() and "## Toy head" in (out / "README.md").read_text()
    again = import_drafter(out / "toy", embed_weight=drafter.embed_tokens.weight)
    assert isinstance(again, ToyDrafter)
    for key, value in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
