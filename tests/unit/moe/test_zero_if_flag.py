"""Zeroing on device flags: the Triton kernel (in Triton's interpreter on CPU) leaves the tensors
(or slices) untouched while their flag is clear and zeroes them in place once it is set, as the
reference."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.moe.kernels.zero_if_flag import zero_if_flag, zero_if_flag_reference
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")


def _tensors(dtype):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(37, 50, generator=generator).to(dtype)
    a[3, 4] = float("nan")  # what an unwritten stash page may hold
    b = torch.randn(9001, generator=generator).to(dtype)  # more than one block of the kernel
    return a, b


def test_reference_zeroes_only_when_the_flag_is_set():
    a, b = _tensors(torch.float32)
    clear, set_ = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    kept = zero_if_flag_reference(clear, a, b)
    assert torch.equal(torch.nan_to_num(kept[0], nan=1.5), torch.nan_to_num(a, nan=1.5))
    assert torch.equal(kept[1], b)
    zeroed = zero_if_flag_reference(set_, a, b)
    assert all(not t.any() for t in zeroed)
    assert torch.isnan(a).any()  # out of place
    zeroed_cpu = zero_if_flag(set_, a, b)  # CPU: the reference
    assert all(not t.any() for t in zeroed_cpu)


def test_slice_reference_and_checks():
    from megatron.bounded.moe.kernels.zero_if_flag import (
        zero_slices_if_flagged,
        zero_slices_if_flagged_reference,
    )

    t = torch.ones(3, 2, 2)
    flags = torch.tensor([0, 5, 0])
    expected = zero_slices_if_flagged_reference(flags, t)
    assert expected[0].all() and not expected[1].any() and expected[2].all() and t.all()
    out = zero_slices_if_flagged(flags, t)  # CPU: masked_fill_, in place
    assert out is t and torch.equal(t, expected)
    with pytest.raises(ValueError, match="2 flags for 3 slices"):
        zero_slices_if_flagged(torch.tensor([0, 1]), t)


def test_empty_groups_from_end_offsets():
    from megatron.bounded.moe.kernels.zero_if_flag import empty_groups, zero_empty_groups

    offs = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    assert empty_groups(offs).tolist() == [1, 0, 1, 0]
    t = torch.ones(4, 3)
    assert zero_empty_groups(offs, t) is t  # CPU: masked_fill_, in place
    assert t.sum(dim=1).tolist() == [0, 3, 0, 3]
    with pytest.raises(ValueError, match="4 offsets for 2 slices"):
        zero_empty_groups(offs, torch.ones(2, 3))


def _body(rank, world_size):
    from megatron.bounded.moe.kernels import zero_if_flag as module

    for dtype in (torch.float32, torch.bfloat16):
        a, b = _tensors(dtype)
        before = [a.clone(), b.clone()]
        for t in (a, b):
            module._launch(torch.zeros(1, dtype=torch.int64), t.view(1, -1))
        assert torch.equal(torch.nan_to_num(a, nan=1.5), torch.nan_to_num(before[0], nan=1.5))
        assert torch.equal(b, before[1])
        for t in (a, b):
            module._launch(torch.tensor([3], dtype=torch.int64), t.view(1, -1))
        assert not a.any() and not b.any() and not torch.isnan(a).any()
        # Per slice: 4 slices of 2 x 2500 elements (more than one block each), slices 1 and 2 set.
        slices = torch.randn(4, 2, 2500).to(dtype)
        flags = torch.tensor([0, 1, -2, 0], dtype=torch.int32)
        expected = module.zero_slices_if_flagged_reference(flags, slices)
        module._launch(flags, slices.view(4, -1))
        assert torch.equal(slices, expected) and slices[0].all() and not slices[1:3].any()
        # From end offsets: groups 0 and 2 (and the last, 4) have no rows.
        offs = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)
        slices = torch.randn(5, 2, 2500).to(dtype)
        expected = module.zero_slices_if_flagged_reference(module.empty_groups(offs), slices)
        module._launch(offs, slices.view(5, -1), module._zero_empty_groups_kernel)
        assert torch.equal(slices, expected) and slices[[1, 3]].all()
        assert not slices[[0, 2, 4]].any()
    return True


def test_kernel_writes_nothing_while_clear_and_zeroes_in_place_once_set(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_body, 1, fresh_process=True) == [True]


@pytest.mark.gpu
@requires_cuda
def test_gpu_kernel_zeroes_flagged_slices_in_place():
    from megatron.bounded.moe.kernels.zero_if_flag import (
        zero_empty_groups,
        zero_if_flag,
        zero_slices_if_flagged,
    )

    t = torch.full((5, 64, 33), float("nan"), device="cuda", dtype=torch.bfloat16)
    t[0] = 1.0
    flags = torch.tensor([0, 1, 1, 0, 1], device="cuda", dtype=torch.int32)
    assert zero_slices_if_flagged(flags, t) is t
    assert (t[0] == 1).all() and torch.isnan(t[3]).all() and not t[[1, 2, 4]].any()
    whole = torch.full((7, 5), float("inf"), device="cuda")
    assert zero_if_flag(torch.zeros(1, device="cuda", dtype=torch.int64), whole)[0] is whole
    assert torch.isinf(whole).all()
    zero_if_flag(torch.ones(1, device="cuda", dtype=torch.int64), whole)
    assert not whole.any()
    t = torch.full((4, 3, 40), float("nan"), device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([0, 5, 5, 9], device="cuda", dtype=torch.int32)  # groups 0 and 2 empty
    assert zero_empty_groups(offs, t) is t
    assert torch.isnan(t[[1, 3]]).all() and not t[[0, 2]].any()
