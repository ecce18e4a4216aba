"""The fused weighted SwiGLU kernels, run by Triton's interpreter on CPU, against the fp32
reference (``weighted_swiglu_reference`` and its autograd gradients)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")

VALID, FFN = 29, 48  # 48: not a power of two, so the column mask matters
OFFS = [10, 10, 29]  # three experts, the second empty


def _inputs(dtype, padding, seed=0):
    """The same valid rows whatever the padding; padding rows hold NaN, which must not be read."""
    generator = torch.Generator().manual_seed(seed)
    valid = (torch.randn(VALID, 2 * FFN, generator=generator), torch.rand(VALID, generator=generator),
             torch.randn(VALID, FFN, generator=generator))
    fc1, probs, grad = (torch.cat([t, torch.full((padding,) + t.shape[1:], float("nan"))]) for t in valid)
    return fc1.to(dtype), probs, grad.to(dtype)


def _reference(fc1, probs, grad):
    fc1 = fc1[:VALID].float().requires_grad_()
    probs = probs[:VALID].clone().requires_grad_()
    from megatron.bounded.moe.kernels.weighted_swiglu import weighted_swiglu_reference

    scaled = weighted_swiglu_reference(fc1, probs)
    grad_fc1, grad_probs = torch.autograd.grad(scaled, (fc1, probs), grad[:VALID].float())
    return scaled.detach(), grad_fc1, grad_probs


def _body(rank, world_size, dtype_name):
    from megatron.bounded.moe.kernels.weighted_swiglu import weighted_swiglu_backward, weighted_swiglu_forward

    dtype = getattr(torch, dtype_name)
    # bf16: one rounding of the fp32 result; fp32: only sigmoid's last bits differ
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    results = {}
    for padding in (0, 11, 64):
        fc1, probs, grad = _inputs(dtype, padding)
        scaled = weighted_swiglu_forward(fc1, probs, offs)
        grad_fc1, scaled_again, grad_probs = weighted_swiglu_backward(fc1, probs, offs, grad, True)
        ref_scaled, ref_grad_fc1, ref_grad_probs = _reference(fc1, probs, grad)
        assert scaled.dtype == dtype and grad_fc1.dtype == dtype and grad_probs.dtype == probs.dtype
        torch.testing.assert_close(scaled[:VALID].float(), ref_scaled, **tol)
        torch.testing.assert_close(scaled_again[:VALID], scaled[:VALID], rtol=0, atol=0)
        torch.testing.assert_close(grad_fc1[:VALID].float(), ref_grad_fc1, **tol)
        torch.testing.assert_close(grad_probs[:VALID], ref_grad_probs, **tol)
        _, _, none = weighted_swiglu_backward(fc1, probs, offs, grad, False)
        assert none is None
        results[padding] = (scaled[:VALID], grad_fc1[:VALID], grad_probs[:VALID])
    # the valid rows do not depend on how many padding rows the buffer has
    for padding in (11, 64):
        for ours, unpadded in zip(results[padding], results[0]):
            assert torch.equal(ours, unpadded)
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_kernels_match_the_reference_on_valid_rows(monkeypatch, dtype_name):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernels
    assert run_on_ranks(_body, 1, args=(dtype_name,), fresh_process=True) == [True]


def test_only_plain_swiglu_on_cuda_takes_the_fused_path():
    import torch.nn.functional as F

    from megatron.bounded.moe.experts import _Activation, _runs_fused

    class Config:
        gated_linear_unit, activation_func, glu_linear_offset, activation_func_clamp_value = (
            True, F.silu, 0.0, None)

    cpu = torch.zeros(2, 4)
    cuda_like = type("CudaLike", (), {"is_cuda": True})()
    assert _runs_fused(_Activation(Config), cuda_like)
    assert not _runs_fused(_Activation(Config), cpu)
    for field, value in [("gated_linear_unit", False), ("activation_func", F.gelu),
                         ("glu_linear_offset", 1.0), ("activation_func_clamp_value", 7.0)]:
        variant = type("Variant", (Config,), {field: value})
        assert not _runs_fused(_Activation(variant), cuda_like), field
    assert not _runs_fused(lambda fc1: fc1, cuda_like)  # any other callable: eager
