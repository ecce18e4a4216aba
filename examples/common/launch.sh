#!/usr/bin/env bash
# Shared by the example scripts (source it after setting the model's arrays): the environment
# every example reads, the data and checkpoint flags, and `launch`, which runs pretrain_gpt.py
# under torchrun — or, with DRY_RUN=1, prints the per-GPU memory budget instead (CPU only).
#
# Read from the environment (defaults here; a script may set its own before sourcing):
#   DATA_PATH        empty: mock data; else a Megatron indexed-dataset prefix
#   TOKENIZER_MODEL  with DATA_PATH: a HuggingFace tokenizer name or path
#   CHECKPOINT_DIR   empty: no checkpoints; else saved there every SAVE_INTERVAL and resumed from
#   PYTHON, MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, DRY_RUN
# The caller provides MOCK_VOCAB_SIZE (vocabulary of the mock data) and SAVE_INTERVAL.

DATA_PATH="${DATA_PATH:-}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-}"
PYTHON="${PYTHON:-python3}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-0}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# NVLink multicast stays off (some hosts' GPUs are shared and multicast can wedge them).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

if [ -z "$DATA_PATH" ]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$MOCK_VOCAB_SIZE")
else
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0
               --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
CHECKPOINT_ARGS=()
if [ -n "$CHECKPOINT_DIR" ]; then
    CHECKPOINT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
                     --ckpt-format torch_dist)
fi

# launch GPUS_PER_NODE NNODES FLAG... : torchrun pretrain_gpt.py FLAG... (or the budget table)
launch() {
    local gpus_per_node="$1" nnodes="$2"
    shift 2
    cd "$REPO_ROOT"
    if [ "${DRY_RUN:-0}" = "1" ]; then
        exec "$PYTHON" tools/memory_budget.py --world-size "$(( gpus_per_node * nnodes ))" "$@"
    fi
    exec "$PYTHON" -m torch.distributed.run \
        --nproc_per_node "$gpus_per_node" --nnodes "$nnodes" --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        pretrain_gpt.py "$@"
}
