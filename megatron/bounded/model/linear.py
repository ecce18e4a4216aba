"""The linear layers' autograd function without tensor parallelism: upstream's arithmetic with less
host time.

Every ``ColumnParallelLinear`` and ``RowParallelLinear`` (the attention's projections, the output
layer) runs upstream's ``LinearWithGradAccumulationAndAsyncCommunication``. Without tensor or
sequence parallelism most of its work is bookkeeping for those (the process group, the gather
buffers, the deferred weight gradients), and its ``custom_fwd`` / ``custom_bwd`` wrappers enter
an autocast context in every backward. In an eager step bound by the host's launches that costs
a visible share of a layer's host time.

:func:`linear` runs, for exactly the calls that need none of it, the same operations in the same
order: forward ``matmul(input, weight.t())`` (+ bias); backward ``grad_output.matmul(weight)``,
then upstream's ``prepare_input_tensors_for_wgrad_compute`` (contiguous, 2-D) and
``grad_output.t().matmul(input)`` (+ the bias gradient ``grad_output.sum(0)``). Outputs and
gradients are therefore bitwise upstream's. Every other call (tensor or sequence parallel, the
input gradient's all-reduce, gradient-accumulation fusion, deferred or GTP weight gradients,
autocast) goes to upstream's function unchanged. The patch that routes the calls here is
``linear-without-tensor-parallelism`` in :mod:`megatron.bounded.upstream.patches`.

Tests: ``tests/unit/model/test_linear.py`` (bitwise upstream's outputs and gradients on CPU, and on
CUDA with ``-m gpu``; which calls are left to upstream).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

__all__ = ["linear", "runs_lean"]


class _Linear(torch.autograd.Function):
    """``input @ weight.t() (+ bias)`` with upstream's backward arithmetic."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        device_type = grad_output.device.type
        if torch.is_autocast_enabled(device_type):
            # as upstream's custom_bwd: the backward runs in the forward's (disabled) autocast
            with torch.autocast(device_type, enabled=False):
                return _Linear._backward(ctx, grad_output)
        return _Linear._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_output, input = prepare_input_tensors_for_wgrad_compute(grad_output, input)
        grad_weight = grad_output.t().matmul(input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias


def runs_lean(input: torch.Tensor, gradient_accumulation_fusion: bool, allreduce_dgrad: bool,
              sequence_parallel: bool, grad_output_buffer, gtp_remat_size: int) -> bool:
    """Whether upstream's call with these arguments needs none of its communication or
    gradient-buffer work (then :func:`linear` computes it)."""
    return (
        not gradient_accumulation_fusion and not allreduce_dgrad and not sequence_parallel
        and grad_output_buffer is None and gtp_remat_size == 1
        and not torch.is_autocast_enabled(input.device.type)
    )


def linear(input: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Upstream's ``linear_with_grad_accumulation_and_async_allreduce`` for a call where
    :func:`runs_lean` holds, bitwise."""
    return _Linear.apply(input, weight, bias)
