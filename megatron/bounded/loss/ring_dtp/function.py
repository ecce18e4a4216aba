"""Ring-DTP's entry point ``ring_dtp_cross_entropy`` and its autograd function, which runs the
schedule of the ring's mode (or of one rank) forward and backward. ``reference_cross_entropy`` is
the materialized computation the tests and benchmark compare with.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron.bounded.loss.ring_dtp.ring import DTYPES, MODES, Ring, build_ring, logger
from megatron.bounded.loss.ring_dtp.schedules import (
    activations_backward,
    activations_forward,
    activations_with_grads,
    weights_backward,
    weights_forward,
)
from megatron.bounded.loss.ring_dtp.single import (
    check_gradient_rows,
    single_backward,
    single_forward,
    single_with_grads,
)
from megatron.bounded.loss.ring_dtp.strips import acc_dtype
from megatron.bounded.units import log_once


def reference_cross_entropy(
    hidden: torch.Tensor, full_weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Materialized per-token cross-entropy of ``hidden @ full_weight^T`` (fp32; fp64 for fp64)."""
    acc = acc_dtype(hidden.dtype, full_weight.dtype)
    logits = hidden.to(acc) @ full_weight.to(acc).T
    return F.cross_entropy(logits, labels.long(), reduction="none", ignore_index=ignore_index)


def _common_gradient_scale(ring: Ring, grad_loss: torch.Tensor, valid: torch.Tensor) -> Optional[float]:
    """The one value every valid token's loss gradient has on every rank of the ring, or None
    when they differ (then gradients computed in forward for a unit scale do not apply).
    All ranks take part and reach the same answer (one small all-gather)."""
    g = grad_loss.to(torch.float64)
    has_valid = valid.any()
    first = g[torch.argmax(valid.to(torch.int8))] if valid.numel() else g.new_zeros(())
    uniform = torch.where(valid, g == first, torch.ones_like(valid)).all()
    mine = torch.stack([has_valid.to(torch.float64), first, uniform.to(torch.float64)])
    if ring.world == 1:
        rows = [mine.tolist()]
    else:
        gathered = [torch.empty_like(mine) for _ in range(ring.world)]
        dist.all_gather(gathered, mine, group=ring.group)
        rows = torch.stack(gathered).cpu().tolist()
    scales = {row[1] for row in rows if row[0]}
    if not all(row[2] for row in rows) or len(scales) > 1:
        return None
    return scales.pop() if scales else 0.0


def _scaled(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` in ``dtype``: in place when ``grad`` has it, else rounded as it is
    written (one pass over the fp32 ``grad``, the same values as scaling it and then rounding)."""
    if grad.dtype == dtype:
        return grad.mul_(scale)
    return torch.mul(grad, scale, out=torch.empty_like(grad, dtype=dtype))


# the schedules that can compute the gradients in forward (see grad_in_forward)
_GRAD_IN_FORWARD_MODES = ("single", "activations")


# the ring schedules by mode (one rank, "single", takes its own arguments)
_FORWARD = {
    "weights": weights_forward,
    "activations": activations_forward,
}
_BACKWARD = {
    "weights": weights_backward,
    "activations": activations_backward,
}


class _RingDTPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight_shard, labels, ring: Ring, chunk, ignore_index, grad_in_forward,
                gradient_rows):
        acc = acc_dtype(hidden.dtype, weight_shard.dtype)
        h = hidden.contiguous()
        w = weight_shard.contiguous()
        t = labels.to(torch.int64).contiguous()
        valid = t != ignore_index
        # (ring_dtp_cross_entropy already turned it off where autograd will not differentiate)
        ctx.with_grads = grad_in_forward and ring.mode in _GRAD_IN_FORWARD_MODES
        unit_grads = ()
        if ctx.with_grads:
            if ring.mode == "single":
                state, dx, dw = single_with_grads(h, t, w, valid, acc, chunk, gradient_rows)
            else:
                state, dx, dw = activations_with_grads(ring, h, t, w, valid, acc, chunk)
            unit_grads = (dx, dw)
        elif ring.mode == "single":
            state = single_forward(h, t, w, acc, chunk)
        else:
            state = _FORWARD[ring.mode](ring, h, t, w, acc, chunk)
        lse = state[0] + torch.log(state[1])
        loss = torch.where(valid, lse - state[2], torch.zeros_like(lse))
        ctx.save_for_backward(h, w, t, lse, *unit_grads)
        ctx.ring, ctx.chunk, ctx.ignore_index, ctx.acc = ring, chunk, ignore_index, acc
        ctx.gradient_rows = gradient_rows
        ctx.dtypes = (hidden.dtype, weight_shard.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        h, w, t, lse, *unit_grads = ctx.saved_tensors
        ring, acc = ctx.ring, ctx.acc
        valid = t != ctx.ignore_index
        scale = _common_gradient_scale(ring, grad_loss, valid) if ctx.with_grads else None
        if scale is not None:
            dx, dw = (_scaled(g, scale, d) for g, d in zip(unit_grads, ctx.dtypes))
        else:
            if ctx.with_grads:
                log_once(
                    logger,
                    "Ring-DTP grad_in_forward: the loss gradient is not one value for every valid "
                    "token on every rank, so the gradients computed in forward do not apply; "
                    "replaying the strips (exact, one more GEMM per strip). Fold per-token "
                    "weights into ignore_index, or reduce the loss by a sum or mean.",
                    level=logging.WARNING,
                )
            gscale = torch.where(valid, grad_loss.to(acc), torch.zeros((), dtype=acc, device=h.device))
            if ring.mode == "single":
                dx, dw = single_backward(h, t, w, lse, gscale, acc, ctx.chunk, ctx.gradient_rows)
            else:
                dx, dw = _BACKWARD[ring.mode](ring, h, t, w, lse, gscale, acc, ctx.chunk)
        dx = dx.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = dw.to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def ring_dtp_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    mode: str = "auto",
    chunk_tokens: Optional[int] = None,
    ignore_index: int = -100,
    grad_in_forward: bool = False,
    gradient_rows: Optional[int] = None,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ W^T`` over the full vocabulary, W sharded on a ring.

    Args:
        hidden: [N, H] this rank's tokens (N may differ across ranks, and may be 0).
        weight_shard: [V_r, H] rows ``vocab_shard_range(V, r, P)`` of the full weight, r = rank in
            ``group``.
        labels: [N] target ids in [0, V), or ``ignore_index`` (loss 0, no gradient).
        group: the P ranks of the ring; ``None`` (or a single-rank group) means one rank.
        mode: ``"weights"``, ``"activations"`` or ``"auto"`` (docs/operators/ring_dtp.md).
        chunk_tokens: rows per strip; bounds the live strip to chunk_tokens x ceil(V/P).
        ignore_index: label value that marks ignored tokens.
        grad_in_forward: compute the gradients in the forward for a loss gradient of one value
            on every valid token of every rank, so every strip is formed once (single-rank and
            ``activations`` schedules; otherwise, or for a non-uniform gradient, the backward
            replays the strips, exact either way).
        gradient_rows: one rank only: rows of G per weight-gradient GEMM, a multiple of
            ``chunk_tokens``; None: ``gradient_group_rows``.

    Returns:
        [N] loss in fp32 (fp64 if an input is fp64), differentiable w.r.t. ``hidden`` and
        ``weight_shard``. Every rank of ``group`` must call this (and later its backward) together.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    check_gradient_rows(gradient_rows, chunk_tokens)
    if hidden.dim() != 2 or weight_shard.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "expected hidden [N, H], weight_shard [V_r, H], labels [N]; got shapes "
            f"{tuple(hidden.shape)}, {tuple(weight_shard.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight_shard.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, "
            f"weight_shard {tuple(weight_shard.shape)}, labels {tuple(labels.shape)}"
        )
    if hidden.dtype not in DTYPES or weight_shard.dtype not in DTYPES:
        raise ValueError(f"unsupported dtypes {hidden.dtype}, {weight_shard.dtype}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    # no gradients are computed in forward for a forward that autograd will not differentiate
    # (evaluation under no_grad: a Function's needs_input_grad does not see the grad mode)
    grad_in_forward = bool(grad_in_forward) and torch.is_grad_enabled() and (
        hidden.requires_grad or weight_shard.requires_grad)
    ring = build_ring(hidden, weight_shard, labels, group, mode, ignore_index, grad_in_forward)
    chunk = None if chunk_tokens is None else int(chunk_tokens)
    rows = None if gradient_rows is None else int(gradient_rows)
    return _RingDTPFunction.apply(hidden, weight_shard, labels, ring, chunk, ignore_index,
                                  grad_in_forward, rows)
