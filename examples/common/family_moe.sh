#!/usr/bin/env bash
# Shared launcher of the model-family examples (gpt_oss_20b, qwen3_30b_a3b, kimi_k2) at long
# context. The family script sets EXAMPLE_NAME, MOCK_VOCAB_SIZE (its vocabulary), NUM_EXPERTS,
# NUM_ATTENTION_HEADS and the arrays MODEL_ARGS (its architecture: the flags of its public launch
# scripts at its real dimensions, NUM_LAYERS layers) and MOE_ARGS (experts and routing), then
# sources this file.
#
# Layout: NNODES nodes of GPUS_PER_NODE GPUs (default: one node, all its GPUs). Each sequence is
# split over CONTEXT_PARALLEL_SIZE GPUs (default: the node's GPUs, at most the attention heads),
# attention trading the split for a split of the heads (--cp-comm-type a2a); the rest is data
# parallelism. The experts are spread over EXPERT_PARALLEL_SIZE GPUs (default: all, at most
# NUM_EXPERTS; it must divide both). The planner (pretrain_gpt.py's --bounded-plan auto) chooses
# recompute, the chunked recompute, kept attention, the operators, the dispatch and the micro-batch
# for the GPUs that train; CHUNKED_RECOMPUTE_TOKENS (with CHUNKED_ATTENTION=1 its attention sublayer
# too), OPERATORS=all and MICRO_BATCH_SIZE give them instead (then full recompute is given with
# them). DRY_RUN=1 prints the plan and the per-GPU memory budget on the CPU for the target machine:
# nodes of 8 H200 GPUs (HBM_GB=150.1) with 250 GB of host memory per GPU (HOST_GB), unless set.
set -euo pipefail

: "${NUM_EXPERTS:?set by the family script}" "${NUM_ATTENTION_HEADS:?set by the family script}"
SAVE_INTERVAL="${SAVE_INTERVAL:-200}"
# DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, PLAN, PYTHON, MASTER_ADDR/PORT, NODE_RANK,
# DRY_RUN: see examples/common/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

NNODES="${NNODES:-1}"
if [ -z "${GPUS_PER_NODE:-}" ]; then
    # no GPU here (DRY_RUN on a CPU machine): plan for one GPU; set GPUS_PER_NODE to plan for more
    GPUS_PER_NODE="$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')" \
        || launch_error "could not count the GPUs with $PYTHON (is torch installed?); set GPUS_PER_NODE."
fi
WORLD_SIZE=$(( GPUS_PER_NODE * NNODES ))
SEQ_LENGTH="${SEQ_LENGTH:-131072}"
CONTEXT_PARALLEL_SIZE="${CONTEXT_PARALLEL_SIZE:-$(( GPUS_PER_NODE < NUM_ATTENTION_HEADS ? GPUS_PER_NODE : NUM_ATTENTION_HEADS ))}"
EXPERT_PARALLEL_SIZE="${EXPERT_PARALLEL_SIZE:-$(( WORLD_SIZE < NUM_EXPERTS ? WORLD_SIZE : NUM_EXPERTS ))}"
HBM_GB="${HBM_GB:-150.1}" HOST_GB="${HOST_GB:-250}"  # the target of DRY_RUN=1
# one sequence per data-parallel rank and step
GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-$(( ${MICRO_BATCH_SIZE:-1} * WORLD_SIZE / CONTEXT_PARALLEL_SIZE ))}"
TRAIN_ITERS="${TRAIN_ITERS:-1000}"
LOG_INTERVAL="${LOG_INTERVAL:-1}"
# the attention sublayer's chunked recompute runs on whole sequences: without context parallelism
CHUNKED_ATTENTION="${CHUNKED_ATTENTION:-$(( CONTEXT_PARALLEL_SIZE == 1 ))}"
TOKENS_PER_RANK=$(( SEQ_LENGTH * ${MICRO_BATCH_SIZE:-1} / CONTEXT_PARALLEL_SIZE ))

LAYOUT_ARGS=(
    --seq-length "$SEQ_LENGTH"
    --context-parallel-size "$CONTEXT_PARALLEL_SIZE" --cp-comm-type a2a
    --expert-model-parallel-size "$EXPERT_PARALLEL_SIZE" --moe-token-dispatcher-type alltoall
)
TRAINING_ARGS=(
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine
    --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95
    --attention-dropout 0.0 --hidden-dropout 0.0
    --bf16 --grad-reduce-in-bf16 --use-distributed-optimizer --seed 1234
    --log-interval "$LOG_INTERVAL" --log-throughput --eval-iters 0 --eval-interval "$TRAIN_ITERS"
)
if [ -n "${MICRO_BATCH_SIZE:-}" ]; then TRAINING_ARGS+=(--micro-batch-size "$MICRO_BATCH_SIZE"); fi
if [ -n "${CHUNKED_RECOMPUTE_TOKENS:-}" ] || [ "${OPERATORS:-}" = all ]; then
    TRAINING_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
if [ "${CHUNKED_RECOMPUTE_TOKENS:-0}" != "0" ]; then
    TRAINING_ARGS+=(--chunked-recompute-tokens "$CHUNKED_RECOMPUTE_TOKENS")
    if [ "$CHUNKED_ATTENTION" = "1" ]; then TRAINING_ARGS+=(--chunked-recompute-attention); fi
fi
long_context_operators "$TOKENS_PER_RANK"
launch "$GPUS_PER_NODE" "$NNODES" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${LAYOUT_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    ${OPERATOR_ARGS[@]+"${OPERATOR_ARGS[@]}"} ${PLAN_ARGS[@]+"${PLAN_ARGS[@]}"} \
    ${LOGGING_ARGS[@]+"${LOGGING_ARGS[@]}"} ${CHECKPOINT_ARGS[@]+"${CHECKPOINT_ARGS[@]}"} "$@"
