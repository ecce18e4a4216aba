"""Fused weighted SwiGLU of the grouped experts, over the valid rows of a static buffer only.

The grouped experts (``megatron.bounded.moe.experts``) turn each expert-grouped fc1 output row
``[gate | linear]`` (``2F`` wide) and its routing probability ``p`` into::

    scaled = silu(gate) · linear · p                                        (forward)

and in backward, from ``grad`` = d loss / d scaled::

    d linear = grad · p · silu(gate)
    d gate   = grad · p · linear · σ(gate) · (1 + gate · (1 − σ(gate)))
    d p      = Σ_f grad · silu(gate) · linear                                 (one sum per row)

plus ``scaled`` once more, which fc2's weight gradient needs. Eagerly that is a chain of
elementwise kernels over the whole static buffer (R rows, of which only ``offs[-1]`` are valid:
a capacity factor of 1.5 pads a third of them), each reading and writing an R × F or R × 2F
tensor. Here one Triton kernel per direction reads every input once, computes in fp32, rounds
once, and skips the padding rows (it reads the valid-row count ``offs[-1]`` on the device: no
host sync). Each row's probability gradient is summed in a fixed order over F, so it does not
depend on R or on what ran before (unlike a compiled kernel picked by shape).

Memory: nothing beyond the outputs (forward R × F; backward R × 2F + R × F + R fp32); traffic
per valid row 2F reads + F writes forward, 3F reads + 3F writes backward (bf16).
Contract (the experts'): rows at or beyond ``offs[-1]`` of every output are unspecified.

Rounding: the eager path rounds ``silu(gate)`` and ``silu(gate) · linear`` to bf16 before the fp32
product with ``p``; this rounds once, so the two differ by about one bf16 ulp.

Used on CUDA with Triton for the plain SwiGLU (``F.silu``, gated, no offset or clamp); every
other activation, and CPU tensors, take the eager path. ``weighted_swiglu_reference`` is the
pure-PyTorch statement of the math in fp32. Tests: ``tests/unit/moe/test_weighted_swiglu.py`` (the
kernels in Triton's interpreter on CPU against the reference); benchmark:
``tools/benchmarks/bench_weighted_swiglu.py``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "weighted_swiglu_reference",
    "weighted_swiglu_forward",
    "weighted_swiglu_backward",
]


def weighted_swiglu_reference(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · linear · p`` in fp32 for every row (``fc1`` = ``[gate | linear]``)."""
    gate, linear = fc1.float().chunk(2, dim=-1)
    return F.silu(gate) * linear * probs.float().unsqueeze(-1)


if HAVE_TRITON:

    @triton.jit
    def _valid_row_tile(probs_ptr, offs_ptr, last_offset, BLOCK_ROWS: tl.constexpr):
        """This program's rows, which of them are valid (< offs[-1]) and their probabilities."""
        valid_rows = tl.load(offs_ptr + last_offset)
        # int64: rows × row stride passes 2**31 in large buffers (2**20 rows of fc1 at FFN 1024)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < valid_rows
        p = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        return rows, row_ok, p

    @triton.jit
    def _gate_and_linear(fc1_ptr, rows, row_ok, start, fc1_stride, FFN: tl.constexpr,
                         BLOCK_FFN: tl.constexpr):
        """Columns [start, start + BLOCK_FFN) of the gate and linear halves, in fp32."""
        cols = start + tl.arange(0, BLOCK_FFN)
        ok = row_ok[:, None] & (cols[None, :] < FFN)
        fc1_at = fc1_ptr + rows[:, None] * fc1_stride + cols[None, :]
        gate = tl.load(fc1_at, mask=ok, other=0.0).to(tl.float32)
        linear = tl.load(fc1_at + FFN, mask=ok, other=0.0).to(tl.float32)
        return cols, ok, gate, linear

    @cached_launch
    @triton.jit
    def _forward_kernel(
        fc1_ptr, probs_ptr, offs_ptr, out_ptr, last_offset, fc1_stride, out_stride,
        FFN: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_FFN: tl.constexpr,
    ):
        rows, row_ok, p = _valid_row_tile(probs_ptr, offs_ptr, last_offset, BLOCK_ROWS)
        for start in range(0, FFN, BLOCK_FFN):
            cols, ok, gate, linear = _gate_and_linear(
                fc1_ptr, rows, row_ok, start, fc1_stride, FFN, BLOCK_FFN)
            scaled = gate * tl.sigmoid(gate) * linear * p[:, None]
            out_at = out_ptr + rows[:, None] * out_stride + cols[None, :]
            tl.store(out_at, scaled.to(out_ptr.dtype.element_ty), mask=ok)

    @cached_launch
    @triton.jit
    def _backward_kernel(
        fc1_ptr, probs_ptr, grad_ptr, offs_ptr, grad_fc1_ptr, scaled_ptr, grad_probs_ptr,
        last_offset, fc1_stride, grad_stride, grad_fc1_stride, scaled_stride, FFN: tl.constexpr,
        PROBS_GRAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_FFN: tl.constexpr,
    ):
        rows, row_ok, p = _valid_row_tile(probs_ptr, offs_ptr, last_offset, BLOCK_ROWS)
        grad_p = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for start in range(0, FFN, BLOCK_FFN):
            cols, ok, gate, linear = _gate_and_linear(
                fc1_ptr, rows, row_ok, start, fc1_stride, FFN, BLOCK_FFN)
            grad = tl.load(grad_ptr + rows[:, None] * grad_stride + cols[None, :], mask=ok,
                           other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            act = silu * linear
            grad_act = grad * p[:, None]
            grad_gate = grad_act * linear * sig * (1.0 + gate * (1.0 - sig))
            grad_fc1_at = grad_fc1_ptr + rows[:, None] * grad_fc1_stride + cols[None, :]
            tl.store(grad_fc1_at, grad_gate.to(grad_fc1_ptr.dtype.element_ty), mask=ok)
            tl.store(grad_fc1_at + FFN, (grad_act * silu).to(grad_fc1_ptr.dtype.element_ty), mask=ok)
            scaled_at = scaled_ptr + rows[:, None] * scaled_stride + cols[None, :]
            tl.store(scaled_at, (act * p[:, None]).to(scaled_ptr.dtype.element_ty), mask=ok)
            if PROBS_GRAD:
                grad_p += tl.sum(grad * act, axis=1)
        if PROBS_GRAD:
            tl.store(grad_probs_ptr + rows, grad_p.to(grad_probs_ptr.dtype.element_ty), mask=row_ok)


def _blocks(ffn: int) -> Tuple[int, int]:
    """(rows, columns) of one program's tile: about 4,096 elements per step."""
    block_ffn = min(triton.next_power_of_2(ffn), 1024)
    return max(1, 4096 // block_ffn), block_ffn


def _check(fc1: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor) -> int:
    if fc1.dim() != 2 or fc1.shape[1] % 2 or probs.shape != fc1.shape[:1]:
        raise ValueError(f"fc1 {tuple(fc1.shape)} / probs {tuple(probs.shape)}: need [R, 2F] / [R]")
    if fc1.stride(1) != 1 or not probs.is_contiguous() or offs.dtype != torch.int32:
        raise ValueError("fc1 rows and probs must be contiguous and offs int32")
    return fc1.shape[1] // 2


def weighted_swiglu_forward(fc1: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[R, 2F]``, ``[R]``, expert end offsets ``[E]`` (int32) -> ``[R, F]`` scaled activation in
    ``fc1``'s dtype; rows at or beyond ``offs[-1]`` unspecified."""
    ffn = _check(fc1, probs, offs)
    out = torch.empty(fc1.shape[0], ffn, dtype=fc1.dtype, device=fc1.device)
    block_rows, block_ffn = _blocks(ffn)
    grid = (triton.cdiv(fc1.shape[0], block_rows),)
    _forward_kernel[grid](
        fc1, probs, offs, out, offs.shape[0] - 1, fc1.stride(0), out.stride(0),
        FFN=ffn, BLOCK_ROWS=block_rows, BLOCK_FFN=block_ffn,
    )
    return out


def weighted_swiglu_backward(
    fc1: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor, grad_scaled: torch.Tensor,
    probs_grad: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(d fc1 ``[R, 2F]``, scaled ``[R, F]``, d probs ``[R]`` or None) from d scaled ``[R, F]``;
    rows at or beyond ``offs[-1]`` unspecified."""
    ffn = _check(fc1, probs, offs)
    if grad_scaled.shape != (fc1.shape[0], ffn) or grad_scaled.stride(1) != 1:
        raise ValueError(f"grad_scaled {tuple(grad_scaled.shape)}: need contiguous rows [R, {ffn}]")
    grad_fc1 = torch.empty_like(fc1)
    scaled = torch.empty_like(grad_scaled, dtype=fc1.dtype)
    grad_probs = torch.empty_like(probs) if probs_grad else None
    block_rows, block_ffn = _blocks(ffn)
    grid = (triton.cdiv(fc1.shape[0], block_rows),)
    _backward_kernel[grid](
        fc1, probs, grad_scaled, offs, grad_fc1, scaled,
        grad_probs if probs_grad else probs,  # not written without PROBS_GRAD
        offs.shape[0] - 1, fc1.stride(0), grad_scaled.stride(0), grad_fc1.stride(0),
        scaled.stride(0), FFN=ffn, PROBS_GRAD=probs_grad, BLOCK_ROWS=block_rows,
        BLOCK_FFN=block_ffn,
    )
    return grad_fc1, scaled, grad_probs
