#!/bin/bash
# Several nodes without Slurm: run this same command on every node.
#   HEAD=10.0.0.1 NNODES=2 NPROC_PER_NODE=8 slurm/multinode_manual.sh train.max_steps=1000
# HEAD is the first node's address (reachable from all nodes, not 127.0.0.1);
# JOB_ID must be the same on every node (it names the rendezvous and the run directory).
# MINDDP_DRY_RUN=1 prints the command instead of running it (slurm/common.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source slurm/common.sh
if [ -z "${HEAD:-}" ]; then
    echo "minddp: set HEAD to the address of the first node, one every node reaches" \
         "(HEAD=10.0.0.1 NNODES=2 $0 ...)" >&2
    exit 2
fi
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
PORT=${PORT:-29500}
JOB_ID=${JOB_ID:-minddp}
export MINDDP_RUN_DIR=${MINDDP_RUN_DIR:-outputs/$JOB_ID}
cmd=("${TORCHRUN[@]}" --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --rdzv_backend=c10d
     --rdzv_endpoint="$HEAD:$PORT" --rdzv_id="$JOB_ID" train.py "$@")
if [ "$DRY_RUN" = 1 ]; then
    show "${cmd[@]}"
    exit 0
fi
exec "${cmd[@]}"
