#!/usr/bin/env bash
# Shared by the example scripts (source it after setting the model's arrays): the environment
# every example reads, the data and checkpoint flags, and `launch`, which runs pretrain_gpt.py
# under torchrun — or, with DRY_RUN=1, prints the per-GPU memory budget instead (CPU only).
#
# Read from the environment (defaults here; a script may set its own before sourcing):
#   DATA_PATH        empty: mock data; else a Megatron indexed-dataset prefix
#                    (tools/preprocess_data.py writes one: PREFIX_text_document)
#   TOKENIZER_MODEL  with DATA_PATH: the HuggingFace tokenizer name or directory the data was
#                    preprocessed with (required with the default TOKENIZER_TYPE)
#   TOKENIZER_TYPE   HuggingFaceTokenizer (default) or GPT2BPETokenizer (with VOCAB_FILE and
#                    MERGE_FILE; note: upstream's loads HuggingFace's "gpt2" by name, online),
#                    or NullTokenizer: data already in token ids below VOCAB_SIZE (default
#                    MOCK_VOCAB_SIZE), whose end-of-document id is VOCAB_SIZE - 1
#   CHECKPOINT_DIR   empty: no checkpoints; else saved there every SAVE_INTERVAL and resumed from
#   PLAN             auto (default): pretrain_gpt.py's planner chooses every knob the flags leave
#                    open, the fastest exact plan that fits (docs/planner.md; a start-up line says
#                    what it added), and refuses a length that cannot fit before anything is built;
#                    off: --bounded-plan off, the flags as given.
#   HBM_GB, HOST_GB  with DRY_RUN=1: the GPU memory and the host memory per GPU of the machine
#                    that trains, decimal GB (--hbm-gb, --budget-host-gb); each example states
#                    its own target; by default one H200 and 250 GB (a node of 2 TB and 8 GPUs)
#   TENSORBOARD_DIR  TensorBoard logs when the tensorboard package is importable (default
#                    results/tensorboard/EXAMPLE_NAME; empty: none)
#   WANDB_API_KEY    set: log to Weights & Biases (WANDB_PROJECT, WANDB_EXP_NAME, WANDB_SAVE_DIR;
#                    needs the wandb package)
#   PYTHON           default: the project's .venv/bin/python when it exists, else python3
#   PREFLIGHT        1 (default, with PLAN=auto): plan once on this machine before torchrun starts,
#                    refusing a plan that cannot fit with one message; 0: leave it to pretrain_gpt.py
#   MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, DRY_RUN
# The caller provides MOCK_VOCAB_SIZE (vocabulary of the mock data), SAVE_INTERVAL and
# EXAMPLE_NAME.

DATA_PATH="${DATA_PATH:-}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-}"
TOKENIZER_TYPE="${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-}"
PLAN="${PLAN:-auto}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-0}"

# NVLink multicast stays off (some hosts' GPUs are shared and multicast can wedge them).
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

launch_error() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

if [ -z "$DATA_PATH" ]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$MOCK_VOCAB_SIZE")
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "$MOCK_VOCAB_SIZE")
elif [ "$TOKENIZER_TYPE" = "HuggingFaceTokenizer" ]; then
    [ -n "$TOKENIZER_MODEL" ] || launch_error "DATA_PATH is set but TOKENIZER_MODEL is not." \
        "Set TOKENIZER_MODEL to the HuggingFace tokenizer (a local directory, or a hub name when" \
        "online) that tools/preprocess_data.py tokenized DATA_PATH with (its --tokenizer-model)."
    TOKENIZER_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
elif [ "$TOKENIZER_TYPE" = "GPT2BPETokenizer" ]; then
    [ -n "${VOCAB_FILE:-}" ] && [ -n "${MERGE_FILE:-}" ] || launch_error \
        "TOKENIZER_TYPE=GPT2BPETokenizer needs VOCAB_FILE (vocab.json) and MERGE_FILE (merges.txt)."
    # megatron-core 0.19.2 builds this tokenizer as HuggingFace's "gpt2" loaded by name, with the
    # files passed on top: it reaches for the network (or a HuggingFace cache holding gpt2).
    GPT2_ADVICE="make a tokenizer directory from your files and train with it: python tools/preprocess_data.py --tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --save-tokenizer DIR, then TOKENIZER_TYPE=HuggingFaceTokenizer TOKENIZER_MODEL=DIR"
    if [ "${HF_HUB_OFFLINE:-0}" = "1" ] || [ "${TRANSFORMERS_OFFLINE:-0}" = "1" ]; then
        launch_error "TOKENIZER_TYPE=GPT2BPETokenizer loads HuggingFace's 'gpt2' tokenizer from" \
            "the network even with local VOCAB_FILE/MERGE_FILE, and this machine is offline" \
            "(HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE): $GPT2_ADVICE."
    fi
    echo "note: megatron-core's GPT2BPETokenizer loads HuggingFace's 'gpt2' by name (network or" \
         "cache) even with local VOCAB_FILE/MERGE_FILE; offline, $GPT2_ADVICE." >&2
    TOKENIZER_ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
elif [ "$TOKENIZER_TYPE" = "NullTokenizer" ]; then
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-$MOCK_VOCAB_SIZE}")
else
    launch_error "TOKENIZER_TYPE must be HuggingFaceTokenizer, GPT2BPETokenizer or NullTokenizer, got '$TOKENIZER_TYPE'" \
        "(other upstream tokenizers: pass --tokenizer-type ... as extra flags)."
fi
if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 "${TOKENIZER_ARGS[@]}")
fi
case "$PLAN" in
    auto) PLAN_ARGS=() ;;
    off) PLAN_ARGS=(--bounded-plan off) ;;
    *) launch_error "PLAN must be auto or off, got '$PLAN'" ;;
esac

# The logs users already read: TensorBoard (when importable) and Weights & Biases (with a key).
LOGGING_ARGS=()
TENSORBOARD_DIR="${TENSORBOARD_DIR-$REPO_ROOT/results/tensorboard/${EXAMPLE_NAME:-example}}"
if [ -n "$TENSORBOARD_DIR" ] && [ "${DRY_RUN:-0}" != "1" ] \
        && "$PYTHON" -c 'import tensorboard' >/dev/null 2>&1; then
    LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi
if [ -n "${WANDB_API_KEY:-}" ]; then
    "$PYTHON" -c 'import wandb' >/dev/null 2>&1 || launch_error "WANDB_API_KEY is set but the" \
        "wandb package is not importable with $PYTHON: pip install wandb, or unset WANDB_API_KEY."
    # upstream writes W&B files under --save unless told otherwise (and fails without --save)
    LOGGING_ARGS+=(--wandb-project "${WANDB_PROJECT:-megatron-bounded}"
                   --wandb-exp-name "${WANDB_EXP_NAME:-${EXAMPLE_NAME:-example}}"
                   --wandb-save-dir "${WANDB_SAVE_DIR:-$REPO_ROOT/results/wandb/${EXAMPLE_NAME:-example}}")
fi
CHECKPOINT_ARGS=()
if [ -n "$CHECKPOINT_DIR" ]; then
    CHECKPOINT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
                     --ckpt-format torch_dist)
fi

# long_context_operators TOKENS_PER_RANK: OPERATOR_ARGS. OPERATORS unset (the default): none
# given, the planner chooses them; OPERATORS=all: OffloadStreamAdamW (fp32 optimizer state in
# pinned host memory), SCO (layer inputs to pinned host memory, SCO_HOST_BUDGET_GB per GPU),
# Ring-DTP (output layer in strips of RING_DTP_CHUNK_TOKENS tokens), PipelinedLLEP (dispatch in
# PIPELINED_LLEP_CHUNKS chunks: a token budget of PIPELINED_LLEP_TOKEN_BUDGET = ceil(tokens per
# rank / chunks) per source rank), given as flags (the planner then leaves them as they are).
long_context_operators() {
    local tokens_per_rank="$1"
    OPERATORS="${OPERATORS:-}"
    SCO_HOST_BUDGET_GB="${SCO_HOST_BUDGET_GB:-16}"
    RING_DTP_CHUNK_TOKENS="${RING_DTP_CHUNK_TOKENS:-8192}"
    PIPELINED_LLEP_CHUNKS="${PIPELINED_LLEP_CHUNKS:-10}"
    PIPELINED_LLEP_TOKEN_BUDGET="${PIPELINED_LLEP_TOKEN_BUDGET:-$(( (tokens_per_rank + PIPELINED_LLEP_CHUNKS - 1) / PIPELINED_LLEP_CHUNKS ))}"
    case "$OPERATORS" in
        all) OPERATOR_ARGS=(
                --offload-stream-optimizer
                --sco-host-budget-gb "$SCO_HOST_BUDGET_GB"
                --ring-dtp --ring-dtp-chunk-tokens "$RING_DTP_CHUNK_TOKENS"
                --pipelined-llep --pipelined-llep-token-budget "$PIPELINED_LLEP_TOKEN_BUDGET"
                --pipelined-llep-max-chunks "$PIPELINED_LLEP_CHUNKS"
             ) ;;
        "") OPERATOR_ARGS=() ;;
        *) launch_error "OPERATORS must be 'all' or unset (the planner chooses), got '$OPERATORS'" ;;
    esac
}

# launch GPUS_PER_NODE NNODES FLAG... : torchrun pretrain_gpt.py FLAG... (or the budget table)
launch() {
    local gpus_per_node="$1" nnodes="$2"
    shift 2
    cd "$REPO_ROOT"
    if [ "${DRY_RUN:-0}" = "1" ]; then
        local vocab=()
        if [ -n "$DATA_PATH" ] && [ "$TOKENIZER_TYPE" != "NullTokenizer" ]; then
            # the budget needs the vocabulary size, which training reads from the tokenizer
            local size
            size="$("$PYTHON" tools/preprocess_data.py "${TOKENIZER_ARGS[@]}" --print-vocab-size)" \
                || launch_error "DRY_RUN=1: could not read the vocabulary size of the tokenizer" \
                    "(${TOKENIZER_ARGS[*]})."
            vocab=(--vocab-size "$size")
        fi
        # plan for the machine that trains (the example's target), not this one
        local target=()
        [ -z "${HBM_GB:-}" ] || target+=(--hbm-gb "$HBM_GB")
        [ -z "${HOST_GB:-}" ] || target+=(--budget-host-gb "$HOST_GB")
        exec "$PYTHON" tools/memory_budget.py --world-size "$(( gpus_per_node * nnodes ))" \
            ${target[@]+"${target[@]}"} "$@" ${vocab[@]+"${vocab[@]}"}
    fi
    if [ "$PLAN" = auto ] && [ "${PREFLIGHT:-1}" = 1 ]; then
        # the plan made here first, for this machine: a length no plan fits is refused with one
        # message, before torchrun starts (and reports the exit of each process)
        LOCAL_WORLD_SIZE="$gpus_per_node" "$PYTHON" tools/memory_budget.py --this-machine \
            --world-size "$(( gpus_per_node * nnodes ))" "$@" || exit $?
    fi
    exec "$PYTHON" -m torch.distributed.run \
        --nproc_per_node "$gpus_per_node" --nnodes "$nnodes" --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        pretrain_gpt.py "$@"
}
