"""Row gather that skips the rows nobody reads: the data movement of the static-capacity dispatcher.

    out[r] = source[index[r]]      where index[r] >= 0
    out[r] = unspecified           where index[r] <  0

A static-capacity buffer of ``E_p × C`` rows holds padding after each slab's valid rows (about a
third of the rows at capacity factor 1.5 with balanced routing). The dispatcher moves such buffers
six times per layer, forward and backward: tokens into send slabs, received slabs into
expert-grouped order, and back. ``index_select`` reads and writes every row, padding included. Here
a padding row gets index −1: the CUDA kernel reads and writes nothing for it. What the row then
holds (whatever the allocator left there) is never read into a result: the grouped experts stop at
``tokens_per_expert.sum()``, the combine sums only kept slots, and probabilities of padding rows
are masked explicitly (``tests/unit/moe/test_token_dispatcher.py`` poisons padding with NaN to check
this).

The eager reference (used on CPU and without Triton) is ``index_select`` with −1 clamped to row 0,
so skipped rows then hold a copy of row 0, as they did before this kernel existed.

Memory: the ``[R, ...]`` output only. Traffic: 2 × (rows with index ≥ 0) × row bytes, against
2 × R × row bytes for ``index_select``.
Tests: ``tests/unit/kernels/test_row_gather.py`` (the kernel in Triton's interpreter on CPU against the
reference, rows with index −1 left untouched). Benchmark: ``tools/benchmarks/bench_row_gather.py``.
"""

from __future__ import annotations

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["gather_rows", "gather_rows_reference", "SKIP"]

SKIP = -1  # the index of a row that is not gathered


def gather_rows_reference(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]`` along dim 0 with ``SKIP`` read as row 0 (eager)."""
    return source.index_select(0, index.clamp(min=0))


if HAVE_TRITON:

    @cached_launch
    @triton.jit
    def _gather_rows_kernel(
        source_ptr, index_ptr, out_ptr, source_stride, out_stride,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row × stride may pass 2**31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        source_row = tl.load(index_ptr + row)
        take = (cols < WIDTH) & (source_row >= 0)
        values = tl.load(source_ptr + source_row * source_stride + cols, mask=take)
        tl.store(out_ptr + row * out_stride + cols, values, mask=take)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[S, W]`` rows and ``[R]`` int64 indices (``SKIP`` = do not gather) -> ``[R, W]``.

    One Triton kernel for 2-D CUDA tensors; elsewhere (and for 1-D tensors such as routing
    probabilities, whose rows are too small to be worth a kernel) ``gather_rows_reference``.
    """
    if HAVE_TRITON and source.is_cuda and source.dim() == 2 and index.numel() > 0:
        return _launch(source, index)
    return gather_rows_reference(source, index)


def _launch(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel; ``out`` (``[R, W]``, row stride free, unit column stride) keeps skipped rows."""
    rows, width = index.shape[0], source.shape[1]
    source = source if source.stride(1) == 1 else source.contiguous()
    if out is None:
        out = torch.empty(rows, width, dtype=source.dtype, device=source.device)
    if rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 2048)
    grid = (rows, triton.cdiv(width, block))
    _gather_rows_kernel[grid](
        source, index.contiguous(), out, source.stride(0), out.stride(0), WIDTH=width, BLOCK=block,
    )
    return out
