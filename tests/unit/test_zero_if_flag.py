"""Zeroing on a device flag: the Triton kernel (in Triton's interpreter on CPU) leaves the tensors
untouched while the flag is clear and zeroes them in place once it is set, as the reference."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.moe.zero_if_flag import zero_if_flag, zero_if_flag_reference
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


def _body(rank, world_size):
    from megatron.bounded.moe import zero_if_flag as module

    for dtype in (torch.float32, torch.bfloat16):
        a, b = _tensors(dtype)
        before = [a.clone(), b.clone()]
        for t in (a, b):
            assert module._launch(torch.zeros(1, dtype=torch.int64), t) is t
        assert torch.equal(torch.nan_to_num(a, nan=1.5), torch.nan_to_num(before[0], nan=1.5))
        assert torch.equal(b, before[1])
        for t in (a, b):
            module._launch(torch.tensor([3], dtype=torch.int64), t)
        assert not a.any() and not b.any() and not torch.isnan(a).any()
    return True


def test_kernel_writes_nothing_while_clear_and_zeroes_in_place_once_set(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_body, 1) == [True]
