"""Run by tests under torchrun: train, then every rank writes its own copy of the drafter's parameters."""

import sys
from pathlib import Path

from safetensors.torch import save_file

from pipeline.config import load_config
from pipeline.dist import close_process_group
from pipeline.train import Trainer

if __name__ == "__main__":
    recipe, out = sys.argv[1], Path(sys.argv[2])
    cfg = load_config(recipe, sys.argv[3:])
    trainer = Trainer(cfg)
    trainer.train()
    rank = trainer.accelerator.process_index
    state = trainer.accelerator.get_state_dict(trainer.model, unwrap=True)  # gathered under ZeRO-3
    params = {n: p.detach().cpu().contiguous() for n, p in trainer.unwrapped().named_parameters() if p.requires_grad}
    if not all(p.numel() for p in params.values()):  # ZeRO-3 keeps only partitions locally: use the gathered copy
        params = {n: state[n].cpu().contiguous() for n in params}
    save_file(params, str(out / f"rank{rank}.safetensors"))
    print(f"WORLD {trainer.accelerator.num_processes} {type(trainer.model).__name__}", flush=True)
    close_process_group()  # as the CLI does at the end of every stage
