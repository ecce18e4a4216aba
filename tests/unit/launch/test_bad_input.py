"""Every bad command line pretrain_gpt.py refuses before building the model, in one table: the
flags, and the flag the refusal must name (with the fix). Each row is parsed by upstream's parser
with our provider and validated as pretrain_gpt.py validates; rows marked ``early`` are also
refused before upstream's validation runs (and prints its argument table), with one message on
rank 0 only; tools/memory_budget.py refuses the same flags with exit status 2 (planning for the
host every row sees: the tool plans for --budget-host-gb, never this machine's RAM).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from megatron.bounded.activations import host_memory
from megatron.bounded.launch import arguments
from megatron.bounded.training import resiliency
from megatron.bounded.launch.arguments import BoundedArgumentError, add_bounded_args, validate_bounded_args
from megatron.bounded.units import GB, GiB
from tests.conftest import MINIMAL_PRETRAIN_FLAGS, write_indexed_dataset

REPO_ROOT = Path(__file__).resolve().parents[3]

BASE = list(MINIMAL_PRETRAIN_FLAGS)
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
CF = ["--moe-expert-rank-capacity-factor"]
STASH = MOE + ["--moe-paged-stash", *CF, "1.5"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
LLEP = MOE + ["--pipelined-llep"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
OFFLOAD = ["--offload-stream-optimizer", "--use-distributed-optimizer"]
GRAPH = ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
RING = ["--ring-dtp", "--untie-embeddings-and-output-weights"]
# The host RAM every row sees (the autouse fixture): 80% of it, 51.2 GiB, may be pinned.
HOST_GIB = 64
# The same host as tools/memory_budget.py states it (decimal GB per GPU): the tool plans for
# --budget-host-gb (default 250), never for the RAM of the machine it runs on.
HOST_GB = HOST_GIB * GiB / GB
# bf16 training, 8 layers of width 8192: 6.4e9 parameters, 72 GiB of fp32 master weights and
# moments (12 B each) on one rank
STATE_72_GIB = ["--bf16", "--num-layers", "8", "--hidden-size", "8192", "--num-attention-heads",
                "64"]
# 16 layers of width 4096: 3.2e9 parameters, 36 GiB of that state
STATE_36_GIB = ["--bf16", "--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads",
                "32"]
CHUNKED_ATTENTION = FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096",
                                      "--chunked-recompute-attention", "--attention-dropout", "0"]
# with STATE_36_GIB's 16 layers of 32 heads of 128: K, V, output and log-sum-exp of 32,768
# tokens are 24,704 B per token and layer, 12.06 GiB pinned
KEEP_ON_HOST_12_GIB = ["--chunked-recompute-keep-attention", "host", "--seq-length", "32768",
                       "--max-position-embeddings", "32768"]
NOT_A_DIR = str(REPO_ROOT / "README.md")
MISSING = "/nonexistent-bounded-dir/corpus"
SAVE_DIR = "/nonexistent-bounded-dir/checkpoints"
# small multi-latent attention: q/k heads of 8 + 4 (rotary), values of 6
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim",
       "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
WINDOW = ["--window-size", "8,0"]


def row(flags, named, set_after_parse=None, early=False, upstream_first=False, id=None):
    return pytest.param(flags, named, set_after_parse or {}, early, upstream_first, id=id)


CASES = [
    # --- new: numbers that are not numbers, or not sane -------------------------------------
    row(MOE + CF + ["inf"], "--moe-expert-rank-capacity-factor", early=True, id="cf-inf"),
    row(MOE + CF + ["1e-9"], "--moe-expert-rank-capacity-factor", early=True, id="cf-1e-9"),
    row(MOE + CF + ["0.05"], "--moe-expert-rank-capacity-factor", early=True, id="cf-below-0.1"),
    row(["--budget-routing-skew", "inf"], "--budget-routing-skew", early=True, id="skew-inf"),
    row(["--budget-routing-skew", "nan"], "--budget-routing-skew", early=True, id="skew-nan"),
    row(["--budget-routing-skew", "0.5"], "--budget-routing-skew", early=True, id="skew-below-1"),
    row(["--hbm-gb", "inf"], "--hbm-gb", early=True, id="hbm-inf"),
    row(["--sco-host-budget-gb", "nan"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-nan"),
    row(["--sco-host-budget-gb", "inf"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-inf"),
    row(["--sco-host-budget-gb", "-1"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-negative"),
    row(["--sco-host-budget-gb", "1e-12"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-rounds-to-0-bytes"),
    row(["--num-layers", "0"], "--num-layers", early=True, id="num-layers-0"),
    row(STASH + ["--moe-paged-stash-buffer-size-factor-cuda", "0"],
        "--moe-paged-stash-buffer-size-factor-cuda", early=True, id="stash-cuda-factor-0"),
    row(STASH + ["--moe-paged-stash-buffer-size-factor-cuda", "nan"],
        "--moe-paged-stash-buffer-size-factor-cuda", early=True, id="stash-cuda-factor-nan"),
    row(STASH + ["--moe-paged-stash-buffer-size-factor-cpu", "nan"],
        "--moe-paged-stash-buffer-size-factor-cpu", early=True, id="stash-cpu-factor-nan"),
    # --- new: an operator's knob without the operator ----------------------------------------
    row(["--ring-dtp-mode", "weights"], "--ring-dtp-mode", early=True, id="ring-mode-alone"),
    row(["--ring-dtp-mode", "auto"], "--ring-dtp-mode", early=True, id="ring-mode-default-alone"),
    row(["--ring-dtp-chunk-tokens", "64"], "--ring-dtp-chunk-tokens", early=True,
        id="ring-chunk-alone"),
    row(["--offload-stream-slots", "2"], "--offload-stream-slots", early=True,
        id="stream-slots-alone"),
    # a knob given as 0 is given (0 == False: it passed as absent)
    row(["--offload-stream-slots", "0"], "--offload-stream-slots", early=True,
        id="stream-slots-0-alone"),
    row(["--ring-dtp-chunk-tokens", "0"], "--ring-dtp-chunk-tokens", early=True,
        id="ring-chunk-0-alone"),
    row(["--offload-stream-bucket-numel", "1000"], "--offload-stream-bucket-numel", early=True,
        id="stream-bucket-alone"),
    row(MOE + ["--llep-min-spill-tokens", "8"], "--llep-min-spill-tokens", early=True,
        id="llep-min-spill-alone"),
    row(MOE + ["--pipelined-llep-max-chunks", "4"], "--pipelined-llep-max-chunks", early=True,
        id="llep-max-chunks-alone"),
    # --- new: launch-time environment ---------------------------------------------------------
    row(["--metrics-jsonl", "/nonexistent-bounded-dir/run/metrics.jsonl"], "--metrics-jsonl",
        early=True, id="metrics-dir-missing"),
    row(["--enable-ft-package"], "--enable-ft-package", early=True, id="ft-without-package"),
    row(["--inprocess-restart"], "--inprocess-restart", early=True, id="inprocess-without-package"),
    # --- the checks of tests/unit/launch/test_arguments.py -------------------------------------------
    # (upstream turns the rope fusion off without rope)
    row(["--position-embedding-type", "rope"], "--no-rope-fusion", {"apply_rope_fusion": True},
        id="rope-fusion-without-te"),
    row([], "--no-gradient-accumulation-fusion", {"gradient_accumulation_fusion": True},
        id="grad-acc-fusion-without-te"),
    row([], "--no-masked-softmax-fusion", {"masked_softmax_fusion": True},
        id="masked-softmax-fusion-without-te"),
    row(["--window-size", "64,2"], "--window-size", id="window-size-not-causal"),
    row(["--window-size", "64,0", "--attention-dropout", "0.1"], "--attention-dropout",
        id="window-attention-dropout"),
    row(["--softmax-type", "learnable", "--attention-dropout", "0.1"], "--attention-dropout",
        id="sinks-attention-dropout"),
    row(["--context-parallel-size", "2"], "--context-parallel-size", id="cp-p2p"),
    # --- packed documents: never attention across documents ----------------------------------
    row(["--reset-attention-mask", *GRAPH], "--cuda-graph-impl",
        id="documents-whole-iteration-graph"),
    row(["--reset-attention-mask", "--cuda-graph-impl", "local"], "--cuda-graph-impl",
        id="documents-layer-graphs"),
    row(["--dataloader-inter-document-masking", *GRAPH],
        "--dataloader-inter-document-masking", id="inter-document-masking-graph"),
    row(["--reset-attention-mask", "--attention-dropout", "0.1"], "--attention-dropout",
        id="documents-attention-dropout"),
    row(["--reset-attention-mask", "--mtp-num-layers", "1", "--position-embedding-type", "rope"],
        "--mtp-num-layers",
        id="documents-mtp"),
    row(["--reset-attention-mask"], "--create-attention-mask-in-dataloader",
        {"create_attention_mask_in_dataloader": True}, id="documents-dataloader-mask"),
    row(["--reset-attention-mask", "--context-parallel-size", "2", "--cp-comm-type", "p2p",
         "--seq-length", "32"], "--cp-comm-type", id="documents-cp-p2p"),
    row(["--lr-warmup-iters", "3"], "--lr-warmup-iters", id="warmup-too-long"),
    row(["--lr-warmup-iters", "2", "--lr-decay-iters", "2"], "--lr-warmup-iters",
        id="warmup-not-shorter-than-decay"),
    row(["--metrics-jsonl", " "], "--metrics-jsonl", id="metrics-empty"),
    row(MOE + CF + ["0"], "--moe-expert-rank-capacity-factor", id="cf-0"),
    row(MOE + CF + ["-1.5"], "--moe-expert-rank-capacity-factor", id="cf-negative"),
    row(MOE + ["--moe-paged-stash"], "--moe-paged-stash", id="stash-without-factor"),
    row(STASH + ["--moe-paged-stash-page-size", "0"], "--moe-paged-stash-page-size",
        id="stash-page-0"),
    row(STASH + ["--cpu-offloading-num-layers", "1"], "--cpu-offloading-num-layers",
        upstream_first=True, id="stash-with-cpu-offloading"),
    row(STASH + FULL_RECOMPUTE, "--recompute-granularity", id="stash-with-full-recompute"),
    row(STASH + ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
        "--recompute-modules", id="stash-with-moe-recompute"),
    # --- selective recompute: a module with nothing to recompute in the local layers --------
    row(SELECTIVE + ["mla_up_proj"], "--recompute-modules mla_up_proj",
        id="mla-up-proj-recompute-without-mla"),
    row(MOE + SELECTIVE + ["mlp"], "--recompute-modules mlp", id="mlp-recompute-without-dense"),
    row(SELECTIVE + ["moe"], "--recompute-modules moe", id="moe-recompute-on-dense-model"),
    row(SELECTIVE + ["moe_act"], "--recompute-modules moe_act",
        id="moe-act-recompute-on-dense-model"),
    row(MOE + SELECTIVE + ["shared_experts"], "--recompute-modules shared_experts",
        id="shared-experts-recompute-without-shared-experts"),
    row(MOE + ["--moe-grouped-gemm", "--bounded-moe-backend", "upstream"] + SELECTIVE
        + ["core_attn", "moe_act"], "--recompute-modules moe_act",
        id="moe-act-recompute-with-sequential-mlp"),
    row(MOE + CF + ["1.5", "--bounded-moe-backend", "upstream"], "--bounded-moe-backend",
        id="upstream-backend-static-capacity"),
    row(MOE + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
        "--moe-token-dispatcher-type alltoall or flex", id="shared-expert-overlap-allgather"),
    row(MOE + ["--moe-pad-expert-input-to-capacity"], "--moe-expert-capacity-factor",
        id="pad-to-capacity-without-factor"),
    # only Transformer Engine's FusedAdam keeps master weights below fp32 and fp16 moments
    row(["--use-precision-aware-optimizer", "--use-distributed-optimizer", "--bf16",
         "--exp-avg-dtype", "fp16"], "--exp-avg-dtype fp16", early=True,
        id="optimizer-state-below-fp32-without-te"),
    row(["--bf16", "--exp-avg-dtype", "bf16"], "--use-distributed-optimizer", early=True,
        id="bf16-moments-without-distributed-optimizer"),
    row(MOE + CF + ["1.5"], "--disable-bias-linear", set_after_parse={"add_bias_linear": True},
        id="grouped-experts-with-biases"),
    row(["--sco-host-budget-gb", "4"], "--recompute-granularity", id="sco-without-recompute"),
    row(["--sco-host-budget-gb", "4", "--pipeline-model-parallel-size", "2"] + FULL_RECOMPUTE,
        "--pipeline-model-parallel-size", id="sco-with-pp"),
    row(["--sco-host-budget-gb", "100000000"] + FULL_RECOMPUTE, "--sco-host-budget-gb",
        id="sco-above-host-memory"),
    row(["--hbm-gb", "0"], "--hbm-gb", id="hbm-0"),
    row(["--budget-host-gb", "0"], "--budget-host-gb", early=True, id="host-gb-0"),
    row(["--budget-host-gb", "nan"], "--budget-host-gb", early=True, id="host-gb-nan"),
    # the planner chooses from the memory budget: it cannot run with the budget off
    row(["--bounded-plan", "auto", "--memory-budget-check", "off"], "--bounded-plan",
        early=True, id="plan-auto-without-budget"),
    row(["--memory-budget-check", "off"], "--bounded-plan off", early=True,
        id="default-plan-without-budget"),
    row(LLEP, "--pipelined-llep-token-budget", id="llep-without-budget"),
    row(LLEP + ["--pipelined-llep-token-budget", "0"], "--pipelined-llep-token-budget",
        id="llep-budget-0"),
    row(LLEP + ["--pipelined-llep-token-budget", "64", "--pipelined-llep-max-chunks", "0"],
        "--pipelined-llep-max-chunks", id="llep-max-chunks-0"),
    row(LLEP + ["--pipelined-llep-token-budget", "64", "--llep-imbalance-threshold", "0.5"],
        "--llep-imbalance-threshold", id="llep-threshold-below-1"),
    row(LLEP + ["--pipelined-llep-token-budget", "64", "--bounded-moe-backend", "upstream"],
        "--bounded-moe-backend", id="llep-with-upstream-backend"),
    row(LLEP + ["--pipelined-llep-token-budget", "64", *CF, "1.5"],
        "--moe-expert-rank-capacity-factor", id="llep-with-capacity-factor"),
    row(["--pipelined-llep", "--pipelined-llep-token-budget", "64"], "--pipelined-llep",
        id="llep-without-moe"),
    row(["--pipelined-llep-token-budget", "64"], "--pipelined-llep-token-budget",
        id="llep-budget-alone"),
    row(["--offload-stream-optimizer"], "--use-distributed-optimizer",
        id="stream-without-distributed-optimizer"),
    row(OFFLOAD + ["--optimizer", "sgd"], "--optimizer", id="stream-with-sgd"),
    row(OFFLOAD + ["--offload-stream-bucket-numel", "0"], "--offload-stream-bucket-numel",
        id="stream-bucket-0"),
    row(OFFLOAD + ["--offload-stream-slots", "0"], "--offload-stream-slots", id="stream-slots-0"),
    row(OFFLOAD + ["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction",
        id="stream-partial-offload"),
    row(OFFLOAD + ["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d",
        id="stream-with-overlap-d2h"),
    row(OFFLOAD + ["--optimizer-cuda-graph"], "--optimizer-cuda-graph", id="stream-with-graph"),
    row(MOE + ["--swiglu"], "--no-bias-swiglu-fusion", {"deterministic_mode": True},
        id="deterministic-with-compiled-swiglu"),
    row(["--ring-dtp-grad-in-forward"], "--ring-dtp-grad-in-forward", id="ring-grad-alone"),
    row(["--chunked-recompute-tokens", "-1"], "--chunked-recompute-tokens", id="chunked-negative"),
    row(["--chunked-recompute-tokens", "4096"], "--recompute-granularity",
        id="chunked-without-full-recompute"),
    row(MOE + FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096"], "--pipelined-llep",
        id="chunked-with-upstream-moe"),
    row(LLEP + FULL_RECOMPUTE + ["--pipelined-llep-token-budget", "64",
                                 "--chunked-recompute-tokens", "4096", "--moe-z-loss-coeff", "1e-3"],
        "--moe-z-loss-coeff", id="chunked-with-z-loss"),
    row(FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096", "--sequence-parallel",
                          "--tensor-model-parallel-size", "2"], "--sequence-parallel",
        id="chunked-with-sequence-parallel"),
    row(FULL_RECOMPUTE + ["--chunked-recompute-attention"], "--chunked-recompute-tokens",
        id="chunked-attention-alone"),
    row(FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096", "--chunked-recompute-attention",
                          "--attention-dropout", "0.1"], "--attention-dropout",
        id="chunked-attention-with-dropout"),
    row(FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096", "--chunked-recompute-attention",
                          "--attention-dropout", "0", "--multi-latent-attention"],
        "--chunked-recompute-attention cannot be used here: --multi-latent-attention",
        id="chunked-attention-with-mla"),
    row(FULL_RECOMPUTE + ["--chunked-recompute-tokens", "4096",
                          "--chunked-recompute-keep-attention", "gpu"],
        "--chunked-recompute-keep-attention gpu keeps what the chunked attention sublayer saves",
        id="keep-attention-without-chunked-attention"),
    row(CHUNKED_ATTENTION + ["--chunked-recompute-keep-attention", "host",
                             "--pipeline-model-parallel-size", "2"],
        "--pipeline-model-parallel-size 2", id="keep-attention-with-pipeline-parallelism"),
    # --- absurd numbers that overflowed or were taken ----------------------------------------
    row(["--hbm-gb", "1e300"], "--hbm-gb", early=True, id="hbm-1e300"),
    row(["--sco-host-budget-gb", "1e300"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-1e300"),
    row(MOE + ["--budget-routing-skew", "1e308", "--expert-model-parallel-size", "2"],
        "--budget-routing-skew", early=True, id="skew-above-ep"),
    row(["--log-interval", "0"], "--log-interval", early=True, id="log-interval-0"),
    row(MOE + CF + ["1e300"], "--moe-expert-rank-capacity-factor", early=True, id="cf-1e300"),
    # --- pinned host memory: SCO, the streamed optimizer, both ---------------------------------
    row(["--sco-host-budget-gb", "60"] + FULL_RECOMPUTE, "--sco-host-budget-gb", early=True,
        id="sco-above-80-percent-of-host"),
    row(OFFLOAD + STATE_72_GIB, "--offload-stream-optimizer", id="stream-state-above-host"),
    row(OFFLOAD + STATE_36_GIB + ["--sco-host-budget-gb", "30"] + FULL_RECOMPUTE,
        "--offload-stream-optimizer", id="sco-plus-stream-above-host"),
    # 36 + 10 GiB fit the 51.2 that may be pinned; the 12.1 GiB of kept attention do not
    row(OFFLOAD + STATE_36_GIB + ["--sco-host-budget-gb", "10"] + CHUNKED_ATTENTION
        + KEEP_ON_HOST_12_GIB, "--chunked-recompute-keep-attention 12.06 GiB",
        id="sco-plus-stream-plus-kept-attention-above-host"),
    # --- operators the whole-iteration graph cannot capture ----------------------------------
    row(GRAPH + LLEP + ["--pipelined-llep-token-budget", "64"], "--cuda-graph-impl", early=True,
        id="graph-with-llep"),
    row(GRAPH + ["--sco-host-budget-gb", "1"] + FULL_RECOMPUTE, "--cuda-graph-impl", early=True,
        id="graph-with-sco"),
    row(GRAPH + RING, "--cuda-graph-impl", early=True, id="graph-with-ring-dtp"),
    row(GRAPH + OFFLOAD, "--cuda-graph-impl", early=True, id="graph-with-stream-optimizer"),
    # --- settings that were accepted and did nothing, or failed at model build -----------------
    row(RING + ["--ring-dtp-mode", "weights", "--ring-dtp-grad-in-forward"],
        "--ring-dtp-grad-in-forward", {"data_parallel_size": 2}, id="ring-weights-grad-in-forward"),
    row(MOE + ["--bounded-moe-backend", "torch", "--expert-tensor-parallel-size", "2"],
        "--expert-tensor-parallel-size", id="torch-backend-expert-tp"),
    row(["--metrics-jsonl", str(REPO_ROOT)], "--metrics-jsonl", early=True, id="metrics-is-a-dir"),
    row(["--eval-interval", "0"], "--eval-interval", early=True, id="eval-interval-0"),
    row(["--sco-host-budget-gb", "4", "--recompute-granularity", "full", "--recompute-method",
         "uniform", "--recompute-num-layers", "0"], "--recompute-num-layers", early=True,
        id="sco-recompute-no-layer"),
    # --- upstream flags accepted and failing later -------------------------------------------
    row(["--save", NOT_A_DIR], "--save", early=True, id="save-is-a-file"),
    row(["--load", NOT_A_DIR], "--load", early=True, id="load-is-a-file"),
    row(["--data-path", MISSING], "--data-path", early=True, id="data-prefix-missing"),
    row(["--data-path", "0.5", MISSING + "-a", "0.5", MISSING + "-b"], "--data-path", early=True,
        id="weighted-data-prefix-missing"),
    row(["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk", early=True,
        id="topk-above-experts"),
    row(["--num-experts", "4", "--moe-router-topk", "0"], "--moe-router-topk", early=True,
        id="topk-0"),
    row(["--seq-length", "0"], "--seq-length", early=True, id="seq-length-0"),
    # --- upstream's bare assertions before the model -----------------------------------------
    row(["--recompute-granularity", "full"], "--recompute-method", early=True,
        id="full-recompute-without-method"),
    row(["--recompute-modules", "layernorm"], "--recompute-granularity selective", early=True,
        id="recompute-modules-without-selective"),
    row(FULL_RECOMPUTE + ["--recompute-modules", "layernorm"], "--recompute-granularity selective",
        early=True, id="recompute-modules-with-full-recompute"),
    row(["--sco-host-budget-gb", "4", "--cpu-offloading-num-layers", "1"] + FULL_RECOMPUTE,
        "--cpu-offloading-num-layers", early=True, id="sco-with-cpu-offloading"),
    row(CF + ["1.5"], "--moe-expert-rank-capacity-factor", early=True, id="cf-on-dense-model"),
    row(["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size", early=True,
        id="tp-not-dividing-heads"),
    row(["--vocab-size", "0"], "--vocab-size", early=True, id="vocab-0"),
    row(["--num-attention-heads", "3"], "--num-attention-heads", early=True,
        id="heads-not-dividing-hidden"),
    row(["--micro-batch-size", "0"], "--micro-batch-size", early=True, id="micro-batch-0"),
    row(["--bf16", "--fp16"], "--fp16", early=True, id="bf16-and-fp16"),
    row(["--lr", "nan"], "--lr", early=True, id="lr-nan"),
    row(["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size", early=True,
        id="tp-0"),
    row(["--num-experts", "3", "--expert-model-parallel-size", "2"],
        "--expert-model-parallel-size", early=True, id="ep-not-dividing-experts"),
    row(["--context-parallel-size", "2", "--seq-length", "30"], "--context-parallel-size",
        early=True, id="seq-not-divisible-by-2cp"),
    row(["--save", SAVE_DIR], "--save-interval", early=True, id="save-without-interval"),
    row(["--save", SAVE_DIR, "--save-interval", "0"], "--save-interval", early=True,
        id="save-interval-0"),
    row(["--save", SAVE_DIR, "--save-interval", "10", "--save-retain-interval", "15"],
        "--save-retain-interval", early=True, id="save-retain-not-a-multiple"),
    row(["--min-lr", "1e-3"], "--min-lr", early=True, id="min-lr-above-lr"),
    row(["--weight-decay-incr-style", "linear"], "--start-weight-decay", early=True,
        id="weight-decay-style-without-ends"),
    row(["--start-weight-decay", "0.1", "--end-weight-decay", "0.2"], "--weight-decay-incr-style",
        early=True, id="weight-decay-ends-without-style"),
    row(["--global-batch-size", "0"], "--global-batch-size", early=True, id="global-batch-0"),
    row(["--num-dataset-builder-threads", "0"], "--num-dataset-builder-threads", early=True,
        id="dataset-threads-0"),
    # --- upstream flags that built a model which cannot learn, or failed at build or step 1 -----
    # (zero kv-lora-rank or v-head-dim: every attention projection's gradient exactly 0)
    row(MLA + ["--kv-lora-rank", "0"], "--kv-lora-rank 0", early=True, id="mla-kv-rank-0"),
    row(MLA + ["--q-lora-rank", "-4"], "--q-lora-rank -4", early=True, id="mla-q-rank-negative"),
    row(MLA + ["--q-lora-rank", "0"], "--q-lora-rank 0", early=True, id="mla-q-rank-0"),
    row(MLA + ["--v-head-dim", "0"], "--v-head-dim 0", early=True, id="mla-v-head-0"),
    row(MLA + ["--qk-head-dim", "0"], "--qk-head-dim 0", early=True, id="mla-qk-head-0"),
    row(MLA + ["--qk-pos-emb-head-dim", "0"], "--qk-pos-emb-head-dim 0", early=True,
        id="mla-rotary-0"),
    row(MLA + ["--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim 3", early=True,
        id="mla-rotary-odd"),
    row(["--mtp-num-layers", "-1"], "--mtp-num-layers", early=True, id="mtp-layers-negative"),
    row(["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "nan"], "--mtp-loss-scaling-factor",
        early=True, id="mtp-factor-nan"),
    row(["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "inf"], "--mtp-loss-scaling-factor",
        early=True, id="mtp-factor-inf"),
    row(["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-0.1"],
        "--mtp-loss-scaling-factor", early=True, id="mtp-factor-negative"),
    row(WINDOW + ["--window-attn-skip-freq", "0"], "--window-attn-skip-freq 0", early=True,
        id="window-skip-freq-0"),
    row(WINDOW + ["--window-attn-skip-freq", "-1"], "--window-attn-skip-freq -1", early=True,
        id="window-skip-freq-negative"),
    row(WINDOW + ["--window-attn-skip-freq", "[1]"], "--window-attn-skip-freq with 1 entries",
        early=True, id="window-pattern-shorter-than-layers"),
    row(WINDOW + ["--window-attn-skip-freq", "[1,0,1]"], "--window-attn-skip-freq with 3 entries",
        early=True, id="window-pattern-longer-than-layers"),
    row(["--window-size", "8"], "--window-size 8", early=True, id="window-size-one-value"),
    row(["--window-size", "0,0"], "--window-size 0,0", early=True, id="window-size-left-0"),
    row(["--window-size=-3,0"], "--window-size -3,0", early=True, id="window-size-below-minus-1"),
    row(["--reset-attention-mask", "--dataloader-inter-document-masking"],
        "--dataloader-inter-document-masking", early=True, id="two-document-sources"),
    row(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "31"],
        "--sequence-parallel splits --seq-length 31 over --tensor-model-parallel-size 2",
        early=True, id="sequence-parallel-seq-not-divisible-by-tp"),
    row(["--tensor-model-parallel-size", "4", "--context-parallel-size", "2",
         "--sequence-parallel", "--seq-length", "20"],
        "--sequence-parallel splits the 10 tokens of --seq-length 20", early=True,
        id="sequence-parallel-cp-share-not-divisible-by-tp"),
    row(["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "--sequence-parallel with --tensor-model-parallel-size 2", early=True,
        id="sequence-parallel-with-torch-norms"),
]


@pytest.fixture(autouse=True)
def stack_without_te_and_resiliency(monkeypatch):
    monkeypatch.setattr(arguments, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(arguments, "apex_available", lambda: False)
    monkeypatch.setattr(resiliency, "resiliency_available", lambda: False)
    # one host for every machine the tests run on, one GPU process on it
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: HOST_GIB * GiB)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    host_memory.plan_for_host(None)
    yield
    # tools/memory_budget.py plans for a stated host (process-wide): this host's RAM again
    host_memory.plan_for_host(None)


def parse(monkeypatch, flags):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    return parse_args(add_bounded_args)


@pytest.mark.parametrize("flags,named,set_after_parse,early,upstream_first", CASES)
def test_bad_input_is_refused_naming_the_flag(monkeypatch, flags, named, set_after_parse, early,
                                             upstream_first):
    args = parse(monkeypatch, flags)
    for name, value in set_after_parse.items():
        setattr(args, name, value)  # e.g. a config file or a wrapper turned it on
    if upstream_first:
        from megatron.training.arguments import validate_args

        validate_args(args, {})  # upstream derives what the check reads (args.cpu_offloading)
    with pytest.raises(BoundedArgumentError) as refused:
        validate_bounded_args(args)
    assert named in str(refused.value), str(refused.value)


EARLY = [case for case in CASES if case.values[3]]


@pytest.mark.parametrize("flags,named,set_after_parse,early,upstream_first", EARLY)
def test_refused_once_before_upstreams_validation(monkeypatch, capsys, flags, named,
                                                  set_after_parse, early, upstream_first):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    assert_refused_once_on_rank_0(monkeypatch, capsys, arguments.check_flags_before_upstream, named)


def assert_refused_once_on_rank_0(monkeypatch, capsys, step, named) -> None:
    """``step()`` exits with status 2 on every rank; rank 0 alone prints one line naming ``named``."""
    for rank, prints in (("0", True), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exited:
            step()
        assert exited.value.code == 2
        err = capsys.readouterr().err
        if prints:
            assert err.count("[bounded] error:") == 1 and named in err, err
        else:
            assert err == "", f"rank {rank} printed: {err}"


def test_good_flags_pass_the_early_check_and_knobs_get_their_defaults(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE])
    arguments.check_flags_before_upstream()  # no exit
    args = parse(monkeypatch, [*LLEP, "--pipelined-llep-token-budget", "64", "--ring-dtp",
                               "--untie-embeddings-and-output-weights", *OFFLOAD])
    assert args.ring_dtp_mode is None and args.offload_stream_slots is None  # not given
    args.data_parallel_size, args.expert_data_parallel_size = 1, 1
    settings = validate_bounded_args(args)
    assert settings.ring_dtp.ring_dtp_mode == "auto" and settings.ring_dtp.ring_dtp_chunk_tokens is None
    assert settings.offload_stream.offload_stream_slots == 2
    assert settings.offload_stream.offload_stream_bucket_numel == 100_000_000
    assert settings.pipelined_llep.llep_min_spill_tokens == 1024
    assert settings.pipelined_llep.pipelined_llep_max_chunks == 10
    assert args.ring_dtp_mode is None  # the parsed flags stay as parsed
    # a second pass (recheck, after --chunked-recompute-keep-attention auto is placed) takes
    # defaults as defaults
    assert arguments.recheck(args, settings) == settings


def test_capacity_factor_bound_is_inclusive_and_finite_values_pass(monkeypatch):
    from megatron.bounded.moe.dispatch.token_dispatcher import MIN_CAPACITY_FACTOR

    for factor in (MIN_CAPACITY_FACTOR, 1.5, 64.0):
        validate_bounded_args(parse(monkeypatch, [*MOE, *CF, str(factor)]))
    assert math.isfinite(MIN_CAPACITY_FACTOR) and 0 < MIN_CAPACITY_FACTOR < 1


def test_smallest_sco_budget_that_is_a_byte_passes(monkeypatch):
    validate_bounded_args(parse(monkeypatch, ["--sco-host-budget-gb", str(2.0 / GiB),
                                              *FULL_RECOMPUTE]))


def test_pinned_host_memory_under_the_limit_passes(monkeypatch):
    # each pinned user of the sco-plus-stream row alone fits 80% of the host
    sco = parse(monkeypatch, ["--sco-host-budget-gb", "30", *FULL_RECOMPUTE])
    validate_bounded_args(sco)
    stream = parse(monkeypatch, [*OFFLOAD, *STATE_36_GIB])
    validate_bounded_args(stream)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two GPU processes pin twice as much
    with pytest.raises(BoundedArgumentError, match="2 GPU process"):
        validate_bounded_args(stream)


def test_one_data_source(monkeypatch, tmp_path):
    # 1,000 documents: the default --split gives the test split 0.1% of them
    prefix = write_indexed_dataset(tmp_path / "corpus", [[1, 2, 3]] * 1000)
    args = parse(monkeypatch, ["--data-path", "1.0", str(prefix)])  # BASE has --mock-data
    with pytest.raises(BoundedArgumentError, match="--mock-data and --data-path"):
        validate_bounded_args(args)
    args.mock_data = False
    validate_bounded_args(args)  # the prefix's files exist and hold a document for each split


# Plans pretrain_gpt.py refuses after the flags pass: (flags, the flag the refusal names). With
# the planner on (the default) a plan that cannot fit is refused before (PLANNER_CASES): these
# flags turn it off.
PLAN_CASES = [
    pytest.param(["--bounded-plan", "off", "--memory-budget-check", "error", "--hbm-gb", "0.001"],
                 "--memory-budget-check", id="budget-error-does-not-fit"),
]

# Command lines for which the planner (--bounded-plan auto, the default) finds no plan that fits:
# pretrain_gpt.py refuses them before upstream parses (flags, what the refusal names).
NOTHING_FITS = "--seq-length 32 at --micro-batch-size 1 does not fit"
PLANNER_CASES = [
    pytest.param(["--hbm-gb", "0.001"], NOTHING_FITS, id="planner-nothing-fits"),
    # --auto-bounds (replaced by the planner) is taken off the command line, not refused
    pytest.param(["--auto-bounds", "--hbm-gb", "0.001"], NOTHING_FITS,
                 id="auto-bounds-nothing-fits"),
]


@pytest.mark.parametrize("flags,named", PLAN_CASES)
def test_plan_that_does_not_fit_is_refused_once(monkeypatch, capsys, flags, named):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    import pretrain_gpt

    args = parse(monkeypatch, flags)
    settings = validate_bounded_args(args)
    assert_refused_once_on_rank_0(monkeypatch, capsys,
                                  lambda: pretrain_gpt.plan_memory(args, settings), named)


@pytest.mark.parametrize("flags,named", PLANNER_CASES)
def test_plan_the_planner_cannot_fit_is_refused_once_before_upstream(monkeypatch, capsys, flags,
                                                                     named):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    import pretrain_gpt

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert_refused_once_on_rank_0(monkeypatch, capsys, pretrain_gpt.parse_flags, named)


def _world_size(flags, set_after_parse) -> int:
    """Ranks for which upstream's validation accepts the parallel sizes of ``flags``."""

    def size(flag):
        return max(1, int(flags[flags.index(flag) + 1])) if flag in flags else 1

    pp = size("--pipeline-model-parallel-size")
    dense = size("--tensor-model-parallel-size") * pp * size("--context-parallel-size")
    experts = size("--expert-model-parallel-size") * size("--expert-tensor-parallel-size") * pp
    return math.lcm(dense, experts) * set_after_parse.get("data_parallel_size", 1)


TOOL_CASES = [pytest.param(*case.values[:3], id=case.id) for case in CASES] + [
    pytest.param(*case.values, {}, id=case.id) for case in PLAN_CASES + PLANNER_CASES]


@pytest.mark.parametrize("flags,named,set_after_parse", TOOL_CASES)
def test_memory_budget_tool_refuses_what_pretrain_refuses(monkeypatch, capsys, flags, named,
                                                          set_after_parse):
    from megatron.bounded.launch.commands import memory_budget
    from megatron.training import arguments as upstream

    parse_args = upstream.parse_args

    def parse_then_set(*a, **k):
        args = parse_args(*a, **k)
        for name, value in set_after_parse.items():
            setattr(args, name, value)
        return args

    monkeypatch.setattr(upstream, "parse_args", parse_then_set)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # upstream's rule for TP and CP
    world = _world_size(flags, set_after_parse)
    host = [] if "--budget-host-gb" in flags else ["--budget-host-gb", f"{HOST_GB:.12g}"]
    try:
        code = memory_budget.main(["--world-size", str(world), *BASE, *flags, *host])
    except SystemExit as exited:
        code = exited.code
    captured = capsys.readouterr()
    assert code == 2, captured.out[-2000:] + captured.err[-2000:]
    assert named in captured.err and "Traceback" not in captured.err, captured.err


def test_memory_budget_tool_plans_pinned_memory_for_a_stated_host(monkeypatch, capsys):
    """tools/memory_budget.py plans pinned memory for the host of the machine that trains:
    --budget-host-gb per GPU, default 250 GB, never the RAM of the machine it runs on. The same
    SCO budget is refused for a stated host too small for it and passes for a larger one, and
    for the default, on a machine whose RAM (64 GiB, every row's) pretrain_gpt.py would refuse."""
    from megatron.bounded.launch.commands import memory_budget as tool

    flags = ["--world-size", "1", *BASE, *FULL_RECOMPUTE, "--sco-host-budget-gb", "60"]
    with pytest.raises(BoundedArgumentError, match="--sco-host-budget-gb"):
        validate_bounded_args(parse(monkeypatch, flags[2:]))  # this host: 60 GiB > 80% of 64 GiB
    with pytest.raises(SystemExit) as exited:
        tool.main(flags + ["--budget-host-gb", "64"])  # 60 GiB > 80% of 64 GB (59.6 GiB)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--budget-host-gb" in err and "--sco-host-budget-gb" in err
    assert tool.main(flags + ["--budget-host-gb", "100"]) in (0, 3)
    assert tool.main(flags) in (0, 3)  # 250 GB per GPU, not this machine's 64 GiB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # nor this machine's GPU processes
    assert tool.main(flags + ["--budget-host-gb", "100"]) in (0, 3)


def test_budget_plans_for_the_visible_gpu_without_hbm_gb(monkeypatch):
    """Without --hbm-gb pretrain_gpt.py's budget takes this process's GPU's memory (an 80 GB GPU:
    a plan for one H200 would pass there and run out of memory); given, the flag's value."""
    import torch

    from megatron.bounded.budget.config import H200_HBM_BYTES

    class Device:
        total_memory = 85_520_809_984  # an H100 80 GB as torch reports it

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: asked.append(device) or Device())
    monkeypatch.setenv("LOCAL_RANK", "1")
    settings = validate_bounded_args(parse(monkeypatch, []))
    assert settings.budget.hbm_bytes == H200_HBM_BYTES
    planned = arguments.with_this_gpu_memory(settings)
    assert planned.budget.hbm_bytes == Device.total_memory and asked == [1]
    given = validate_bounded_args(parse(monkeypatch, ["--hbm-gb", "100"]))
    assert arguments.with_this_gpu_memory(given).budget.hbm_bytes == 100 * GB


# Flags upstream's validation asserts on without a message when they are missing: (the flag left
# out of BASE, flags added, what the refusal names).
MISSING_CASES = [
    pytest.param("--seq-length", [], "--seq-length is missing", id="seq-length-missing"),
    pytest.param("--micro-batch-size", ["--bounded-plan", "off"], "--micro-batch-size is missing",
                 id="micro-batch-missing-without-planner"),
]


def _base_without(flag):
    index = BASE.index(flag)
    return BASE[:index] + BASE[index + 2:]


@pytest.mark.parametrize("left_out,flags,named", MISSING_CASES)
def test_missing_flag_is_refused_naming_it(monkeypatch, capsys, left_out, flags, named):
    from megatron.training.arguments import parse_args

    from megatron.bounded.launch.commands import memory_budget as memory_budget_tool

    argv = [*_base_without(left_out), *flags]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    with pytest.raises(BoundedArgumentError, match=named):
        validate_bounded_args(parse_args(add_bounded_args))
    assert_refused_once_on_rank_0(monkeypatch, capsys, arguments.check_flags_before_upstream, named)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exited:
        memory_budget_tool.main(["--world-size", "1", *argv, "--budget-host-gb", f"{HOST_GB:.12g}"])
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_flags_next_to_the_refused_ones_pass(monkeypatch):
    """The neighbours of the refused values are accepted: the rules refuse nothing that runs."""
    good = [
        MLA, MLA + ["--q-lora-rank", "1", "--kv-lora-rank", "1", "--qk-pos-emb-head-dim", "2"],
        ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
         "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"],  # no --q-lora-rank: full rank
        ["--mtp-num-layers", "0"], ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0"],
        WINDOW + ["--window-attn-skip-freq", "1"], WINDOW + ["--window-attn-skip-freq", "[1,0]"],
        ["--window-size", "1,0"], ["--window-size=-1,0"],
        ["--reset-attention-mask"], ["--dataloader-inter-document-masking"],
        ["--save", SAVE_DIR, "--save-interval", "10", "--save-retain-interval", "20"],
        ["--min-lr", "1e-4"],
        ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0", "--end-weight-decay",
         "0.1"],
        # tensor parallelism of 1 turns sequence parallelism off (upstream's validation)
        ["--sequence-parallel"],
    ]
    for flags in good:
        arguments.validate_flags_early(parse(monkeypatch, flags))
    # with Apex's fused LayerNorm the local implementation runs sequence parallelism
    monkeypatch.setattr(arguments, "apex_available", lambda: True)
    arguments.validate_flags_early(parse(monkeypatch, [
        "--tensor-model-parallel-size", "4", "--context-parallel-size", "2", "--sequence-parallel",
        "--seq-length", "24", "--normalization", "LayerNorm"]))


def test_selective_recompute_of_parts_the_model_has_passes(monkeypatch):
    """Each of upstream's selective modules on a model that has its part is accepted, also with
    --recompute-activations and --moe-layer-recompute (which turn selective recompute on)."""
    grouped = MOE + ["--moe-grouped-gemm"]
    good = [
        SELECTIVE + ["core_attn", "layernorm"], MLA + SELECTIVE + ["mla_up_proj"],
        grouped + ["--moe-layer-freq", "[0,1]"] + SELECTIVE + ["mlp", "moe", "moe_act"],
        grouped + ["--moe-shared-expert-intermediate-size", "64"] + SELECTIVE
        + ["shared_experts"],
        grouped + ["--recompute-activations", "--recompute-modules", "moe_act"],
        grouped + ["--moe-layer-recompute"],
    ]
    for flags in good:
        args = parse(monkeypatch, flags)
        arguments.validate_flags_early(args)
        validate_bounded_args(args)
