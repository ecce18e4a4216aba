"""Rotary position embedding: the eager reference is bitwise upstream's
``_apply_rotary_pos_emb_bshd`` (output and input gradient), the Triton kernels are bitwise the
reference (in Triton's interpreter on CPU in fp32; against upstream in bf16, fp16 and fp32 on the
GPU), and the tables are computed once per unchanged angle tensor."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron.bounded.attention import rotary
from megatron.bounded.attention.rotary import (
    apply_rotary,
    apply_rotary_reference,
    fused_rotary_supported,
    rotary_grad_reference,
    rotary_tables,
)
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

SEQ, BATCH, HEADS = 7, 3, 5  # 105 rows: not a multiple of the kernel's rows per program


def _case(dim, dtype, seed=0, device="cpu"):
    """``(base, t, freqs)``: ``t`` is heads 1..HEADS of ``base`` (as q and k are views of the
    fused QKV projection), so not contiguous; random angles (upstream's repeat both halves,
    which would hide a kernel mixing up the halves' tables)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SEQ, BATCH, HEADS + 3, dim, generator=generator).to(device, dtype)
    base.requires_grad_(True)
    freqs = (torch.rand(SEQ, 1, 1, dim, generator=generator) * 50.0).to(device)
    return base, base[:, :, 1:HEADS + 1], freqs


def _output_gradient(shape, dtype, seed=1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_reference_is_upstream_bitwise(dtype, mscale):
    base, t, freqs = _case(64, dtype)
    expected = _apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
    grad = _output_gradient(expected.shape, dtype)
    expected.backward(grad)
    expected_grad = base.grad[:, :, 1:HEADS + 1].clone()
    assert not t.is_contiguous()

    cos, sin = rotary_tables(freqs, dtype, mscale)
    assert cos.shape == sin.shape == (SEQ, 64) and cos.is_contiguous() and cos.dtype == dtype
    base.grad = None
    ours = apply_rotary_reference(t, cos, sin)
    assert torch.equal(ours, expected)
    assert torch.equal(rotary_grad_reference(grad, cos, sin), expected_grad)
    ours.backward(grad)  # the reference's own graph too
    assert torch.equal(base.grad[:, :, 1:HEADS + 1], expected_grad)
    assert torch.equal(apply_rotary(t, freqs, mscale), expected)  # CPU: the reference


def _interpreted_kernels(rank, world_size):
    from megatron.bounded.attention import rotary as module

    for dim in (48, 64, 128):  # 48: a half of 24 columns in a block of 32
        base, t, freqs = _case(dim, torch.float32, seed=dim)
        cos, sin = module.rotary_tables(freqs, torch.float32, 1.3)
        out = module._launch_forward(t, cos, sin)
        assert out.is_contiguous() and torch.equal(out, module.apply_rotary_reference(t, cos, sin))
        wide = _output_gradient((SEQ, BATCH, 2 * HEADS, dim), torch.float32)
        expanded = wide[:, :1, :HEADS, :1].expand(SEQ, BATCH, HEADS, dim)  # strides 0, as sum's
        for grad in (wide[:, :, ::2], expanded):
            assert torch.equal(module._launch_backward(grad, cos, sin),
                               module.rotary_grad_reference(grad, cos, sin))
        # through the autograd function
        fused = module._FusedRotary.apply(t, cos, sin)
        fused.backward(wide[:, :, ::2])
        assert torch.equal(fused, out)
        assert torch.equal(base.grad[:, :, 1:HEADS + 1],
                           module.rotary_grad_reference(wide[:, :, ::2], cos, sin))
    return True


def test_kernels_are_bitwise_the_reference_in_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_interpreted_kernels, 1, fresh_process=True) == [True]


def test_tables_are_computed_once_per_unchanged_angles():
    _, _, freqs = _case(64, torch.float32)
    cos, sin = rotary_tables(freqs, torch.bfloat16)
    again = rotary_tables(freqs, torch.bfloat16)
    assert again[0] is cos and again[1] is sin
    assert torch.equal(cos, torch.cos(freqs).to(torch.bfloat16).view(SEQ, 64))
    assert torch.equal(sin, torch.sin(freqs).to(torch.bfloat16).view(SEQ, 64))

    freqs.mul_(0.5)  # in place: a new version of the same tensor
    changed = rotary_tables(freqs, torch.bfloat16)
    assert changed[0] is not cos
    assert torch.equal(changed[0], torch.cos(freqs).to(torch.bfloat16).view(SEQ, 64))
    # one entry: another dtype or mscale replaces it
    assert rotary_tables(freqs, torch.float32)[0] is not changed[0]
    assert rotary_tables(freqs, torch.bfloat16)[0] is not changed[0]
    scaled = rotary_tables(freqs, torch.bfloat16, 2.0)
    assert torch.equal(scaled[1], (torch.sin(freqs) * 2.0).to(torch.bfloat16).view(SEQ, 64))
    # an equal but distinct tensor has its own tables
    assert rotary_tables(freqs.clone(), torch.bfloat16, 2.0)[0] is not scaled[0]


def test_fused_only_for_the_non_interleaved_whole_head_case(monkeypatch):
    _, t, freqs = _case(64, torch.bfloat16)
    t = t.detach()
    assert not fused_rotary_supported(t, freqs, False, False, None)  # a CPU tensor
    if not rotary.HAVE_TRITON:
        return
    # Pretend CPU tensors are CUDA ones, so that each case below is refused for its own reason.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fused_rotary_supported(t, freqs, False, False, None)
    assert not fused_rotary_supported(t, freqs, True, False, None)
    assert not fused_rotary_supported(t, freqs, False, True, None)
    assert not fused_rotary_supported(t, freqs, False, False, torch.tensor([0, 3, SEQ]))
    assert not fused_rotary_supported(t, freqs[..., :32], False, False, None)  # partial rot_dim
    assert not fused_rotary_supported(t.to(torch.float64), freqs, False, False, None)
    assert not fused_rotary_supported(t[:, :, :, ::2], freqs[..., :32], False, False, None)
    assert not fused_rotary_supported(t, freqs.view(SEQ, 1, 64), False, False, None)
    assert not fused_rotary_supported(t, freqs.expand(SEQ, BATCH, 1, 64), False, False, None)
    assert not fused_rotary_supported(t[:-1], freqs, False, False, None)
    assert not fused_rotary_supported(t, freqs.clone().requires_grad_(), False, False, None)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="whole head dim"):
        apply_rotary(t, freqs[..., :32])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_fused_is_upstream_bitwise(dtype, dim):
    for mscale in (1.0, 1.3):
        base, t, freqs = _case(dim, dtype, device="cuda")
        assert fused_rotary_supported(t, freqs, False, False, None)
        expected = _apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
        grad = _output_gradient(expected.shape, dtype, device="cuda")
        expected.backward(grad)
        expected_grad, base.grad = base.grad.clone(), None
        ours = apply_rotary(t, freqs, mscale)
        assert ours.grad_fn is not None and type(ours.grad_fn).__name__ == "_FusedRotaryBackward"
        ours.backward(grad)
        assert torch.equal(ours, expected), mscale
        assert torch.equal(base.grad, expected_grad), mscale
        # an expanded output gradient (sum's)
        base.grad = None
        _apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale).sum().backward()
        expected_grad, base.grad = base.grad.clone(), None
        apply_rotary(t, freqs, mscale).sum().backward()
        assert torch.equal(base.grad, expected_grad), mscale
