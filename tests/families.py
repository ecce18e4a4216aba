"""Published launch flags of today's MoE model families, scaled to one GPU (the CPU test
tests/unit/model/test_families.py and the GPU test tests/functional/test_families.py read this table).

Each family's ``flags`` are its source's flags (grouped as the source groups them; blocks that
several sources share are written once), with only these changes, each written down in ``scaled``:

* paths removed: data, tokenizer model, checkpoint, TensorBoard/W&B, data cache; the tokenizer
  becomes ``--tokenizer-type NullTokenizer`` with ``--mock-data`` (``MOCK_DATA``);
* parallel sizes set to one rank: TP = PP = EP = CP = 1, virtual pipeline stages removed
  (they need PP > 1);
* sizes scaled down: layers (with ``--moe-layer-freq``'s pattern of the same form), widths,
  experts and top-k, heads and groups, MLA ranks and head widths (proportions kept), vocabulary,
  sequence length and the sample counts of the schedule;
* a small batch (``--micro-batch-size 1 --global-batch-size 1``); sources without a training
  schedule get ``TRAINING`` (learning rate and iterations).

Every other flag is passed as published. The sequence length is ``{seq}`` in the flags
(:meth:`Family.command_line` fills it in): the CPU test runs short sequences, the GPU test 4096.

"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Family:
    """One family: its source and its flags (``{seq}``: the sequence length)."""

    name: str
    repository: str
    path: str
    commit: str
    flags: Tuple[str, ...]
    scaled: Dict[str, str]  # what was scaled or added: flag -> "published -> here"
    removed: Tuple[str, ...] = field(default=())  # published flags left out (paths, VP)
    # the published sizes, flag -> value(s), for planning the recipe at them (see with_values)
    published_dims: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return f"{self.repository} {self.path} @ {self.commit}"

    def command_line(self, seq_length: int) -> List[str]:
        """The flags with ``seq_length`` tokens per sequence."""
        return [flag.replace("{seq}", str(seq_length)) for flag in self.flags]

    def published_command_line(self, parallel: Dict[str, Tuple[str, ...]]) -> List[str]:
        """The flags with the published sizes (``published_dims``: widths, heads, MLA ranks,
        experts, vocabulary, sequence, batch), the layers kept as scaled, and ``parallel`` (the
        parallel sizes to plan for) over both."""
        seq = self.published_dims.get("--seq-length", ("4096",))[0]
        return with_values(self.command_line(int(seq)), {**self.published_dims, **parallel})


def flag_values(flags, flag: str) -> Tuple[str, ...]:
    """The values that follow ``flag`` in ``flags`` (up to the next flag); () if absent."""
    flags = list(flags)
    if flag not in flags:
        return ()
    start = flags.index(flag) + 1
    end = start
    while end < len(flags) and not flags[end].startswith("--"):
        end += 1
    return tuple(flags[start:end])


def with_values(flags, values: Dict[str, Tuple[str, ...]]) -> List[str]:
    """``flags`` with each flag of ``values`` given those values: in place where the flag is
    there, appended where not."""
    result = list(flags)
    for flag, given in values.items():
        if flag in result:
            start = result.index(flag) + 1
            result[start:start + len(flag_values(result, flag))] = list(given)
        else:
            result += [flag, *given]
    return result


MOCK_DATA = ("--mock-data", "--tokenizer-type", "NullTokenizer")
VOCAB = ("--vocab-size", "1024")
SMALL_BATCH = ("--micro-batch-size", "1", "--global-batch-size", "1")
# what sources that publish an architecture only (no schedule, no precision) get
TRAINING = ("--lr", "1e-4", "--train-iters", "20", "--eval-iters", "0", "--bf16")
# the sample counts of sample-based schedules: 20 iterations of one sample
TRAIN_SAMPLES = ("--train-samples", "20")
LR_SAMPLES = ("--lr-decay-samples", "20", "--lr-warmup-samples", "2")
SCHEDULE_SCALED = "--train-samples, --lr-decay-samples, --lr-warmup-samples -> 20, 20, 2"
ZOO, MEGATRON, SLIME = "yanring/Megatron-MoE-ModelZoo", "NVIDIA/Megatron-LM", "THUDM/slime"

# Model-zoo yaml files (MODEL_ARGS): ${TP} & co. at one rank; ${MOE_TOKEN_DISPATCHER} and
# ${MOE_GROUPED_GEMM} as runtime_configs/benchmarking/runtime.conf sets them for the model.
ZOO_PARALLEL = ("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                "--expert-model-parallel-size", "1", "--context-parallel-size", "1",
                "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer")
ZOO_DATA = (*MOCK_DATA, *VOCAB, "--split", "99,1,0", "--no-mmap-bin-files", "--num-workers", "6")
ZOO_LOGGING = ("--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
               "--log-validation-ppl-to-tensorboard", "--log-throughput", "--log-interval", "1")
ZOO_REGULARIZATION = ("--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0",
                      "--weight-decay", "0.1")
ZOO_ADAM = ("--lr-decay-style", "cosine", "--adam-beta1", "0.9", "--adam-beta2", "0.95")
ZOO_REMOVED = ("--data-cache-path", "--tokenizer-model", "--data-path", "--load", "--save",
               "--tensorboard-dir", "--wandb-project", "--wandb-exp-name")
ZOO_SCALED = {
    "parallel": "--tensor/pipeline/expert-model-parallel-size, --context-parallel-size ${..} -> 1",
    "--tokenizer-type": "HuggingFaceTokenizer -> NullTokenizer with --mock-data --vocab-size 1024",
    "schedule": SCHEDULE_SCALED, "batch": "--micro-batch-size, --global-batch-size ${MBS}, ${GBS} -> 1, 1",
    "--seq-length": "${SEQ_LEN} (4096 in runtime.conf) -> {seq}",
}

MIXTRAL_8X7B = Family(
    "mixtral-8x7b", ZOO, "model_configs/benchmarking/Mixtral-8x7B.yaml",
    "78fd4d6de6f1fc8d8e0854232b3cc4c0676c4cfd",
    ("--distributed-timeout-minutes", "60", *ZOO_PARALLEL,
     "--overlap-grad-reduce", "--overlap-param-gather",
     "--use-mcore-models", "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear",
     *SMALL_BATCH, *TRAIN_SAMPLES, "--exit-duration-in-mins", "230",
     "--transformer-impl", "transformer_engine", *ZOO_DATA,
     "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
     "--rotary-percent", "1.0", "--normalization", "RMSNorm", "--swiglu",
     "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "896",
     "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
     "--seq-length", "{seq}", "--max-position-embeddings", "4096",
     "--make-vocab-size-divisible-by", "128", *ZOO_REGULARIZATION,
     *LR_SAMPLES, "--lr", "1.2e-5", "--min-lr", "1.2e-6", *ZOO_ADAM,
     "--num-experts", "8", "--moe-router-load-balancing-type", "aux_loss",
     "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2",
     "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion",
     "--eval-iters", "32", "--eval-interval", "200",
     "--finetune", "--auto-detect-ckpt-format", "--no-ckpt-fully-parallel-save",
     "--save-interval", "500", "--dist-ckpt-strictness", "log_all", "--init-method-std", "0.008",
     *ZOO_LOGGING, "--log-num-zeros-in-grad", "--log-params-norm", "--bf16"),
    {**ZOO_SCALED, "--num-layers": "32 -> 4", "--hidden-size": "4096 -> 256",
     "--ffn-hidden-size": "14336 -> 896", "--num-attention-heads": "32 -> 8",
     "--num-query-groups": "8 -> 2"},
    removed=ZOO_REMOVED + ("--num-layers-per-virtual-pipeline-stage",),
)

# Qwen3-30B-A3B and Qwen3-235B-A22B: the same flags but for these
QWEN3_COMMON = (
    *ZOO_PARALLEL, "--overlap-grad-reduce", "--overlap-param-gather",
    "--no-create-attention-mask-in-dataloader",
    "--use-mcore-models", "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear",
    *SMALL_BATCH, *TRAIN_SAMPLES, "--exit-duration-in-mins", "230", "--manual-gc",
    "--manual-gc-interval", "5", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te",
    "--enable-experimental", "--transformer-impl", "transformer_engine", *ZOO_DATA,
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    "--rotary-percent", "1.0", "--rotary-base", "1000000",
    "--rotary-seq-len-interpolation-factor", "1", "--normalization", "RMSNorm", "--swiglu",
    "--norm-epsilon", "1e-06", "--num-layers", "4", "--hidden-size", "256",
    "--ffn-hidden-size", "768", "--num-attention-heads", "8", "--group-query-attention",
    "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm", "--seq-length", "{seq}",
    "--make-vocab-size-divisible-by", "1187", *ZOO_REGULARIZATION, *LR_SAMPLES, *ZOO_ADAM,
    "--num-experts", "16", "--moe-ffn-hidden-size", "96",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "8",
    "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3",
    "--moe-permute-fusion", "--moe-router-dtype", "fp32", "--moe-router-fusion",
    "--eval-iters", "32", "--eval-interval", "500", "--finetune", "--auto-detect-ckpt-format",
    "--dist-ckpt-strictness", "log_all", "--init-method-std", "0.02", *ZOO_LOGGING, "--bf16",
)
QWEN3_SCALED = {
    **ZOO_SCALED, "--num-layers": "48 (235B: 94) -> 4", "--hidden-size": "2048 (235B: 4096) -> 256",
    "--ffn-hidden-size": "6144 (235B: 12288) -> 768",
    "--moe-ffn-hidden-size": "768 (235B: 1536) -> 96",
    "--num-attention-heads": "32 (235B: 64) -> 8", "--num-query-groups": "4 -> 2",
    "--kv-channels": "128 -> 32", "--num-experts": "128 -> 16",
    "--moe-router-pre-softmax": "false in the yaml: not passed",
}

QWEN3_30B_A3B = Family(
    "qwen3-30b-a3b", ZOO, "model_configs/benchmarking/Qwen3-30B-A3B.yaml",
    "274316a7c1fa2f348863845596f192d842d32d7f",
    ("--distributed-timeout-minutes", "60", *QWEN3_COMMON, "--max-position-embeddings", "40960",
     "--lr", "1.2e-4", "--min-lr", "1.2e-5", "--moe-token-dispatcher-type", "alltoall",
     "--save-interval", "500", "--log-num-zeros-in-grad", "--log-params-norm"),
    QWEN3_SCALED, removed=ZOO_REMOVED + ("--num-layers-per-virtual-pipeline-stage",),
)

QWEN3_235B_A22B = Family(
    "qwen3-235b-a22b", ZOO, "model_configs/benchmarking/Qwen3-235B-A22B.yaml",
    "798dfb503c6884a130fca8638e13da3bd0dd7ce0",
    ("--distributed-timeout-minutes", "220", *QWEN3_COMMON,
     "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
     "--max-position-embeddings", "{seq}", "--lr-warmup-init", "3.9e-7", "--lr", "3.9e-6",
     "--min-lr", "3.9e-7", "--no-load-rng", "--no-load-optim", "--save-interval", "100",
     "--logging-level", "40"),
    {**QWEN3_SCALED, "--max-position-embeddings": "${SEQ_LEN} -> {seq}"},
    removed=ZOO_REMOVED + ("--num-layers-per-virtual-pipeline-stage",),
)

# the MLA ranks and head widths, scaled (DeepSeek-V3's proportions)
MLA_RANKS = ("--q-lora-rank", "96", "--kv-lora-rank", "32", "--qk-head-dim", "32",
             "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32")
MLA_SCALED = ("--q-lora-rank 1536 -> 96, --kv-lora-rank 512 -> 32, --qk-head-dim 128 -> 32, "
              "--qk-pos-emb-head-dim 64 -> 16, --v-head-dim 128 -> 32 (proportions kept)")

# DeepSeek-V3, its proxy and Kimi-K2: the same flags but for these
DEEPSEEK_COMMON = (
    "--distributed-timeout-minutes", "60", *ZOO_PARALLEL,
    "--use-mcore-models", "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear",
    *SMALL_BATCH, *TRAIN_SAMPLES, "--exit-duration-in-mins", "220",
    "--no-check-for-nan-in-loss-and-grad", "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl", "native", "--manual-gc", "--manual-gc-interval", "10",
    "--transformer-impl", "transformer_engine", "--seq-length", "{seq}", *ZOO_DATA,
    "--no-create-attention-mask-in-dataloader",
    "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "768",
    "--num-attention-heads", "8", "--max-position-embeddings", "4096",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--swiglu", "--untie-embeddings-and-output-weights", "--multi-latent-attention",
    *ZOO_REGULARIZATION, "--qk-layernorm", *LR_SAMPLES, "--lr-warmup-init", "3.9e-7",
    "--lr", "3.9e-6", "--min-lr", "3.9e-7", *ZOO_ADAM,
    "--num-experts", "16", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-ffn-hidden-size", "96",
    "--moe-shared-expert-intermediate-size", "96", "--moe-router-load-balancing-type",
    "seq_aux_loss", "--moe-router-topk", "8", "--moe-grouped-gemm",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    *MLA_RANKS, "--mscale", "1.0",
    "--mscale-all-dim", "1.0", "--eval-iters", "32", "--eval-interval", "200",
    "--no-load-optim", "--no-load-rng", "--auto-detect-ckpt-format", "--save-interval", "500",
    "--dist-ckpt-strictness", "log_all", "--init-method-std", "0.02", *ZOO_LOGGING,
    "--logging-level", "40", "--bf16", "--enable-experimental",
)
DEEPSEEK_SCALED = {
    **ZOO_SCALED, "--hidden-size": "7168 -> 256", "--ffn-hidden-size": "18432 -> 768",
    "--moe-ffn-hidden-size": "2048 -> 96", "--moe-shared-expert-intermediate-size": "2048 -> 96",
    "MLA": MLA_SCALED,
    "--num-experts": "256 (proxy 64, Kimi-K2 384) -> 16",
}

# DeepSeek-V3 and Kimi-K2 (not the proxy)
DEEPSEEK_FULL = ("--overlap-grad-reduce", "--overlap-param-gather", "--no-save-optim",
                 "--moe-router-fusion")

DEEPSEEK_V3 = Family(
    "deepseek-v3", ZOO, "model_configs/benchmarking/DeepSeek-V3.yaml",
    "1b93710746711003f029cbaa3608cae7637ec554",
    (*DEEPSEEK_COMMON, *DEEPSEEK_FULL, "--kv-channels", "32", "--rotary-base", "10000",
     "--make-vocab-size-divisible-by", "3232", "--moe-aux-loss-coeff", "1e-4",
     "--moe-router-group-topk", "4", "--moe-router-num-groups", "8",
     "--moe-router-topk-scaling-factor", "2.5", "--rotary-scaling-factor", "40"),
    {**DEEPSEEK_SCALED, "--num-layers": "61 -> 4", "--moe-layer-freq": "([0]*3+[1]*58) -> ([0]*1+[1]*3)",
     "--num-attention-heads": "128 -> 8", "--kv-channels": "128 -> 32"},
    removed=ZOO_REMOVED,
)

DEEPSEEK_V3_PROXY_MTP = Family(
    "deepseek-v3-proxy-mtp", ZOO, "model_configs/benchmarking/DeepSeek-V3-Proxy.yaml",
    "70c5e351f4b288218572c257921565ec5de8469e",
    (*DEEPSEEK_COMMON, "--kv-channels", "32", "--rotary-base", "10000",
     "--make-vocab-size-divisible-by", "3232", "--moe-token-dispatcher-type", "flex",
     "--moe-enable-deepep", "--moe-router-pre-softmax", "--moe-aux-loss-coeff", "1e-4",
     "--moe-router-group-topk", "4", "--moe-router-num-groups", "8",
     "--moe-router-topk-scaling-factor", "2.5", "--rotary-scaling-factor", "40",
     "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"),
    {**DEEPSEEK_SCALED, "--num-layers": "14 -> 4", "--moe-layer-freq": "([0]*3+[1]*11) -> ([0]*1+[1]*3)",
     "--num-attention-heads": "128 -> 8", "--kv-channels": "128 -> 32",
     "--no-save-optim": "false in the yaml: not passed"},
    removed=ZOO_REMOVED,
)

KIMI_K2 = Family(
    "kimi-k2", ZOO, "model_configs/benchmarking/Kimi-K2.yaml",
    "8e0e9094db280e16209ca95b1b8c4bfb37e2a220",
    (*DEEPSEEK_COMMON, *DEEPSEEK_FULL, "--kv-channels", "16", "--rotary-base", "50000",
     "--make-vocab-size-divisible-by", "1280", "--moe-aux-loss-coeff", "0",
     "--moe-router-group-topk", "1", "--moe-router-num-groups", "1",
     "--moe-router-topk-scaling-factor", "2.827", "--rotary-scaling-factor", "32"),
    {**DEEPSEEK_SCALED, "--num-layers": "61 -> 4",
     "--moe-layer-freq": "'([0]*1+[1]*60)' (the quotes are the shell's) -> ([0]*1+[1]*3)",
     "--num-attention-heads": "64 -> 8", "--kv-channels": "64 -> 16"},
    removed=ZOO_REMOVED,
)

SLIME_SCALED = {
    "added": "mock data, the small batch and " + " ".join(TRAINING) + " (the file is the "
             "architecture only)", "--vocab-size": "-> 1024 (NullTokenizer with --mock-data)",
    "--num-layers": "-> 4, the first dense (--moe-layer-freq of the same form)",
    "--num-experts": "-> 16", "--hidden-size": "-> 256", "--ffn-hidden-size": "-> 768",
}

MOONLIGHT_16B_A3B = Family(
    "moonlight-16b-a3b", SLIME, "scripts/models/moonlight.sh",
    "10f21d86514bcd26ca813590a7d22072325d36df",
    ("--disable-bias-linear", "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size",
     "768", "--num-attention-heads", "8", "--kv-channels", "32", "--normalization", "RMSNorm",
     "--position-embedding-type", "rope", "--norm-epsilon", "1e-5", "--rotary-percent", "1.0",
     "--swiglu", "--untie-embeddings-and-output-weights", "--no-masked-softmax-fusion",
     *VOCAB, "--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "32",
     "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32", "--qk-layernorm",
     "--rotary-scaling-factor", "1", "--rotary-base", "50000", "--mscale", "1.0",
     "--mscale-all-dim", "1.0", "--attention-softmax-in-fp32", "--no-rope-fusion",
     "--num-experts", "16", "--moe-layer-freq", "[0,1,1,1]", "--moe-ffn-hidden-size", "96",
     "--moe-router-topk", "6", "--moe-shared-expert-intermediate-size", "192",
     "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid",
     "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss",
     "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0",
     "--moe-router-bias-update-rate", "0", "--moe-router-group-topk", "1",
     "--moe-router-num-groups", "1", "--moe-grouped-gemm", "--moe-router-topk-scaling-factor",
     "2.446", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32",
     "--moe-permute-fusion",
     *MOCK_DATA, *SMALL_BATCH, *TRAINING, "--seq-length", "{seq}",
     "--max-position-embeddings", "{seq}"),
    {**SLIME_SCALED, "--num-layers": "27 -> 4", "--moe-layer-freq": "[0,1,...,1] (27 entries, the script joins them with commas) -> [0,1,1,1]",
     "--hidden-size": "2048 -> 256", "--ffn-hidden-size": "11264 -> 768",
     "--num-attention-heads": "16 -> 8", "--kv-channels": "128 -> 32",
     "MLA": "--kv-lora-rank 512 -> 32, --qk-head-dim 128 -> 32, --qk-pos-emb-head-dim 64 -> 16, "
            "--v-head-dim 128 -> 32", "--num-experts": "64 -> 16",
     "--moe-ffn-hidden-size": "1408 -> 96", "--moe-shared-expert-intermediate-size": "2816 -> 192",
     "--vocab-size": "163840 -> 1024", "--seq-length": "added: {seq}"},
)

GLM_45_AIR = Family(
    "glm-4.5-air", SLIME, "scripts/models/glm4.5-106B-A12B.sh",
    "59036aa0bb2e713377021c744972aea82f7931c7",
    ("--disable-bias-linear", "--group-query-attention", "--num-attention-heads", "8",
     "--num-query-groups", "2", "--kv-channels", "32", "--num-layers", "4", "--hidden-size",
     "256", "--ffn-hidden-size", "768", "--add-qkv-bias", "--normalization", "RMSNorm",
     "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--swiglu",
     "--untie-embeddings-and-output-weights", *VOCAB, "--rotary-base", "1000000",
     "--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size", "96",
     "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid",
     "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
     "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type",
     "alltoall", "--moe-router-topk", "8", "--moe-layer-freq", "[0]*1+[1]*3",
     "--num-experts", "16", "--moe-grouped-gemm", "--moe-router-dtype", "fp32",
     "--moe-permute-fusion", "--moe-aux-loss-coeff", "0",
     *MOCK_DATA, *SMALL_BATCH, *TRAINING, "--seq-length", "{seq}",
     "--max-position-embeddings", "{seq}"),
    {**SLIME_SCALED, "--num-layers": "46 -> 4", "--moe-layer-freq": "[0]*1+[1]*45 -> [0]*1+[1]*3",
     "--hidden-size": "4096 -> 256", "--ffn-hidden-size": "10944 -> 768",
     "--num-attention-heads": "96 -> 8", "--num-query-groups": "8 -> 2",
     "--kv-channels": "128 -> 32", "--num-experts": "128 -> 16",
     "--moe-ffn-hidden-size": "1408 -> 96", "--moe-shared-expert-intermediate-size": "1408 -> 96",
     "--vocab-size": "151552 -> 1024", "--seq-length": "added: {seq}"},
)

# gpt-oss: attention alternating sliding-window (127 tokens back) and full, learnable softmax
# sinks, quick-GeGLU experts with a clamp; --enable-gpt-oss and --export-force-local-attention
# are flags of Megatron-LM's ModelOpt integration.
GPT_OSS_ATTENTION = (
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-bias-gelu-fusion",
    "--export-force-local-attention", "--no-bias-dropout-fusion", "--quick-geglu",
    "--glu-linear-offset", "1.0", "--softmax-type", "learnable", "--window-attn-skip-freq", "2",
    "--activation-func-clamp-value", "7.0", "--window-size", "127,0", "--enable-gpt-oss",
)

GPT_OSS_20B_TRAIN = Family(
    "gpt-oss-20b-train", MEGATRON, "examples/gptoss/02_train.sh",
    "779c5b748dbcf00ad9e36d539c576b404ab4abe9",
    ("--transformer-impl", "transformer_engine", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
     "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "512",
     "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
     "--seq-length", "{seq}", "--max-position-embeddings", "{seq}", "--use-mcore-models",
     "--rotary-percent", "1.0", "--rope-type", "rope", "--position-embedding-type", "rope",
     "--rotary-base", "10000", *GPT_OSS_ATTENTION,
     "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
     "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm",
     "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
     "--moe-ffn-hidden-size", "512", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3",
     "--moe-permute-fusion",
     *MOCK_DATA, *VOCAB, "--tiktoken-pattern", "v2", "--split", "99,1,0",
     "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
     *SMALL_BATCH, "--lr", "1.0e-5", *TRAIN_SAMPLES, "--lr-decay-samples", "20",
     "--lr-decay-style", "cosine", "--min-lr", "1.0e-6", "--weight-decay", "0.1",
     "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16", "--use-flash-attn",
     "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
     "--disable-bf16-reduced-precision-matmul", "--recompute-activations",
     "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
     "--expert-model-parallel-size", "1", "--sequence-parallel", "--context-parallel-size", "1",
     "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-param-gather",
     "--fp8-amax-compute-algo", "max", "--fp8-amax-history-len", "1024",
     "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000",
     "--eval-iters", "0", "--moe-per-layer-logging", "--no-load-optim", "--no-load-rng",
     "--log-throughput"),
    {"parallel": "--pipeline-model-parallel-size ${WORLD_SIZE} -> 1",
     "--num-layers": "12 -> 4", "--hidden-size": "512 -> 256", "--ffn-hidden-size": "2048 -> 512",
     "--moe-ffn-hidden-size": "2048 -> 512", "--num-attention-heads": "64 -> 8",
     "--num-query-groups": "8 -> 2", "--seq-length": "8192 -> {seq}",
     "--max-position-embeddings": "8192 -> {seq}", "--vocab-size": "128256 -> 1024",
     "--num-workers": "1 (the script's mock-data branch)", "batch": "--global-batch-size 128 -> 1",
     "schedule": "--train-samples, --lr-decay-samples 1953125000, 1949218748 -> 20, 20"},
    removed=("--data-cache-path", "--save", "--tensorboard-dir"),
)

GPT_OSS_20B_MODELOPT = Family(
    "gpt-oss-20b-modelopt", MEGATRON, "examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh",
    "6ec369d4a13da71d38a6fc95ecc2017b873f711c",
    ("--save-interval", "100000", "--micro-batch-size", "1", "--bf16",
     "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
     "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "256",
     "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
     "--kv-channels", "32", "--num-experts", "8", "--moe-ffn-hidden-size", "256",
     "--moe-router-dtype", "fp32", "--moe-router-topk", "4", "--moe-aux-loss-coeff", "0.0",
     "--moe-token-dispatcher-type", "alltoall", "--moe-router-score-function", "softmax",
     "--moe-router-load-balancing-type", "aux_loss", "--seq-length", "{seq}",
     "--max-position-embeddings", "40960", *MOCK_DATA, *VOCAB,
     "--make-vocab-size-divisible-by", "128", "--use-mcore-models", "--rotary-percent", "1.0",
     "--rotary-base", "150000", "--sequence-parallel", "--padded-vocab-size", "1024",
     *GPT_OSS_ATTENTION, "--global-batch-size", "1", *TRAINING),
    {"--num-layers": "24 -> 4", "--hidden-size": "2880 -> 256", "--ffn-hidden-size": "2880 -> 256",
     "--moe-ffn-hidden-size": "2880 -> 256", "--num-attention-heads": "64 -> 8",
     "--num-query-groups": "8 -> 2", "--kv-channels": "64 -> 32", "--num-experts": "32 -> 8",
     "--seq-length": "4096 -> {seq}", "--padded-vocab-size": "201088 -> 1024",
     "--tokenizer-type": "HuggingFaceTokenizer -> NullTokenizer with --mock-data --vocab-size 1024",
     "added": "--global-batch-size 1 and " + " ".join(TRAINING[:-1]) + " (the file has the "
              "architecture and --micro-batch-size 1 only)"},
)

# Recipes: launch lines that add flags to a model file (the model zoo's best-practice scripts
# through its sbatch_benchmarking.sh), Megatron-LM's functional test cases and README examples.
# ``published_dims`` holds each one's sizes as published, for tools/memory_budget.py.


def dims(**sizes) -> Dict[str, Tuple[str, ...]]:
    """``published_dims`` from keyword sizes: ``hidden_size=7168`` -> ``--hidden-size 7168``."""
    return {"--" + name.replace("_", "-"): tuple(str(value).split())
            for name, value in sizes.items()}


def parallel(tp, pp, ep, etp=1, cp=1) -> Dict[str, Tuple[str, ...]]:
    return dims(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                context_parallel_size=cp)


DEEPSEEK_V3_DIMS = dims(
    hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, kv_channels=128,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, num_experts=256,
    q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
    vocab_size=129280, seq_length=4096, micro_batch_size=1)

# best_practice/deepseek-v3/run_deepseek_v3_h100.sh: each line runs sbatch_benchmarking.sh on
# DeepSeek-V3.yaml with environment variables that add flags (PR=fp8, A2A_OVERLAP,
# OPTIMIZER_OFFLOAD and DISPATCHER, default deepep) and the line's own flags after the yaml's.
ZOO_DEEPEP = ("--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep")
ZOO_FP8 = ("--fp8-recipe", "blockwise", "--fp8-format", "e4m3")
ZOO_FP8_OPTIMIZER = ("--use-precision-aware-optimizer", "--main-grads-dtype", "fp32",
                     "--main-params-dtype", "fp32", "--exp-avg-dtype", "bf16",
                     "--exp-avg-sq-dtype", "bf16", "--moe-router-padding-for-fp8")
MTP_ONE = ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1")
DEEPSEEK_LINE_SCALED = {
    **DEEPSEEK_V3.scaled,
    "parallel": "the line's TP, PP, VPP, EP (and runtime.conf's CP) -> 1",
    "batch": "GBS=8192 -> --global-batch-size 1 (MBS=1)",
    "--pipeline-model-parallel-layout": "removed: it places the layers over PP = 8 stages "
                                        "(and 4 virtual ones); one rank has one stage",
}


def deepseek_v3_line(name: str, added: Tuple[str, ...], source: str, tp: int, ep: int) -> Family:
    """A line of run_deepseek_v3_h100.sh: DeepSeek-V3.yaml's flags (as the deepseek-v3 family)
    followed by ``added`` (the line's, then sbatch_benchmarking.sh's), at PP=8 and GBS=8192."""
    return Family(
        name, ZOO, "best_practice/deepseek-v3/run_deepseek_v3_h100.sh",
        "38ce2ed2e1c8cd410c24a21cd051a8cd350c95bd", (*DEEPSEEK_V3.flags, *added),
        {**DEEPSEEK_LINE_SCALED, "source": source},
        removed=ZOO_REMOVED + ("--pipeline-model-parallel-layout",),
        published_dims={**DEEPSEEK_V3_DIMS, **parallel(tp, 8, ep), **dims(global_batch_size=8192)},
    )


DEEPSEEK_V3_BEST_PRACTICE_H100 = deepseek_v3_line(
    "deepseek-v3-best-practice-h100",
    ("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "mlp",
     *MTP_ONE, *ZOO_DEEPEP, *ZOO_FP8, "--fp8-param-gather", *ZOO_FP8_OPTIMIZER,
     "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm"),
    "the H100 line (A2A_OVERLAP=1 PP=8 VPP=4 TP=2 EP=64 NNODES=128 GBS=8192 PR=fp8): "
    "DeepSeek-V3.yaml's flags, the line's, then sbatch_benchmarking.sh's for DISPATCHER=deepep, "
    "PR=fp8 with OPTIMIZER_OFFLOAD=0 (--fp8-param-gather) and A2A_OVERLAP=1, in that order",
    tp=2, ep=64)

DEEPSEEK_V3_LONG_CONTEXT = deepseek_v3_line(
    "deepseek-v3-long-context",
    ("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "moe", "mlp",
     "layernorm", *MTP_ONE, "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
     *ZOO_DEEPEP, *ZOO_FP8, *ZOO_FP8_OPTIMIZER),
    "the Long Context 4k line (OPTIMIZER_OFFLOAD=1 A2A_OVERLAP=0 PP=8 VPP=4 TP=1 EP=32 CP=1 "
    "NNODES=32 GBS=8192 PR=fp8): DeepSeek-V3.yaml's flags, the line's, then "
    "sbatch_benchmarking.sh's for OPTIMIZER_OFFLOAD=1, DISPATCHER=deepep and PR=fp8 (no "
    "--fp8-param-gather with the offloaded optimizer)",
    tp=1, ep=32)

# Megatron-LM's functional test cases (tests/functional_tests/test_cases/moe/<case>/model_config.yaml,
# MODEL_ARGS; a quoted "[a b]" list is passed as its items, as the test launcher does)
MEGATRON_CASES = "tests/functional_tests/test_cases/moe/"
CASE_SCALED = {
    "--tokenizer-type": "--vocab-file/--merge-file (GPT-2 BPE) -> NullTokenizer with --mock-data "
                        "--vocab-size 1024",
    "batch": "--micro-batch-size, --global-batch-size -> 1, 1",
    "--recompute-modules": "the yaml's quoted list \"[...]\" -> its items",
}
CASE_REMOVED = ("--data-path", "--data-cache-path", "--vocab-file", "--merge-file", "--save",
                "--load", "--tensorboard-dir", "--pipeline-model-parallel-layout")

MLA_MOE_SELECTIVE_RECOMPUTE = Family(
    "mla-moe-mtp-selective-recompute", MEGATRON,
    MEGATRON_CASES + "gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental/model_config.yaml",
    "ab16414a20a539d9530d8f0986d35423ccb95025",
    ("--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1",
     "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "1",
     "--context-parallel-size", "1", "--expert-tensor-parallel-size", "1",
     "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
     "--attention-backend", "unfused", "--use-mcore-models", "--sequence-parallel",
     "--disable-bias-linear", *SMALL_BATCH, "--train-iters", "20", "--exit-duration-in-mins",
     "230", "--no-check-for-nan-in-loss-and-grad", "--no-rope-fusion",
     "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native", "--manual-gc",
     "--manual-gc-interval", "100", "--recompute-granularity", "selective",
     "--recompute-modules", "layernorm", "mla_up_proj", "mlp", "moe_act",
     "--transformer-impl", "transformer_engine", "--seq-length", "{seq}", *MOCK_DATA, *VOCAB,
     "--split", "949,50,1", "--num-layers", "4", "--moe-layer-freq", "([0]*1+[1]*3)",
     "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "8",
     "--kv-channels", "32", "--max-position-embeddings", "4096", "--position-embedding-type",
     "rope", "--rotary-base", "10000", "--make-vocab-size-divisible-by", "3232",
     "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
     "--untie-embeddings-and-output-weights", "--multi-latent-attention", *MTP_ONE,
     *ZOO_REGULARIZATION, "--qk-layernorm", "--lr-warmup-fraction", ".01", "--lr", "0.00015",
     "--min-lr", "1.0e-5", *ZOO_ADAM, "--num-experts", "16", "--moe-ffn-hidden-size", "256",
     "--moe-shared-expert-intermediate-size", "256", "--moe-router-load-balancing-type",
     "seq_aux_loss", "--moe-router-topk", "4", "--moe-token-dispatcher-type", "alltoall",
     "--moe-router-pre-softmax", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4",
     "--moe-router-group-topk", "2", "--moe-router-num-groups", "4",
     "--moe-router-topk-scaling-factor", "2.0", "--moe-router-score-function", "sigmoid",
     "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
     "--moe-router-dtype", "fp32", "--moe-permute-fusion", *MLA_RANKS,
     "--rotary-scaling-factor", "40", "--mscale", "1.0",
     "--mscale-all-dim", "1.0", "--eval-iters", "32", "--eval-interval", "200",
     "--save-interval", "25", "--init-method-std", "0.02", "--log-timers-to-tensorboard",
     "--log-memory-to-tensorboard", "--log-num-zeros-in-grad", "--log-params-norm",
     "--log-validation-ppl-to-tensorboard", "--log-throughput", "--log-interval", "1",
     "--logging-level", "40", "--bf16", "--exit-interval", "20",
     "--overlap-moe-expert-parallel-comm", "--async-save", "--use-persistent-ckpt-worker"),
    {**CASE_SCALED, "parallel": "--tensor/pipeline/expert-model-parallel-size 2, 2, 4 -> 1",
     "--num-layers": "16 -> 4", "--moe-layer-freq": "([0]*3+[1]*13) -> ([0]*1+[1]*3)",
     "--hidden-size": "1024 -> 256", "--ffn-hidden-size": "4096 -> 1024",
     "--num-attention-heads": "32 -> 8", "--kv-channels": "128 -> 32",
     "--num-experts": "32 -> 16 (4 groups of 4)",
     "--moe-ffn-hidden-size": "1024 -> 256 (the hidden size, as published)",
     "--moe-shared-expert-intermediate-size": "1024 -> 256",
     "MLA": MLA_SCALED, "--seq-length": "4096 -> {seq}", "batch": "--micro-batch-size, --global-batch-size 4, 32 -> 1, 1",
     "schedule": "--train-iters 50, --exit-interval 50 -> 20, 20"},
    removed=CASE_REMOVED,
    published_dims={**parallel(2, 2, 4), **dims(
        hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=32, kv_channels=128,
        num_experts=32, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=1024,
        q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, vocab_size=50257, seq_length=4096, micro_batch_size=4,
        global_batch_size=32)},
)

MOE_SCOPED_CUDA_GRAPH = Family(
    "moe-scoped-cudagraph", MEGATRON,
    MEGATRON_CASES + "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph/model_config.yaml",
    "ab16414a20a539d9530d8f0986d35423ccb95025",
    ("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", *MTP_ONE[:2],
     *SMALL_BATCH, "--seq-length", "{seq}", "--max-position-embeddings", "{seq}",
     "--position-embedding-type", "rope", "--rotary-base", "10000",
     "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout",
     "0.0", "--hidden-dropout", "0.0", "--train-iters", "20", "--lr-decay-iters", "20",
     "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "0.00015",
     "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "1e-2",
     "--clip-grad", "1.0", "--lr-warmup-fraction", ".01", "--transformer-impl",
     "transformer_engine", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
     "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
     "--sequence-parallel", "--num-experts", "8", "--use-distributed-optimizer",
     "--overlap-grad-reduce", "--overlap-param-gather", "--moe-token-dispatcher-type",
     "alltoall", "--moe-router-load-balancing-type", "global_aux_loss", "--moe-router-topk",
     "2", "--moe-router-dtype", "fp32", "--moe-router-fusion", "--moe-router-enable-expert-bias",
     "--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
     "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "256",
     "--moe-grouped-gemm", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-permute-fusion",
     "--deterministic-mode", "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32",
     "--use-checkpoint-opt_param-scheduler", "--use-mcore-models", "--bf16", "--fp8-format",
     "hybrid", "--fp8-recipe", "blockwise", "--first-last-layers-bf16", "--no-bias-gelu-fusion",
     "--recompute-granularity", "selective", "--recompute-modules", "moe_act",
     "--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "mlp",
     "moe_router", "moe_preprocess", "--log-memory-to-tensorboard", "--log-params-norm",
     "--log-num-zeros-in-grad", "--log-validation-ppl-to-tensorboard",
     "--log-timers-to-tensorboard", "--log-interval", "1", "--timing-log-level", "0",
     "--save-interval", "50", "--eval-interval", "1000", "--eval-iters", "10", *MOCK_DATA, *VOCAB,
     "--ckpt-fully-parallel-load", "--ckpt-format", "torch_dist",
     "--ckpt-assume-constant-structure", "--async-save", "--use-persistent-ckpt-worker"),
    {**CASE_SCALED, "parallel": "--tensor/pipeline/expert-model-parallel-size, "
                                "--expert-tensor-parallel-size 4, 2, 2, 2 -> 1",
     "--num-layers": "13 -> 4", "--moe-layer-freq": "([0]*4+[1]*9) -> ([0]*1+[1]*3)",
     "--hidden-size": "512 -> 256", "--moe-ffn-hidden-size": "1024 -> 512",
     "--moe-shared-expert-intermediate-size": "512 -> 256",
     "--seq-length": "1024 -> {seq}", "--max-position-embeddings": "1024 -> {seq}",
     "batch": "--micro-batch-size, --global-batch-size 2, 32 -> 1, 1",
     "schedule": "--train-iters, --lr-decay-iters 100, 320000 -> 20, 20",
     "--recompute-modules": "\"[moe_act]\" -> moe_act",
     "--cuda-graph-modules": "\"[attn mlp moe_router moe_preprocess]\" -> its items"},
    removed=CASE_REMOVED,
    published_dims={**parallel(4, 2, 2, etp=2), **dims(
        hidden_size=512, moe_ffn_hidden_size=1024, moe_shared_expert_intermediate_size=512,
        num_experts=8, vocab_size=50257, seq_length=1024, max_position_embeddings=1024,
        micro_batch_size=2, global_batch_size=32)},
)

QWEN2_57B_A14B = Family(
    "qwen2-57b-a14b", ZOO, "model_configs/benchmarking/Qwen2-57B-A14B.yaml",
    "78fd4d6de6f1fc8d8e0854232b3cc4c0676c4cfd",
    ("--distributed-timeout-minutes", "60", *ZOO_PARALLEL, "--overlap-grad-reduce",
     "--overlap-param-gather", "--no-create-attention-mask-in-dataloader", "--use-mcore-models",
     "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear", "--add-qkv-bias",
     *SMALL_BATCH, *TRAIN_SAMPLES, "--exit-duration-in-mins", "230",
     "--transformer-impl", "transformer_engine", *ZOO_DATA,
     "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
     "--rotary-percent", "1.0", "--rotary-base", "1000000",
     "--rotary-seq-len-interpolation-factor", "1", "--normalization", "RMSNorm", "--swiglu",
     "--norm-epsilon", "1e-06", "--num-layers", "4", "--hidden-size", "256",
     "--ffn-hidden-size", "192", "--num-attention-heads", "8", "--group-query-attention",
     "--num-query-groups", "2", "--seq-length", "{seq}", "--max-position-embeddings", "131072",
     "--make-vocab-size-divisible-by", "1187", *ZOO_REGULARIZATION, *LR_SAMPLES,
     "--lr", "1.2e-4", "--min-lr", "1.2e-5", *ZOO_ADAM,
     "--num-experts", "16", "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk",
     "8", "--moe-router-pre-softmax", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2",
     "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size", "1536",
     "--moe-shared-expert-overlap", "--moe-permute-fusion", "--eval-iters", "32",
     "--eval-interval", "500", "--finetune", "--auto-detect-ckpt-format",
     "--no-ckpt-fully-parallel-save", "--save-interval", "500", "--dist-ckpt-strictness",
     "log_all", "--init-method-std", "0.008", *ZOO_LOGGING, "--log-num-zeros-in-grad",
     "--log-params-norm", "--bf16"),
    {**ZOO_SCALED, "runtime.conf": "its Qwen2-57B-A14B row at this commit: TP 2, PP 4, EP 4, "
     "VPP 7, dispatcher alltoall, grouped GEMM true", "--num-layers": "28 -> 4",
     "--hidden-size": "3584 -> 256", "--ffn-hidden-size": "2560 -> 192 (the experts' width: no "
     "--moe-ffn-hidden-size)", "--moe-shared-expert-intermediate-size": "20480 -> 1536 (8 "
     "experts' width, as published)", "--num-attention-heads": "28 -> 8",
     "--num-query-groups": "4 -> 2", "--num-experts": "64 -> 16"},
    removed=ZOO_REMOVED + ("--num-layers-per-virtual-pipeline-stage",),
    published_dims={**parallel(2, 4, 4), **dims(
        hidden_size=3584, ffn_hidden_size=2560, num_attention_heads=28, num_query_groups=4,
        num_experts=64, moe_shared_expert_intermediate_size=20480, vocab_size=151936,
        seq_length=4096, micro_batch_size=1, global_batch_size=256)},
)

# The drop-and-pad quick start of megatron-core's MoE README (the last version with it) added to
# the README's own MoE training example (Mixtral 8x7B), which has no dispatcher flag (allgather).
MOE_README = "megatron/core/transformer/moe/README.md"
MOE_TOKEN_DROP = Family(
    "moe-token-drop-and-pad", MEGATRON, MOE_README, "b97184db566352ed2095d389bf09ff76649cc231",
    ("--disable-bias-linear", "--seq-length", "{seq}", "--max-position-embeddings", "32768",
     "--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "896",
     "--num-attention-heads", "8", "--init-method-std", "0.01", "--attention-dropout", "0.0",
     "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--position-embedding-type",
     "rope", "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
     "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
     "--num-experts", "8", "--expert-model-parallel-size", "1",
     "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "2",
     "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-permute-fusion",
     "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
     *MOCK_DATA, *VOCAB, "--split", "99990,8,2", *SMALL_BATCH, "--lr", "1e-4",
     "--train-iters", "20", "--lr-decay-iters", "20", "--lr-decay-style", "cosine",
     "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "2", "--clip-grad",
     "1.0", "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
     "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
     "--sequence-parallel", "--use-distributed-optimizer", "--log-interval", "1",
     "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
     "--no-load-optim", "--no-load-rng"),
    {"added": "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity: the "
              "README's drop-and-pad quick start, added to its MoE training example",
     "parallel": "--expert-model-parallel-size 8, --pipeline-model-parallel-size 4 -> 1",
     "--num-layers": "32 -> 4", "--hidden-size": "4096 -> 256", "--ffn-hidden-size": "14336 -> 896",
     "--num-attention-heads": "32 -> 8", "--num-query-groups": "8 -> 2",
     "--seq-length": "4096 -> {seq}", "batch": "--global-batch-size 128 -> 1",
     "--tokenizer-type": "Llama2Tokenizer -> NullTokenizer with --mock-data --vocab-size 1024",
     "schedule": "--train-iters, --lr-decay-iters, --lr-warmup-iters 500000, 320000, 500 -> 20, 20, 2"},
    removed=("--tokenizer-model", "--data-path", "--save", "--load", "--tensorboard-dir",
             "--num-layers-per-virtual-pipeline-stage", "--wandb-project", "--wandb-exp-name"),
    published_dims={**parallel(1, 4, 8), **dims(
        hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
        vocab_size=32000, seq_length=4096, micro_batch_size=1, global_batch_size=128)},
)

# Qwen3-Next-80B-A3B: best_practice/qwen3/run_next_80b.sh's H100 line (PP=4 VPP=3 TP=1 EP=32,
# PR=bf16, DISPATCHER default deepep) on model_configs/benchmarking/Qwen3-Next-80B-A3B.yaml,
# without its gated DeltaNet layers: every layer is full attention (with the output gate).
QWEN3_NEXT_GDN = ("--linear-attention-type", "--linear-attention-freq",
                  "--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-value-head-dim",
                  "--linear-num-key-heads", "--linear-num-value-heads")
QWEN3_NEXT_NORMS = Family(
    "qwen3-next-80b-a3b-full-attention", ZOO, "best_practice/qwen3/run_next_80b.sh",
    "38ce2ed2e1c8cd410c24a21cd051a8cd350c95bd",
    ("--distributed-timeout-minutes", "60", *ZOO_PARALLEL,
     "--no-create-attention-mask-in-dataloader", "--cross-entropy-loss-fusion",
     "--cross-entropy-fusion-impl", "te", "--enable-experimental", "--use-mcore-models",
     "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear", *SMALL_BATCH,
     *TRAIN_SAMPLES, "--exit-duration-in-mins", "230", "--manual-gc", "--manual-gc-interval",
     "5", "--transformer-impl", "transformer_engine", *ZOO_DATA,
     "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
     "--rotary-percent", "0.25", "--rotary-base", "10000000",
     "--rotary-seq-len-interpolation-factor", "1", "--normalization", "RMSNorm",
     "--apply-layernorm-1p", "--swiglu", "--norm-epsilon", "1e-06", "--num-layers", "4",
     "--hidden-size", "256", "--ffn-hidden-size", "640", "--num-attention-heads", "8",
     "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "64",
     "--qk-layernorm", "--attention-output-gate", "--seq-length", "{seq}",
     "--max-position-embeddings", "262144", "--make-vocab-size-divisible-by", "1187",
     *ZOO_REGULARIZATION, "--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm",
     *LR_SAMPLES, "--lr", "1.2e-4", "--min-lr", "1.2e-5", *ZOO_ADAM,
     "--num-experts", "16", "--moe-ffn-hidden-size", "64",
     "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
     "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "10",
     "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type",
     "flex", "--moe-enable-deepep", "--moe-permute-fusion", "--moe-router-dtype", "fp32",
     "--moe-router-fusion", *MTP_ONE, "--eval-iters", "32", "--eval-interval", "500",
     "--finetune", "--auto-detect-ckpt-format", "--save-interval", "50",
     "--dist-ckpt-strictness", "log_all", "--init-method-std", "0.02", *ZOO_LOGGING,
     "--log-num-zeros-in-grad", "--log-params-norm", "--bf16",
     "--recompute-granularity", "selective", "--recompute-modules", "moe_act",
     "shared_experts", "layernorm", "--moe-router-force-load-balancing", *ZOO_DEEPEP),
    {**ZOO_SCALED, "source": "the H100 line: Qwen3-Next-80B-A3B.yaml's flags (MOE_GROUPED_GEMM="
     "true), the line's, then sbatch_benchmarking.sh's for DISPATCHER=deepep",
     "parallel": "the line's TP, PP, VPP, EP (PP=4 VPP=3 TP=1 EP=32) -> 1",
     "linear attention": "left out: the yaml's gated DeltaNet layers (--linear-attention-freq 4: "
                         "three of every four layers) are not built; every layer is full "
                         "attention (--linear-attention-type is not a flag of megatron-core "
                         "0.19.2, which names it --experimental-attention-variant)",
     "--no-weight-decay-cond-type": "qwen3_next -> apply_wd_to_qk_layernorm (megatron-core "
                                    "0.19.2's name for the same choice: weight decay on the qk "
                                    "layernorms; its parser refuses qwen3_next)",
     "--tp-comm-overlap": "removed (PR=bf16 adds it): it overlaps tensor-parallel "
                          "communication, which needs TP > 1 with sequence parallelism",
     "--num-layers": "48 -> 4", "--hidden-size": "2048 -> 256", "--ffn-hidden-size": "5120 -> 640",
     "--num-attention-heads": "16 -> 8", "--kv-channels": "256 -> 64 (the query width twice "
     "the hidden size, as published)", "--num-experts": "512 -> 16",
     "--moe-ffn-hidden-size": "512 -> 64", "--moe-shared-expert-intermediate-size": "512 -> 64",
     "--moe-router-pre-softmax": "false in the yaml: not passed",
     "batch": "GBS=256 -> --global-batch-size 1 (MBS=1)"},
    removed=ZOO_REMOVED + ("--num-layers-per-virtual-pipeline-stage", "--tp-comm-overlap")
    + QWEN3_NEXT_GDN,
    published_dims={**parallel(1, 4, 32), **dims(
        hidden_size=2048, ffn_hidden_size=5120, num_attention_heads=16, num_query_groups=2,
        kv_channels=256, num_experts=512, moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512, vocab_size=151936, seq_length=4096,
        micro_batch_size=1, global_batch_size=256)},
)

RECIPES = (DEEPSEEK_V3_BEST_PRACTICE_H100, DEEPSEEK_V3_LONG_CONTEXT, MLA_MOE_SELECTIVE_RECOMPUTE,
           MOE_SCOPED_CUDA_GRAPH, QWEN2_57B_A14B, MOE_TOKEN_DROP, QWEN3_NEXT_NORMS)


FAMILIES = (MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN3_235B_A22B, DEEPSEEK_V3, DEEPSEEK_V3_PROXY_MTP,
            KIMI_K2, MOONLIGHT_16B_A3B, GLM_45_AIR, GPT_OSS_20B_TRAIN, GPT_OSS_20B_MODELOPT,
            *RECIPES)
FAMILIES_BY_NAME = {family.name: family for family in FAMILIES}
