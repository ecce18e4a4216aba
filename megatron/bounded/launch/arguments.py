"""Command-line flags this project adds to Megatron's, and their validation.

:func:`add_bounded_args` is the ``extra_args_provider`` that ``pretrain_gpt.py`` hands to upstream's
``parse_and_validate_args``. Besides adding our flags it adapts upstream *defaults* to the
installed stack: without Transformer Engine (or Apex) the defaults select the local
implementation and switch off the fusions that need those packages, so a plain
``torchrun pretrain_gpt.py ...`` works on stock PyTorch; flags the user passes explicitly always win.

:func:`validate_bounded_args` runs right after parsing, before the model config is built and
before any GPU allocation. Every check raises :class:`BoundedArgumentError` with a message that
names the offending flags and the fix; each check has a unit test in
``tests/unit/test_arguments.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from megatron.bounded.activations.chunked_attention import DEFAULT_CHUNKED_ATTENTION, check_chunked_attention
from megatron.bounded.activations.chunked_recompute import DEFAULT_CHUNK_TOKENS, check_chunked_recompute
from megatron.bounded.moe.backend import check_moe_capacity_and_paged_stash, select_moe_backend
from megatron.bounded.moe.pipelined_llep import (
    DEFAULT_MAX_CHUNKS,
    DEFAULT_MIN_SPILL_TOKENS,
    check_pipelined_llep_args,
)
from megatron.bounded.activations.sco import check_sco_args
from megatron.bounded.optimizer.distributed import check_offload_stream_args
from megatron.bounded.optimizer.offload_stream_adamw import DEFAULT_BUCKET_NUMEL, DEFAULT_NUM_SLOTS
from megatron.bounded.validation import BoundedArgumentError


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None


# Upstream defaults that need Transformer Engine or Apex, and the TE-free value for each
# (measured: each otherwise raises at config construction or model build without TE/Apex).
TE_FREE_DEFAULTS = {
    "transformer_impl": "local",
    "apply_rope_fusion": False,  # --no-rope-fusion
    "no_persist_layer_norm": True,  # --no-persist-layer-norm
    "gradient_accumulation_fusion": False,  # --no-gradient-accumulation-fusion
    "masked_softmax_fusion": False,  # --no-masked-softmax-fusion
}


# Evaluation interval when --train-iters is given without --eval-interval: older Megatron-LM's
# default (megatron-core 0.19.2 has none and divides by it when sizing the datasets).
DEFAULT_EVAL_INTERVAL = 1000


def add_bounded_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider``: add our flags and TE-free defaults when TE is absent."""
    group = parser.add_argument_group(title="megatron-bounded")
    group.add_argument(
        "--bounded-fast-path",
        action="store_true",
        help="Add the flags of the fastest exact configuration that the other flags allow "
        "(megatron.bounded.launch.fast_path): for MoE models the torch-native backend with a no-drop "
        "rank capacity factor (= EP) and paged stash, plus upstream's whole-iteration CUDA graph "
        "(with the loss checked for NaN/inf on the host every log interval) where nothing in the "
        "step syncs with the host. Explicit flags win; a start-up line lists what was added and "
        "why any part was left out. The example scripts pass it.",
    )
    group.add_argument(
        "--bounded-moe-backend",
        choices=("auto", "torch", "upstream"),
        default="auto",
        help="MoE token dispatcher and experts. torch: this project's torch-native static-capacity "
        "all-to-all dispatcher (dropless without --moe-expert-rank-capacity-factor) with grouped "
        "experts on torch._grouped_mm; upstream: megatron-core's dispatcher chosen by "
        "--moe-token-dispatcher-type and its experts. auto (default): torch when "
        "--moe-expert-rank-capacity-factor is set and upstream's HybridEP/NCCL-EP + Transformer "
        "Engine path cannot run, else upstream.",
    )
    group.add_argument(
        "--sco-host-budget-gb",
        type=float,
        default=0.0,
        help="SCO: offload full-recompute checkpoint boundaries (each layer's input) of one "
        "micro-batch to pinned host memory, up to this many GiB per GPU, in forward order; in "
        "backward the previous boundary is prefetched so at most two are back on the GPU. "
        "Needs --recompute-granularity full. 0 (default) turns it off.",
    )
    group.add_argument(
        "--ring-dtp",
        action="store_true",
        help="Ring-DTP: shard the output layer's vocabulary rows over the data-parallel x "
        "context-parallel ranks and compute each rank's loss by passing strips around the ring, "
        "so no rank materializes N x V logits (exact). Needs untied embeddings, TP = PP = 1 and "
        "--expert-model-parallel-size equal to the data-parallel x context-parallel size.",
    )
    group.add_argument(
        "--ring-dtp-mode",
        choices=("auto", "weights", "activations"),
        default="auto",
        help="What travels around the ring: weight shards (V/P x H per hop), activations "
        "(N x H per hop), or auto (weights when N > V/P; activations with "
        "--ring-dtp-grad-in-forward). Default auto.",
    )
    group.add_argument(
        "--ring-dtp-chunk-tokens",
        type=int,
        default=None,
        help="Ring-DTP: also split each strip into chunks of this many tokens, so the live strip "
        "is chunk x V/P and stops growing with N. Default: whole strips.",
    )
    group.add_argument(
        "--ring-dtp-gradient-rows",
        type=int,
        default=None,
        help="Ring-DTP on one rank (data-parallel x context-parallel size 1): tokens of the "
        "gradient strip kept for each weight-gradient GEMM, a multiple of "
        "--ring-dtp-chunk-tokens. Fewer, longer GEMMs read and write the fp32 weight-gradient "
        "accumulator fewer times, for (rows - default) x V x 2 bytes more. Default: as many as "
        "fit with the strip in the bytes of the returned weight gradient.",
    )
    group.add_argument(
        "--ring-dtp-grad-in-forward",
        action="store_true",
        help="Ring-DTP: compute the output layer's gradients during the forward, so every strip "
        "is formed once (three GEMMs per strip instead of four). Exact when every token's loss "
        "gradient is one value on all ranks of the ring: tokens with loss mask 0 are passed as "
        "ignored labels for that, and the value is common when the ranks count the same number "
        "of loss tokens or with --calculate-per-token-loss; otherwise the backward replays the "
        "strips (exact, slower; a warning says so). Takes effect with the activations schedule, "
        "which --ring-dtp-mode auto then picks. Needs --ring-dtp.",
    )
    group.add_argument(
        "--pipelined-llep",
        action="store_true",
        help="PipelinedLLEP: dispatch each MoE layer's tokens in K = min(ceil(N/c), K_max) "
        "strided chunks of at most c tokens per source rank, pipelined (the next chunk's "
        "dispatch overlaps the previous chunk's combine) and recomputed chunk by chunk in "
        "backward, so the receive buffer is bounded by 2·E_p·k·c rows whatever the routing. "
        "Exact. Uses the torch-native MoE backend; needs --pipelined-llep-token-budget.",
    )
    group.add_argument(
        "--pipelined-llep-token-budget",
        type=int,
        default=None,
        help="PipelinedLLEP: tokens per chunk and source rank (c).",
    )
    group.add_argument(
        "--pipelined-llep-max-chunks",
        type=int,
        default=DEFAULT_MAX_CHUNKS,
        help=f"PipelinedLLEP: most chunks per layer (K_max; default {DEFAULT_MAX_CHUNKS}).",
    )
    group.add_argument(
        "--llep-imbalance-threshold",
        type=float,
        default=None,
        help="PipelinedLLEP's least-loaded expert balancing: when the hottest rank's routed load "
        "exceeds this multiple of the mean (>= 1.0, e.g. 1.3), overloaded experts spill tokens "
        "and a copy of their weights to the least-loaded ranks (exact). Default: off.",
    )
    group.add_argument(
        "--llep-min-spill-tokens",
        type=int,
        default=DEFAULT_MIN_SPILL_TOKENS,
        help="LLEP: smallest number of tokens worth moving to a helper rank (default "
        f"{DEFAULT_MIN_SPILL_TOKENS}).",
    )
    group.add_argument(
        "--chunked-recompute-tokens",
        type=int,
        default=DEFAULT_CHUNK_TOKENS,
        metavar="T",
        help="With --recompute-granularity full: recompute each layer's MLP block (pre-MLP norm, "
        "router, experts or MLP, residual add) in sequence chunks of T tokens in backward, free "
        "the recomputed layer's output and keep attention's inputs compact, so the per-token "
        "memory of the layer in backward no longer holds the MLP block's tensors (they grow "
        "with T). Exact (weight gradients summed over chunks in another order). MoE layers need "
        "the torch-native backend (e.g. --pipelined-llep). Default 0: off.",
    )
    group.add_argument(
        "--chunked-recompute-attention",
        action="store_true",
        default=DEFAULT_CHUNKED_ATTENTION,
        help="With --chunked-recompute-tokens: recompute each layer's whole attention sublayer "
        "(input norm, QKV projection, rotary embedding, causal attention, output projection) in "
        "the same chunks in backward; it keeps only K, V, attention's output and log-sum-exp for "
        "the whole sequence, and back-propagates attention block by block (query chunk x key "
        "chunk), summing dK and dV in fp32. Exact up to the order of sums. Needs "
        "--attention-dropout 0 and no context parallelism.",
    )
    group.add_argument(
        "--offload-stream-optimizer",
        action="store_true",
        help="OffloadStreamAdamW as the inner optimizer of the distributed optimizer: fp32 master "
        "weights and Adam moments of each data-parallel rank's shard live in pinned host memory "
        "and stream through the GPU bucket by bucket for a fused AdamW update (bitwise equal to "
        "torch's fused AdamW); the GPU keeps no fp32 master or moment. Needs "
        "--use-distributed-optimizer and --optimizer adam.",
    )
    group.add_argument(
        "--offload-stream-bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help=f"OffloadStreamAdamW: elements per streamed bucket (>= 16; default {DEFAULT_BUCKET_NUMEL:.0e}). GPU staging "
        "= slots × largest bucket × 16 bytes per optimizer (dense and expert parameters each "
        "have one).",
    )
    group.add_argument(
        "--offload-stream-slots",
        type=int,
        default=DEFAULT_NUM_SLOTS,
        help=f"OffloadStreamAdamW: GPU staging slots (buckets in flight; default {DEFAULT_NUM_SLOTS}).",
    )
    group.add_argument(
        "--memory-budget-check",
        choices=("off", "warn", "error"),
        default="warn",
        help="Estimate the per-GPU memory peak (megatron.bounded.budget, the paper's Eq. 6) "
        "before building the model: warn (default) prints the table when the plan does not fit, "
        "error refuses to start, off skips it. tools/memory_budget.py prints the same table.",
    )
    group.add_argument(
        "--auto-bounds",
        action="store_true",
        help="Choose the bounded operators' knobs that fit the GPU memory with the least "
        "expected slowdown (cost model in megatron.bounded.budget.choose_bounds), print the "
        "choice and use it.",
    )
    group.add_argument(
        "--hbm-gb",
        type=float,
        default=None,
        help="GPU memory per device for the memory budget, in decimal GB (default: one H200 as "
        "torch reports it, 150.1).",
    )
    group.add_argument(
        "--budget-routing-skew",
        type=float,
        default=None,
        help="Routing skew the memory budget assumes for the standard (dropless) dispatch: the "
        "hottest rank receives this many times its even share of routed rows (default 2.0; "
        "at EP = 2 that is every row on one rank). An assumption, not a bound; static capacity "
        "and PipelinedLLEP are sized without it.",
    )
    group.add_argument(
        "--metrics-jsonl",
        type=str,
        default=None,
        help="Append one JSON record per training iteration (iteration, exact lm loss, grad "
        "norm) to this file, written by the last rank. Used to compare runs bit for bit.",
    )
    from megatron.bounded.training import checkpoint_manifest

    checkpoint_manifest.add_arguments(group)  # --no-verify-checkpoint
    from megatron.bounded.loss.ring_dtp_output import RING_DTP_KNOBS
    from megatron.bounded.moe.pipelined_llep import LLEP_KNOBS
    from megatron.bounded.optimizer.distributed import OFFLOAD_STREAM_KNOBS

    # An operator's knobs parse as None when not given, so that one given without its operator
    # is refused; the operator's check gives the others their defaults (megatron.bounded.knobs).
    for knobs in (RING_DTP_KNOBS, LLEP_KNOBS, OFFLOAD_STREAM_KNOBS):
        knobs.defer_defaults(parser)
    parser.set_defaults(
        # one_logger is an internal NVIDIA package; upstream defaults it on and warns without it.
        enable_one_logger=False,
        # the attention of this project is causal by construction: an [s, s] mask per sample
        # built by the dataloader would cost s² bytes (16 GiB at 128K tokens) for nothing.
        create_attention_mask_in_dataloader=False,
    )
    if not transformer_engine_available():
        parser.set_defaults(**TE_FREE_DEFAULTS)
    return parser


def validate_bounded_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations this project cannot run; call before building the model."""
    _check_transformer_engine(args)
    check_moe_capacity_and_paged_stash(args, flag_style=True)
    validate_flags_early(args)
    check_sco_args(args, BoundedArgumentError)
    check_pipelined_llep_args(args, BoundedArgumentError)
    check_offload_stream_args(args, BoundedArgumentError)
    if args.offload_stream_optimizer:
        # the streamed optimizer takes upstream's host-optimizer path: --optimizer-cpu-offload
        # selects the HybridDeviceOptimizer slot (which megatron.bounded.upstream.patches binds to ours)
        # and the precision-aware mode hands over the bf16 shards without fp32 copies on the GPU
        args.optimizer_cpu_offload = True
        args.use_precision_aware_optimizer = True
    _check_deterministic_mode(args)
    check_chunked_recompute(args, flag_style=True)
    check_chunked_attention(args, flag_style=True)
    from megatron.bounded.loss.ring_dtp_output import check_ring_dtp_layout

    check_ring_dtp_layout(args, BoundedArgumentError)
    from megatron.bounded.training.resiliency import check_resiliency_args

    check_resiliency_args(args, BoundedArgumentError)
    if args.transformer_impl == "local":
        from megatron.bounded.attention.core import check_sdpa_attention_supported

        check_sdpa_attention_supported(args, flag_style=True)
    if getattr(args, "multi_latent_attention", False):
        raise BoundedArgumentError(
            "--multi-latent-attention is not supported by this pretrain_gpt.py yet (upstream "
            "would silently replace our transformer config class). Remove the flag and use "
            "grouped-query attention (--group-query-attention --num-query-groups G)."
        )
    if getattr(args, "heterogeneous_layers_config_path", None) is not None:
        raise BoundedArgumentError(
            "--heterogeneous-layers-config-path is not supported by this pretrain_gpt.py: "
            "remove the flag."
        )
    if args.train_iters is not None and args.eval_interval is None:
        # upstream divides by eval_interval when sizing the datasets (a TypeError on None)
        args.eval_interval = DEFAULT_EVAL_INTERVAL
        _note(args, "bounded_defaults", f"--eval-interval {DEFAULT_EVAL_INTERVAL} (not given; "
              "megatron-core 0.19.2 has no default, older Megatron-LM's was 1000)")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if decay_iters is not None and args.lr_warmup_iters and args.lr_warmup_iters >= decay_iters:
        # upstream's scheduler asserts on this only after the model and optimizer are built
        raise BoundedArgumentError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than the decay length "
            f"(--lr-decay-iters, default --train-iters: {decay_iters}): lower --lr-warmup-iters "
            "or raise --train-iters."
        )
    if args.auto_bounds and args.memory_budget_check == "off":
        raise BoundedArgumentError(
            "--auto-bounds chooses knobs from the memory budget, which --memory-budget-check off "
            "disables: use --memory-budget-check warn or error with --auto-bounds."
        )
    if args.metrics_jsonl is not None and args.metrics_jsonl.strip() == "":
        raise BoundedArgumentError("--metrics-jsonl needs a file path; omit the flag to disable it.")


def validate_flags_early(args: argparse.Namespace) -> None:
    """The checks that need nothing upstream's validation derives, composed from the operators'
    modules: :func:`check_flags_before_upstream` runs them on the parsed flags before upstream
    validates (and prints its argument table); :func:`validate_bounded_args` runs them again."""
    from megatron.bounded.moe.dispatch.token_dispatcher import check_capacity_flags
    from megatron.bounded.activations.sco import check_host_budget_gb
    from megatron.bounded.training.resiliency import check_resiliency_args

    if args.num_layers is not None and args.num_layers < 1:
        raise BoundedArgumentError(
            f"--num-layers must be >= 1 (transformer layers of the model), got {args.num_layers}."
        )
    if args.hbm_gb is not None and not (args.hbm_gb > 0 and math.isfinite(args.hbm_gb)):
        raise BoundedArgumentError(
            f"--hbm-gb must be positive and finite (decimal GB per GPU, e.g. 150.1 for an H200), "
            f"got {args.hbm_gb}."
        )
    skew = args.budget_routing_skew
    if skew is not None and not (skew >= 1.0 and math.isfinite(skew)):
        raise BoundedArgumentError(
            f"--budget-routing-skew must be >= 1.0 and finite (the hottest rank receives at least "
            f"its even share of routed rows; e.g. 2.0), got {skew}."
        )
    check_host_budget_gb(args.sco_host_budget_gb, BoundedArgumentError)
    check_capacity_flags(args, BoundedArgumentError)
    from megatron.bounded.loss.ring_dtp_output import RING_DTP_KNOBS
    from megatron.bounded.moe.pipelined_llep import LLEP_KNOBS
    from megatron.bounded.optimizer.distributed import OFFLOAD_STREAM_KNOBS

    for knobs in (RING_DTP_KNOBS, LLEP_KNOBS, OFFLOAD_STREAM_KNOBS):
        knobs.resolve(args, BoundedArgumentError)  # each operator's check resolves them again
    check_resiliency_args(args, BoundedArgumentError)
    if args.metrics_jsonl is not None and args.metrics_jsonl.strip():
        directory = os.path.dirname(os.path.abspath(args.metrics_jsonl))
        if not os.path.isdir(directory):
            raise BoundedArgumentError(
                f"--metrics-jsonl {args.metrics_jsonl}: the directory {directory} does not exist "
                f"(the first record would fail after the model is built): create it "
                f"(mkdir -p {directory}) or choose another path."
            )


def refuse(error: Exception) -> None:
    """Print a refused flag's message once (rank 0 by ``RANK``; every process runs this before
    torch.distributed exists) and exit with status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[bounded] error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_flags_before_upstream(extra_args_provider=None) -> None:
    """Parse ``sys.argv`` with upstream's parser (no validation, nothing printed) and refuse
    flags :func:`validate_flags_early` rejects, before upstream's validation prints its argument
    table and fails on some of them with a less direct message."""
    from megatron.training.arguments import parse_args

    try:
        validate_flags_early(parse_args(extra_args_provider or add_bounded_args))
    except BoundedArgumentError as error:
        refuse(error)


def _check_deterministic_mode(args: argparse.Namespace) -> None:
    """Upstream's experts (``SequentialMLP``) with ``--bias-swiglu-fusion`` run a torch.compile'd
    weighted SwiGLU whose backward sums over the hidden dimension. Inductor compiles it once per
    row count seen first and once with dynamic shapes, and the two kernels sum in different
    orders, so the same step's router gradients depend on which shapes the process met before:
    a run resumed from a checkpoint then differs from the uninterrupted one in the last bits.
    Like upstream's own deterministic-mode checks, refuse rather than silently change the flag.
    """
    if not (args.deterministic_mode and args.num_experts and args.swiglu and args.bias_swiglu_fusion):
        return
    if select_moe_backend(args) == "upstream":
        raise BoundedArgumentError(
            "--deterministic-mode with upstream's MoE experts needs --no-bias-swiglu-fusion: the "
            "compiled fused weighted SwiGLU reduces in an order that depends on the shapes compiled "
            "earlier in the process, so a resumed run would not reproduce the uninterrupted one bit "
            "for bit. Pass --no-bias-swiglu-fusion (our torch-native experts, selected by "
            "--moe-expert-rank-capacity-factor, are not affected)."
        )


def note_substitution(args: argparse.Namespace, text: str) -> None:
    """Record what the command line asked for and what runs instead (printed at start-up by
    :mod:`megatron.bounded.launch.run_summary`)."""
    _note(args, "bounded_substitutions", text)


def _note(args: argparse.Namespace, attribute: str, text: str) -> None:
    """Append ``text`` once to the list ``args.<attribute>`` (created when missing)."""
    notes = getattr(args, attribute, None)
    if notes is None:
        notes = []
        setattr(args, attribute, notes)
    if text not in notes:
        notes.append(text)


def _check_transformer_engine(args: argparse.Namespace) -> None:
    if not transformer_engine_available():
        # Scripts written for Transformer Engine run on the local implementation instead.
        if args.transformer_impl == "transformer_engine":
            args.transformer_impl = "local"
            note_substitution(
                args, "--transformer-impl transformer_engine -> local (SDPA attention, local "
                "linears): Transformer Engine is not installed"
            )
        if getattr(args, "use_transformer_engine_op_fuser", False):
            args.use_transformer_engine_op_fuser = False
            note_substitution(
                args, "--use-transformer-engine-op-fuser -> local linears: Transformer Engine is "
                "not installed"
            )
    if transformer_engine_available() or apex_available():
        return
    te_only = [
        ("apply_rope_fusion", "--no-rope-fusion"),
        ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion"),
        ("masked_softmax_fusion", "--no-masked-softmax-fusion"),
    ]
    for name, fix in te_only:
        if getattr(args, name, False):
            raise BoundedArgumentError(
                f"{name.replace('_', '-')} is on but needs Transformer Engine or Apex, neither of "
                f"which is installed: pass {fix}."
            )
