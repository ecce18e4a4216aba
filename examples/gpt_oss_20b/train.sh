#!/usr/bin/env bash
# gpt-oss-20b (24 layers, hidden 2880, 64 query heads of 64 in 8 groups, attention alternating a
# 128-token sliding window and the whole sequence, learnable softmax sinks, 32 experts of FFN 2880
# with quick-GeGLU, top-4, vocabulary 201,088) at long context: the architecture flags of
# Megatron-LM's examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh, without biases as in
# its examples/gptoss/02_train.sh (the grouped experts have none), launched by
# examples/common/family_moe.sh (layout, operators and every variable: see there).
#   bash examples/gpt_oss_20b/train.sh                     # one node, SEQ_LENGTH=131072
#   GPUS_PER_NODE=1 NUM_LAYERS=4 SEQ_LENGTH=262144 bash examples/gpt_oss_20b/train.sh   # one GPU
#   DRY_RUN=1 GPUS_PER_NODE=8 bash examples/gpt_oss_20b/train.sh                        # budget
set -euo pipefail
EXAMPLE_NAME=gpt_oss_20b
NUM_LAYERS="${NUM_LAYERS:-24}"
NUM_EXPERTS="${NUM_EXPERTS:-32}"
NUM_ATTENTION_HEADS=64
MOCK_VOCAB_SIZE=201088
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 2880 --ffn-hidden-size 2880
    --num-attention-heads "$NUM_ATTENTION_HEADS" --group-query-attention --num-query-groups 8
    --kv-channels 64 --max-position-embeddings "${SEQ_LENGTH:-131072}"
    --position-embedding-type rope --rotary-percent 1.0 --rotary-base 150000
    --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear
    --window-size 127,0 --window-attn-skip-freq 2 --softmax-type learnable
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-ffn-hidden-size 2880 --moe-router-topk 4
    --moe-router-score-function softmax --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.0
)
source "$(dirname "${BASH_SOURCE[0]}")/../common/family_moe.sh"
