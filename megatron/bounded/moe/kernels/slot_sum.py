"""Sum of each token's top-k expert rows: the combine of the static-capacity dispatcher.

    out[n] = Σ_{s = 0..k−1, keep[n, s]} source[slot_rows[n, s]]        (in slot order, fp32)

``source`` holds the rows that came back from the experts (combine forward) or the gradients of
the send rows (the dispatch's backward); a slot that is not kept points at row 0, which may be
another pair's row or padding holding NaN, and contributes nothing. The eager reference reads
each slot's rows with ``index_select``, masks them with ``torch.where`` and adds them into an
fp32 accumulator: per token about 16·H bytes per slot, k + 1 full-size temporaries. On CUDA one
Triton program per (token, column block) reads the k kept rows once, adds them in slot order in
fp32 and writes the token once (k·H·b + H·b bytes): the same additions in the same order, so the
result is bitwise the reference's (checked on the fp32 sums: Triton's interpreter, which the CPU
test runs, truncates fp32 -> bf16 where the GPU rounds to nearest even, as torch does).

Memory: no temporaries besides the [N, H] output (the reference also holds an fp32 [N, H]
accumulator and one [N, H] row per slot at a time).
Tests: ``tests/unit/moe/test_slot_sum.py`` (the kernel in Triton's interpreter on CPU, bitwise
against the reference); the dispatcher's tests use it through ``combine_slots``.
"""

from __future__ import annotations

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["slot_sum", "slot_sum_reference"]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def slot_sum_reference(
    source: torch.Tensor, slot_rows: torch.Tensor, slot_keep: torch.Tensor, out_dtype=None
) -> torch.Tensor:
    """``[R, ...]`` rows, ``[N, k]`` row per slot and keep flags -> ``[N, ...]`` (eager), in
    ``out_dtype`` (default: the source's)."""
    out_dtype = out_dtype or source.dtype
    num_tokens, topk = slot_rows.shape
    acc = torch.zeros(
        (num_tokens,) + tuple(source.shape[1:]),
        dtype=_accumulate_dtype(source.dtype),
        device=source.device,
    )
    if source.shape[0] == 0:
        return acc.to(out_dtype)
    for slot in range(topk):
        picked = source.index_select(0, slot_rows[:, slot])
        keep = slot_keep[:, slot].view((num_tokens,) + (1,) * (source.dim() - 1))
        acc.add_(torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device)))
    return acc.to(out_dtype)


if HAVE_TRITON:

    @cached_launch
    @triton.jit
    def _slot_sum_kernel(
        source_ptr, slot_rows_ptr, slot_keep_ptr, out_ptr, source_stride, out_stride,
        TOPK: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)  # token × row stride may pass 2**31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < HIDDEN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for slot in tl.static_range(TOPK):
            keep = tl.load(slot_keep_ptr + token * TOPK + slot) != 0
            row = tl.load(slot_rows_ptr + token * TOPK + slot)
            picked = tl.load(source_ptr + row * source_stride + cols, mask=col_ok & keep, other=0.0)
            acc += picked.to(tl.float32)
        tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def slot_sum(source: torch.Tensor, slot_rows: torch.Tensor, slot_keep: torch.Tensor) -> torch.Tensor:
    """``slot_sum_reference``'s result; one Triton kernel for 2-D fp32/bf16/fp16 rows on CUDA."""
    num_tokens, topk = slot_rows.shape
    fused = (
        HAVE_TRITON and source.is_cuda and source.dim() == 2 and source.shape[0] > 0
        and num_tokens > 0 and source.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if not fused:
        return slot_sum_reference(source, slot_rows, slot_keep)
    return _launch(source, slot_rows, slot_keep)


def _launch(source: torch.Tensor, slot_rows: torch.Tensor, slot_keep: torch.Tensor,
            out_dtype=None) -> torch.Tensor:
    num_tokens, topk = slot_rows.shape
    source = source if source.stride(1) == 1 else source.contiguous()
    hidden = source.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or source.dtype, device=source.device)
    block = min(triton.next_power_of_2(hidden), 1024)
    grid = (num_tokens, triton.cdiv(hidden, block))
    _slot_sum_kernel[grid](
        source, slot_rows.contiguous(), slot_keep.contiguous(), out, source.stride(0),
        out.stride(0), TOPK=topk, HIDDEN=hidden, BLOCK=block,
    )
    return out
