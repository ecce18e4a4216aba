"""Ring-DTP's strips: the GEMM dtype of a strip, forming one strip at a time, folding it into the
running (max, sum, target logit) state and turning it into the gradient strip G; and the counters
of what a call formed and sent (:func:`ring_dtp_stats`). Derivation: docs/operators/ring_dtp.md.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.bounded.loss.ring_dtp.kernels import fold_strip, gradient_strip, rescale_running_sum


STATS = {}


def reset_ring_dtp_stats() -> None:
    """Reset the instrumentation counters returned by :func:`ring_dtp_stats`."""
    STATS.clear()
    STATS.update(
        max_strip_elements=0,  # largest logits strip (elements) formed since the last reset
        num_strips=0,  # strips formed (forward and backward replay)
        bytes_sent=0,  # payload bytes this rank posted to its ring successor
        hops=0,  # batched P2P exchanges posted
        last_mode=None,  # schedule used by the last call: "weights", "activations" or "single"
        weight_grad_gemms=0,  # single rank: GEMMs adding into the fp32 weight gradient
    )


reset_ring_dtp_stats()


def ring_dtp_stats() -> dict:
    """A copy of this process's Ring-DTP counters (see :func:`reset_ring_dtp_stats`)."""
    return dict(STATS)


def note_strip(strip: torch.Tensor) -> None:
    STATS["num_strips"] += 1
    if strip.numel() > STATS["max_strip_elements"]:
        STATS["max_strip_elements"] = strip.numel()


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if any(d == torch.float64 for d in dtypes) else torch.float32


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_PROBED: dict = {}


def _probed(name: str, device: torch.device, dtype: torch.dtype, probe) -> bool:
    """``probe(device, dtype)`` once per (name, device type, dtype); an error counts as False."""
    key = (name, device.type, dtype)
    if key not in _PROBED:
        try:
            _PROBED[key] = bool(probe(device, dtype))
        except (RuntimeError, TypeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


def mixed_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=fp32)`` runs for 16-bit ``a``, ``b`` here."""

    def probe(device, dtype):
        a = torch.zeros(16, 16, dtype=dtype, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32

    return _probed("mm", device, dtype, probe)


def gemm_operand(w: torch.Tensor, h: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The weight in the dtype the strip GEMMs take. Hidden and weight of one 16-bit dtype stay
    16-bit where a 16-bit GEMM can write an fp32 result (CUDA): fp32 strips at tensor-core speed
    with no fp32 copy of the shard. Elsewhere (and for mixed dtypes) both are upcast to ``acc``."""
    if w.dtype in _SIXTEEN_BIT and h.dtype == w.dtype and acc == torch.float32:
        if mixed_gemm_supported(w.device, w.dtype):
            return w
    return w.to(acc)


def mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with an ``acc`` result (a 16-bit GEMM writes fp32 directly)."""
    return a @ b if a.dtype == acc else torch.mm(a, b, out_dtype=acc)


def mixed_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=fp32, out=c)`` adds a 16-bit product into an fp32
    ``c`` in place here, for a plain and a transposed ``a`` (checked against the unfused sum)."""

    def probe(device, dtype):
        a = (torch.arange(256, device=device, dtype=torch.float32).view(16, 16) / 64).to(dtype)
        for left in (a, a.t()):
            c = torch.ones(16, 16, device=device)
            expected = c + torch.mm(left, a, out_dtype=torch.float32)
            torch.addmm(c, left, a, out_dtype=torch.float32, out=c)
            if not torch.allclose(c, expected, rtol=1e-6, atol=0):
                return False
        return True

    return _probed("addmm", device, dtype, probe)


def accumulate_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for 16-bit ``a``, ``b`` and an fp32 ``total``: in place where the GEMM
    can add into fp32 (CUDA), else through an fp32 product (``mm``) of ``total``'s size."""
    if mixed_addmm_supported(a.device, a.dtype):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(mm(a, b, total.dtype))


def new_state(n: int, acc: torch.dtype, device) -> torch.Tensor:
    """A (3, n) state (m, z, y) equal to the identity of the fold: m = -inf, z = 0, y = 0."""
    state = torch.zeros(3, n, dtype=acc, device=device)
    state[0].fill_(-math.inf)
    return state


def _strips(h, w_op, chunk: Optional[int], acc):
    """Yield ``(a, b, h_chunk, strip)`` for the row chunks [a, b) of ``h``: ``strip`` is the fp32
    ``h[a:b] . w_op^T`` [rows, V_shard], the only strip alive; ``h_chunk`` is in ``w_op``'s dtype.
    Nothing is yielded for an empty batch or shard."""
    n, vo = h.shape[0], w_op.shape[0]
    if n == 0 or vo == 0:
        return
    step = chunk or n
    w_t = w_op.T
    for a in range(0, n, step):
        b = min(n, a + step)
        h_chunk = h[a:b].to(w_op.dtype)
        strip = mm(h_chunk, w_t, acc)
        note_strip(strip)
        yield a, b, h_chunk, strip
        del h_chunk, strip  # the caller has dropped them too: one strip alive at a time


def local_targets(t: torch.Tensor, offset: int, shard_rows: int) -> torch.Tensor:
    """Each label as a column of the shard starting at ``offset``, or -1 outside it (other
    shards' labels and ``ignore_index``)."""
    local = t - offset
    return torch.where((local >= 0) & (local < shard_rows), local, torch.full_like(local, -1))


def fold_shard(h, t, w_op, offset: int, state: torch.Tensor, chunk: Optional[int], acc) -> None:
    """Fold the strips ``h . w_op^T`` (rows chunked) into ``state`` in place; ``w_op`` is in the
    GEMM dtype (:func:`gemm_operand`), the strips and the state in ``acc``."""
    targets = local_targets(t, offset, w_op.shape[0])
    for a, b, _, strip in _strips(h, w_op, chunk, acc):
        fold_strip(strip, targets[a:b], state[:, a:b])
        del strip  # before the next strip is formed


def merge_state(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- dst (+) src for two fold states over disjoint vocabulary parts."""
    m = torch.maximum(dst[0], src[0])
    z = dst[1] * rescale_running_sum(dst[0], m) + src[1] * rescale_running_sum(src[0], m)
    dst[2].add_(src[2])
    dst[1].copy_(z)
    dst[0].copy_(m)


def grad_from_strip(strip, lse, targets, gscale, w_op, h_c, dx_acc, dw_acc, acc) -> None:
    """G = (softmax - onehot) * gscale from one strip (overwritten); dx_acc += G . w and
    dw_acc += G^T . h_c. The GEMMs run in ``w_op``'s dtype (:func:`gemm_operand`); the
    accumulators are in ``acc``, and so is G for ``acc`` GEMMs (written over the strip) while
    16-bit GEMMs take G rounded to 16 bits, as a 16-bit output layer's backward does."""
    grad_strip = gradient_strip(strip, lse, targets, gscale, w_op.dtype)
    del strip
    if w_op.dtype == acc:
        dx_acc.addmm_(grad_strip, w_op)
        dw_acc.addmm_(grad_strip.T, h_c)
    else:  # 16-bit GEMMs with fp32 results, accumulated across chunks and shards
        accumulate_mm(dx_acc, grad_strip, w_op)
        accumulate_mm(dw_acc, grad_strip.T, h_c)


def grad_shard(h, t, w_op, offset: int, lse, gscale, dx_acc, dw_acc, chunk: Optional[int], acc):
    """Replay the strips of one shard: dx_acc += G . w, dw_acc += G^T . h with G recomputed
    from the saved log-sum-exp (:func:`grad_from_strip`)."""
    targets = local_targets(t, offset, w_op.shape[0])
    for a, b, h_c, strip in _strips(h, w_op, chunk, acc):
        grad_from_strip(strip, lse[a:b], targets[a:b], gscale[a:b], w_op, h_c, dx_acc[a:b],
                         dw_acc, acc)
        del strip, h_c
