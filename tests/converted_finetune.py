"""Models of released shapes made with transformers' own classes, and the command line that
fine-tunes their imported checkpoint (``tools/convert_hf.py import``) with every long-context
operator: read by the GPU test tests/functional/test_convert_hf_finetune.py and by the CPU test
tests/unit/convert/test_converted_finetune_flags.py, which checks that pretrain_gpt.py accepts it.

The shapes are the released models' per layer (gpt-oss-20b; Qwen3-30B-A3B) with two layers and a
vocabulary of 32,000 instead of 201,088 / 151,936: the real vocabularies' embedding and output
layers would be 1.2e9 / 0.6e9 parameters, more than the two layers' experts of Qwen3 and most of
the optimizer's host traffic and the output layer's time.
"""

from __future__ import annotations

from pathlib import Path

NUM_LAYERS = 2
VOCAB = 32_000  # NullTokenizer --vocab-size: end of document 31,999
TOKENS = 131_072  # one packed sequence per iteration
DOCUMENT = 4_096
DOCUMENT_IDS = 1_024  # the documents' ids come from the first 1,024: a distribution to learn
TRAIN_ITERS = 50

# family -> (transformers config class, the released model's dimensions and options)
MODELS = {
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=32, intermediate_size=2880, num_experts_per_tok=4, swiglu_limit=7.0,
        max_position_embeddings=131_072, rope_parameters=dict(
            rope_type="yarn", rope_theta=150_000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=4096))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, moe_intermediate_size=768, intermediate_size=6144,
        num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=40_960,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0))),
}
# The same models at toy widths (the CPU test imports these; every option stays on).
TOY_WIDTHS = {
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, intermediate_size=32, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                      num_experts_per_tok=2),
}

# Fine-tuning one 131,072-token sequence per iteration on one GPU. The learning rate is a
# pretraining one: 50 iterations must move random weights visibly.
TRAINING_FLAGS = [
    "--finetune", "--ckpt-format", "torch_dist",
    # the export needs the weights only: no optimizer state (1e9 parameters x 12 B) to write
    "--no-save-optim", "--no-save-rng", "--save-interval", str(TRAIN_ITERS),
    "--seq-length", str(TOKENS), "--max-position-embeddings", str(TOKENS),
    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(TRAIN_ITERS),
    "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
    "--bf16", "--use-distributed-optimizer", "--seed", "1234",
    "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
    "--eval-interval", str(TRAIN_ITERS),
    "--split", "100,0,0",  # no validation documents: a 1% split holds no whole sequence
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--reset-attention-mask", "--eod-mask-loss",
]
# The long-context operators and full recompute (examples/common/family_moe.sh's).
OPERATOR_FLAGS = [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1",
    "--offload-stream-optimizer", "--sco-host-budget-gb", "4",  # the layer inputs: 1.5 GB
    "--ring-dtp", "--ring-dtp-chunk-tokens", "8192",
]
# What needs this project's grouped experts (PipelinedLLEP is built on them; the recompute in
# chunks needs their router, which splits the load-balancing loss over chunks): not with
# gpt-oss's experts, which have biases (its import selects --bounded-moe-backend upstream).
GROUPED_EXPERTS_OPERATOR_FLAGS = [
    "--pipelined-llep", "--pipelined-llep-token-budget", str(TOKENS // 10 + 1),
    "--pipelined-llep-max-chunks", "10",
    "--chunked-recompute-tokens", "16384", "--chunked-recompute-attention",
]
UPSTREAM_EXPERTS = ("--bounded-moe-backend", "upstream")


def hf_config(family: str, **changes):
    """transformers' config of ``family``'s model (``changes``: other widths)."""
    import transformers

    config_class, fields = MODELS[family]
    return getattr(transformers, config_class)(
        **{**fields, "num_hidden_layers": NUM_LAYERS, "vocab_size": VOCAB, **changes})


def save_model(family: str, directory: Path, **changes) -> Path:
    """``family``'s model with transformers' random initialization, saved in bf16."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **changes),
                                                          dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def uses_upstream_experts(flags: list) -> bool:
    return any(flags[i:i + 2] == list(UPSTREAM_EXPERTS) for i in range(len(flags) - 1))


def finetune_flags(architecture: list, checkpoint: str, data_prefix: str, save: str) -> list:
    """pretrain_gpt.py's flags: the ``architecture`` (the import's pretrain_args.txt) fine-tuned
    from ``checkpoint`` on the indexed dataset ``data_prefix``, saved to ``save``."""
    operators = OPERATOR_FLAGS + ([] if uses_upstream_experts(architecture)
                                  else GROUPED_EXPERTS_OPERATOR_FLAGS)
    return [*architecture, "--load", checkpoint, "--save", save, "--data-path", data_prefix,
            *TRAINING_FLAGS, *operators]


def write_stand_in_import(directory: Path, architecture: list) -> Path:
    """A directory laid out as ``tools/convert_hf.py import`` writes it for ``architecture`` (the
    tracker, a ``release`` torch_dist checkpoint with the importer's common state, and
    pretrain_args.txt) that holds one small tensor instead of the model's: what pretrain_gpt.py's
    start-up checks of --load read, for shapes too large to import on a CPU."""
    import torch

    from megatron.bounded.convert import pipeline, torch_dist

    checkpoint = Path(directory) / torch_dist.RELEASE
    checkpoint.mkdir(parents=True)
    num_layers = int(architecture[architecture.index("--num-layers") + 1])
    torch_dist.write(str(checkpoint), {"stand_in": torch.empty(4, device="meta")},
                     lambda key: torch.zeros(4), {}, torch_dist.common_state(num_layers))
    (Path(directory) / torch_dist.TRACKER_FILE).write_text(torch_dist.RELEASE)
    (Path(directory) / pipeline.ARGS_FILE).write_text(" ".join(architecture) + "\n")
    return Path(directory)
