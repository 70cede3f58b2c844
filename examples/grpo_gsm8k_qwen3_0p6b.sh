#!/usr/bin/env bash
# GRPO on GSM8K from a real Qwen3-0.6B checkpoint, one node: the command to run once the weights and the data
# are on disk (nothing is downloaded at run time).
#
#   MODEL_DIR=/models/Qwen3-0.6B DATA_DIR=/data/gsm8k examples/grpo_gsm8k_qwen3_0p6b.sh [Hydra overrides]
#
# MODEL_DIR: an HF model directory (config.json, *.safetensors, tokenizer.json, generation_config.json), e.g.
#   `huggingface-cli download Qwen/Qwen3-0.6B --local-dir /models/Qwen3-0.6B` on a machine with internet access.
# DATA_DIR: train.parquet and test.parquet with GSM8K's columns (question, answer ending in "#### <number>"),
#   e.g. the two files of the "main" config of the openai/gsm8k dataset.
# model.init_from takes the architecture, the weights (each rank reads its own shards) and the tokenizer from
# MODEL_DIR; task=gsm8k + data=gsm8k map the columns, apply Qwen3's chat template and grade with math-verify;
# the stop tokens come from the tokenizer and generation_config.json. docs/DATA.md explains every setting.
set -euo pipefail
# shellcheck source=/dev/null  # examples/launcher.sh, checked on its own
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"
torchrun=$(find_torchrun)

: "${MODEL_DIR:?set MODEL_DIR to the Qwen3-0.6B directory}"
: "${DATA_DIR:?set DATA_DIR to the directory holding train.parquet and test.parquet}"
require_path MODEL_DIR "$MODEL_DIR" dir
require_path MODEL_DIR "$MODEL_DIR/config.json" file
require_path DATA_DIR "$DATA_DIR/train.parquet" file
require_path DATA_DIR "$DATA_DIR/test.parquet" file
nproc="${NPROC_PER_NODE:-gpu}"   # one rank per visible GPU; extra ranks beyond parallel.tp are data parallel

exec "$torchrun" --standalone --nnodes 1 --nproc-per-node "$nproc" -m megatron_iso.cli.train \
    model.init_from="$MODEL_DIR" \
    task=gsm8k data=gsm8k \
    data.train_files="$DATA_DIR/train.parquet" data.val_files="$DATA_DIR/test.parquet" \
    +data.chat_template_kwargs.enable_thinking=false \
    rl=grpo rl.steps=300 task.prompts_per_step=32 rl.group_size=8 \
    rl.max_prompt_length=512 rl.max_response_length=1024 rl.temperature=1.0 \
    rl.lr=1e-6 rl.lr_warmup_steps=10 rl.weight_decay=0.0 rl.train_micro_batch_seqs=64 \
    rl.val_every=25 data.val_max_samples=500 rl.checkpoint_every=25 \
    rollout.kv_cache_mb=16384 \
    "$@"
