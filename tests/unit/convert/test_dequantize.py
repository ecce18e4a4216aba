"""megatron.bounded.convert.dequantize: block FP8 and MXFP4 weights dequantized as the releases
store them (partial edge blocks, biased exponents), checked against the quantization made here,
against a block-by-block loop, and against transformers' own decoding where it is importable."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.convert.dequantize import (
    FP4_E2M1_VALUES, FP8_E4M3_MAX, dequantize_fp8_blocks, dequantize_mxfp4,
)
from megatron.bounded.units import ceil_div

BLOCK = (128, 128)


def quantize_fp8_blocks(weight: torch.Tensor, block=BLOCK):
    """(float8_e4m3fn weight, fp32 weight_scale_inv) as the DeepSeek-V3 release stores them: each
    block (the last ones partial) divided by its amax / 448."""
    rows, cols = weight.shape[-2:]
    grid = (ceil_div(rows, block[0]), ceil_div(cols, block[1]))
    padded = torch.zeros(*weight.shape[:-2], grid[0] * block[0], grid[1] * block[1])
    padded[..., :rows, :cols] = weight.float()
    tiles = padded.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., grid rows, grid cols]
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scaled = (tiles / scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2)
    quantized = scaled[..., :rows, :cols].clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return quantized.to(torch.float8_e4m3fn), scale_inv.float()


def fp8_error_bound(weight: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The largest |weight - dequantized| rounding to e4m3 allows, element by element: half the
    spacing of e4m3 values at |weight / scale|, at most 2^-4 of it (3 mantissa bits), and 2^-10
    below e4m3's smallest normal 2^-6 (its subnormals are 2^-9 apart); times the block's scale."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.repeat_interleave(block[0], -2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], -1)[..., :cols]
    magnitude = (weight.float() / scale).abs()
    # 1e-6: the division by the scale is itself rounded in fp32
    return torch.maximum(magnitude * 2.0 ** -4, torch.full_like(magnitude, 2.0 ** -10)) * \
        scale * (1 + 1e-6)


def blockwise_loop(quantized: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK):
    """The dequantization written block by block (the reference of the vectorized one)."""
    out = torch.empty(quantized.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = quantized[rows, cols].float() * scale_inv[i, j]
    return out


@pytest.mark.parametrize("shape", [(300, 130), (128, 256), (24, 160), (1, 1)])
def test_fp8_blocks_dequantize_within_the_rounding_of_e4m3(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns of many scales
    quantized, scale_inv = quantize_fp8_blocks(weight)
    assert tuple(scale_inv.shape) == (ceil_div(shape[0], 128), ceil_div(shape[1], 128))
    ours = dequantize_fp8_blocks(quantized, scale_inv)
    assert torch.equal(ours, blockwise_loop(quantized, scale_inv))
    error = (ours - weight).abs()
    assert (error <= fp8_error_bound(weight, scale_inv)).all()
    assert error.max() > 0 or weight.numel() == 1  # the check can fail: the rounding is there
    bf16 = dequantize_fp8_blocks(quantized, scale_inv, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, ours.bfloat16())


def test_fp8_blocks_with_leading_axes_and_one_scale_per_tensor():
    torch.manual_seed(1)
    weight = torch.randn(3, 200, 140)
    quantized, scale_inv = quantize_fp8_blocks(weight)
    stacked = dequantize_fp8_blocks(quantized, scale_inv)
    for expert in range(3):
        assert torch.equal(stacked[expert], dequantize_fp8_blocks(quantized[expert],
                                                                  scale_inv[expert]))
    scale = torch.tensor(0.25)
    whole = dequantize_fp8_blocks(quantized[0], scale, block=None)
    assert torch.equal(whole, quantized[0].float() * 0.25)


def test_fp8_scales_of_the_wrong_grid_are_refused():
    quantized, scale_inv = quantize_fp8_blocks(torch.randn(300, 130))
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):
        dequantize_fp8_blocks(quantized, scale_inv[:2])


def test_fp8_blocks_agree_with_transformers():
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    reference = getattr(finegrained, "_dequantize_fp8_weight", None)
    if reference is None:
        pytest.skip("this transformers has no _dequantize_fp8_weight")
    torch.manual_seed(2)
    quantized, scale_inv = quantize_fp8_blocks(torch.randn(300, 130))
    theirs = reference(quantized, scale_inv, list(BLOCK), torch.float32)
    assert torch.equal(dequantize_fp8_blocks(quantized, scale_inv), theirs)


def quantize_mxfp4(weight: torch.Tensor):
    """(blocks uint8 [..., G, 16], scales uint8 [..., G]) of ``weight`` [..., 32 G] as gpt-oss
    stores them: per group of 32 the power of two that brings the amax to 6 or below, each value
    rounded to the nearest e2m1 value, two codes a byte (the even element low)."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    values = torch.tensor(FP4_E2M1_VALUES[:8])
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    code = (scaled.abs().unsqueeze(-1) - values).abs().argmin(-1)
    code = code + 8 * ((scaled < 0) & (code > 0))
    pairs = code.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_error_bound(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half the spacing of e2m1 values at each |value / 2^e| (0.5 up to 2, 1 up to 4, 2 up to 6),
    times the group's 2^e."""
    groups = weight.float().unflatten(-1, (-1, 32))
    power = torch.exp2(scales.float() - 127).unsqueeze(-1)
    magnitude = groups.abs() / power
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return (spacing / 2 * power).flatten(-2)


def test_mxfp4_decodes_codes_and_exponents():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # element 0: code 15 (-6.0), element 1: code 2 (1.0)
    scales = torch.tensor([128], dtype=torch.uint8)  # 2^1
    values = dequantize_mxfp4(blocks, scales)
    assert values.shape == (32,) and values[:2].tolist() == [-12.0, 2.0]
    assert values[2:].abs().sum() == 0


def test_mxfp4_dequantizes_within_the_rounding_of_e2m1():
    torch.manual_seed(3)
    weight = torch.randn(4, 48, 64) * 0.05
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (4, 48, 2, 16) and scales.shape == (4, 48, 2)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == weight.shape
    error = (ours - weight).abs()
    assert (error <= mxfp4_error_bound(weight, scales) * (1 + 1e-6)).all() and error.max() > 0
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact


def test_mxfp4_agrees_with_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    torch.manual_seed(4)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 2), dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    # transformers returns the [E, in, out] layout of gpt-oss's experts
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_mxfp4_shapes_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8),
                         torch.zeros(2, 4, dtype=torch.uint8))
