"""Command lines of Megatron-LM's own example scripts, scaled down, to show that existing scripts
run unchanged on this project's ``pretrain_gpt.py`` (CPU: tests/unit/launch/test_upstream_scripts.py;
GPU: tests/functional/test_upstream_scripts_training.py).

``mixtral_8x7b_flags`` holds the flag set of Megatron-LM's
``examples/mixtral/train_mixtral_8x7b_distributed.sh`` (model, MoE, training, parallel and
logging arrays, in that order) with only these changes: a few small layers instead of 32 of
4096 (so sequence, batch and schedule lengths shrink with them), one GPU (EP = PP = 1 instead of
8 and 4), and mock data with ``--tokenizer-type NullTokenizer --vocab-size 32000`` instead of
``--tokenizer-type Llama2Tokenizer --tokenizer-model ... --data-path ...``. Everything else,
``--moe-grouped-gemm``, ``--moe-token-dispatcher-type alltoall``, ``--sequence-parallel``,
``--use-mcore-models``, ``--no-position-embedding`` and ``--eval-interval 1000`` included, is
passed as that script passes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import List


def mixtral_8x7b_flags(checkpoint_dir: Path, train_iters: int = 100, warmup_iters: int = 5) -> List[str]:
    model = [
        "--use-mcore-models",
        "--disable-bias-linear",
        "--seq-length", "512",
        "--max-position-embeddings", "32768",
        "--num-layers", "2",
        "--hidden-size", "256",
        "--ffn-hidden-size", "896",
        "--num-attention-heads", "8",
        "--init-method-std", "0.01",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--normalization", "RMSNorm",
        "--position-embedding-type", "rope",
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups", "8",
        "--no-masked-softmax-fusion",
        "--no-position-embedding",
        "--rotary-base", "1000000",
    ]
    moe = [
        "--num-experts", "8",
        "--moe-router-topk", "2",
        "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
    ]
    data = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
        "--split", "99990,8,2",
    ]
    training = [
        "--micro-batch-size", "1",
        "--global-batch-size", "8",
        "--lr", "1e-4",
        "--train-iters", str(train_iters),
        "--lr-decay-iters", str(train_iters),
        "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5",
        "--weight-decay", "0.1",
        "--lr-warmup-iters", str(warmup_iters),
        "--clip-grad", "1.0",
        "--bf16",
    ]
    parallel = [
        "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "1",
        "--use-distributed-optimizer",
        "--sequence-parallel",
    ]
    logging = [
        "--log-interval", "1",
        "--save-interval", "10000",
        "--eval-interval", "1000",
        "--eval-iters", "10",
        "--save", str(checkpoint_dir),
        "--load", str(checkpoint_dir),
        "--tensorboard-dir", str(Path(checkpoint_dir) / "tensorboard"),
        "--no-load-optim",
        "--no-load-rng",
    ]
    return model + moe + data + training + parallel + logging


def without(flags: List[str], flag: str, takes_value: bool = True) -> List[str]:
    """``flags`` without ``flag`` (and its value)."""
    index = flags.index(flag)
    return flags[:index] + flags[index + (2 if takes_value else 1):]
