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
# that way, in the lanes listed below (`suite --list` prints them; `suite --part K/N` runs the
# K-th of N parts).
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS_DIR="$(mkdir -p "${RESULTS_DIR:-$REPO_ROOT/results}" && cd "${RESULTS_DIR:-$REPO_ROOT/results}" && pwd)"
GPUS_PER_LANE="${GPUS_PER_LANE:-2}"
[ "$#" -ge 1 ] || { echo "usage: $0 'TEST_PATHS|BENCHMARKS' ... | suite [--list] [--part K/N]" >&2; exit 2; }

if [ "$1" = "suite" ]; then
    # Every GPU test in eleven lanes on the same GPUs: about 10 minutes on 2 H200s (about 40 in
    # series). On one GPU the tests that need two skip and the rest take longer: run the suite in
    # two calls with `suite --part 1/2` and `suite --part 2/2` (lanes split in order).
    # tests/harness/test_gpu_lanes.py checks that the lanes cover every GPU test once.
    shift
    list_only=0 part=1/1
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --list) list_only=1 ;;
            --part) part="$2"; shift ;;
            *) echo "suite: unknown option $1 (--list, --part K/N)" >&2; exit 2 ;;
        esac
        shift
    done
    F=tests/functional
    M=$F/test_memory_budget.py
    E="$M::test_estimates_bound_measured_peaks"
    FT=$F/test_fault_tolerance.py
    set -- "tests/unit $F/test_context_parallel_training.py|" \
        "$F/test_pretrain_small_moe.py $FT::test_sigkill_of_a_rank_then_restart_resumes_bitwise|" \
        "$FT::test_sigterm_with_exit_signal_handler_saves_and_resumes_bitwise $FT::test_whole_iteration_graph_job_exits_promptly_at_exit_interval|" \
        "$F/test_offload_stream_training.py $F/test_families.py $F/test_recipes.py|" \
        "$F/test_fast_path_training.py $F/test_family_examples.py|" \
        "$E[baseline] $E[full_recompute] $E[sco] $E[ring_dtp]|" \
        "$E[capacity_factor] $E[pipelined_llep] $E[offload_stream_optimizer] $M::test_error_mode_refuses_before_the_model_is_built $M::test_the_planner_makes_a_plan_fit_and_trains|" \
        "$F/test_ring_dtp_training.py $F/test_upstream_scripts_training.py $F/test_own_data_training.py|" \
        "$F/test_sco_training.py $F/test_backend_switch_resume.py $F/test_convert_hf_finetune.py|" \
        "$F/test_paged_stash_training.py $F/test_memory_budget_long_context.py $F/test_chunked_recompute_memory.py|" \
        "$F/test_packed_documents.py|"
    case "$part" in
        *[!0-9/]*|*/*/*) echo "suite: --part takes K/N, e.g. 1/2 (got $part)" >&2; exit 2 ;;
        [0-9]*/[0-9]*) ;;
        *) echo "suite: --part takes K/N, e.g. 1/2 (got $part)" >&2; exit 2 ;;
    esac
    k="${part%/*}" n="${part#*/}"
    if [ "$n" -lt 1 ] || [ "$k" -lt 1 ] || [ "$k" -gt "$n" ]; then
        echo "suite: --part K/N needs 1 <= K <= N (got $part)" >&2; exit 2
    fi
    lanes=("$@")
    first=$(( (k - 1) * ${#lanes[@]} / n )) last=$(( k * ${#lanes[@]} / n ))
    set -- "${lanes[@]:$first:$((last - first))}"
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
