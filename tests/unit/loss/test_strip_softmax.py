"""Ring-DTP's fused strip kernels, run by Triton's interpreter on CPU, against the eager
reference (``fold_strip_reference``, ``gradient_strip_reference``) and against fp64 math."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")

ROWS, COLS = 7, 37  # 37: not a power of two, so the column mask matters


def _strip_and_targets(seed=0):
    generator = torch.Generator().manual_seed(seed)
    strip = 4 * torch.randn(ROWS, COLS, generator=generator)
    # tokens whose label is in this strip (several columns, first and last), elsewhere (-1)
    targets = torch.tensor([0, 5, -1, COLS - 1, 17, -1, 3], dtype=torch.int64)
    return strip, targets


def _state(seed):
    """A running state after some earlier strips: finite m for most rows, -inf (empty) for one."""
    generator = torch.Generator().manual_seed(seed)
    state = torch.stack([3 * torch.randn(ROWS, generator=generator),
                         torch.rand(ROWS, generator=generator) + 0.5,
                         torch.randn(ROWS, generator=generator)])
    state[0, 2], state[1, 2], state[2, 2] = -math.inf, 0.0, 0.0
    return state


def _fold_fp64(strip, targets, state):
    """The fold in fp64 from its definition (logsumexp of the state and the strip)."""
    m, z, y = (row.double() for row in state)
    strip = strip.double()
    old = torch.where(m == -math.inf, torch.full_like(m, -math.inf), m + torch.log(z))
    lse = torch.logaddexp(old, torch.logsumexp(strip, dim=1))
    picked = torch.where(targets >= 0, strip.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(m))
    return lse, y + picked


def _body(rank, world_size):
    from megatron.bounded.loss.ring_dtp.kernels import (
        fold_strip_fused, fold_strip_reference, gradient_strip_after_fold_fused, gradient_strip_fused,
        gradient_strip_reference,
    )

    strip, targets = _strip_and_targets()
    for seed in (1, 2):
        fused_state, eager_state = _state(seed), _state(seed)
        fused_strip, eager_strip = strip.clone(), strip.clone()
        fold_strip_fused(fused_strip, targets, fused_state)
        fold_strip_reference(eager_strip, targets, eager_state)
        torch.testing.assert_close(fused_state, eager_state, rtol=1e-6, atol=1e-6)
        # the fold only reads the strip: Ring-DTP keeps it for the gradient
        assert torch.equal(fused_strip, strip) and torch.equal(eager_strip, strip)
        lse, y = _fold_fp64(strip, targets, _state(seed))
        fused_lse = fused_state[0].double() + torch.log(fused_state[1].double())
        torch.testing.assert_close(fused_lse, lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_state[2].double(), y, rtol=1e-6, atol=1e-6)
        # a view of a wider state (the caller folds row chunks [a, b) of [3, N])
        wide = torch.cat([_state(seed), _state(seed + 10)], dim=1)
        fold_strip_fused(strip.clone(), targets, wide[:, :ROWS])
        assert torch.equal(wide[:, :ROWS], fused_state)
        assert torch.equal(wide[:, ROWS:], _state(seed + 10))

    lse = torch.logsumexp(strip, dim=1) + 0.25  # as if other shards held the rest of the vocabulary
    gscale = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.0, 3.0, 1.0])
    for dtype in (torch.float32, torch.bfloat16):
        fused = gradient_strip_fused(strip.clone(), lse, targets, gscale, dtype)
        eager = gradient_strip_reference(strip.clone(), lse, targets, gscale, dtype)
        assert fused.dtype == dtype and fused.shape == strip.shape
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(fused, eager, **tol)
        onehot = torch.zeros(ROWS, COLS, dtype=torch.float64)
        hit = targets >= 0
        onehot[hit.nonzero().squeeze(1), targets[hit]] = 1.0
        exact = (torch.exp(strip.double() - lse.double().unsqueeze(1)) - onehot) * gscale.double().unsqueeze(1)
        torch.testing.assert_close(fused.double(), exact, **tol)
    # the gradient with lse = m + log(z) of a folded state, formed in the kernel
    state = _state(1)
    fold_strip_reference(strip.clone(), targets, state)
    for dtype in (torch.float32, torch.bfloat16):
        fused = gradient_strip_after_fold_fused(strip.clone(), state, targets, gscale, dtype)
        eager = gradient_strip_reference(strip.clone(), state[0] + torch.log(state[1]), targets,
                                         gscale, dtype)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(fused, eager, **tol)
    # fp32: G is written over the strip itself (no second n x s buffer)
    in_place = strip.clone()
    assert gradient_strip_fused(in_place, lse, targets, gscale, torch.float32).data_ptr() == in_place.data_ptr()
    # ... or into rows of a caller's buffer (out), in the GEMM dtype, touching nothing else
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in (gradient_strip_fused, gradient_strip_reference):
            buffer = torch.full((ROWS + 3, COLS), 7.0, dtype=dtype)
            got = kernel(strip.clone(), lse, targets, gscale, dtype, out=buffer[1:ROWS + 1])
            assert got.data_ptr() == buffer[1].data_ptr()
            assert torch.equal(got, kernel(strip.clone(), lse, targets, gscale, dtype))
            assert (buffer[0] == 7).all() and (buffer[ROWS + 1:] == 7).all()
    return True


def test_kernels_match_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernels
    assert run_on_ranks(_body, 1, fresh_process=True) == [True]


def test_cpu_strips_take_the_eager_reference():
    from megatron.bounded.loss.ring_dtp.kernels import fold_strip, fold_strip_reference, gradient_strip

    strip, targets = _strip_and_targets()
    ours, eager = _state(1), _state(1)
    fold_strip(strip.clone(), targets, ours)
    fold_strip_reference(strip.clone(), targets, eager)
    assert torch.equal(ours, eager)
    lse = torch.logsumexp(strip, dim=1)
    grad = gradient_strip(strip.clone(), lse, targets, torch.ones(ROWS), torch.float32)
    # each row of the softmax gradient sums to 0 where the target is in the strip
    hit = targets >= 0
    torch.testing.assert_close(grad[hit].sum(dim=1), torch.zeros(int(hit.sum())), rtol=0, atol=1e-6)


def test_cpu_gradient_after_fold_takes_the_eager_reference():
    from megatron.bounded.loss.ring_dtp.kernels import gradient_strip_after_fold, gradient_strip_reference

    strip, targets = _strip_and_targets()
    state = _state(1)
    gscale = torch.full((ROWS,), 0.5)
    ours = gradient_strip_after_fold(strip.clone(), state, targets, gscale, torch.bfloat16)
    eager = gradient_strip_reference(strip.clone(), state[0] + torch.log(state[1]), targets,
                                     gscale, torch.bfloat16)
    assert torch.equal(ours, eager)


@pytest.mark.gpu
@requires_cuda
def test_gpu_gradient_after_fold_is_bitwise_the_gradient_of_torchs_lse():
    """On CUDA the kernel forms lse = m + log(z) with libdevice's log: the same bits as
    ``state[0] + torch.log(state[1])``, so G matches the replay's, which gets that lse."""
    from megatron.bounded.loss.ring_dtp.kernels import (
        fold_strip, gradient_strip, gradient_strip_after_fold,
    )

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, cols = 256, 50_001
    strip = 6 * torch.randn(rows, cols, device=dev, generator=gen)
    targets = torch.randint(0, cols, (rows,), device=dev, generator=gen)
    targets[::5] = -1
    state = torch.stack([torch.full((rows,), -math.inf, device=dev),
                         torch.zeros(rows, device=dev), torch.zeros(rows, device=dev)])
    fold_strip(strip, targets, state)
    gscale = torch.rand(rows, device=dev, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        ours = gradient_strip_after_fold(strip.clone(), state, targets, gscale, dtype)
        replay = gradient_strip(strip.clone(), state[0] + torch.log(state[1]), targets, gscale,
                                dtype)
        assert torch.equal(ours, replay), dtype
