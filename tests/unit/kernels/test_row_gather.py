"""The padding-skipping row gather: the Triton kernel (in Triton's interpreter on CPU) copies the
rows with an index >= 0 bitwise as ``index_select`` does and leaves rows with ``SKIP`` untouched;
the reference reads ``SKIP`` as row 0."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.kernels.row_gather import SKIP, gather_rows, gather_rows_reference
from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")

SOURCE_ROWS, ROWS, WIDTH = 37, 53, 40  # 40 columns: not a power of two


def _case(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(SOURCE_ROWS, WIDTH, generator=generator).to(dtype)
    index = torch.randint(0, SOURCE_ROWS, (ROWS,), generator=generator)
    skipped = torch.rand(ROWS, generator=generator) < 0.3
    index[skipped] = SKIP
    return source, index, skipped


def test_reference_reads_skip_as_row_zero():
    source, index, skipped = _case(torch.float64)
    out = gather_rows_reference(source, index)
    for r in range(ROWS):
        assert torch.equal(out[r], source[0] if skipped[r] else source[index[r]])
    assert torch.equal(gather_rows(source, index), out)  # CPU: the reference
    probs = torch.rand(SOURCE_ROWS, dtype=torch.float32)
    assert torch.equal(gather_rows(probs, index), probs.index_select(0, index.clamp(min=0)))


def _body(rank, world_size):
    from megatron.bounded.kernels import row_gather as module

    for dtype in (torch.float32, torch.bfloat16):
        source, index, skipped = _case(dtype, seed=1)
        sentinel = torch.full((ROWS, WIDTH), 7.0, dtype=dtype)
        out = module._launch(source, index, out=sentinel.clone())
        expected = module.gather_rows_reference(source, index)
        assert torch.equal(out[~skipped], expected[~skipped]), dtype
        assert torch.equal(out[skipped], sentinel[skipped]), dtype  # nothing read or written
        # a transposed view (row stride 1) is gathered from a contiguous copy
        assert torch.equal(module._launch(source.t().contiguous().t(), index)[~skipped], expected[~skipped])
    empty = module._launch(source, index[:0])
    assert empty.shape == (0, WIDTH)
    return True


def test_kernel_copies_the_taken_rows_and_skips_the_rest(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_body, 1, fresh_process=True) == [True]
