#!/usr/bin/env bash
# End-to-end throughput of the small MoE example (examples/moe_small) on 1 and 2 GPUs.
#   bash tools/benchmarks/bench_small_moe.sh RESULTS_DIR [extra pretrain_gpt.py flags]
# Writes RESULTS_DIR/<label>_{1,2}gpu.metrics.jsonl and prints the summary table
# (steady state: medians over the log intervals after the first). LABEL names the variant
# (default: bench_small_moe), GPU_COUNTS the GPU counts to run (default: 1 and 2, as far as the host
# has them); the example's settings can be changed through its environment variables.
set -euo pipefail
RESULTS_DIR="$1"; shift
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
LABEL="${LABEL:-bench_small_moe}"
MAX_GPUS="$("$PYTHON" -c 'import torch; print(min(torch.cuda.device_count(), 2))')"
export TRAIN_ITERS="${TRAIN_ITERS:-20}" LOG_INTERVAL="${LOG_INTERVAL:-5}" PYTHON
# each variant names the flags it measures: the planner only with PLAN=auto
export PLAN="${PLAN:-off}" TENSORBOARD_DIR="${TENSORBOARD_DIR-}"
files=()
for gpus in ${GPU_COUNTS:-$(seq 1 "$MAX_GPUS")}; do
    metrics="$RESULTS_DIR/${LABEL}_${gpus}gpu.metrics.jsonl"
    rm -f "$metrics"
    NUM_GPUS="$gpus" MASTER_PORT=$((29600 + gpus + ${PORT_OFFSET:-0})) bash "$REPO_ROOT/examples/moe_small/train.sh" \
        --metrics-jsonl "$metrics" "$@" > "$RESULTS_DIR/${LABEL}_${gpus}gpu.log" 2>&1
    files+=("$metrics")
    # A paged-stash step that went over budget ran twice (static, then dropless): say how many did
    reruns="$(grep -c "Paged stash: rerunning forward-backward" "$RESULTS_DIR/${LABEL}_${gpus}gpu.log" || true)"
    [ "$reruns" = 0 ] || echo "${LABEL}_${gpus}gpu: $reruns of $TRAIN_ITERS steps rerun dropless"
done
"$PYTHON" "$REPO_ROOT/tools/summarize_metrics.py" "${files[@]}"
