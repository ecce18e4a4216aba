"""The combine's slot sum: the Triton kernel (in Triton's interpreter on CPU) is bitwise equal to
the eager reference, which is checked against a plain loop."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.moe.kernels.slot_sum import slot_sum, slot_sum_reference
from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")

TOKENS, TOPK, ROWS, HIDDEN = 23, 4, 70, 40  # 40 columns: not a power of two


def _case(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(ROWS, HIDDEN, generator=generator).to(dtype)
    slot_rows = torch.randint(0, ROWS - 6, (TOKENS, TOPK), generator=generator)
    slot_keep = torch.rand(TOKENS, TOPK, generator=generator) > 0.25
    source[ROWS - 6:] = float("nan")  # padding rows: only dropped slots point there
    slot_rows[~slot_keep] = torch.randint(ROWS - 6, ROWS, (int((~slot_keep).sum()),), generator=generator)
    return source, slot_rows, slot_keep


def test_reference_is_the_sum_of_the_kept_rows():
    source, slot_rows, slot_keep = _case(torch.float64)
    expected = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for n in range(TOKENS):
        for s in range(TOPK):
            if slot_keep[n, s]:
                expected[n] += source[slot_rows[n, s]]
    torch.testing.assert_close(slot_sum_reference(source, slot_rows, slot_keep), expected)
    assert torch.equal(slot_sum(source, slot_rows, slot_keep), slot_sum_reference(source, slot_rows, slot_keep))


def _body(rank, world_size):
    from megatron.bounded.moe.kernels import slot_sum as module

    for dtype in (torch.float32, torch.bfloat16):
        source, slot_rows, slot_keep = _case(dtype, seed=1)
        # the fp32 sums (the interpreter truncates fp32 -> bf16; GPUs and torch round to nearest)
        fused = module._launch(source, slot_rows, slot_keep, out_dtype=torch.float32)
        reference = module.slot_sum_reference(source, slot_rows, slot_keep, out_dtype=torch.float32)
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, reference), dtype
    assert module._launch(source, slot_rows, slot_keep).dtype == torch.bfloat16
    return True


def test_kernel_is_bitwise_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_body, 1, fresh_process=True) == [True]
