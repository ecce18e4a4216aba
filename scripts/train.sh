#!/usr/bin/env bash
# The train command: run the small MoE example on the GPUs of this machine.
#   bash scripts/train.sh [extra pretrain_gpt.py flags]
# Uses PYTHON, else the project's .venv when it exists, else python3 when it already has torch and
# megatron-core 0.19.2 (e.g. an offline GPU machine); otherwise it creates .venv. Settings come from examples/moe_small/train.sh (environment
# variables: SEQ_LENGTH, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE, TRAIN_ITERS, CHECKPOINT_DIR, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

if [ -z "${PYTHON:-}" ] && [ -x "$VENV_DIR/bin/python" ]; then
    PYTHON="$VENV_DIR/bin/python"  # the project's environment when it exists
fi
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import importlib.metadata as m, torch, megatron.core; assert m.version("megatron-core") == "0.19.2"' >/dev/null 2>&1; then
    ensure_venv
    PYTHON="$VENV_DIR/bin/python"
fi

NUM_GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$NUM_GPUS" -eq 0 ]; then
    echo "scripts/train.sh: no CUDA GPU found on this machine. Training needs at least one NVIDIA" \
         "GPU; run the CPU test suite with 'bash scripts/test.sh' instead." >&2
    exit 2
fi

export PYTHON NUM_GPUS
exec bash "$REPO_ROOT/examples/moe_small/train.sh" "$@"
