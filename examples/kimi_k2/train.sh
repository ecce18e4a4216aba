#!/usr/bin/env bash
# Kimi-K2 (the DeepSeek-V3 architecture: 61 layers, the first dense, hidden 7168, 64 heads of
# multi-latent attention (q rank 1536, kv rank 512, q/k heads of 128 + 64 rotary, v heads of 128),
# 384 experts of FFN 2048 plus one shared, top-8 with sigmoid scores and expert bias, vocabulary
# 163,840) at long context: the architecture flags of Megatron-MoE-ModelZoo's
# model_configs/benchmarking/Kimi-K2.yaml, launched by examples/common/family_moe.sh (layout,
# operators and every variable: see there). The planner leaves the chunked recompute out (the
# sequence-level auxiliary loss does not split over chunks, and the attention sublayer's chunks are
# not available with multi-latent attention: their checks refuse it).
#   GPUS_PER_NODE=8 NNODES=16 bash examples/kimi_k2/train.sh     # on every node, with NODE_RANK
#   GPUS_PER_NODE=1 NUM_LAYERS=3 NUM_EXPERTS=16 SEQ_LENGTH=262144 bash examples/kimi_k2/train.sh
#   DRY_RUN=1 GPUS_PER_NODE=8 NNODES=16 bash examples/kimi_k2/train.sh   # nodes of 8 H200s, 250 GB per GPU
set -euo pipefail
EXAMPLE_NAME=kimi_k2
NUM_LAYERS="${NUM_LAYERS:-61}"
NUM_EXPERTS="${NUM_EXPERTS:-384}"
NUM_ATTENTION_HEADS=64
MOCK_VOCAB_SIZE=163840
MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 7168 --ffn-hidden-size 18432
    --num-attention-heads "$NUM_ATTENTION_HEADS" --multi-latent-attention
    --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm --max-position-embeddings "${SEQ_LENGTH:-131072}"
    --position-embedding-type rope --rotary-base 50000 --rotary-scaling-factor 32
    --mscale 1.0 --mscale-all-dim 1.0
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
)
MOE_ARGS=(
    --num-experts "$NUM_EXPERTS" --moe-layer-freq "([0]*1+[1]*$(( NUM_LAYERS - 1 )))"
    --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-topk-scaling-factor 2.827
    --moe-router-num-groups 1 --moe-router-group-topk 1 --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0
)
source "$(dirname "${BASH_SOURCE[0]}")/../common/family_moe.sh"
