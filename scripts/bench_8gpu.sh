#!/usr/bin/env bash
# Paper-scale component benchmarks on one node of 8 GPUs (P = E_p = 8), results in RESULTS_DIR
# and a markdown summary RESULTS_DIR/summary_8_gpus.md (its figures go into the operator pages under
# docs/operators/, each row with its date, commit, machine and command). Run on an 8-GPU machine after installing the wheelhouse like
# scripts/gpu_functional.sh does (or with megatron-core 0.19.2 installed):
#   RESULTS_DIR=results bash scripts/bench_8gpu.sh
# STEPS selects parts (default "llep ring adam e2e").
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS_DIR="$(mkdir -p "${RESULTS_DIR:-$REPO_ROOT/results}" && cd "${RESULTS_DIR:-$REPO_ROOT/results}" && pwd)"
PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-llep ring adam e2e}"
BENCH="$REPO_ROOT/tools/benchmarks"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
TORCHRUN=("$PYTHON" -m torch.distributed.run --nproc_per_node 8 --master_port 29800)
SUMMARY="$RESULTS_DIR/summary_8_gpus.md"
echo "# 8-GPU component benchmarks ($(date -u +%Y-%m-%d), $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))') x $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())'))" > "$SUMMARY"
status=0

section() {  # title, log name, command...
    local title="$1" log="$RESULTS_DIR/$2.log"; shift 2
    echo "== $title =="
    "$@" > "$log" 2>&1 || { echo "FAILED: $title (see $log)"; status=1; }
    { echo; echo "## $title"; echo; echo '```'; echo "$*" | sed "s|$REPO_ROOT/||g"; echo '```'; echo;
      grep -E '^\|' "$log" || echo "(no table: see $(basename "$log"))"; } >> "$SUMMARY"
}

for step in $STEPS; do
    case "$step" in
        llep)  # dispatch peak and time, balanced and skewed routing
            for skew in balanced 80pct16; do
                section "PipelinedLLEP, EP=8, 65,536 tokens/rank, H=7168, top-8, K=10 ($skew)" "llep_$skew" \
                    "${TORCHRUN[@]}" "$BENCH/bench_pipelined_llep.py" --tokens 65536 --hidden 7168 \
                    --ffn 2048 --experts 384 --topk 8 --chunks 10 --skew "$skew" \
                    --out "$RESULTS_DIR/llep_$skew.json"
            done ;;
        ring)  # vocabulary-projection peak and time against the materialized logits
            for tokens in 16384 32768; do
                section "Ring-DTP, P=8, H=7168, V=200,000, N=$tokens, fp32" "ring_$tokens" \
                    "${TORCHRUN[@]}" "$BENCH/bench_ring_dtp.py" --tokens "$tokens" --hidden 7168 \
                    --vocab 200000 --dtype fp32 --mode all --out "$RESULTS_DIR/ring_$tokens.json"
            done ;;
        adam)  # streamed step time with 8 ranks sharing the host links
            section "OffloadStreamAdamW, 8 ranks at once, 2.6e9 parameters each, 100M buckets, 2 slots" adam \
                bash -c 'for gpu in 0 1 2 3 4 5 6 7; do
                    CUDA_VISIBLE_DEVICES=$gpu '"$PYTHON"' '"$BENCH"'/bench_offload_stream_adamw.py \
                        --numel 2600000000 --bucket-numel 100000000 --slots 2 \
                        --out '"$RESULTS_DIR"'/adam_rank$gpu.json > '"$RESULTS_DIR"'/adam_rank$gpu.log 2>&1 &
                done; wait; cat '"$RESULTS_DIR"'/adam_rank0.log' ;;
        e2e)  # the small MoE example on 8 GPUs with and without the operators
            for ops in none all; do
                if [ "$ops" = all ]; then
                    extra=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
                           --sco-host-budget-gb 6 --ring-dtp --offload-stream-optimizer
                           --pipelined-llep --pipelined-llep-token-budget 1024)
                else
                    extra=()
                fi
                section "small MoE example, 8 GPUs, operators: $ops" "e2e_$ops" \
                    env PLAN=off TENSORBOARD_DIR= NUM_GPUS=8 TRAIN_ITERS=20 LOG_INTERVAL=5 PYTHON="$PYTHON" \
                    bash "$REPO_ROOT/examples/moe_small/train.sh" \
                    --metrics-jsonl "$RESULTS_DIR/e2e_$ops.metrics.jsonl" "${extra[@]}"
                # longest context: double the sequence until a run fails
                seq=8192
                while [ "$seq" -le 1048576 ]; do
                    if ! env PLAN=off TENSORBOARD_DIR= NUM_GPUS=8 TRAIN_ITERS=3 SEQ_LENGTH=$seq GLOBAL_BATCH_SIZE=8 PYTHON="$PYTHON" \
                        bash "$REPO_ROOT/examples/moe_small/train.sh" "${extra[@]}" \
                        > "$RESULTS_DIR/e2e_${ops}_seq$seq.log" 2>&1; then break; fi
                    echo "operators $ops: sequence $seq trains" >> "$RESULTS_DIR/e2e_longest.txt"
                    seq=$(( seq * 2 ))
                done
            done
            { echo; echo "## Longest trainable sequence (small MoE, 8 GPUs, global batch 8)"; echo;
              cat "$RESULTS_DIR/e2e_longest.txt" 2>/dev/null; } >> "$SUMMARY"
            "$PYTHON" "$REPO_ROOT/tools/summarize_metrics.py" "$RESULTS_DIR"/e2e_*.metrics.jsonl >> "$SUMMARY" ;;
        *) echo "unknown step '$step'" >&2; status=1 ;;
    esac
done
echo; cat "$SUMMARY"
exit $status
