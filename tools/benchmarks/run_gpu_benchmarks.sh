#!/usr/bin/env bash
# Run the GPU benchmarks into RESULTS_DIR; BENCHMARKS selects them (space-separated names).
#   BENCHMARKS="small_moe" bash tools/benchmarks/run_gpu_benchmarks.sh RESULTS_DIR
set -uo pipefail
RESULTS_DIR="$1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCHMARKS="${BENCHMARKS:-small_moe}"
status=0
for name in $BENCHMARKS; do
    echo "== benchmark: $name =="
    case "$name" in
        small_moe) bash "$HERE/bench_small_moe.sh" "$RESULTS_DIR" || status=1 ;;
        *) echo "unknown benchmark '$name'" >&2; status=1 ;;
    esac
done
exit $status
