"""Dequantization of the two quantized formats Hugging Face releases store weights in; plain
PyTorch, exact in fp32.

* Block FP8 (DeepSeek-V3, Kimi-K2; ``quantization_config.quant_method = "fp8"``): a weight
  ``[out, in]`` is stored as float8 (e4m3) with a ``weight_scale_inv`` of fp32 scales
  ``[ceil(out / bo), ceil(in / bi)]``, one per block of ``weight_block_size = [bo, bi]`` rows and
  columns (128 x 128; the blocks of the last rows and columns are partial). The weight is the
  stored value times its block's scale.
* MXFP4 (gpt-oss; ``quant_method = "mxfp4"``): groups of 32 values along the last axis, each a
  4-bit e2m1 code (two per byte, the even element in the low nibble) times the group's power of
  two, stored as a biased exponent byte (2 ** (byte - 127)). ``blocks`` ``[..., G, 16]`` (uint8)
  and ``scales`` ``[..., G]`` give ``[..., 32 G]``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.bounded.units import ceil_div

FP8_E4M3_MAX = 448.0  # the largest float8_e4m3fn value: block scales are amax / 448
MXFP4_GROUP = 32  # values per scale
MXFP4_EXPONENT_BIAS = 127
# the e2m1 value of each 4-bit code: sign bit 3, then exponent and mantissa
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scale_grid(shape: Sequence[int], block: Optional[Sequence[int]]) -> tuple:
    """The shape of the scales of a ``[..., rows, cols]`` weight: one per block, the last ones
    partial; ``block`` None: one scale for the whole weight."""
    if block is None:
        return ()
    rows, cols = shape[-2:]
    return (*shape[:-2], ceil_div(rows, block[0]), ceil_div(cols, block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: Optional[Sequence[int]] = (128, 128),
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight`` (float8, ``[..., rows, cols]``) times the scale of its block (``scale_inv``,
    ``scale_grid(weight.shape, block)``), computed in fp32 and returned as ``dtype``."""
    values = weight.to(torch.float32)
    scales = scale_inv.to(torch.float32)
    if block is None:
        return (values * scales.reshape(())).to(dtype)
    rows, cols = weight.shape[-2:]
    if tuple(scales.shape) != scale_grid(weight.shape, block):
        raise ValueError(f"scales {tuple(scales.shape)} for a weight {tuple(weight.shape)} in "
                         f"blocks of {tuple(block)}: expected {scale_grid(weight.shape, block)}")
    # each scale repeated over its block's rows and columns, cut to the weight's (partial blocks)
    spread = scales.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    spread = spread.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (values * spread).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., 32 G]`` from ``blocks`` ``[..., G, 16]`` (uint8, two e2m1 codes a byte) and
    ``scales`` ``[..., G]`` (uint8 biased exponents); exact in fp32 and in bf16."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != MXFP4_GROUP:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, {MXFP4_GROUP // 2}] and [..., G]")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    low, high = (codes & 0x0F).long(), (codes >> 4).long()
    values = torch.stack([table[low], table[high]], dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - MXFP4_EXPONENT_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)
