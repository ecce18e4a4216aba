#!/usr/bin/env bash
# GPU functional tests and benchmarks, for GPU machines without a package index.
#   RESULTS_DIR=results bash scripts/gpu_functional.sh [pytest args, e.g. -k resume]
# Installs every wheel in .whl/ (e.g. megatron-core 0.19.2, see README) into a scratch target,
# puts it and the repository on PYTHONPATH, runs `pytest -m gpu $TEST_PATHS` (default:
# tests/functional tests/unit; RUN_TESTS=0 skips them), then the benchmarks named in BENCHMARKS
# (see tools/benchmarks/run_gpu_benchmarks.sh; RUN_BENCHMARKS=0 skips them). PORT_OFFSET shifts
# every rendezvous port (scripts/gpu_lanes.sh runs several of these at once on one host).
# Logs, metrics and JSON go to RESULTS_DIR; a summary table is printed last. With ARCHIVE=PATH
# the whole RESULTS_DIR is also packed into one .tar.gz there.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS_DIR="$(mkdir -p "${RESULTS_DIR:-$REPO_ROOT/results}" && cd "${RESULTS_DIR:-$REPO_ROOT/results}" && pwd)"
export RESULTS_DIR
PYTHON="${PYTHON:-python3}"
# The wheels go to a fresh private directory (removed on exit) unless SCRATCH_SITE names one:
# a fixed shared path could be another user's, or another run's on the same host.
if [ -n "${SCRATCH_SITE:-}" ]; then
    mkdir -p "$SCRATCH_SITE" || exit 1
else
    SCRATCH_SITE="$(mktemp -d "${TMPDIR:-/tmp}/megatron-bounded-site.XXXXXX")" || exit 1
    trap 'rm -rf "$SCRATCH_SITE"' EXIT
fi
RUN_TESTS="${RUN_TESTS:-1}"
RUN_BENCHMARKS="${RUN_BENCHMARKS:-1}"
TEST_PATHS="${TEST_PATHS:-tests/functional tests/unit}"

# NVLink multicast must stay off on shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G "$REPO_ROOT/.whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SCRATCH_SITE" "$REPO_ROOT"/.whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
    export PYTHONPATH="$SCRATCH_SITE:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c 'import importlib.metadata as m, torch; print("torch", torch.__version__, "| GPUs", torch.cuda.device_count(), "| megatron-core", m.version("megatron-core"))' || exit 1

cd "$REPO_ROOT"
status=0
if [ "$RUN_TESTS" = "1" ]; then
    # shellcheck disable=SC2086  # TEST_PATHS is a list of paths
    "$PYTHON" -m pytest -m gpu $TEST_PATHS -v -p no:cacheprovider --durations=0 \
        --junitxml="$RESULTS_DIR/gpu_tests.xml" "$@" 2>&1 | tee "$RESULTS_DIR/gpu_tests.log"
    status=${PIPESTATUS[0]}
fi

if [ "$RUN_BENCHMARKS" = "1" ] && [ -f tools/benchmarks/run_gpu_benchmarks.sh ]; then
    bash tools/benchmarks/run_gpu_benchmarks.sh "$RESULTS_DIR" 2>&1 | tee "$RESULTS_DIR/benchmarks.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo
echo "== summary ($(date -u +%Y-%m-%dT%H:%MZ), $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null) x $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')) =="
[ "$RUN_TESTS" = "1" ] && grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|(passed|failed|error)" "$RESULTS_DIR/gpu_tests.log" | tail -n 1
if compgen -G "$RESULTS_DIR/*.metrics.jsonl" >/dev/null; then
    "$PYTHON" tools/summarize_metrics.py "$RESULTS_DIR"/*.metrics.jsonl --json "$RESULTS_DIR/training_summary.json"
fi
if [ -n "${ARCHIVE:-}" ]; then
    tar czf "$ARCHIVE" -C "$RESULTS_DIR" . && echo "results packed into $ARCHIVE"
fi
exit $status
