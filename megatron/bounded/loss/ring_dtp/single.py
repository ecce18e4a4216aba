"""Ring-DTP on one rank: a chunked fused linear + cross-entropy whose gradient strips are kept in
groups of rows, one weight-gradient GEMM per group (:func:`gradient_group_rows`).
Derivation: docs/operators/ring_dtp.md.
"""

from __future__ import annotations

from typing import Optional

import torch

# through the module, so every schedule calls the one binding of ``strips.mm`` (which the tests
# rebind to emulate the CUDA GEMM on CPU)
import megatron.bounded.loss.ring_dtp.strips as strips
from megatron.bounded.loss.ring_dtp.kernels import (
    fold_strip, gradient_strip, gradient_strip_after_fold,
)


def single_forward(h, t, w, acc, chunk):
    state = strips.new_state(h.shape[0], acc, h.device)
    strips.fold_shard(h, t, strips.gemm_operand(w, h, acc), 0, state, chunk, acc)
    return state


def single_backward(h, t, w, lse, gscale, acc, chunk, group_rows):
    # each group's dX is one GEMM (no accumulation over strips): written in the input dtype, it
    # is the returned gradient, rounded once as a cast of an fp32 dX would round it
    dx = torch.zeros(h.shape[0], h.shape[1], dtype=h.dtype, device=h.device)
    dw = torch.zeros(w.shape[0], w.shape[1], dtype=acc, device=w.device)
    _single_grouped(h, t, w, strips.gemm_operand(w, h, acc), acc, chunk, group_rows, gscale, dx,
                    dw, lse=lse)
    return dx, dw


def gradient_group_rows(chunk_rows: int, hidden_size: int, weight_bytes: int, grad_bytes: int,
                        acc_bytes: int = 4, separate_strip: bool = True) -> int:
    """Rows of the gradient strip G that one rank keeps for one weight-gradient GEMM (a multiple
    of ``chunk_rows``, at least one chunk).

    The weight gradient is accumulated in ``acc`` (fp32); every GEMM that adds into it reads and
    writes the whole s x H accumulator, whatever its token count K. G is therefore kept for as
    many chunks as fit, together with the fp32 strip being formed when that is a separate tensor
    (16-bit G), in the bytes of H input-dtype elements per vocabulary row: the size of the
    returned weight gradient, which the backward's rounding of the accumulator forms anyway.
    Per vocabulary row: rows * grad_bytes + (chunk_rows * acc_bytes if separate_strip) <=
    hidden_size * weight_bytes.
    """
    chunk_rows = max(1, int(chunk_rows))
    budget = int(hidden_size) * int(weight_bytes) - (chunk_rows * int(acc_bytes) if separate_strip else 0)
    return max(1, budget // (int(grad_bytes) * chunk_rows)) * chunk_rows


def check_gradient_rows(gradient_rows: Optional[int], chunk_tokens: Optional[int],
                        names=("gradient_rows", "chunk_tokens"), error_class=ValueError) -> None:
    """``gradient_rows`` is None or a positive multiple of ``chunk_tokens`` (which it needs);
    ``names`` are the two as the caller's user knows them (arguments, or flags)."""
    if gradient_rows is None:
        return
    rows_name, chunk_name = names
    if chunk_tokens is None:
        raise error_class(f"{rows_name} needs {chunk_name}: without chunks the whole batch is "
                          f"one strip and one group; add {chunk_name} or remove {rows_name}.")
    if int(gradient_rows) < 1 or int(gradient_rows) % int(chunk_tokens):
        raise error_class(f"{rows_name} must be a positive multiple of {chunk_name} "
                          f"({chunk_tokens}), got {gradient_rows}.")


def _single_grouped(h, t, w, w_op, acc, chunk, group_rows, gscale, dx, dw, state=None,
                    lse=None) -> None:
    """One rank's gradients, strip by strip; shared by the replay (``lse`` given) and gradients in
    forward (``state`` given: each strip is folded first, and its rows' log-sum-exp is then final).

    Each chunk's strip becomes its rows of G in a buffer of ``group_rows`` rows (None:
    ``gradient_group_rows``), in the GEMM dtype (for fp32 GEMMs the strip is formed in the buffer
    itself); once the buffer is full one GEMM gives the group's fp32 dX (written into ``dx``,
    rounded when ``dx`` is 16-bit) and one adds G^T . h into ``dw``: the fp32 accumulator is read
    and written once per group instead of once per chunk. Both callers group alike, so their GEMMs
    are the same."""
    n, hidden = h.shape
    vo = w_op.shape[0]
    if n == 0 or vo == 0:
        return
    step = chunk or n
    g_dtype = w_op.dtype
    separate = g_dtype != acc  # 16-bit G: the fp32 strip is formed apart, then rounded into G
    group = group_rows or gradient_group_rows(step, hidden, w.element_size(), g_dtype.itemsize,
                                              acc.itemsize, separate)
    group = min(group, -(-n // step) * step)
    buf = torch.empty(group, vo, dtype=g_dtype, device=h.device)
    targets = strips.local_targets(t, 0, vo)
    w_t = w_op.T
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        for a in range(g0, g1, step):
            b = min(g1, a + step)
            rows = buf[a - g0:b - g0]
            h_c = h[a:b].to(g_dtype)
            strip = strips.mm(h_c, w_t, acc) if separate else torch.mm(h_c, w_t, out=rows)
            strips.note_strip(strip)
            del h_c
            if state is not None:
                fold_strip(strip, targets[a:b], state[:, a:b])
                gradient_strip_after_fold(strip, state[:, a:b], targets[a:b], gscale[a:b],
                                          g_dtype, out=rows)
            else:
                gradient_strip(strip, lse[a:b], targets[a:b], gscale[a:b], g_dtype, out=rows)
            del strip, rows
        grad = buf[:g1 - g0]
        h_g = h[g0:g1].to(g_dtype)
        dx[g0:g1] = strips.mm(grad, w_op, acc)
        if g_dtype == acc:
            dw.addmm_(grad.T, h_g)
        else:
            strips.accumulate_mm(dw, grad.T, h_g)
        strips.STATS["weight_grad_gemms"] += 1
        del grad, h_g


def single_with_grads(h, t, w, valid, acc, chunk, group_rows):
    """One rank: per row chunk, the full-vocabulary strip is folded and, its log-sum-exp being
    final at once, turned into the unit gradient (1 per valid token) of dX and dW
    (:func:`_single_grouped`)."""
    n, H = h.shape
    state = strips.new_state(n, acc, h.device)
    dx = torch.empty(n, H, dtype=h.dtype, device=h.device)  # each group's, rounded once
    dw = torch.zeros(w.shape[0], H, dtype=acc, device=w.device)
    _single_grouped(h, t, w, strips.gemm_operand(w, h, acc), acc, chunk, group_rows,
                    valid.to(acc), dx, dw, state=state)
    return state, dx, dw
