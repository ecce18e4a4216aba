"""Attention sinks (``--softmax-type off-by-one`` / ``learnable``) on any attention kernel.

Upstream's local ``DotProductAttention`` appends to every score row one more logit per head, its
``softmax_offset`` s_h (zeros for ``off-by-one``, a learnable parameter of ``heads`` per
tensor-parallel rank for ``learnable``), and drops that column after the softmax: a key of
logit s_h whose value is zero. Given a kernel's output O and log-sum-exp L over the real keys,
the sink's attention is

    L' = logaddexp(L, s_h),    O' = O · exp(L − L').

Backward: the probabilities over the real keys are exp(score − L'), and D = rowsum(dO ∘ O')
is the sink softmax's (the sink adds nothing to it: its value is zero), so the kernel's own
backward called with (O', L') gives the exact dQ, dK, dV; the sink's gradient is
dL/ds_h = −Σ_rows exp(s_h − L') · rowsum(dO ∘ O'). :class:`KernelAttention` applies this to a
kernel pair of :mod:`megatron.bounded.attention.windows` (windows and sinks together); the
blocked backward of :mod:`megatron.bounded.attention.blockwise` uses :func:`with_sink` and
:func:`sink_gradient` directly. Tensors are ``[b, heads, s, d]``; log-sum-exps ``[b, heads, s]``
(or with a trailing 1, as cuDNN's).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from megatron.core import tensor_parallel

from megatron.bounded.attention.windows import Band

__all__ = ["KernelAttention", "sink_gradient", "softmax_offset", "with_sink"]


def softmax_offset(config, heads: int) -> Optional[torch.Tensor]:
    """The sink logits of ``heads`` heads (this tensor-parallel rank's) for
    ``config.softmax_type``, as upstream's local attention makes them: None for ``vanilla``,
    zeros for ``off-by-one``, a parameter initialized by ``config.init_method`` for
    ``learnable`` (tensor-parallel along its only dimension)."""
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type == "vanilla":
        return None
    on_gpu = torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)
    device = torch.cuda.current_device() if on_gpu else "cpu"
    offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
    if softmax_type == "off-by-one":
        return offset
    if softmax_type != "learnable":
        raise ValueError(f"softmax_type {softmax_type!r} is not one of vanilla, off-by-one, "
                         "learnable")
    offset = torch.nn.Parameter(offset)
    tensor_parallel.set_tensor_model_parallel_attributes(offset, True, 0, 1)
    if config.perform_initialization:
        with torch.no_grad():
            config.init_method(offset)
    return offset


def _per_row(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[heads] -> broadcastable against ``lse`` [b, heads, s(, 1)], in the log-sum-exp's dtype."""
    return sink.to(lse.dtype).view(1, -1, *([1] * (lse.dim() - 2)))


def with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor):
    """(O', L') from a kernel's output and log-sum-exp over the real keys."""
    total = torch.logaddexp(lse, _per_row(sink, lse))
    factor = torch.exp(lse - total)
    if factor.dim() < out.dim():
        factor = factor.unsqueeze(-1)
    return out * factor.to(out.dtype), total


ROW_DOT_ROWS = 8192  # rows of dO ∘ O' widened at a time by sink_gradient


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  sink: torch.Tensor) -> torch.Tensor:
    """dL/ds [heads] (in the log-sum-exp's dtype) from rows' output gradient, the corrected
    output O' and log-sum-exp L'."""
    rows_lse = lse.reshape(out.shape[:-1])
    # rowsum(dO ∘ O') in the log-sum-exp's dtype, a slice of rows at a time: the widened copies
    # of dO and O' are then a slice's, not two more outputs' worth
    row_dot = rows_lse.new_empty(rows_lse.shape)
    for start in range(0, out.shape[2], ROW_DOT_ROWS):
        rows = slice(start, start + ROW_DOT_ROWS)
        row_dot[:, :, rows] = (grad_out[:, :, rows].to(rows_lse.dtype)
                               * out[:, :, rows].to(rows_lse.dtype)).sum(dim=-1)
    weight = torch.exp(_per_row(sink, rows_lse) - rows_lse)
    return -(weight * row_dot).sum(dim=(0, 2))


Kernel = Tuple[Callable, Callable]


class KernelAttention(torch.autograd.Function):
    """Attention through a (forward, backward) kernel pair under a band, with an optional sink:
    ``[b, heads, s, d]`` queries, ``[b, groups, s, d]`` keys/values, the sink ``[heads]`` or
    None. Saves what the kernel's own backward reads (q, k, v, O', L')."""

    @staticmethod
    def forward(ctx, kernel: Kernel, scale: float, band: Band, query, key, value,
                sink: Optional[torch.Tensor]):
        out, lse = kernel[0](query, key, value, scale, band)
        if sink is not None:
            out, lse = with_sink(out, lse, sink)
        ctx.kernel, ctx.scale, ctx.band = kernel, scale, band
        ctx.save_for_backward(query, key, value, out, lse, sink)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sink = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.kernel[1](grad_out, query, key, value, out, lse, ctx.scale,
                                               ctx.band)
        grad_sink = None
        if sink is not None and ctx.needs_input_grad[6]:
            grad_sink = sink_gradient(grad_out, out, lse, sink).to(sink.dtype)
        return None, None, None, grad_q, grad_k, grad_v, grad_sink
