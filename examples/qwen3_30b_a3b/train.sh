#!/usr/bin/env bash
# Qwen3-30B-A3B (48 layers, hidden 2048, 32 query heads of 128 in 4 groups with QK layernorm,
# 128 experts of FFN 768, top-8, vocabulary 151,936) at long context: the architecture flags of
# Megatron-MoE-ModelZoo's model_configs/benchmarking/Qwen3-30B-A3B.yaml, launched by
# examples/common/family_moe.sh (layout, operators and every variable: see there).
#   bash examples/qwen3_30b_a3b/train.sh                   # one node, SEQ_LENGTH=131072
#   GPUS_PER_NODE=1 NUM_LAYERS=4 SEQ_LENGTH=262144 bash examples/qwen3_30b_a3b/train.sh  # one GPU
#   DRY_RUN=1 GPUS_PER_NODE=8 bash examples/qwen3_30b_a3b/train.sh                       # budget
set -euo pipefail
EXAMPLE_NAME=qwen3_30b_a3b
NUM_LAYERS="${NUM_LAYERS:-48}"
NUM_EXPERTS="${NUM_EXPERTS:-128}"
NUM_ATTENTION_HEADS=32
MOCK_VOCAB_SIZE=151936
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 2048 --ffn-hidden-size 6144
    --num-attention-heads "$NUM_ATTENTION_HEADS" --group-query-attention --num-query-groups 4
    --kv-channels 128 --qk-layernorm --max-position-embeddings "${SEQ_LENGTH:-131072}"
    --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-ffn-hidden-size 768 --moe-router-topk 8
    --moe-router-dtype fp32 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
)
source "$(dirname "${BASH_SOURCE[0]}")/../common/family_moe.sh"
