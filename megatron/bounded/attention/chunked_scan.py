"""A recurrent token mixer recomputed in sequence chunks, its carry handed from chunk to chunk.

A recurrent layer (gated DeltaNet) maps a whole sequence ``x`` to ``y`` through a carry (its
state) that each token updates. Backward through the whole sequence at once holds every
intermediate of every token. :func:`chunked_scan` runs ``step(x_chunk, carry) -> (y_chunk,
carry')`` over chunks of rows as one autograd node: the forward runs the chunks in order without
gradients and keeps only ``x`` and the carry entering each chunk; the backward recomputes the
chunks from the last to the first, each from its kept carry, and back-propagates the chunk's
output gradient together with the gradient of the carry it handed on (from the later chunk's
backward), so only one chunk's intermediates are alive.

Exact: each chunk recomputes the forward's operations on the same inputs; weight gradients are
summed over the chunks (within floating-point rounding of the unchunked sum). Inside the
recompute of upstream's full-recompute checkpoint the node's output is read by nothing once its
backward starts (the layer's residual add has run its backward), so its storage is released
then, as the chunked MLP block does.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence, Tuple

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from megatron.bounded.attention.blockwise import block_bounds, rows_by_block

__all__ = ["chunked_scan", "input_and_its_gradient"]

Carry = Tuple[torch.Tensor, ...]


def _scan(step, x, bounds, initial: Carry, entering: list = None) -> torch.Tensor:
    """The chunks run in order into one output; ``entering`` collects each chunk's carry."""
    carry = initial

    def chunk(start, end):
        nonlocal carry
        if entering is not None:
            entering.append(carry)
        y, carry = step(x[start:end], carry)
        return (y,)

    return rows_by_block(x.shape[0], bounds, chunk)[0]


def input_and_its_gradient(ctx) -> Tuple[torch.Tensor, torch.Tensor]:
    """At the start of a chunked node's backward: the input it saved and an empty gradient for
    it, once the output's storage (``ctx.output``, a weak reference inside a checkpoint's
    recompute, else None) is released."""
    (x,) = ctx.saved_tensors
    out = ctx.output() if ctx.output is not None else None
    if out is not None:  # the checkpoint recompute's output only starts the backward
        out.untyped_storage().resize_(0)
    return x, torch.empty_like(x)


class _ChunkedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: Callable, bounds: Sequence[Tuple[int, int]], release_output: bool,
                x: torch.Tensor, *initial: torch.Tensor):
        carries = []
        out = _scan(step, x, bounds, initial, carries)
        ctx.step, ctx.bounds, ctx.carries = step, bounds, carries
        ctx.output = weakref.ref(out) if release_output else None
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, grad_x = input_and_its_gradient(ctx)
        grad_carry = None  # the last chunk's carry goes nowhere
        for (start, end), carry in zip(reversed(ctx.bounds), reversed(ctx.carries)):
            chunk = x[start:end].detach().requires_grad_(True)
            carry = tuple(part.detach().requires_grad_(True) for part in carry)
            with torch.enable_grad():
                y, handed_on = ctx.step(chunk, carry)
            outputs, grads = [y], [grad_out[start:end]]
            if grad_carry is not None:
                outputs += list(handed_on)
                grads += list(grad_carry)
            torch.autograd.backward(outputs, grads)
            grad_x[start:end] = chunk.grad
            grad_carry = tuple(torch.zeros_like(part) if part.grad is None else part.grad
                               for part in carry)
            del y, handed_on, chunk, carry
        ctx.carries = None
        return (None, None, None, grad_x) + (None,) * len(grad_carry)


def chunked_scan(step: Callable[[torch.Tensor, Carry], Tuple[torch.Tensor, Carry]],
                 x: torch.Tensor, initial: Carry, chunk_rows: int) -> torch.Tensor:
    """``y`` of ``step`` run over chunks of ``chunk_rows`` rows (dim 0) of ``x`` from the carry
    ``initial`` (module docstring); with gradients, one autograd node that keeps ``x`` and the
    carry entering each chunk and recomputes the chunks in backward, last to first."""
    bounds = block_bounds(x.shape[0], chunk_rows)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _scan(step, x, bounds, initial)
    return _ChunkedScan.apply(step, bounds, is_checkpointing(), x, *initial)
