"""Row-wise softmax work on one logits strip of Ring-DTP, fused into one pass over the strip.

Ring-DTP (``megatron.bounded.loss.ring_dtp``) forms one fp32 strip ``l = h · W_shard^T``
(``n × s``: n tokens, s vocabulary rows of one shard) at a time and needs two things from it:

* forward, the fold of the strip into each token's running state (m, z, y)::

      m' = max(m, max_v l_v)     z' = z · exp(m − m') + Σ_v exp(l_v − m')     y' = y + l[target]

  (``target`` is the token's label as a column of this strip, or −1 when the label lies in
  another shard or the token is ignored);
* backward, the gradient strip ``G = (exp(l − lse) − onehot(target)) · g`` (``lse`` the token's
  final log-sum-exp, ``g`` its loss gradient, 0 for ignored tokens), in the dtype of the GEMMs
  that consume it.

Eagerly each is a chain of four or five kernels, every one reading (and most writing) the whole
strip: at n = 8,192 and s = 100,000 one pass moves 3.3 GB. On CUDA with Triton one kernel per
direction reads the strip once (the fold keeps an online maximum and rescaled sum per row; the
gradient writes ``G`` straight in the GEMM dtype, in place when that is fp32). Elsewhere the
eager reference runs. Both compute in fp32; they differ by summation order and the exponential's
last bits (a few fp32 ulp). Where the fold has just made a token's state final (one rank, the
gradient formed in the forward), ``gradient_strip_after_fold`` takes the state itself and the
kernel forms ``lse = m + log(z)`` per row, with libdevice's ``log``: the same bits as
``state[0] + torch.log(state[1])``, without the two small kernels per strip that compute them.

Memory: nothing beyond the state (forward) or ``G`` (backward, ``n × s`` in the GEMM dtype, or
the strip itself for fp32; or rows of a caller's buffer, ``out``). Tests:
``tests/unit/loss/test_strip_softmax.py`` (the kernels in Triton's interpreter on CPU against the
eager reference; on CUDA, the gradient after the fold bitwise the one from torch's lse);
benchmark: ``tools/benchmarks/bench_strip_softmax.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

__all__ = [
    "rescale_running_sum",
    "fold_strip",
    "fold_strip_fused",
    "fold_strip_reference",
    "gradient_strip",
    "gradient_strip_after_fold",
    "gradient_strip_after_fold_fused",
    "gradient_strip_fused",
    "gradient_strip_reference",
]


def rescale_running_sum(m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """exp(m_old - m_new), defined as 0 where m_old = -inf (an empty running sum)."""
    return torch.where(m_old == -math.inf, torch.zeros_like(m_old), torch.exp(m_old - m_new))


def fold_strip_reference(strip: torch.Tensor, targets: torch.Tensor, state: torch.Tensor) -> None:
    """Eager fold of ``strip`` [n, s] into ``state`` [3, n] (m, z, y) in place; ``targets`` [n]
    holds each token's column in this strip or -1. The strip is only read (one temporary of its
    size holds the exponentials)."""
    hit = targets >= 0
    picked = strip.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    state[2] += torch.where(hit, picked, torch.zeros_like(picked))
    m_old = state[0]
    m_new = torch.maximum(m_old, strip.amax(dim=1))
    exponentials = torch.exp(strip - m_new.unsqueeze(1))
    state[1] = state[1] * rescale_running_sum(m_old, m_new) + exponentials.sum(dim=1)
    state[0] = m_new


def gradient_strip_reference(strip: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                             gscale: torch.Tensor, dtype: torch.dtype,
                             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eager ``(exp(strip - lse) - onehot(targets)) * gscale`` in ``dtype``; the strip is
    overwritten (and returned when ``dtype`` is its own and no ``out`` is given). ``out``: an
    [n, s] tensor of ``dtype`` (contiguous rows) to write ``G`` into instead, returned."""
    strip.sub_(lse.unsqueeze(1)).exp_()
    hit = (targets >= 0).to(strip.dtype)
    strip.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -hit.unsqueeze(1))
    strip.mul_(gscale.unsqueeze(1))
    if out is not None:
        _check_out(out, strip, dtype)
        return out if out.data_ptr() == strip.data_ptr() else out.copy_(strip)
    return strip if dtype == strip.dtype else strip.to(dtype)


def _check_out(out: torch.Tensor, strip: torch.Tensor, dtype: torch.dtype) -> None:
    if out.shape != strip.shape or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a {dtype} tensor of shape {tuple(strip.shape)} with "
                         f"contiguous rows; got {out.dtype} {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if out.data_ptr() == strip.data_ptr() and out.stride() != strip.stride():
        raise ValueError("out may be the strip itself, not another view of its storage")


if HAVE_TRITON:

    @cached_launch
    @triton.jit
    def _fold_kernel(strip_ptr, row_stride, targets_ptr, m_ptr, z_ptr, y_ptr,
                     NUM_COLS: tl.constexpr, BLOCK: tl.constexpr):
        # int64: row × row stride passes 2**31 for strips of a few GB
        row = tl.program_id(0).to(tl.int64)
        one = tl.arange(0, 1)
        base = strip_ptr + row * row_stride
        # the strip's own maximum and sum of exp relative to it, online over column blocks
        m_run = tl.full([1], float("-inf"), tl.float32)
        z_run = tl.zeros([1], tl.float32)
        for start in range(0, NUM_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < NUM_COLS, other=float("-inf"))
            m_new = tl.maximum(m_run, tl.max(x, axis=0))
            z_run = z_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m_run = m_new
        m_old = tl.load(m_ptr + row + one)
        z_old = tl.load(z_ptr + row + one)
        m_out = tl.maximum(m_old, m_run)
        scale_old = tl.where(m_old == float("-inf"), 0.0, tl.exp(m_old - m_out))
        tl.store(z_ptr + row + one, z_old * scale_old + z_run * tl.exp(m_run - m_out))
        tl.store(m_ptr + row + one, m_out)
        target = tl.load(targets_ptr + row + one)
        hit = target >= 0
        picked = tl.load(base + tl.where(hit, target, 0), mask=hit, other=0.0)
        tl.store(y_ptr + row + one, tl.load(y_ptr + row + one) + picked)

    @cached_launch
    @triton.jit
    def _gradient_kernel(strip_ptr, row_stride, out_ptr, out_row_stride, lse_ptr, z_ptr, gscale_ptr,
                         targets_ptr, NUM_COLS: tl.constexpr, BLOCK: tl.constexpr,
                         LSE_FROM_STATE: tl.constexpr, EXACT_LOG: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        one = tl.arange(0, 1)
        base = strip_ptr + row * row_stride
        out_base = out_ptr + row * out_row_stride
        lse = tl.load(lse_ptr + row + one)
        if LSE_FROM_STATE:  # lse_ptr holds the running maximum m: lse = m + log(z)
            z = tl.load(z_ptr + row + one)
            if EXACT_LOG:  # libdevice's logf: bitwise torch.log on CUDA
                lse = lse + libdevice.log(z)
            else:  # Triton's interpreter has no libdevice
                lse = lse + tl.log(z)
        gscale = tl.load(gscale_ptr + row + one)
        target = tl.load(targets_ptr + row + one)
        for start in range(0, NUM_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < NUM_COLS
            x = tl.load(base + cols, mask=in_row, other=0.0)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * gscale
            tl.store(out_base + cols, grad.to(out_ptr.dtype.element_ty), mask=in_row)

    # The column count is a compile-time constant (the shard width: at most two values on a
    # ring), which also keeps the column loop's bounds static.
    def _launch_options(num_cols: int):
        block = min(4096, triton.next_power_of_2(max(num_cols, 16)))
        return block, (8 if block >= 2048 else 4)


def _runs_fused(strip: torch.Tensor) -> bool:
    return HAVE_TRITON and strip.is_cuda and strip.dtype == torch.float32 and strip.stride(1) == 1


def fold_strip(strip: torch.Tensor, targets: torch.Tensor, state: torch.Tensor) -> None:
    """Fold the fp32 strip [n, s] into ``state`` [3, n] (m, z, y) in place (module docstring);
    ``targets`` [n] int64: each token's column in this strip, or -1. The strip is only read (a
    caller may keep it for the gradient). The Triton kernel on CUDA, the eager reference
    elsewhere."""
    if _runs_fused(strip) and strip.shape[0] > 0:
        fold_strip_fused(strip, targets, state)
    else:
        fold_strip_reference(strip, targets, state)


def gradient_strip(strip: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                   gscale: torch.Tensor, dtype: torch.dtype,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``G = (exp(strip - lse) - onehot(targets)) * gscale`` [n, s] in ``dtype`` (module
    docstring); for ``dtype`` = the strip's, ``G`` is written over the strip and returned. With
    ``out`` (an [n, s] tensor of ``dtype`` with contiguous rows, or the strip itself) ``G`` is
    written there and ``out`` returned. The Triton kernel on CUDA, the eager reference
    elsewhere."""
    if _runs_fused(strip) and strip.shape[0] > 0:
        return gradient_strip_fused(strip, lse, targets, gscale, dtype, out)
    return gradient_strip_reference(strip, lse, targets, gscale, dtype, out)


def gradient_strip_after_fold(strip: torch.Tensor, state: torch.Tensor, targets: torch.Tensor,
                              gscale: torch.Tensor, dtype: torch.dtype,
                              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gradient_strip` with ``lse = m + log(z)`` of a final folded ``state`` [3, n]
    (m, z, y): the Triton kernel forms it per row, with libdevice's ``log`` (bitwise
    ``state[0] + torch.log(state[1])``, which the eager reference computes)."""
    if _runs_fused(strip) and strip.shape[0] > 0:
        return gradient_strip_after_fold_fused(strip, state, targets, gscale, dtype, out)
    return gradient_strip_reference(strip, state[0] + torch.log(state[1]), targets, gscale, dtype,
                                    out)


def fold_strip_fused(strip: torch.Tensor, targets: torch.Tensor, state: torch.Tensor) -> None:
    """:func:`fold_strip` as one Triton kernel (one program per row); the strip is only read."""
    if strip.stride(1) != 1 or strip.dtype != torch.float32:
        raise ValueError("the fused fold needs an fp32 strip with contiguous rows")
    rows = [state[i].contiguous() for i in range(3)]  # views of [3, n] rows: no copy
    block, warps = _launch_options(strip.shape[1])
    _fold_kernel[(strip.shape[0],)](
        strip, strip.stride(0), targets.contiguous(), *rows,
        NUM_COLS=strip.shape[1], BLOCK=block, num_warps=warps,
    )
    for i, row in enumerate(rows):
        if row.data_ptr() != state[i].data_ptr():  # a strided state was copied: write it back
            state[i].copy_(row)


def gradient_strip_fused(strip: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                         gscale: torch.Tensor, dtype: torch.dtype,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gradient_strip` as one Triton kernel (one program per row)."""
    return _launch_gradient(strip, lse, None, targets, gscale, dtype, out)


def gradient_strip_after_fold_fused(strip: torch.Tensor, state: torch.Tensor,
                                    targets: torch.Tensor, gscale: torch.Tensor,
                                    dtype: torch.dtype,
                                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`gradient_strip_after_fold` as one Triton kernel (one program per row)."""
    return _launch_gradient(strip, state[0], state[1], targets, gscale, dtype, out)


def _launch_gradient(strip, lse_or_m, z, targets, gscale, dtype, out):
    """The gradient kernel; ``z`` given: ``lse_or_m`` is the state's m and lse = m + log(z)."""
    if strip.stride(1) != 1 or strip.dtype != torch.float32:
        raise ValueError("the fused gradient needs an fp32 strip with contiguous rows")
    if out is not None:
        _check_out(out, strip, dtype)
    elif dtype == strip.dtype:
        out = strip
    else:
        out = torch.empty(strip.shape, dtype=dtype, device=strip.device)
    lse_or_m = lse_or_m.contiguous()
    block, warps = _launch_options(strip.shape[1])
    _gradient_kernel[(strip.shape[0],)](
        strip, strip.stride(0), out, out.stride(0), lse_or_m,
        lse_or_m if z is None else z.contiguous(), gscale.contiguous(), targets.contiguous(),
        NUM_COLS=strip.shape[1], BLOCK=block, LSE_FROM_STATE=z is not None,
        EXACT_LOG=strip.is_cuda, num_warps=warps,
    )
    return out
