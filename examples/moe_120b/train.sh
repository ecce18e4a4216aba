#!/usr/bin/env bash
# 120B MoE (the paper's model at 7 layers) on 16 GPUs (2 nodes × 8), sequence 128K by default.
# Layout and settings: examples/common/paper_moe.sh. Environment variables (defaults there):
# SEQ_LENGTH, CONTEXT_PARALLEL_SIZE, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, OPERATORS,
# DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK,
# GPUS_PER_NODE, DRY_RUN.
#   MASTER_ADDR=node0 NODE_RANK=$i bash examples/moe_120b/train.sh [extra pretrain_gpt.py flags]
EXAMPLE_NAME=moe_120b NUM_LAYERS=7 GPUS_TOTAL=16 exec bash "$(dirname "${BASH_SOURCE[0]}")/../common/paper_moe.sh" "$@"
