#!/usr/bin/env bash
# Shared launcher of the paper-scale MoE examples (moe_120b, moe_241b, moe_667b): the model of
# "Flattening Every Memory Peak in Long-Context MoE Training" (Appendix A): H=7168, 384 routed
# experts of FFN 2048 plus one shared expert, top-8, vocabulary 200,000; the per-size scripts set
# NUM_LAYERS and GPUS_TOTAL and source this file.
#
# Parallel layout (the paper's): every sequence is split over CONTEXT_PARALLEL_SIZE GPUs (default:
# all of them), each keeping N = SEQ_LENGTH / CP of its tokens; attention trades that split for a
# split of the heads with one all-to-all each way (--cp-comm-type a2a: upstream's through
# Transformer Engine, megatron.bounded.attention.context_parallel without it). The remaining factor is data
# parallelism (DP = GPUs / CP sequences at a time). The experts are spread over all GPUs (EP = all
# GPUs: 384 / EP experts per GPU); no tensor or pipeline parallelism. Attention and embedding
# weights are replicated and their optimizer state is sharded over all GPUs by the distributed
# optimizer; expert weights are not replicated at all. Gradients are reduced in bf16
# (--grad-reduce-in-bf16: 2 B per parameter, the paper's 4 B of weight + gradient). At these sizes
# the model state and the long-context peaks do not fit 141 GB without this project's bounded
# operators: the planner (pretrain_gpt.py's --bounded-plan auto) chooses recompute, the operators
# (OffloadStreamAdamW, SCO, Ring-DTP, PipelinedLLEP) and their knobs, the fastest plan that fits;
# OPERATORS=all gives the four with full recompute instead (long_context_operators in
# examples/common/launch.sh). Host memory per node is then up to GPUS_PER_NODE × (12 B × local
# parameters + SCO's boundaries). DRY_RUN=1 prints the plan and the per-GPU memory budget (CPU
# only) for the target: nodes of 8 H200 GPUs (HBM_GB=150.1) with 250 GB of host memory per GPU
# (HOST_GB), unless set.
#
# Multi-node torchrun: run the same script on every node with MASTER_ADDR (first node's address),
# NNODES and NODE_RANK set; GPUS_PER_NODE defaults to 8.
set -euo pipefail

: "${NUM_LAYERS:?set by the per-size script}" "${GPUS_TOTAL:?set by the per-size script}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NNODES="${NNODES:-$(( GPUS_TOTAL / GPUS_PER_NODE ))}"
WORLD_SIZE=$(( GPUS_PER_NODE * NNODES ))
SEQ_LENGTH="${SEQ_LENGTH:-131072}"
CONTEXT_PARALLEL_SIZE="${CONTEXT_PARALLEL_SIZE:-$WORLD_SIZE}"
MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE:-1}"
# one micro-batch per data-parallel rank
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-$(( MICRO_BATCH_SIZE * WORLD_SIZE / CONTEXT_PARALLEL_SIZE ))}"
TRAIN_ITERS="${TRAIN_ITERS:-1000}"
SAVE_INTERVAL="${SAVE_INTERVAL:-200}"
MOCK_VOCAB_SIZE=200000
HBM_GB="${HBM_GB:-150.1}" HOST_GB="${HOST_GB:-250}"  # the target of DRY_RUN=1
EXAMPLE_NAME="${EXAMPLE_NAME:-moe_${NUM_LAYERS}_layers}"
TOKENS_PER_RANK=$(( SEQ_LENGTH * MICRO_BATCH_SIZE / CONTEXT_PARALLEL_SIZE ))
# DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, PYTHON, MASTER_ADDR/PORT, NODE_RANK, DRY_RUN:
# see examples/common/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size 7168 --ffn-hidden-size 18432
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 384 --moe-router-topk 8 --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --expert-model-parallel-size "$WORLD_SIZE"
    --context-parallel-size "$CONTEXT_PARALLEL_SIZE" --cp-comm-type a2a
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
)
TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine
    --lr-warmup-iters $(( TRAIN_ITERS > 20 ? 20 : TRAIN_ITERS - 1 )) --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.006
    --bf16 --grad-reduce-in-bf16 --use-distributed-optimizer --seed 1234
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval "$TRAIN_ITERS"
)
if [ "${OPERATORS:-}" = all ]; then
    TRAINING_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
long_context_operators "$TOKENS_PER_RANK"
launch "$GPUS_PER_NODE" "$NNODES" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    ${OPERATOR_ARGS[@]+"${OPERATOR_ARGS[@]}"} ${PLAN_ARGS[@]+"${PLAN_ARGS[@]}"} \
    ${LOGGING_ARGS[@]+"${LOGGING_ARGS[@]}"} ${CHECKPOINT_ARGS[@]+"${CHECKPOINT_ARGS[@]}"} "$@"
