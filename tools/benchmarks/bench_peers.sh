#!/usr/bin/env bash
# This project's training path beside transformers (plain PyTorch loop, short- and long-context
# settings) and torchtitan, on the same model, weights, tokens, optimizer and precision, on this
# machine's first GPU: tools/benchmarks/bench_peers.py grid, then its report (docs/peers.md).
#
#   RESULTS_DIR=results/peers bash tools/benchmarks/bench_peers.sh
#
# Environment (defaults in brackets):
#   RESULTS_DIR     records, logs, summary.md, summary.json and peers.svg [results/peers]
#   WORK_DIR        the model, its import and the token stream, made here first (2-4 GB for
#                   the small preset, 12-18 GB for the other) [results/peers_work]
#                   (paths relative to the repository: the records name them as given)
#   PRESET          small (the small example's dimensions) or qwen3_30b_a3b_4l [small]
#   SYSTEMS         hf hf_long hf_offload torchtitan ours [hf hf_long torchtitan ours]
#   RUNS            sequence lengths, and "longest" for each system's longest to within 5%
#                   [4096 32768 131072 longest]
#   STEPS           optimizer steps per run (the first WARMUP left out of tokens/s) [6, 2]
#   RUN_TIMEOUT_S   one run's limit: longer counts as not trained [420]
#   TIME_BUDGET_S   no run starts that the rest of this cannot hold [540]; a run is kept in
#                   RESULTS_DIR/records once finished, so calling again (with RESULTS_DIR kept)
#                   goes on where the last call stopped, until it prints "grid complete"
#   ARCHIVE         also pack RESULTS_DIR into this .tar.gz
#   BENCH_COMMIT    the commit to record where the tree has no git directory
#
# Wheels: every .whl in .whl/ is installed into a private scratch directory first (as
# scripts/gpu_functional.sh does): megatron-core, and for the peers Liger-Kernel and torchtitan
# 0.2.2 (the release that runs on torch 2.11; 0.3.0 needs a newer torch) with the packages they
# import that a CUDA image may lack, fetched where pip reaches an index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform any -d .whl \
#       liger-kernel==0.8.5 torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.16 \
#       docstring-parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
# (2.5 MB together). DeepSpeed is not among them: PyPI has it as source only (0.19.8: no wheel),
# so it would be built on the GPU machine, and its CPU Adam compiles C++ at first use; the peers
# keep torch's fused AdamW on the GPU, as the long-context recipes they follow do.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT" || exit 1
RESULTS_DIR="${RESULTS_DIR:-results/peers}"
WORK_DIR="${WORK_DIR:-results/peers_work}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$RESULTS_DIR" "$WORK_DIR" || exit 1

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G "$REPO_ROOT/.whl/*.whl" >/dev/null; then
    SCRATCH_SITE="$(mktemp -d "${TMPDIR:-/tmp}/megatron-bounded-site.XXXXXX")" || exit 1
    trap 'rm -rf "$SCRATCH_SITE"' EXIT
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SCRATCH_SITE" "$REPO_ROOT"/.whl/*.whl || { echo "wheel install failed" >&2; exit 1; }
    export PYTHONPATH="$SCRATCH_SITE:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
# the example scripts run pretrain_gpt.py with this interpreter
export PYTHON
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)' \
    || { echo "bench_peers.sh needs a CUDA GPU (bench_peers.py run --device cpu runs one system here)" >&2; exit 2; }
# what each system needs, said once here: a run of a system whose package does not import ends
# as an error record
"$PYTHON" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "|", torch.cuda.get_device_name(0))
for name in ("megatron.core", "transformers", "liger_kernel.transformers",
             "torchtitan.models.qwen3", "matplotlib"):
    try:
        importlib.import_module(name)
        print(f"  {name}: imports")
    except Exception as error:  # any failure to import is worth one line here
        print(f"  {name}: does NOT import ({type(error).__name__}: {error})")
EOF

read -r -a systems <<< "${SYSTEMS:-hf hf_long torchtitan ours}"
read -r -a runs <<< "${RUNS:-4096 32768 131072 longest}"
"$PYTHON" tools/benchmarks/bench_peers.py grid --preset "${PRESET:-small}" --work-dir "$WORK_DIR" \
    --results-dir "$RESULTS_DIR" --systems "${systems[@]}" --lengths "${runs[@]}" \
    --steps "${STEPS:-6}" --warmup "${WARMUP:-2}" --run-timeout-s "${RUN_TIMEOUT_S:-420}" \
    --time-budget-s "${TIME_BUDGET_S:-540}"
status=$?
"$PYTHON" tools/benchmarks/bench_peers.py report --results-dir "$RESULTS_DIR" \
    --markdown "$RESULTS_DIR/summary.md" --plot "$RESULTS_DIR/peers.svg" \
    --out "$RESULTS_DIR/summary.json" || status=1
if [ -n "${ARCHIVE:-}" ]; then
    tar czf "$ARCHIVE" -C "$RESULTS_DIR" . && echo "results packed into $ARCHIVE"
fi
exit $status
