#!/usr/bin/env bash
# Run scripts/gpu_functional.sh in several lanes at once on one host, each lane on its own GPUs
# (GPUS_PER_LANE, default 2), with its own rendezvous ports and results folder. A lane is one
# argument "TEST_PATHS|BENCHMARKS" (either side may be empty), e.g. on a 4-GPU host:
#   RESULTS_DIR=results bash scripts/gpu_lanes.sh \
#       "tests/functional/test_pretrain_small_moe.py tests/functional/test_ring_dtp_training.py|" \
#       "tests/functional/test_offload_stream_training.py|small_moe"
# Lane i writes RESULTS_DIR/lane<i>/ and RESULTS_DIR/lane<i>.log; with ARCHIVE=PATH everything is
# packed into one .tar.gz. Exits non-zero when any lane failed. Timings taken in parallel lanes
# share the host's CPUs and memory bandwidth: rerun a benchmark alone before quoting it as final.
# SHARE_GPUS=1 gives every lane all GPUs instead (the functional tests' jobs are small and spend
# most of their time starting up, so several fit on the same 2 GPUs; peaks are measured per
# process by the allocator, so they are not disturbed). `gpu_lanes.sh suite` runs every GPU test
# that way, in the lanes listed below (`suite --list` prints them).
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS_DIR="$(mkdir -p "${RESULTS_DIR:-$REPO_ROOT/results}" && cd "${RESULTS_DIR:-$REPO_ROOT/results}" && pwd)"
GPUS_PER_LANE="${GPUS_PER_LANE:-2}"
[ "$#" -ge 1 ] || { echo "usage: $0 'TEST_PATHS|BENCHMARKS' ... | suite [--list]" >&2; exit 2; }

if [ "$1" = "suite" ]; then
    # Every GPU test in eight lanes on the same GPUs, about 10 minutes on 2 H200s (about 40 in
    # series); tests/harness/test_gpu_lanes.py checks that the lanes cover every GPU test.
    list_only=$([ "${2:-}" = "--list" ] && echo 1 || echo 0)
    M=tests/functional/test_memory_budget.py
    E="$M::test_estimates_bound_measured_peaks"
    set -- "tests/unit tests/functional/test_context_parallel_training.py|" \
        "tests/functional/test_pretrain_small_moe.py tests/functional/test_fault_tolerance.py|" \
        "tests/functional/test_offload_stream_training.py tests/functional/test_fast_path_training.py|" \
        "$E[baseline] $E[full_recompute] $E[sco] $E[ring_dtp]|" \
        "$E[capacity_factor] $E[pipelined_llep] $E[offload_stream_optimizer] $M::test_error_mode_refuses_before_the_model_is_built $M::test_auto_bounds_makes_a_plan_fit_and_trains|" \
        "tests/functional/test_ring_dtp_training.py tests/functional/test_upstream_scripts_training.py|" \
        "tests/functional/test_sco_training.py tests/functional/test_own_data_training.py tests/functional/test_backend_switch_resume.py|" \
        "tests/functional/test_paged_stash_training.py tests/functional/test_memory_budget_long_context.py tests/functional/test_chunked_recompute_memory.py|"
    [ "$list_only" = 1 ] && { printf '%s\n' "$@"; exit 0; }
    SHARE_GPUS=1
fi

pids=()
for lane in $(seq 0 $(($# - 1))); do
    spec="${*:$((lane + 1)):1}"
    tests="${spec%%|*}"
    benchmarks="${spec#*|}"
    [ "$spec" = "$tests" ] && benchmarks=""
    first_gpu=$((lane * GPUS_PER_LANE))
    devices="$(seq -s, "$first_gpu" $((first_gpu + GPUS_PER_LANE - 1)))"
    [ "${SHARE_GPUS:-0}" = "1" ] && devices="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_LANE - 1)))}"
    (
        export CUDA_VISIBLE_DEVICES="$devices" PORT_OFFSET=$((lane * 100))
        # each lane's gpu_functional.sh installs the wheels into a private mktemp directory
        export RESULTS_DIR="$RESULTS_DIR/lane$lane"
        unset SCRATCH_SITE
        export TEST_PATHS="$tests" RUN_TESTS=$([ -n "$tests" ] && echo 1 || echo 0)
        export BENCHMARKS="$benchmarks" RUN_BENCHMARKS=$([ -n "$benchmarks" ] && echo 1 || echo 0)
        unset ARCHIVE
        echo "lane $lane: GPUs $devices | tests: ${tests:-none} | benchmarks: ${benchmarks:-none}"
        bash "$REPO_ROOT/scripts/gpu_functional.sh"
    ) > "$RESULTS_DIR/lane$lane.log" 2>&1 &
    pids+=("$!")
done

status=0
for lane in "${!pids[@]}"; do
    wait "${pids[$lane]}"; code=$?
    [ "$code" -eq 0 ] || status=1
    echo "== lane $lane (exit $code) =="
    head -n 1 "$RESULTS_DIR/lane$lane.log"
    grep -E "^(FAILED|ERROR)|benchmark .* FAILED| (passed|failed)" "$RESULTS_DIR/lane$lane.log" | tail -n 20
done
if [ -n "${ARCHIVE:-}" ]; then
    tar czf "$ARCHIVE" -C "$RESULTS_DIR" . && echo "results packed into $ARCHIVE"
fi
exit $status
