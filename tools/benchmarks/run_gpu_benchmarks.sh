#!/usr/bin/env bash
# Run the GPU benchmarks into RESULTS_DIR; BENCHMARKS selects them (space-separated names):
#   small_moe             the small example end to end on 1 and 2 GPUs (the baseline)
#   small_moe_paged_stash the same with the torch-native backend, paged stash and factor 1.5 (on
#                         the example's mock data every step of two runs went over that budget and
#                         was rerun dropless; the script counts them)
#   small_moe_paged_stash_steady
#                         2 GPUs: factor 2.0 = E_p (nothing can drop) and a CUDA stash of 2.0 × the
#                         routed rows: every step runs static with pages, none is rerun
#   small_moe_paged_stash_graphs
#                         2 GPUs: the steady setting under upstream's whole-iteration CUDA graph
#                         (--cuda-graph-impl full_iteration), which the sync-free path allows
#   small_moe_optimizers  2 GPUs: --offload-stream-optimizer against upstream's
#                         --optimizer-cpu-offload (host Adam), both with the whole state on the host
#   moe_dispatch          upstream alltoall + SequentialMLP vs the static-capacity path and paged
#                         stash: 16,384 tokens/rank, H=2048, 64 experts, top-8, FFN 1024, EP=2
#   moe_dispatch_graph    the same shape, upstream eager beside ours eager and captured in a CUDA
#                         graph (factors 1.5 and 1.2): the static path without launch overhead
#   moe_paged_stash       4 stacked layers of that shape with paged stash (no drops): pages in use
#                         at the end of forward against the bytes routed to the paged layers
#   weighted_swiglu       the grouped experts' activation: eager chain vs fused Triton kernels,
#                         196,608-row static buffer (131,072 valid), FFN 1024, bf16, one GPU
#   slot_sum              the combine's sum of each token's top-k rows: eager vs Triton, 16,384
#                         tokens, top-8, H=2048, bf16, one GPU (must be bitwise equal)
#   rotary                the attention's rotary embedding: upstream's eager vs Triton, q
#                         [4096, 1, 16, 64] and k [4096, 1, 4, 64], bf16, GPU and host time per
#                         layer, one GPU (must be bitwise equal)
#   sdpa_attention        the example's attention (16 heads, 4 groups, d 64, causal, bf16) per SDPA
#                         backend (flash, cuDNN, memory-efficient), 32K and 128K tokens, one GPU
#   row_gather            the dispatcher's padding-skipping row gather vs index_select: 196,608
#                         rows (131,072 taken), H=2048, bf16, one GPU
#   strip_softmax         Ring-DTP's strip fold and gradient strip: eager vs Triton, 4,096 tokens x
#                         100,000 vocabulary rows (V = 200,000 at P = 2), fp32 strip, one GPU
#   sparse_attention      DeepSeek sparse attention's Triton kernels: attention forward + backward
#                         (128 heads, q/k 192, v 128, k 2048) at 32K and 128K tokens, spread and
#                         recent selections; the indexer's top-k (64 heads x 128) at 32K, 128K and
#                         1M tokens; the PyTorch paths at small lengths; one GPU, about 4 minutes
#   pipelined_llep        65,536 tokens/rank, H=2048, 64 experts, top-8, EP=2, K=10, balanced and
#                         80% skew (with LLEP at threshold 1.3); balanced under activation
#                         checkpoint; balanced at H=7168; 32,768 tokens/rank at K = 10, 4, 2
#   ring_dtp              P=2, H=4096, V=200,000, bf16, N in {8192, 16384, 32768}, whole strips
#                         and 1,024-token chunks, with and without gradients in forward, with
#                         Liger / Cut Cross-Entropy when installed
#   offload_stream_adamw  1e9 parameters, bucket/slot sweep, one GPU
#   sco                   SCO on/off, transformer-like stack with full recompute, one GPU
#   reach                 opt-in (tens of minutes; not in the default list): the context-reach
#                         ladder plain -> + Ring-DTP -> + PipelinedLLEP -> + SCO -> + OffloadStream
#                         on the GPUs of this machine (bench_reach.py): peak against length, bytes
#                         per token, budget / measured; finished trials are kept in REACH_DIR
#                         (default RESULTS_DIR/reach) and reused, so the ladder can be measured
#                         over several time-limited runs; REACH_ARGS adds options (split on
#                         spaces, e.g. "--lengths plain=131072,262144 --snapshot --jobs 2")
#   BENCHMARKS="small_moe ring_dtp" bash tools/benchmarks/run_gpu_benchmarks.sh RESULTS_DIR
set -uo pipefail
RESULTS_DIR="$1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
BENCHMARKS="${BENCHMARKS:-small_moe small_moe_paged_stash small_moe_paged_stash_steady small_moe_optimizers moe_dispatch moe_paged_stash weighted_swiglu slot_sum rotary row_gather strip_softmax sdpa_attention sparse_attention pipelined_llep ring_dtp offload_stream_adamw sco}"
TORCHRUN=("$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_port $((29700 + ${PORT_OFFSET:-0})))
# EP = 2: a factor of 2.0 fits every pair a rank can send; the CUDA stash holds 2.0 × the average
PAGED_STASH_STEADY=(--moe-paged-stash --moe-expert-rank-capacity-factor 2.0
    --moe-paged-stash-buffer-size-factor-cuda 2.0)
status=0
run() {  # name, command...
    local name="$1"; shift
    echo "== benchmark: $name =="
    "$@" 2>&1 | tee "$RESULTS_DIR/bench_$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark $name FAILED"; status=1; }
}
for name in $BENCHMARKS; do
    case "$name" in
        small_moe) run small_moe bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" ;;
        small_moe_paged_stash) LABEL=bench_small_moe_paged_stash run small_moe_paged_stash \
            bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" --moe-paged-stash --moe-expert-rank-capacity-factor 1.5 ;;
        small_moe_paged_stash_steady) GPU_COUNTS=2 LABEL=bench_small_moe_paged_stash_steady \
            run small_moe_paged_stash_steady bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" \
            "${PAGED_STASH_STEADY[@]}" ;;
        small_moe_paged_stash_graphs) GPU_COUNTS=2 LABEL=bench_small_moe_paged_stash_graphs \
            run small_moe_paged_stash_graphs bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" \
            "${PAGED_STASH_STEADY[@]}" --cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad ;;
        small_moe_optimizers)
            GPU_COUNTS=2 LABEL=bench_small_moe_offload_stream run small_moe_offload_stream \
                bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" --offload-stream-optimizer
            GPU_COUNTS=2 LABEL=bench_small_moe_cpu_offload run small_moe_cpu_offload \
                bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" --optimizer-cpu-offload \
                --use-precision-aware-optimizer --optimizer-offload-fraction 1.0 ;;
        moe_dispatch) run moe_dispatch "${TORCHRUN[@]}" "$HERE/bench_moe_dispatch.py" --layers 1 --profile \
            --cf 1.5 1.2 --out "$RESULTS_DIR/moe_dispatch.json" ;;
        moe_dispatch_graph) run moe_dispatch_graph "${TORCHRUN[@]}" "$HERE/bench_moe_dispatch.py" --layers 1 \
            --cf 1.5 1.2 --cuda-graph --no-dropless --no-paged-stash --out "$RESULTS_DIR/moe_dispatch_graph.json" ;;
        moe_paged_stash) run moe_paged_stash "${TORCHRUN[@]}" "$HERE/bench_moe_dispatch.py" --layers 4 \
            --cf --no-upstream --no-dropless --out "$RESULTS_DIR/moe_paged_stash.json" ;;
        weighted_swiglu) run weighted_swiglu "$PYTHON" "$HERE/bench_weighted_swiglu.py" \
            --out "$RESULTS_DIR/weighted_swiglu.json" ;;
        slot_sum) run slot_sum "$PYTHON" "$HERE/bench_slot_sum.py" --out "$RESULTS_DIR/slot_sum.json" ;;
        rotary) run rotary "$PYTHON" "$HERE/bench_rotary.py" --out "$RESULTS_DIR/rotary.json" ;;
        sdpa_attention) run sdpa_attention "$PYTHON" "$HERE/bench_sdpa_attention.py" \
            --repeats 5 --out "$RESULTS_DIR/sdpa_attention.json" ;;
        row_gather) run row_gather "$PYTHON" "$HERE/bench_row_gather.py" --out "$RESULTS_DIR/row_gather.json" ;;
        strip_softmax) run strip_softmax "$PYTHON" "$HERE/bench_strip_softmax.py" \
            --out "$RESULTS_DIR/strip_softmax.json" ;;
        sparse_attention) run sparse_attention "$PYTHON" "$HERE/bench_sparse_attention.py" \
            --out "$RESULTS_DIR/sparse_attention.json" ;;
        pipelined_llep)
            run pipelined_llep_balanced "${TORCHRUN[@]}" "$HERE/bench_pipelined_llep.py" \
                --skew balanced --out "$RESULTS_DIR/pipelined_llep_balanced.json"
            # 80% skew: LLEP balancing (threshold 1.3) beside the same chunks without it
            run pipelined_llep_80pct16 "${TORCHRUN[@]}" "$HERE/bench_pipelined_llep.py" \
                --skew 80pct16 --llep-threshold 1.3 --out "$RESULTS_DIR/pipelined_llep_80pct16.json"
            # Where chunking stops paying: 32,768 tokens/rank at K = 10, 4 and 2
            for chunks in 10 4 2; do
                run "pipelined_llep_32k_k$chunks" "${TORCHRUN[@]}" "$HERE/bench_pipelined_llep.py" \
                    --tokens 32768 --chunks "$chunks" --variants static_unchunked pipelined_strided \
                    --out "$RESULTS_DIR/pipelined_llep_32k_k$chunks.json"
            done
            # The full-recompute case (backward re-runs the dispatch) and the paper's hidden size.
            run pipelined_llep_recompute "${TORCHRUN[@]}" "$HERE/bench_pipelined_llep.py" \
                --recompute --out "$RESULTS_DIR/pipelined_llep_recompute.json"
            run pipelined_llep_h7168 "${TORCHRUN[@]}" "$HERE/bench_pipelined_llep.py" \
                --hidden 7168 --out "$RESULTS_DIR/pipelined_llep_h7168.json" ;;
        ring_dtp)
            # Whole strips, then 1,024-token chunks (the peak no longer grows with N), each also
            # with gradients in forward; the mean loss is backpropagated, and the fused
            # single-GPU kernels run beside them when installed (--fused-baselines auto).
            for chunk in none 1024; do
                for tokens in 8192 16384 32768; do
                    name="ring_dtp_${tokens}$([ "$chunk" = none ] || echo "_chunk$chunk")"
                    run "$name" "${TORCHRUN[@]}" "$HERE/bench_ring_dtp.py" --tokens "$tokens" \
                        --hidden 4096 --vocab 200000 --dtype bf16 --grad-in-forward \
                        --out "$RESULTS_DIR/$name.json" \
                        $([ "$chunk" = none ] || echo "--chunk-tokens $chunk")
                done
            done ;;
        offload_stream_adamw)
            # The first plan runs every variant (GPU-resident, both CPU updates, ours); the sweep
            # points run ours alone.
            variants="gpu_fused_adamw,cpu_adamw_fused,cpu_adamw_foreach,offload_stream_adamw"
            for plan in "100000000 2" "100000000 3" "50000000 2" "200000000 2" "25000000 2"; do
                set -- $plan
                run "offload_stream_adamw_$1_$2" "$PYTHON" "$HERE/bench_offload_stream_adamw.py" \
                    --bucket-numel "$1" --slots "$2" --variants "$variants" \
                    --out "$RESULTS_DIR/offload_stream_adamw_$1_$2.json"
                variants="offload_stream_adamw"
            done ;;
        sco) run sco "$PYTHON" "$HERE/bench_sco.py" --out "$RESULTS_DIR/sco.json" ;;
        reach) run reach "$PYTHON" "$HERE/bench_reach.py" \
            --num-gpus "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" \
            --base-port $((29820 + ${PORT_OFFSET:-0})) --results-dir "${REACH_DIR:-$RESULTS_DIR/reach}" \
            --out "$RESULTS_DIR/reach.json" --markdown "$RESULTS_DIR/reach.md" ${REACH_ARGS:-} ;;
        *) echo "unknown benchmark '$name'" >&2; status=1 ;;
    esac
done
exit $status
