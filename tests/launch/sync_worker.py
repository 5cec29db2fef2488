"""Launched by tests/launch/test_multiprocess.py in place of `-m draftsmith`: runs the real CLI (`STAGE CONFIG
overrides...`), and after training every rank writes its own copy of the drafter's trainable parameters to
$SYNC_DIR/rank<r>.safetensors so the test can check the ranks stayed in sync."""

import os
import sys
from pathlib import Path

from safetensors.torch import save_file

import draftsmith.pipeline.train as train_stage

_real_train = train_stage.Trainer.train


def _train_then_dump(self):
    result = _real_train(self)
    acc = self.accelerator
    trainable = [(n, p) for n, p in self.unwrapped().named_parameters() if p.requires_grad]
    local = sum(p.numel() for _, p in trainable)  # 0 when ZeRO-3 really partitioned every trainable parameter
    if any(hasattr(p, "ds_id") for _, p in trainable):  # ZeRO-3: every rank gathers the whole parameters
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in trainable], modifier_rank=None):
            params = {n: p.detach().cpu().clone().contiguous() for n, p in trainable}
    else:
        params = {n: p.detach().cpu().contiguous() for n, p in trainable}
    out = Path(os.environ["SYNC_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(params, str(out / f"rank{acc.process_index}.safetensors"))
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    print(
        f"SYNC world={acc.num_processes} engine={type(self.model).__name__} "
        f"zero={getattr(plugin, 'zero_stage', None)} local_params={local}",
        flush=True,
    )
    return result


train_stage.Trainer.train = _train_then_dump

if __name__ == "__main__":
    from draftsmith.pipeline.cli import main

    sys.exit(main(sys.argv[1:]))
