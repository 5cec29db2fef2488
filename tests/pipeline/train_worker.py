"""Run by tests under torchrun: train, then every rank writes its own copy of the drafter's parameters."""

import sys
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.pipeline.config import load_config
from draftsmith.pipeline.dist import close_process_group
from draftsmith.pipeline.train import Trainer

if __name__ == "__main__":
    recipe, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(recipe, sys.argv[3:])
    trainer = Trainer(cfg)
    trainer.train()
    trainer.accelerator.wait_for_everyone()  # the process group outlives training (later families and stages use it)
    rank = trainer.accelerator.process_index
    trainable = [(n, p) for n, p in trainer.unwrapped().named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in trainable):  # ZeRO-3 keeps partitions: every rank gathers the whole
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=None):
            params = {n: p.detach().cpu().clone().contiguous() for n, p in trainable}
    else:
        params = {n: p.detach().cpu().contiguous() for n, p in trainable}
    save_file(params, str(out / f"rank{rank}.safetensors"))
    print(f"WORLD {trainer.accelerator.num_processes} {type(trainer.model).__name__}", flush=True)
    close_process_group()  # as the CLI does at the end of every stage
