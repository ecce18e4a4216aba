"""Ring-DTP in a Megatron GPT model: the output layer sharded over the ranks with distinct tokens.

``--ring-dtp`` makes every rank of the data-parallel group with context parallelism (DP × CP
ranks, each holding different tokens) keep only rows ``vocab_shard_range(V, r, P)`` of the
output-layer weight (P = DP × CP, V = padded vocabulary) and compute the language-model
loss of its own tokens with :func:`megatron.bounded.loss.ring_dtp.ring_dtp_cross_entropy`,
so no rank materializes N × V logits and the output layer's weight, gradient and optimizer state
shrink P times. Pieces:

* :func:`shard_output_layer` — a pre-wrap hook (``GPTModelConfig.pre_wrap_hooks``): replaces the
  output layer's full weight by this rank's rows of it. Every rank of the ring initialized the
  same full weight, so the shards are exactly the rows of that initialization. The shard is marked
  ``allreduce = False``: Megatron's DDP then reduces its gradient over the expert-data-parallel
  group, which :meth:`RingDTPSettings.check` requires to be a single rank (each shard's gradient
  is already complete: it travelled the ring), and the gradient norm sums the shards over the
  expert-model-parallel group, which then equals the ring's (DP × CP) group.
* :class:`RingDTPLoss` — ``output_processor`` for ``GPTModel.forward``: per-token loss [b, s];
  with ``--ring-dtp-grad-in-forward`` its gradients are computed in the forward, for which
  :func:`labels_for_loss` marks loss-masked tokens ignored (one loss-gradient value per token).
* the shard's ``sharded_state_dict`` places it at its row offset of the [V, H] weight, so
  distributed checkpoints hold the whole matrix once.

Memory: the standard path's three N × V fp32 tensors become Ring-DTP's strips (see
``workspace.py``: about 4 strips of N × V/P fp32, chunk × V/P with ``--ring-dtp-chunk-tokens``); the
output weight, its gradient and optimizer state are V/P × H instead of V × H per rank.
Tests: ``tests/unit/loss/test_ring_dtp_output.py`` (CPU, gloo), ``tests/functional/test_ring_dtp_training.py``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron.bounded.loss.ring_dtp.function import ring_dtp_cross_entropy
from megatron.bounded.loss.ring_dtp.ring import vocab_shard_range
from megatron.bounded.loss.ring_dtp.single import check_gradient_rows
from megatron.bounded.object_changes import object_change
from megatron.bounded.settings import BoundedArgumentError, Settings, knob

# label value of tokens without a loss (upstream's cross-entropy default)
IGNORE_INDEX = -100


def expert_data_parallel_size(args) -> int:
    """Ranks that replicate one expert shard (Megatron's expert-data-parallel group size)."""
    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    return args.world_size // (
        args.expert_model_parallel_size * expert_tp * args.pipeline_model_parallel_size
    )


@dataclass(frozen=True)
class RingDTPSettings(Settings):
    """Ring-DTP's flags (handed to :class:`RingDTPLoss` at model build)."""

    SWITCH = "ring_dtp"
    EARLY = False  # the ring is the data- x context-parallel group upstream derives

    ring_dtp: bool = knob(
        False, "Ring-DTP: shard the output layer's vocabulary over the data- x context-parallel "
        "ranks and pass strips around the ring: no rank holds N x V logits (exact).")
    ring_dtp_mode: str = knob(
        "auto", "Ring-DTP: what travels around the ring (auto: weights when N > V/P, activations "
        "with --ring-dtp-grad-in-forward).", choices=("auto", "weights", "activations"))
    ring_dtp_chunk_tokens: Optional[int] = knob(
        None, "Ring-DTP: split each strip into chunks of this many tokens (live strip: chunk x "
        "V/P). Default: whole strips.", metavar="T")
    ring_dtp_gradient_rows: Optional[int] = knob(
        None, "Ring-DTP on one rank: tokens of the gradient strip per weight-gradient GEMM, a "
        "multiple of --ring-dtp-chunk-tokens. Default: within the weight gradient's bytes.",
        metavar="R")
    ring_dtp_grad_in_forward: bool = knob(
        False, "Ring-DTP: compute the output layer's gradients in the forward (three GEMMs per "
        "strip instead of four); the backward replays the strips where that is not exact.")

    def check(self, args) -> None:
        """Layouts Ring-DTP supports; ``args`` are parsed (and upstream-validated) flags."""
        if not self.ring_dtp:
            return
        chunk = self.ring_dtp_chunk_tokens
        if chunk is not None and chunk <= 0:
            raise BoundedArgumentError(
                f"--ring-dtp-chunk-tokens must be a positive number of tokens, got {chunk}; omit "
                "it to fold whole strips."
            )
        ring_size = args.data_parallel_size * args.context_parallel_size
        # (one rank runs the single-rank schedule, which takes it whatever the mode)
        if self.ring_dtp_mode == "weights" and self.ring_dtp_grad_in_forward and ring_size > 1:
            raise BoundedArgumentError(
                "--ring-dtp-grad-in-forward has no effect with --ring-dtp-mode weights on a ring "
                f"of {ring_size} ranks (the weights schedule computes the gradients in the "
                "backward): remove --ring-dtp-grad-in-forward, or use --ring-dtp-mode "
                "activations (or auto)."
            )
        unsupported = [
            (args.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1"),
            (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
            (not args.untie_embeddings_and_output_weights, "tied embedding and output weights "
             "(add --untie-embeddings-and-output-weights)"),
            (bool(getattr(args, "mtp_num_layers", None)), "--mtp-num-layers"),
        ]
        for is_set, what in unsupported:
            if is_set:
                raise BoundedArgumentError(
                    f"--ring-dtp does not support {what} yet: remove it or --ring-dtp.")
        check_gradient_rows(self.ring_dtp_gradient_rows, chunk,
                            ("--ring-dtp-gradient-rows", "--ring-dtp-chunk-tokens"),
                            BoundedArgumentError)
        if self.ring_dtp_gradient_rows is not None and ring_size > 1:
            raise BoundedArgumentError(
                f"--ring-dtp-gradient-rows takes effect on one rank only; this ring has {ring_size} "
                f"(data-parallel × context-parallel): remove it."
            )
        if expert_data_parallel_size(args) != 1:
            raise BoundedArgumentError(
                "--ring-dtp shards the output layer over the data- and context-parallel ranks and "
                "keeps its gradient out of the data-parallel reduction the way expert weights are "
                "kept, which needs one rank per expert shard: an MoE model with "
                f"--expert-model-parallel-size equal to data-parallel × context-parallel size "
                f"({ring_size}); otherwise remove --ring-dtp."
            )
        divisor = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        if divisor % ring_size != 0:
            raise BoundedArgumentError(
                f"--ring-dtp needs equal vocabulary shards: --make-vocab-size-divisible-by "
                f"({args.make_vocab_size_divisible_by}) must be a multiple of the data-parallel × "
                f"context-parallel size ({ring_size})."
            )

    def loss(self) -> "RingDTPLoss":
        """The ``output_processor`` these settings give the model."""
        return RingDTPLoss(self.ring_dtp_mode, self.ring_dtp_chunk_tokens,
                           grad_in_forward=self.ring_dtp_grad_in_forward,
                           gradient_rows=self.ring_dtp_gradient_rows)


def _unwrap(module):
    while not hasattr(module, "output_layer") and hasattr(module, "module"):
        module = module.module
    return module


def ring_group():
    """The ranks whose tokens differ and which share one output layer: data × context parallel."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def shard_output_layer(model_chunks, group=None):
    """Pre-wrap hook: keep this rank's vocabulary rows of every output layer; returns the chunks."""
    group = group if group is not None else ring_group()
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    for chunk in model_chunks:
        model = _unwrap(chunk)
        output_layer = getattr(model, "output_layer", None) if model.post_process else None
        if output_layer is None:
            continue
        full = output_layer.weight
        start, end = vocab_shard_range(full.shape[0], rank, size)
        shard = torch.nn.Parameter(full.detach()[start:end].clone())
        for name, value in vars(full).items():  # tensor-parallel and sharding attributes
            setattr(shard, name, value)
        shard.allreduce = False
        object_change("ring-dtp-output-layer-shard").set(
            output_layer, weight=shard, ring_dtp_shard=(rank, size),
            sharded_state_dict=types.MethodType(_shard_sharded_state_dict, output_layer))
    return model_chunks


def _shard_sharded_state_dict(output_layer, prefix="", sharded_offsets=(), metadata=None):
    rank, size = output_layer.ring_dtp_shard
    key = f"{prefix}weight"
    # shard `rank` of `size` equal row blocks; every rank holds a different block, so each is
    # the main copy of its piece (replica 0)
    return {
        key: ShardedTensor.from_rank_offsets(
            key, output_layer.weight, (0, rank, size), replica_id=(0, 0, 0)
        )
    }


class RingDTPLoss:
    """``output_processor`` of ``GPTModel.forward``: per-token losses [b, s] through the ring."""

    def __init__(self, mode: str = "auto", chunk_tokens=None, group=None, grad_in_forward=False,
                 gradient_rows=None):
        self.mode = mode
        self.chunk_tokens = chunk_tokens
        self.gradient_rows = gradient_rows
        self.group = group
        # gradients in forward need one loss-gradient value per valid token: the caller passes
        # the labels of loss-masked tokens as IGNORE_INDEX (``labels_for_loss``)
        self.grad_in_forward = grad_in_forward

    def __call__(self, *, hidden_states, output_layer, labels, **_unused):
        if labels is None:
            raise ValueError("Ring-DTP computes the training loss only: labels are required")
        group = self.group if self.group is not None else ring_group()
        seq, batch, hidden = hidden_states.shape
        tokens = hidden_states.transpose(0, 1).reshape(batch * seq, hidden)
        loss = ring_dtp_cross_entropy(
            tokens,
            output_layer.weight,
            labels.reshape(-1),
            group=group,
            mode=self.mode,
            chunk_tokens=self.chunk_tokens,
            ignore_index=IGNORE_INDEX,
            grad_in_forward=self.grad_in_forward,
            gradient_rows=self.gradient_rows,
        )
        return loss.view(batch, seq)


def labels_for_loss(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The labels with loss-masked tokens marked ignored: their loss and gradient are 0 either
    way, and without a masked token every remaining token's loss gradient is the same value,
    which gradients in forward need."""
    return labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
