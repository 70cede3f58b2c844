#!/usr/bin/env bash
# iso-train over several nodes: run this once on every node (the SLURM recipe does it through
# srun). Rendezvous is torchrun's c10d backend on MASTER_ADDR:MASTER_PORT; each node's ranks are
# consecutive, so a tensor-parallel group (parallel.tp <= NPROC_PER_NODE) never crosses nodes.
#
# Environment (SLURM's variables are used when the explicit ones are unset):
#   NNODES          number of nodes                     (SLURM_NNODES)
#   NODE_RANK       this node's index, 0..NNODES-1      (SLURM_NODEID)
#   MASTER_ADDR     host of the rendezvous, one node    (required)
#   MASTER_PORT     its TCP port                        (default 29500)
#   NPROC_PER_NODE  ranks per node                      (default: one per visible GPU)
#   RDZV_ID         id shared by the nodes of one job   (SLURM_JOB_ID, else "megatron_iso")
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/torchrun_multi_node.sh model=qwen3_30b_a3b parallel.tp=8 ...
set -euo pipefail
# shellcheck source=/dev/null  # examples/launcher.sh, checked on its own
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"
torchrun=$(find_torchrun)

nnodes="${NNODES:-${SLURM_NNODES:-}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-}}"
: "${nnodes:?set NNODES (or run under SLURM): the number of nodes}"
: "${node_rank:?set NODE_RANK (or run under SLURM): the index of this node, 0..NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR: the host that runs the c10d rendezvous (one of the nodes)}"
port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-${SLURM_JOB_ID:-megatron_iso}}"
nproc="${NPROC_PER_NODE:-gpu}"

exec "$torchrun" \
    --nnodes "$nnodes" \
    --node-rank "$node_rank" \
    --nproc-per-node "$nproc" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$port" \
    --rdzv-id "$rdzv_id" \
    --max-restarts 0 \
    -m megatron_iso.cli.train "$@"
