#!/usr/bin/env bash
# iso-train on one node under torchrun: NPROC_PER_NODE ranks (default: one per visible GPU), any
# Hydra overrides passed through. Ranks not used by parallel.tp * parallel.pp form data parallel.
#
#   examples/torchrun_single_node.sh model=qwen3_8b parallel.tp=8 out_dir=runs/qwen3_8b
#   NPROC_PER_NODE=2 examples/torchrun_single_node.sh parallel.tp=2 rl.steps=2   # CPU: gloo ranks
#
# In the GPU image:  docker run --gpus all --ipc=host -v "$PWD/runs:/workspace/runs" megatron-iso:gpu \
#                        /opt/megatron_iso/examples/torchrun_single_node.sh parallel.tp=8
set -euo pipefail
# shellcheck source=/dev/null  # examples/launcher.sh, checked on its own
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"
torchrun=$(find_torchrun)

# torchrun's "gpu" counts the visible CUDA devices; CPU runs must say how many processes they want.
nproc="${NPROC_PER_NODE:-gpu}"

exec "$torchrun" --standalone --nnodes 1 --nproc-per-node "$nproc" -m megatron_iso.cli.train "$@"
