"""Run by tests/pipeline/test_target_sharding.py under torchrun (2 ranks, gloo): load the tiny target sharded
(ZeRO-3 inference with CPU partitions, then transformers tensor parallelism) and print, per rank, whether its
features and gathered head/embedding equal those of the whole model loaded plainly. Each rank writes its own
result file (two ranks printing to one pipe can interleave their lines)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.data.features import FeatureCapture
from draftsmith.pipeline.config import ModelConfig
from draftsmith.pipeline.dist import close_process_group
from draftsmith.pipeline.target import load_head_weights, load_model

if __name__ == "__main__":
    path, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lines = []
    whole = load_model(ModelConfig(target=path, dtype="float32"))
    reference = FeatureCapture(whole, [0, 1, 2])
    for label, fields in (("zero3-cpu", {"zero3": "cpu"}), ("tp", {"tp_size": 2})):
        cfg = ModelConfig(target=path, dtype="float32", **fields)
        model = load_model(cfg, shard=True)
        _, head, embed = load_head_weights(cfg, model=model)
        same_weights = torch.equal(head, whole.lm_head.weight) and torch.equal(embed, whole.model.embed_tokens.weight)
        capture = FeatureCapture(model, [0, 1, 2])
        worst = 0.0
        for n in range(2):
            # ZeRO-3 ranks run different inputs (data parallel); tensor-parallel ranks must share theirs
            offset = rank if label.startswith("zero3") else 0
            ids = ((torch.arange(9 + n + offset) * 7 + 3 + offset) % 300).unsqueeze(0)
            aux, final = capture(ids)
            aux_ref, final_ref = reference(ids)
            worst = max(worst, (aux - aux_ref).abs().max().item(), (final - final_ref).abs().max().item())
        lines.append(f"RESULT {label} rank={rank} weights_equal={same_weights} max_abs_diff={worst:.3g}\n")
    (out / f"rank{rank}.txt").write_text("".join(lines))
    close_process_group()  # as the CLI does: every rank together (a rank exiting alone can abort in gloo)
