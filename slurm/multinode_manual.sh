#!/bin/bash
# Several nodes without Slurm: run this same command on every node.
#   HEAD=10.0.0.1 NNODES=2 NPROC_PER_NODE=8 slurm/multinode_manual.sh train.max_steps=1000
# HEAD is the first node's address (reachable from all nodes, not 127.0.0.1);
# JOB_ID must be the same on every node (it names the rendezvous and the run directory).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${HEAD:?set HEAD to the first node's address}"
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
PORT=${PORT:-29500}
JOB_ID=${JOB_ID:-minddp}
export MINDDP_RUN_DIR=${MINDDP_RUN_DIR:-outputs/$JOB_ID}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}  # see slurm/common.sh
exec "${MINDDP_PYTHON:-python3}" -m torch.distributed.run --nnodes="$NNODES" \
    --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$PORT" \
    --rdzv_id="$JOB_ID" train.py "$@"
