"""Collectives shared by several operators: differentiable row all-to-all and row permutation.

The static-capacity MoE dispatcher (``megatron.bounded.moe.dispatch.token_dispatcher``), PipelinedLLEP
(``megatron.bounded.moe.pipelined_llep``) and the context-parallel attention exchange
(``megatron.bounded.attention.context_parallel``) move rows of ``[rows, ...]`` tensors between ranks and reorder
them. The helpers here do both with autograd support:

* :func:`all_to_all_rows`: ``all_to_all_single`` along dim 0 (equal splits, or explicit split
  lists); its backward is the reverse exchange. It is the identity with no group or a one-rank
  group. Optionally a weight-gradient handoff runs its pending GEMM while the backward's
  exchange is in flight.
* :func:`permute_rows`: ``x[index]`` for a permutation with a known inverse; the backward is the
  gather by the inverse (no scatter, no atomics, so results are deterministic). Entries equal to
  ``megatron.bounded.kernels.row_gather.SKIP`` leave the destination row unwritten (padding rows).
* :func:`start_all_to_all` / :func:`all_to_all_blocking`: the raw exchange, asynchronous or
  waited for.

They work on CPU tensors over gloo and on CUDA tensors over NCCL, and never synchronize with the
host. Tests: ``tests/unit/moe/test_token_dispatcher.py``, ``tests/unit/attention/test_ulysses.py``,
``tests/unit/moe/test_wgrad_handoff.py`` (multi-rank, gloo).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import utils as mcore_utils

from megatron.bounded.kernels.row_gather import gather_rows

__all__ = ["all_to_all_rows", "permute_rows", "start_all_to_all", "all_to_all_blocking"]


class _PermuteRows(torch.autograd.Function):
    """out = x[index] for a permutation ``index`` whose inverse is ``inverse`` (either may hold
    SKIP for padding rows, which are then not written: see ``row_gather``)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return gather_rows(x, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return gather_rows(grad, inverse), None, None


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward is the reverse all-to-all.

    With a handoff (an object with ``params`` and ``run()``, e.g.
    ``megatron.bounded.moe.wgrad_handoff.WeightGradHandoff``) its parameters are extra inputs
    that the forward does not use; the backward runs the handoff's pending weight-gradient GEMM
    while its exchange is in flight and returns the result as their gradients.
    """

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, handoff, *handoff_params):
        ctx.group = group
        ctx.output_splits = output_splits
        ctx.input_splits = input_splits
        ctx.handoff = handoff
        return all_to_all_blocking(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        out, exchange = start_all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits)
        handoff_grads = ctx.handoff.run() if ctx.handoff is not None else ()
        ctx.handoff = None
        exchange.wait()
        return (out, None, None, None, None) + tuple(handoff_grads)


def start_all_to_all(x, group, output_splits, input_splits):
    """Issue the exchange on the process group's stream: ``(output, work)``; the output is
    ready once ``work.wait()`` returned (on CUDA: the current stream waits for it)."""
    x = x.contiguous()
    if output_splits is None:
        out_rows = x.shape[0]
    else:
        out_rows = int(sum(output_splits))
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(
        out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group,
        async_op=True,
    )
    return out, work


def all_to_all_blocking(x, group, output_splits, input_splits):
    """The exchange of :func:`start_all_to_all`, waited for; not differentiable."""
    out, work = start_all_to_all(x, group, output_splits, input_splits)
    work.wait()
    return out


def all_to_all_rows(
    x: torch.Tensor,
    group,
    output_splits: Optional[List[int]] = None,
    input_splits: Optional[List[int]] = None,
    handoff=None,
) -> torch.Tensor:
    """Differentiable all-to-all of rows; equal splits when both split lists are None.

    With no group or a one-rank group it is the identity (no communication).  ``handoff``: run
    its pending weight gradients during the backward's exchange (only when ``x`` needs a
    gradient: otherwise there is no backward exchange to overlap, and it must not be given).
    """
    if group is None or mcore_utils.get_pg_size(group) == 1:
        return x
    if x.requires_grad:
        params = handoff.params if handoff is not None else ()
        return _AllToAllRows.apply(x, group, output_splits, input_splits, handoff, *params)
    if handoff is not None:
        raise ValueError("a weight-gradient handoff needs an all-to-all input that needs a gradient")
    return all_to_all_blocking(x, group, output_splits, input_splits)


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Differentiable row permutation ``x[index]`` (``inverse`` is the inverse permutation; SKIP
    entries in either leave padding rows unwritten)."""
    return _PermuteRows.apply(x, index, inverse)
