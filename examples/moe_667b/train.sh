#!/usr/bin/env bash
# 667B MoE (the paper's model at 39 layers) on 64 GPUs (8 nodes × 8), sequence 128K by default.
# Layout and settings: examples/common/paper_moe.sh. Environment variables (defaults there):
# SEQ_LENGTH, CONTEXT_PARALLEL_SIZE, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, OPERATORS,
# DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK,
# GPUS_PER_NODE, DRY_RUN.
#   MASTER_ADDR=node0 NODE_RANK=$i bash examples/moe_667b/train.sh [extra pretrain_gpt.py flags]
# With OPERATORS=all, PipelinedLLEP in 20 chunks: its receive bound 2·E_p·k·c·H·b grows with E_p = 64, and at 1M tokens
# the default 10 chunks leave the plan ~15 GiB over 141 GB (DRY_RUN=1 shows the table).
export PIPELINED_LLEP_CHUNKS="${PIPELINED_LLEP_CHUNKS:-20}"
EXAMPLE_NAME=moe_667b NUM_LAYERS=39 GPUS_TOTAL=64 exec bash "$(dirname "${BASH_SOURCE[0]}")/../common/paper_moe.sh" "$@"
