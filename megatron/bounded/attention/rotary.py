"""Rotary position embedding (non-interleaved, rotating the whole head dim) in one kernel per pass.

For ``t`` of shape ``[S, B, heads, D]`` and position angles ``freqs`` of shape ``[S, 1, 1, D]``
(fp32), with ``h = D / 2`` and every operation rounded to ``t``'s dtype, as upstream's eager
``_apply_rotary_pos_emb_bshd`` does::

    cos = (cos(freqs) · mscale) -> dtype           sin = (sin(freqs) · mscale) -> dtype
    out[i] = t[i] · cos[i] − t[i + h] · sin[i]      (i < h)
    out[i] = t[i] · cos[i] + t[i − h] · sin[i]      (i ≥ h)

and the input gradient that autograd takes through that graph (the transposed rotation)::

    grad_t[i] = g[i] · cos[i] + g[i + h] · sin[i + h]      (i < h)
    grad_t[i] = g[i] · cos[i] − g[i − h] · sin[i − h]      (i ≥ h)

Each product is rounded to the dtype, then the sum (negation commutes with rounding). Upstream
runs about a dozen small kernels forward (the two tables, the negated half, the concatenated
rotation, two products, the sum, the concatenation with the empty pass-through part) and about
seven backward: in a launch-bound step the host time of those launches is the cost. Here the
tables are computed once per ``freqs`` tensor (all layers of one forward pass the same object)
(while a CUDA graph is being captured, inside the capture, which then owns them) and each pass
is one Triton launch: one program per block of rows, a row being one
``(s, b, head)`` vector, which it reads as its two halves, multiplies by its position's table
rows in fp32 and rounds after each product and after the sum, as torch does: bitwise
upstream's output and gradient (checked against upstream on CPU for the reference, in Triton's
interpreter for the kernels in fp32, on the GPU in bf16, fp16 and fp32; the interpreter
truncates fp32 -> bf16 where GPUs round to nearest even, as torch does). The kernels are
compiled without floating-point contraction, which would fuse a product and the sum into one
rounding in fp32.

Memory: no temporaries besides the ``[S, B, heads, D]`` result (the eager forward also allocates
the negated half, the rotation and both products); autograd keeps only the two ``[S, D]``
tables, which the cache shares between the layers.
Traffic per pass: ``t`` (or the gradient) read once and the result written once, plus the
``2·S·D`` table elements, read once per head and batch row of each position (mostly from cache).
Tests: ``tests/unit/attention/test_rotary.py`` (the reference against upstream on CPU, the kernels in
Triton's interpreter against the reference, the table cache, the fused path on the GPU against
upstream).
"""

from __future__ import annotations

import weakref

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "fused_rotary_supported",
    "rotary_grad_reference",
    "rotary_tables",
]

# Elements of one half-row block a program handles: rows per program = this / the half width.
_HALF_ELEMENTS_PER_PROGRAM = 1024

# (weak reference to freqs, key, cos, sin) of the last call; one entry, so no old table outlives
# the next forward's freqs.
_last_tables = None


def rotary_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """``(cos, sin)``, each ``[S, D]`` contiguous in ``dtype``, computed as upstream does; the last
    result is returned again while ``freqs`` is the same, unchanged tensor (same object, version
    and storage), with the same ``dtype`` and ``mscale``."""
    global _last_tables
    if freqs.is_cuda and torch.cuda.is_current_stream_capturing():
        # a captured graph must own its tables: a cached one could be freed before a replay
        return _compute_tables(freqs, dtype, mscale)
    key = (freqs._version, freqs.data_ptr(), dtype, mscale)
    last = _last_tables
    # the weak reference, not id(freqs): a new tensor may reuse a freed one's id and address
    if last is not None and last[0]() is freqs and last[1] == key:
        return last[2], last[3]
    cos, sin = _compute_tables(freqs, dtype, mscale)
    # tables that carry a graph to freqs would tie every later forward to this one's graph
    _last_tables = None if freqs.requires_grad else (weakref.ref(freqs), key, cos, sin)
    return cos, sin


def _compute_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float):
    shape = (freqs.shape[0], freqs.shape[-1])
    cos = (torch.cos(freqs) * mscale).to(dtype).reshape(shape).contiguous()
    sin = (torch.sin(freqs) * mscale).to(dtype).reshape(shape).contiguous()
    return cos, sin


def _per_position(table: torch.Tensor) -> torch.Tensor:
    """``[S, D]`` -> ``[S, 1, 1, D]``, broadcast over batch and heads."""
    return table[:, None, None, :]


def apply_rotary_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[S, B, heads, D]`` rotated by ``[S, D]`` tables (eager, the same operations as
    upstream's, so the same roundings forward and, through autograd, backward)."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * _per_position(cos) + rotated * _per_position(sin)


def rotary_grad_reference(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The input gradient of :func:`apply_rotary_reference` for output gradient ``grad``, written
    out with autograd's roundings: what the backward kernel computes."""
    half = grad.shape[-1] // 2
    through_rotation = grad * _per_position(sin)
    transposed = torch.cat((through_rotation[..., half:], -through_rotation[..., :half]), dim=-1)
    return grad * _per_position(cos) + transposed


if HAVE_TRITON:

    @triton.jit
    def _rotate_rows(
        src_ptr, out_ptr, cos_ptr, sin_ptr, num_rows, batch, heads,
        stride_s, stride_b, stride_h,
        HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
        TRANSPOSED: tl.constexpr,
    ):
        # One block of rows: the rotation (TRANSPOSED false) or its transpose (the gradient).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        head = rows % heads
        sample = (rows // heads) % batch
        position = rows // heads // batch
        cols = tl.arange(0, BLOCK_HALF)
        mask = (rows < num_rows)[:, None] & (cols < HALF)[None, :]
        src_first = (src_ptr + (position * stride_s + sample * stride_b + head * stride_h)[:, None]
                     + cols[None, :])
        table_first = (position * (2 * HALF))[:, None] + cols[None, :]
        out_first = out_ptr + (rows * (2 * HALF))[:, None] + cols[None, :]

        x1 = tl.load(src_first, mask=mask).to(tl.float32)
        x2 = tl.load(src_first + HALF, mask=mask).to(tl.float32)
        cos1 = tl.load(cos_ptr + table_first, mask=mask).to(tl.float32)
        cos2 = tl.load(cos_ptr + table_first + HALF, mask=mask).to(tl.float32)
        sin1 = tl.load(sin_ptr + table_first, mask=mask).to(tl.float32)
        sin2 = tl.load(sin_ptr + table_first + HALF, mask=mask).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # each product rounded to the tensor's dtype, as torch's separate multiplies are
        if TRANSPOSED:
            partner1 = (x2 * sin2).to(dtype).to(tl.float32)
            partner2 = -(x1 * sin1).to(dtype).to(tl.float32)
        else:
            partner1 = -(x2 * sin1).to(dtype).to(tl.float32)
            partner2 = (x1 * sin2).to(dtype).to(tl.float32)
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + partner1
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + partner2
        tl.store(out_first, out1.to(dtype), mask=mask)
        tl.store(out_first + HALF, out2.to(dtype), mask=mask)

    @cached_launch
    @triton.jit
    def _rotary_forward_kernel(
        t_ptr, out_ptr, cos_ptr, sin_ptr, num_rows, batch, heads, stride_s, stride_b, stride_h,
        HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        _rotate_rows(t_ptr, out_ptr, cos_ptr, sin_ptr, num_rows, batch, heads,
                     stride_s, stride_b, stride_h, HALF, BLOCK_ROWS, BLOCK_HALF, False)

    @cached_launch
    @triton.jit
    def _rotary_backward_kernel(
        grad_ptr, grad_t_ptr, cos_ptr, sin_ptr, num_rows, batch, heads,
        stride_s, stride_b, stride_h,
        HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        _rotate_rows(grad_ptr, grad_t_ptr, cos_ptr, sin_ptr, num_rows, batch, heads,
                     stride_s, stride_b, stride_h, HALF, BLOCK_ROWS, BLOCK_HALF, True)


def _launch_rows(kernel, source: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``kernel`` over the rows of ``[S, B, heads, D]`` ``source`` -> contiguous result."""
    if source.stride(-1) != 1:  # an expanded gradient (stride 0), say
        source = source.contiguous()
    seq, batch, heads, dim = source.shape
    out = torch.empty((seq, batch, heads, dim), dtype=source.dtype, device=source.device)
    num_rows = seq * batch * heads
    if num_rows == 0:
        return out
    block_half = triton.next_power_of_2(dim // 2)
    block_rows = max(1, _HALF_ELEMENTS_PER_PROGRAM // block_half)
    kernel[(triton.cdiv(num_rows, block_rows),)](
        source, out, cos, sin, num_rows, batch, heads,
        source.stride(0), source.stride(1), source.stride(2),
        HALF=dim // 2, BLOCK_ROWS=block_rows, BLOCK_HALF=block_half,
        enable_fp_fusion=False,  # no fused multiply-add: torch rounds the product, then the sum
    )
    return out


def _launch_forward(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch_rows(_rotary_forward_kernel, t, cos, sin)


def _launch_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch_rows(_rotary_backward_kernel, grad, cos, sin)


class _FusedRotary(torch.autograd.Function):
    """One kernel forward, one backward; saves only the tables (the gradient does not need t)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch_forward(t, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch_backward(grad, cos, sin), None, None


def fused_rotary_supported(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool,
                           mla_rotary_interleaved: bool, cu_seqlens) -> bool:
    """Whether :func:`apply_rotary` runs the kernels for upstream's call with these arguments:
    CUDA with Triton, ``[S, B, heads, D]`` fp32/bf16/fp16 with unit stride on D, ``[S, 1, 1, D]``
    angles covering the whole head dim (no pass-through part) and not needing a gradient, the
    non-interleaved rotation, no packed sequences."""
    return (
        HAVE_TRITON and t.is_cuda and t.dim() == 4
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and t.shape[-1] % 2 == 0 and t.stride(-1) == 1
        and freqs.dim() == 4 and freqs.shape[-1] == t.shape[-1]
        and freqs.shape[0] == t.shape[0] and freqs.shape[1] == freqs.shape[2] == 1
        and not freqs.requires_grad  # the fused function gives the angles no gradient
        and not rotary_interleaved and not mla_rotary_interleaved and cu_seqlens is None
    )


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Upstream's ``_apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)`` (non-interleaved, the
    angles covering the whole head dim), bitwise: the kernels where
    :func:`fused_rotary_supported`, the eager reference otherwise."""
    if freqs.shape[-1] != t.shape[-1]:
        raise ValueError(f"apply_rotary rotates the whole head dim ({t.shape[-1]}); the angles "
                         f"cover {freqs.shape[-1]}")
    cos, sin = rotary_tables(freqs, t.dtype, mscale)
    if fused_rotary_supported(t, freqs, False, False, None):
        return _FusedRotary.apply(t, cos, sin)
    return apply_rotary_reference(t, cos, sin)
