#!/bin/bash
# The torchrun equivalent of the accelerate launch commands: run it once per node (by hand, or under
# `srun --ntasks-per-node=1`), every node with the same MASTER_ADDR / MASTER_PORT / RDZV_ID.
#
#   launch/torchrun_train.sh CONFIG [key=value ...]                               # one node, all its GPUs, ZeRO-2
#   DS_CONFIG= launch/torchrun_train.sh CONFIG                                    # plain DDP
#   NNODES=2 MASTER_ADDR=node0 launch/torchrun_train.sh CONFIG train.deepspeed=launch/ds_zero3.json
#   STAGE=collect launch/torchrun_train.sh CONFIG                                 # generate / collect split by rank too
#
# Environment (all optional):
#   NNODES          nodes                      (default SLURM_NNODES, else 1)
#   NPROC_PER_NODE  processes per node         (default: the GPUs torch sees, at least 1)
#   MASTER_ADDR     rendezvous host            (default: first host of the SLURM allocation, else localhost)
#   MASTER_PORT     rendezvous port            (default 29500)
#   RDZV_ID         rendezvous id              (default SLURM_JOB_ID, else draftsmith)
#   DS_CONFIG       DeepSpeed JSON for train   (default launch/ds_zero2.json; empty = DDP)
#   STAGE           draftsmith stage           (default train)
#   ENTRY           what torchrun runs         (default "-m draftsmith"; the tests put a wrapper script here)
#   PYTHON          interpreter                (default .venv/bin/python when present, else python)

set -euo pipefail

if [ "$#" -lt 1 ]; then
  echo "usage: launch/torchrun_train.sh CONFIG [key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NPROC_PER_NODE=${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  else
    MASTER_ADDR=localhost
  fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-draftsmith}}
STAGE=${STAGE:-train}
DS_CONFIG=${DS_CONFIG-launch/ds_zero2.json}
ENTRY=${ENTRY:--m draftsmith}

extra=()
if [ "$STAGE" = train ] && [ -n "$DS_CONFIG" ]; then extra+=("train.deepspeed=$DS_CONFIG"); fi

# c10d rendezvous: node ranks are assigned as nodes join, so the same command runs unchanged on every node
# shellcheck disable=SC2086  # ENTRY ("-m draftsmith") is split into words on purpose
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
  $ENTRY "$STAGE" "$CONFIG" ${extra[@]+"${extra[@]}"} "$@"
