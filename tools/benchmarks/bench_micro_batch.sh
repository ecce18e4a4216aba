#!/usr/bin/env bash
# The main command's throughput and peak against the memory budget, per micro-batch size, with
# upstream's path beside it, on the GPUs of this machine (one call: the same GPU, the same hour).
#   RESULTS_DIR=R [MICRO_BATCHES="shipped 1 2 4 8"] [UPSTREAM_MICRO_BATCHES="shipped"] \
#       [TRAIN_ITERS=30] bash tools/benchmarks/bench_micro_batch.sh [extra pretrain_gpt.py flags]
# Each entry runs `bash scripts/train.sh` at the global batch size of examples/moe_small;
# "shipped" leaves MICRO_BATCH_SIZE unset (the example's default), a number sets it. The upstream
# entries add --bounded-moe-backend upstream (PLAN=off: upstream's dispatcher and SequentialMLP,
# eager). Writes R/<label>.log and R/<label>.metrics.jsonl and prints one line per run: tokens/s
# and TFLOP/s per GPU (median of the iterations after the first five), the peak allocated and the
# budget's prediction from the run's own start-up line.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS_DIR="${RESULTS_DIR:?set RESULTS_DIR}"
mkdir -p "$RESULTS_DIR"
MICRO_BATCHES="${MICRO_BATCHES:-shipped 1 2 4 8}"
UPSTREAM_MICRO_BATCHES="${UPSTREAM_MICRO_BATCHES:-shipped}"
export TRAIN_ITERS="${TRAIN_ITERS:-30}" LOG_INTERVAL=1 TENSORBOARD_DIR="" CHECKPOINT_DIR=""

run() {  # label, micro-batch ("shipped" or a number), then extra flags
    local label="$1" micro_batch="$2"; shift 2
    local -a env=()
    [ "$micro_batch" = shipped ] || env=(MICRO_BATCH_SIZE="$micro_batch")
    env ${env[@]+"${env[@]}"} bash "$REPO_ROOT/scripts/train.sh" \
        --metrics-jsonl "$RESULTS_DIR/$label.metrics.jsonl" "$@" \
        > "$RESULTS_DIR/$label.log" 2>&1 || { echo "$label: exit $?"; status=1; }
    labels+=("$label")
}

status=0
labels=()
for micro_batch in $MICRO_BATCHES; do
    run "fast_mb$micro_batch" "$micro_batch" "$@"
done
for micro_batch in $UPSTREAM_MICRO_BATCHES; do
    PLAN=off run "upstream_mb$micro_batch" "$micro_batch" --bounded-moe-backend upstream "$@"
done

python3 - "$RESULTS_DIR" "${labels[@]}" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

results = Path(sys.argv[1])
for label in sys.argv[2:]:
    log = (results / f"{label}.log").read_text(errors="replace")
    path = results / f"{label}.metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    timed = [r for r in records if "tokens_per_s_per_gpu" in r][5:]
    if not timed:
        print(f"{label}: fewer than six timed iterations")
        continue
    micro_batch = re.search(r"micro_batch_size \.+ (\d+)", log)
    budget = re.search(r"memory budget: peak allocated ([\d.]+) GiB predicted", log)
    predicted = float(budget.group(1)) if budget else float("nan")
    peak = max(r["peak_allocated_gib"] for r in records)
    tokens = statistics.median(r["tokens_per_s_per_gpu"] for r in timed)
    tflops = statistics.median(r["tflops_per_gpu"] for r in timed)
    print(f"{label}: micro-batch {micro_batch.group(1) if micro_batch else '?'}, "
          f"{tokens:,.0f} tokens/s/GPU, {tflops:.1f} TFLOP/s/GPU (median of {len(timed)}); "
          f"peak {peak:.2f} GiB, budget {predicted:.2f} GiB ({predicted / peak:.3f})")
EOF
exit $status
