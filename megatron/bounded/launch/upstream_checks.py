"""Upstream's own flags that megatron-core would accept and fail on later, or fail on with a bare
assertion: refused here, before upstream's validation prints its argument table, naming the flag
and the fix.

Every rule reads only parsed flags (nothing upstream's validation derives) and the data files
they name, so
:func:`check_upstream_flags` runs in the early pass of
:func:`megatron.bounded.launch.arguments.validate_flags_early` and again after upstream's
validation.
"""

from __future__ import annotations

import argparse
import math
import os

from megatron.bounded.data.indexed_check import check_data_files
from megatron.bounded.settings import BoundedArgumentError, flag_name
from megatron.bounded.units import ceil_div

# Flags that count something and must be >= 1 when given, and what they count.
COUNTS = {
    "num_layers": "transformer layers of the model",
    "hidden_size": "the model's width",
    "num_attention_heads": "attention heads per layer",
    "seq_length": "tokens per sequence",
    "micro_batch_size": "sequences per micro-batch",
    "vocab_size": "tokens of the vocabulary",
    "tensor_model_parallel_size": "ranks of a tensor-parallel group; 1 turns it off",
    "pipeline_model_parallel_size": "pipeline stages; 1 turns it off",
    "context_parallel_size": "ranks of a context-parallel group; 1 turns it off",
    "expert_model_parallel_size": "ranks of an expert-parallel group; 1 turns it off",
    "expert_tensor_parallel_size": "ranks of an expert tensor-parallel group; 1 turns it off",
    "eval_interval": "iterations between evaluations",
    "global_batch_size": "sequences per iteration over all data-parallel ranks",
    "num_dataset_builder_threads": "threads that build the datasets",
}


def check_upstream_flags(args: argparse.Namespace) -> None:
    """Refuse upstream flags that cannot run, from the parsed flags alone."""
    _check_required(args)
    _check_counts(args)
    _check_numbers(args)
    _check_schedule(args)
    _check_checkpoint_intervals(args)
    _check_layout(args)
    _check_moe(args)
    _check_mtp(args)
    _check_recompute(args)
    _check_paths(args)


def _check_required(args) -> None:
    """Flags upstream's validation needs, asserted there without a message."""
    if args.seq_length is None and getattr(args, "encoder_seq_length", None) is None:
        raise BoundedArgumentError(
            "--seq-length is missing (tokens per sequence): add it, e.g. --seq-length 4096, with "
            "--max-position-embeddings at least as large."
        )
    if args.micro_batch_size is None and getattr(args, "bounded_plan", "auto") == "off":
        raise BoundedArgumentError(
            "--micro-batch-size is missing; with --bounded-plan off nothing chooses it: add e.g. "
            "--micro-batch-size 1, or drop --bounded-plan off to let the planner choose."
        )


def _check_counts(args) -> None:
    for name, what in COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise BoundedArgumentError(
                f"{flag_name(name)} must be >= 1 ({what}), got {value}: give a positive value."
            )


def _check_numbers(args) -> None:
    lr = getattr(args, "lr", None)
    if lr is not None and not (math.isfinite(lr) and lr >= 0):
        raise BoundedArgumentError(
            f"--lr must be a finite learning rate >= 0, got {lr}: give e.g. --lr 3e-4."
        )
    if getattr(args, "bf16", False) and getattr(args, "fp16", False):
        raise BoundedArgumentError(
            "--bf16 and --fp16 choose one precision each: keep one of them (--bf16 on GPUs "
            "that support it)."
        )


def _check_schedule(args) -> None:
    """The learning-rate and weight-decay schedules' flags (upstream asserts them bare)."""
    lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", 0.0)
    if lr is not None and min_lr is not None and min_lr > lr:
        raise BoundedArgumentError(
            f"--min-lr {min_lr} is above --lr {lr}: the schedule decays from --lr down to "
            "--min-lr; give a --min-lr no larger than --lr."
        )
    style = getattr(args, "weight_decay_incr_style", "constant")
    start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
    if style != "constant" and (start is None or end is None):
        raise BoundedArgumentError(
            f"--weight-decay-incr-style {style} goes from --start-weight-decay to "
            "--end-weight-decay: give both, or drop the style for a constant --weight-decay."
        )
    # upstream's validation sets both to --weight-decay for the constant style
    decay = getattr(args, "weight_decay", None)
    if style == "constant" and (start, end) != (None, None) and (start, end) != (decay, decay):
        raise BoundedArgumentError(
            "--start-weight-decay and --end-weight-decay need --weight-decay-incr-style linear or "
            "cosine (the default, constant, uses --weight-decay): add the style, or remove them."
        )


def _check_checkpoint_intervals(args) -> None:
    if not getattr(args, "save", None):
        return
    interval = getattr(args, "save_interval", None)
    if interval is None or interval < 1:
        given = "is missing" if interval is None else f"is {interval}"
        raise BoundedArgumentError(
            f"--save needs --save-interval (iterations between checkpoints), which {given}: add "
            "e.g. --save-interval 1000."
        )
    retain = getattr(args, "save_retain_interval", None)
    if retain is not None and (retain < 1 or retain % interval):
        raise BoundedArgumentError(
            f"--save-retain-interval {retain} must be a positive multiple of --save-interval "
            f"{interval} (the checkpoints kept are among those saved): e.g. "
            f"--save-retain-interval {interval * max(1, ceil_div(retain, interval))}."
        )


def _check_layout(args) -> None:
    """Tensor and context parallelism's divisibility rules."""
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if heads is not None and heads % tp:
        raise BoundedArgumentError(
            f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads {heads} "
            "(each tensor-parallel rank holds whole heads): use a tensor-parallel size that "
            "divides the heads."
        )
    groups = getattr(args, "num_query_groups", None)
    if getattr(args, "group_query_attention", False) and groups and groups % tp:
        raise BoundedArgumentError(
            f"--tensor-model-parallel-size {tp} does not divide --num-query-groups {groups}: use "
            "a tensor-parallel size that divides the query groups."
        )
    hidden = args.hidden_size
    if heads is not None and hidden is not None and args.kv_channels is None and hidden % heads:
        raise BoundedArgumentError(
            f"--num-attention-heads {heads} does not divide --hidden-size {hidden} (the head "
            "width is hidden / heads): choose heads that divide the hidden size, or give "
            "--kv-channels."
        )
    cp, seq = args.context_parallel_size, args.seq_length
    if cp > 1 and seq is not None and seq % (2 * cp):
        raise BoundedArgumentError(
            f"--seq-length {seq} must be a multiple of 2 × --context-parallel-size ({2 * cp}): "
            "each context-parallel rank takes two equal chunks of every sequence; pad the "
            "sequence length or change the context-parallel size."
        )
    if getattr(args, "sequence_parallel", False) and tp > 1 and seq is not None and (seq // cp) % tp:
        multiple = math.lcm(tp * cp, 2 * cp if cp > 1 else 1)
        share = f"--seq-length {seq}" if cp == 1 else (
            f"the {seq // cp} tokens of --seq-length {seq} that each of --context-parallel-size "
            f"{cp} ranks holds")
        raise BoundedArgumentError(
            f"--sequence-parallel splits {share} over --tensor-model-parallel-size {tp} ranks, "
            f"which does not divide them: make --seq-length a multiple of {multiple} (e.g. "
            f"{ceil_div(seq, multiple) * multiple}), or remove --sequence-parallel."
        )


def _check_moe(args) -> None:
    experts = args.num_experts
    if experts is None:
        for name in ("moe_expert_rank_capacity_factor", "moe_expert_capacity_factor"):
            if getattr(args, name, None) is not None:
                raise BoundedArgumentError(
                    f"{flag_name(name)} applies to MoE layers, and this model is dense (no "
                    f"--num-experts): remove {flag_name(name)}, or add --num-experts."
                )
        return
    topk, ep = args.moe_router_topk, args.expert_model_parallel_size
    if not 1 <= topk <= experts:
        raise BoundedArgumentError(
            f"--moe-router-topk {topk} must be between 1 and --num-experts ({experts}): each "
            "token is routed to that many distinct experts."
        )
    if experts % ep:
        raise BoundedArgumentError(
            f"--expert-model-parallel-size {ep} does not divide --num-experts {experts} (each "
            "expert-parallel rank holds as many experts): use an expert-parallel size that "
            "divides the experts."
        )


def _check_mtp(args) -> None:
    layers = getattr(args, "mtp_num_layers", None)
    if layers is not None and layers < 0:
        raise BoundedArgumentError(
            f"--mtp-num-layers must be >= 0 (multi-token-prediction layers; 0 turns them off), "
            f"got {layers}: give e.g. --mtp-num-layers 1, or leave the flag out."
        )
    factor = getattr(args, "mtp_loss_scaling_factor", None)
    if factor is not None and not (math.isfinite(factor) and factor >= 0):
        # a NaN or infinite weight makes every gradient NaN at the first step
        raise BoundedArgumentError(
            f"--mtp-loss-scaling-factor must be a finite weight >= 0 of the multi-token-prediction "
            f"loss, got {factor}: give e.g. 0.1 (megatron-core's default)."
        )


def _check_recompute(args) -> None:
    granularity = args.recompute_granularity
    if granularity == "full" and args.recompute_method is None:
        raise BoundedArgumentError(
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers: add e.g. --recompute-method uniform --recompute-num-layers 1."
        )
    # --recompute-activations and --moe-layer-recompute turn selective recompute on themselves
    selective = granularity == "selective" or granularity is None and (
        getattr(args, "recompute_activations", False) or getattr(args, "moe_layer_recompute", False))
    if args.recompute_modules is not None and not selective:
        modules = " ".join(args.recompute_modules)
        why = ("full recompute runs whole layers again" if granularity
               else "without it nothing is recomputed")
        raise BoundedArgumentError(
            f"--recompute-modules {modules} is read with --recompute-granularity selective only "
            f"({why}): add --recompute-granularity selective, or remove --recompute-modules."
        )


def _check_paths(args) -> None:
    """Checkpoint directories that are files; data prefixes whose files are missing, damaged or
    empty (:mod:`megatron.bounded.data.indexed_check`); more than one data source."""
    for name in ("save", "load"):
        path = getattr(args, name, None)
        if path and os.path.isfile(path):
            raise BoundedArgumentError(
                f"{flag_name(name)} {path} is a file; checkpoints are directories: name a "
                "directory (it is created when saving)."
            )
    sources = [flag for flag, given in (
        ("--mock-data", getattr(args, "mock_data", False)),
        ("--data-path", bool(getattr(args, "data_path", None))),
        ("--train-data-path/--valid-data-path/--test-data-path", any(
            getattr(args, name, None) for name in ("train_data_path", "valid_data_path",
                                                   "test_data_path"))),
    ) if given]
    if len(sources) > 1:
        raise BoundedArgumentError(
            f"{' and '.join(sources)} each name the training data: keep one of them."
        )
    check_data_files(args)  # each prefix's .bin and .idx: there, whole, of one corpus

