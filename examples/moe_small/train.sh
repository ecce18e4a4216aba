#!/usr/bin/env bash
# Small MoE GPT on 1 or 2 GPUs (a few minutes): 8 layers, H=1024, 32 experts, top-4, seq 4096,
# bf16, mock data. Expert parallelism spans all GPUs of the node (EP = NUM_GPUS), data
# parallelism too (DP = NUM_GPUS); no tensor or pipeline parallelism.
#
#   bash examples/moe_small/train.sh [extra pretrain_gpt.py flags, which override these]
#
# Any SEQ_LENGTH works: the planner (--bounded-plan auto, pretrain_gpt.py's default) chooses every
# knob left open (micro-batch, recompute, kept attention, the operators, the MoE dispatch, the
# whole-iteration CUDA graph): the fastest exact plan that fits the GPU, or a refusal before
# anything is built that names the longest length that fits. PLAN=off runs the flags as given;
# the extra flag --bounded-moe-backend upstream runs upstream's dispatcher and SequentialMLP.
# Every setting below can be changed from the environment without editing this file.
set -euo pipefail

SEQ_LENGTH="${SEQ_LENGTH:-4096}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
LOG_INTERVAL="${LOG_INTERVAL:-5}"
SAVE_INTERVAL="${SAVE_INTERVAL:-1000}"
NNODES="${NNODES:-1}"
MOCK_VOCAB_SIZE=32000
EXAMPLE_NAME=moe_small
# DRY_RUN=1 plans for one H100 80 GB (torch reports 85.0 GB) with 128 GiB of host memory per GPU
HBM_GB="${HBM_GB:-85.0}" HOST_GB="${HOST_GB:-137}"
# DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, PLAN, TENSORBOARD_DIR, PYTHON, MASTER_ADDR/PORT,
# NODE_RANK, DRY_RUN: see examples/common/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common/launch.sh"

if [ -z "${NUM_GPUS:-}" ]; then
    NUM_GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" \
        || launch_error "could not count the GPUs with $PYTHON (is torch installed?); set NUM_GPUS."
    if [ "$NUM_GPUS" -eq 0 ]; then
        if [ "${DRY_RUN:-0}" = "1" ]; then
            echo "$(basename "$0"): no GPU found; planning for NUM_GPUS=1 (set NUM_GPUS to plan for more)." >&2
            NUM_GPUS=1
        else
            launch_error "no CUDA GPU found: training needs at least one (DRY_RUN=1 prints the memory budget on the CPU)."
        fi
    fi
fi
# Default global batch: 32,768 tokens per step (8 sequences of 4096), at least one sequence per GPU.
SEQUENCE_TOKENS="$SEQ_LENGTH"  # an extra --seq-length overrides the variable: count that one
EXTRA_FLAGS=("$@")
for (( i = 0; i + 1 < ${#EXTRA_FLAGS[@]}; i++ )); do
    [ "${EXTRA_FLAGS[$i]}" != --seq-length ] || SEQUENCE_TOKENS="${EXTRA_FLAGS[$((i + 1))]}"
done
if [ -z "${GLOBAL_BATCH_SIZE:-}" ]; then
    GLOBAL_BATCH_SIZE=$(( 32768 / SEQUENCE_TOKENS ))
    (( GLOBAL_BATCH_SIZE >= NUM_GPUS * NNODES )) || GLOBAL_BATCH_SIZE=$(( NUM_GPUS * NNODES ))
fi

# The micro-batch is the planner's choice (the fastest that fits, a divisor of each rank's share
# of the global batch) unless MICRO_BATCH_SIZE is set; with PLAN=off the largest divisor with at
# most 32,768 tokens per rank.
if [ "$PLAN" = off ] && [ -z "${MICRO_BATCH_SIZE:-}" ]; then
    SAMPLES_PER_RANK=$(( GLOBAL_BATCH_SIZE / (NUM_GPUS * NNODES) ))
    MICRO_BATCH_SIZE=1
    for (( size = SAMPLES_PER_RANK; size > 1; size-- )); do
        if (( SAMPLES_PER_RANK % size == 0 && size * SEQUENCE_TOKENS <= 32768 )); then
            MICRO_BATCH_SIZE=$size
            break
        fi
    done
fi
MICRO_BATCH_ARGS=()
if [ -n "${MICRO_BATCH_SIZE:-}" ]; then MICRO_BATCH_ARGS=(--micro-batch-size "$MICRO_BATCH_SIZE"); fi
MODEL_ARGS=(
    --num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096
    --num-attention-heads 16 --group-query-attention --num-query-groups 4
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope --normalization RMSNorm --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 1024
    --expert-model-parallel-size "$NUM_GPUS"
    --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
)
TRAINING_ARGS=(
    ${MICRO_BATCH_ARGS[@]+"${MICRO_BATCH_ARGS[@]}"} --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters $(( TRAIN_ITERS > 5 ? 5 : TRAIN_ITERS - 1 )) --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.02
    --bf16 --use-distributed-optimizer --seed 1234
    --log-interval "$LOG_INTERVAL" --log-throughput --eval-iters 0 --eval-interval "$TRAIN_ITERS"
)
launch "$NUM_GPUS" "$NNODES" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" \
    ${PLAN_ARGS[@]+"${PLAN_ARGS[@]}"} ${LOGGING_ARGS[@]+"${LOGGING_ARGS[@]}"} \
    ${CHECKPOINT_ARGS[@]+"${CHECKPOINT_ARGS[@]}"} "$@"
