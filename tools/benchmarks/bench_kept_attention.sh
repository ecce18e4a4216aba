#!/usr/bin/env bash
# The long-context step with attention recomputed and kept (--chunked-recompute-keep-attention),
# on one GPU, side by side in one call: the small example (examples/moe_small) at SEQ_LENGTH
# tokens (default 524,288) with every long-context operator on, TRAIN_ITERS iterations (default
# 2) for each placement in KEEP (default "off gpu host"), CHUNK_TOKENS tokens (default 16,384) per
# recompute chunk and as PipelinedLLEP's token budget.
#   RESULTS_DIR=R [SEQ_LENGTH=N] [TRAIN_ITERS=I] [KEEP="off gpu"] [CHUNK_TOKENS=T] \
#       bash tools/benchmarks/bench_kept_attention.sh \
#       [extra pretrain_gpt.py flags, e.g. the profiler's]
# Writes R/kept_<keep>.log and R/kept_<keep>.metrics.jsonl per placement and prints one line each:
# seconds per iteration and upstream's TFLOP/s of the last iteration, the peak allocated against
# the budget's prediction, and the largest relative difference of the losses and gradient norms
# from the first placement's (compare with the first placement run twice: KEEP="off off").
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS_DIR="${RESULTS_DIR:?set RESULTS_DIR}"
mkdir -p "$RESULTS_DIR"
SEQ_LENGTH="${SEQ_LENGTH:-524288}"
TRAIN_ITERS="${TRAIN_ITERS:-2}"
KEEP="${KEEP:-off gpu host}"
CHUNK_TOKENS="${CHUNK_TOKENS:-16384}"
# SCO's host budget holds the 8 checkpoint boundaries (N·H·b each)
SCO_GIB=$(( (8 * SEQ_LENGTH * 1024 * 2 + (1 << 30) - 1) >> 30 ))

status=0
for keep in $KEEP; do
    NUM_GPUS=1 SEQ_LENGTH="$SEQ_LENGTH" MICRO_BATCH_SIZE=1 GLOBAL_BATCH_SIZE=1 \
    TRAIN_ITERS="$TRAIN_ITERS" PLAN=off PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    bash "$REPO_ROOT/examples/moe_small/train.sh" \
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
        --attention-backend fused --lr-warmup-iters 0 --ring-dtp --ring-dtp-chunk-tokens 4096 \
        --pipelined-llep --pipelined-llep-token-budget "$CHUNK_TOKENS" --sco-host-budget-gb "$SCO_GIB" \
        --offload-stream-optimizer --chunked-recompute-tokens "$CHUNK_TOKENS" --chunked-recompute-attention \
        --chunked-recompute-keep-attention "$keep" --log-interval 1 \
        --metrics-jsonl "$RESULTS_DIR/kept_$keep.metrics.jsonl" "$@" \
        > "$RESULTS_DIR/kept_$keep.log" 2>&1 || { echo "kept_$keep: exit $?"; status=1; }
done

python3 - "$RESULTS_DIR" $KEEP <<'EOF'
import json, re, sys
from pathlib import Path

results, keeps = Path(sys.argv[1]), sys.argv[2:]
first = None
for keep in keeps:
    log = (results / f"kept_{keep}.log").read_text(errors="replace")
    path = results / f"kept_{keep}.metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not records:
        print(f"kept_{keep}: no iteration finished")
        continue
    budget = re.search(r"memory budget: peak allocated ([\d.]+) GiB predicted", log)
    tflops = re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)", log)
    seconds = re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)
    peak = max(r["peak_allocated_gib"] for r in records)
    series = [value for r in records for value in (r["lm_loss"], r["grad_norm"])]
    first = series if first is None else first
    difference = max(abs(a - b) / abs(b) for a, b in zip(series, first))
    first_iteration = re.search(r"the first iteration ([\d.]+) GiB, before", log)
    # a one-iteration run peaks in its first iteration, before the streamed optimizer's staging
    predicted = (float(first_iteration.group(1)) if first_iteration and len(records) == 1
                 else float(budget.group(1)) if budget else float("nan"))
    print(f"kept_{keep}: {float(seconds[-1]) / 1e3:.1f} s/iteration, {tflops[-1]} TFLOP/s/GPU "
          f"(last of {len(records)}); peak {peak:.2f} GiB, budget {predicted:.1f} GiB "
          f"({predicted / peak:.3f}); losses and grad norms {series}, largest relative "
          f"difference from the first placement's {difference:.2e}")
EOF
exit $status
