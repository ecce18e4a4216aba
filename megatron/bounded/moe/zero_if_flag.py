"""Zero tensors in place when a device flag is set, without reading the flag on the host.

    t[:] = 0   for every t in tensors,   if flag[0] != 0      (else nothing changes)

The grouped experts' backward needs this after a paged-stash overflow: the activations restored
from the stash were never written (upstream's pop kernel skips them) and may hold NaN/Inf, which
upstream's NaN checks would trip on before the runner discards the step and reruns it. A host
read of the flag would be a sync in every step; ``torch.where(flag, 0, t)`` reads and writes the
whole tensor in every step (two full passes over the expert input and fc1 rows per paged layer).
On CUDA each Triton program reads the flag and returns at once when it is clear; only after an
overflow does it write zeros. The writes bypass autograd's version counters, which is what the
caller wants: these are saved tensors of a step that will be discarded.

The eager reference (CPU, or without Triton) is the ``torch.where`` above, out of place.

Memory: none. Traffic with the flag clear: one flag read per program.
Tests: ``tests/unit/test_zero_if_flag.py`` (the kernel in Triton's interpreter on CPU, flag clear
and set). Benchmark: its cost is part of the paged layers' step in ``bench_moe_dispatch.py``
(benchmark ``moe_paged_stash``), against the same layers without paging.
"""

from __future__ import annotations

import torch

from megatron.bounded.triton_support import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["zero_if_flag", "zero_if_flag_reference"]

_BLOCK = 4096


def zero_if_flag_reference(flag: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """``tensors`` with every element zero where ``flag[0] != 0`` (new tensors, eager)."""
    set_ = flag.reshape(-1)[0] != 0
    return tuple(torch.where(set_, torch.zeros((), dtype=t.dtype, device=t.device), t) for t in tensors)


if HAVE_TRITON:

    @triton.jit
    def _zero_if_flag_kernel(data_ptr, flag_ptr, numel, BLOCK: tl.constexpr):
        if tl.load(flag_ptr) != 0:
            offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], dtype=data_ptr.dtype.element_ty)
            tl.store(data_ptr + offsets, zeros, mask=offsets < numel)


def zero_if_flag(flag: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """``zero_if_flag_reference``'s values; on CUDA with Triton the contiguous ``tensors`` are
    zeroed in place (and returned) by one kernel each, which does nothing while the flag is
    clear. ``flag`` is a one-element integer device tensor."""
    if not (HAVE_TRITON and flag.is_cuda and not flag.dtype.is_floating_point and flag.dtype != torch.bool):
        return zero_if_flag_reference(flag, *tensors)
    return tuple(_launch(flag, t) if t.is_contiguous() else zero_if_flag_reference(flag, t)[0]
                 for t in tensors)


def _launch(flag: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel():
        grid = (triton.cdiv(tensor.numel(), _BLOCK),)
        _zero_if_flag_kernel[grid](tensor, flag, tensor.numel(), BLOCK=_BLOCK)
    return tensor
