"""Zero tensors in place where device flags are set, without reading the flags on the host.

    t[:] = 0   for every t in tensors,   if flag[0] != 0      (zero_if_flag)
    t[g] = 0   for every slice g of t,   if flags[g] != 0     (zero_slices_if_flagged)
    t[g] = 0   for every slice g of t,   if group g is empty  (zero_empty_groups)

where group g of a grouped GEMM's end offsets ``offs`` is empty when ``offs[g] == offs[g-1]``
(``offs[-1]`` read as 0).

The grouped experts' backward needs the first and the third. After a paged-stash overflow the activations restored
from the stash were never written (upstream's pop kernel skips them) and may hold NaN/Inf, which
upstream's NaN checks would trip on before the runner discards the step and reruns it. And the
weight gradient of an expert that received no rows is whatever the grouped GEMM leaves there; it
must be an exact zero (``zero_empty_groups`` reads the emptiness from the offsets in the kernel,
so no flags are computed first). A host read of the flags would be a sync in every step;
``torch.where(flag, 0, t)`` reads and writes the whole tensor in every step (for the expert weight
gradients of the benchmark shape, 0.8 GB of traffic per layer). On CUDA each Triton program reads
its slice's flag and returns at once when it is clear; only a flagged slice is written. The writes
bypass autograd's version counters, which is what the callers want: stash pages of a step that
will be discarded, and a weight gradient not yet handed to autograd.

The eager references (``*_reference``) are the ``torch.where`` above, out of place. Without the
kernel (CPU, or no Triton) ``zero_if_flag`` returns its reference and ``zero_slices_if_flagged``
runs ``masked_fill_`` in place.

Memory: none. Traffic with every flag clear: one flag read per program.
Tests: ``tests/unit/moe/test_zero_if_flag.py`` (the kernel in Triton's interpreter on CPU, flags
clear and set). Benchmark: its cost is part of the MoE step in ``bench_moe_dispatch.py``
(benchmarks ``moe_dispatch`` for the weight gradients, ``moe_paged_stash`` for the stash).
"""

from __future__ import annotations

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["empty_groups", "zero_empty_groups", "zero_if_flag", "zero_if_flag_reference",
           "zero_slices_if_flagged", "zero_slices_if_flagged_reference"]

_BLOCK = 4096


def zero_if_flag_reference(flag: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """``tensors`` with every element zero where ``flag[0] != 0`` (new tensors, eager)."""
    set_ = flag.reshape(-1)[0] != 0
    return tuple(torch.where(set_, torch.zeros((), dtype=t.dtype, device=t.device), t) for t in tensors)


def zero_slices_if_flagged_reference(flags: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with slice ``g`` (along dim 0) zero where ``flags[g] != 0`` (new tensor)."""
    set_ = (flags.reshape(-1) != 0).view((-1,) + (1,) * (tensor.dim() - 1))
    return torch.where(set_, torch.zeros((), dtype=tensor.dtype, device=tensor.device), tensor)


def empty_groups(offs: torch.Tensor) -> torch.Tensor:
    """int32 flag per group: 1 where the group of the end offsets ``offs`` has no rows."""
    return (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).to(torch.int32)


if HAVE_TRITON:

    @triton.jit
    def _zero_block(data_ptr, slice_index, slice_numel, BLOCK: tl.constexpr):
        in_slice = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offsets = slice_index.to(tl.int64) * slice_numel + in_slice
        zeros = tl.zeros([BLOCK], dtype=data_ptr.dtype.element_ty)
        tl.store(data_ptr + offsets, zeros, mask=in_slice < slice_numel)

    @cached_launch
    @triton.jit
    def _zero_if_flag_kernel(data_ptr, flag_ptr, slice_numel, BLOCK: tl.constexpr):
        # program (i, g): block i of slice g, zeroed only when flag g is set
        slice_index = tl.program_id(1)
        if tl.load(flag_ptr + slice_index) != 0:
            _zero_block(data_ptr, slice_index, slice_numel, BLOCK)

    @cached_launch
    @triton.jit
    def _zero_empty_groups_kernel(data_ptr, offs_ptr, slice_numel, BLOCK: tl.constexpr):
        # program (i, g): block i of slice g, zeroed only when group g has no rows
        group = tl.program_id(1)
        end = tl.load(offs_ptr + group)
        start = tl.where(group > 0, tl.load(offs_ptr + tl.maximum(group - 1, 0)), 0)
        if start == end:
            _zero_block(data_ptr, group, slice_numel, BLOCK)


def _runs_kernel(flags: torch.Tensor) -> bool:
    return HAVE_TRITON and flags.is_cuda and not flags.dtype.is_floating_point and flags.dtype != torch.bool


def zero_if_flag(flag: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """``zero_if_flag_reference``'s values; on CUDA with Triton the contiguous ``tensors`` are
    zeroed in place (and returned) by one kernel each, which does nothing while the flag is
    clear. ``flag`` is a one-element integer device tensor."""
    if not _runs_kernel(flag):
        return zero_if_flag_reference(flag, *tensors)
    result = []
    for t in tensors:
        if t.is_contiguous():
            _launch(flag.reshape(-1)[:1], t.view(1, -1))
            result.append(t)
        else:
            result.append(zero_if_flag_reference(flag, t)[0])
    return tuple(result)


def zero_slices_if_flagged(flags: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``zero_slices_if_flagged_reference``'s values, written into ``tensor`` (returned): on CUDA
    with Triton, for a contiguous ``tensor``, by one kernel whose programs do nothing for a clear
    flag; otherwise by ``masked_fill_`` (a full pass, but no second buffer: the callers' tensors
    are weight-sized). ``flags`` is an integer tensor with one entry per slice along dim 0."""
    if flags.numel() != tensor.shape[0]:
        raise ValueError(f"{flags.numel()} flags for {tensor.shape[0]} slices")
    if not (_runs_kernel(flags) and tensor.is_contiguous()):
        set_ = (flags.reshape(-1) != 0).view((-1,) + (1,) * (tensor.dim() - 1))
        return tensor.masked_fill_(set_, 0)
    _launch(flags.reshape(-1).contiguous(), tensor.view(tensor.shape[0], -1))
    return tensor


def zero_empty_groups(offs: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``zero_slices_if_flagged(empty_groups(offs), tensor)``: on CUDA with Triton, for a
    contiguous ``tensor``, one kernel that reads the offsets itself. ``offs``: integer end
    offsets, one per slice along dim 0."""
    if offs.numel() != tensor.shape[0]:
        raise ValueError(f"{offs.numel()} offsets for {tensor.shape[0]} slices")
    if not (_runs_kernel(offs) and tensor.is_contiguous() and offs.is_contiguous()):
        return zero_slices_if_flagged(empty_groups(offs), tensor)
    _launch(offs, tensor.view(tensor.shape[0], -1), _zero_empty_groups_kernel)
    return tensor


def _launch(flags: torch.Tensor, slices: torch.Tensor, kernel=None) -> None:
    """Zero the rows of the contiguous 2-D ``slices`` whose flag is set (in place); ``kernel``
    ``_zero_empty_groups_kernel`` when ``flags`` are end offsets."""
    if slices.numel():
        grid = (triton.cdiv(slices.shape[1], _BLOCK), slices.shape[0])
        (kernel or _zero_if_flag_kernel)[grid](slices, flags, slices.shape[1], BLOCK=_BLOCK)
