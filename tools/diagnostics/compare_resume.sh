#!/usr/bin/env bash
# Is a resume bit-exact, and if not, where does it first differ? Runs the small example twice on
# NUM_GPUS GPUs with --deterministic-mode --no-bias-swiglu-fusion: uninterrupted to iteration 12 (saving at 10), then a new
# job from the iteration-10 checkpoint to 12; records checksums of iteration 11 in both and
# compares them (tools/diagnostics/checksums.py). Extra arguments go to both runs.
#   RESULTS_DIR=results NUM_GPUS=2 bash tools/diagnostics/compare_resume.sh [--moe-aux-loss-coeff 0]
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS_DIR="$(mkdir -p "${RESULTS_DIR:-results}" && cd "${RESULTS_DIR:-results}" && pwd)"
PYTHON="${PYTHON:-python3}"
CHECKPOINT_DIR="$(mktemp -d)"
PORT=$((29900 + ${PORT_OFFSET:-0}))
export PYTHON NUM_GPUS="${NUM_GPUS:-2}" SEQ_LENGTH="${SEQ_LENGTH:-2048}" GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE:-8}"
export TRAIN_ITERS=30 LOG_INTERVAL=1 SAVE_INTERVAL=10 CHECKPOINT_DIR BOUNDED_CHECKSUMS_AT=11
export PLAN=off TENSORBOARD_DIR=  # the example's flags as given, no planner or TensorBoard
export PYTHONPATH="$REPO_ROOT/tools/diagnostics/checksum_site${PYTHONPATH:+:$PYTHONPATH}"
run() {  # name, port, flags...
    local name="$1" port="$2"; shift 2
    BOUNDED_CHECKSUMS_OUT="$RESULTS_DIR/$name" MASTER_PORT="$port" \
        bash "$REPO_ROOT/examples/moe_small/train.sh" --deterministic-mode --no-bias-swiglu-fusion --exit-interval 12 \
        --metrics-jsonl "$RESULTS_DIR/$name.metrics.jsonl" "$@" > "$RESULTS_DIR/$name.log" 2>&1 \
        || { echo "$name failed: see $RESULTS_DIR/$name.log"; exit 2; }
}
run checksums_uninterrupted "$PORT" "$@"
run checksums_resumed $((PORT + 1)) --ckpt-step 10 --save "$CHECKPOINT_DIR/resumed" "$@"
rm -rf "$CHECKPOINT_DIR"
"$PYTHON" "$REPO_ROOT/tools/diagnostics/checksums.py" \
    "$RESULTS_DIR/checksums_uninterrupted" "$RESULTS_DIR/checksums_resumed"
