"""Which tensors of a Hugging Face directory are quantized, and the tensors they stand for.

``config.json``'s ``quantization_config`` says how (``dequantize`` has the formats):

* ``quant_method = "fp8"``: every ``NAME`` stored as float8 comes with ``NAME_scale_inv``
  (``x.weight`` + ``x.weight_scale_inv``); the pair reads as ``NAME``. Tensors without a scale
  (embeddings, norms, the router) are stored as they are and read so.
* ``quant_method = "mxfp4"``: ``NAME_blocks`` with ``NAME_scales`` read as ``NAME``. MXFP4 groups
  the last axis of a ``[..., out, in]`` weight; the tensors it replaces in gpt-oss (the experts'
  ``gate_up_proj`` ``[E, hidden, 2F]`` and ``down_proj`` ``[E, F, hidden]``) are ``[..., in,
  out]``, so the dequantized weight is transposed (as transformers does).

Other methods are refused; so are quantized tensors in files whose config.json does not say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.bounded.convert import dequantize
from megatron.bounded.convert.core import refuse

FP8, MXFP4 = "fp8", "mxfp4"
FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16")
# what converting a quantized model needs instead
BF16_COPY = ("convert a bf16 copy of the model (loaded with transformers, dequantized, saved with "
             "save_pretrained)")


@dataclass(frozen=True)
class Dequantized:
    """A tensor the files hold quantized: its stored ``parts`` and how they make it."""

    parts: tuple  # names of the stored tensors, in ``decode``'s order
    shape: tuple
    decode: Callable  # list of stored tensors -> the tensor (fp32)
    dtype: torch.dtype  # one that holds the dequantized values exactly


def method(config: dict) -> Optional[str]:
    """``FP8``, ``MXFP4`` or None (not quantized); refuses the other methods and FP8 settings that
    a dequantized model would not reproduce."""
    settings = config.get("quantization_config")
    if not settings:
        return None
    if not isinstance(settings, dict):
        raise refuse(f"config.json's quantization_config is {settings!r}, not an object",
                     "restore the model's own config.json")
    quant_method = settings.get("quant_method")
    if quant_method not in (FP8, MXFP4):
        raise refuse(f"config.json's quantization_config.quant_method = {quant_method!r}, which "
                     f"the converter does not dequantize (it dequantizes {FP8!r} block scales "
                     f"and {MXFP4!r})", BF16_COPY)
    if quant_method == FP8:
        scheme = settings.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise refuse(f"config.json's quantization_config.activation_scheme = {scheme!r}: "
                         "the model quantizes its activations with stored scales, which a "
                         "dequantized model does not", BF16_COPY)
        block = settings.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(
                isinstance(b, int) and b > 0 for b in block)):
            raise refuse(f"config.json's quantization_config.weight_block_size = {block!r}",
                         "it is [rows, columns] of a block (DeepSeek-V3: [128, 128])")
    return quant_method


def _fp8(config: dict, names: dict, describe: Callable) -> dict:
    block = config["quantization_config"].get("weight_block_size")
    found = {}
    for scale_name in (n for n in names if n.endswith(FP8_SCALE_SUFFIX)):
        name = scale_name[:-len(FP8_SCALE_SUFFIX)]
        if name not in names:
            raise refuse(f"{scale_name} (in {names[scale_name]}) scales a tensor {name} that the "
                         "files lack", "check that the safetensors files are complete")
        dtype, shape = describe(name)
        scale_dtype, scale_shape = describe(scale_name)
        if dtype not in FP8_DTYPES or scale_dtype not in SCALE_DTYPES:
            raise refuse(f"{name} is {dtype} with a {scale_dtype} {scale_name} (in "
                         f"{names[name]}); FP8 dequantization takes float8 weights with float "
                         "scales", BF16_COPY)
        grid = dequantize.scale_grid(shape, block)
        fits = (len(shape) >= 2 and list(scale_shape) == list(grid)) if block is not None \
            else all(extent == 1 for extent in scale_shape)  # one scale for the whole weight
        if not fits:
            raise refuse(f"{scale_name} (in {names[scale_name]}) is {list(scale_shape)}, but "
                         f"{name} {shape} in blocks of weight_block_size = {block} has "
                         f"{list(grid)} blocks", "check the quantization_config against the files")
        # float8 times an fp32 scale is rounded to fp32 (as transformers computes it)
        found[name] = Dequantized((name, scale_name), tuple(shape), lambda parts, b=block:
                                  dequantize.dequantize_fp8_blocks(parts[0], parts[1], b),
                                  torch.float32)
    unscaled = [n for n in names if n not in found and describe(n)[0] in FP8_DTYPES]
    if unscaled:
        raise refuse(f"{unscaled[0]} (in {names[unscaled[0]]}) is float8 without a "
                     f"{unscaled[0]}{FP8_SCALE_SUFFIX}", "check that the files are complete")
    return found


def _mxfp4(names: dict, describe: Callable) -> dict:
    found = {}
    for blocks_name in (n for n in names if n.endswith(MXFP4_BLOCKS)):
        name = blocks_name[:-len(MXFP4_BLOCKS)]
        scales_name = name + MXFP4_SCALES
        if scales_name not in names:
            raise refuse(f"{blocks_name} (in {names[blocks_name]}) has no {scales_name}",
                         "check that the safetensors files are complete")
        (dtype, shape), (scales_dtype, scales_shape) = describe(blocks_name), describe(scales_name)
        if dtype != "U8" or scales_dtype != "U8" or len(shape) < 3 or \
                shape[:-1] != scales_shape or shape[-1] * 2 != dequantize.MXFP4_GROUP:
            raise refuse(f"{blocks_name} {dtype} {shape} and {scales_name} {scales_dtype} "
                         f"{scales_shape} (in {names[blocks_name]}) are not MXFP4's [..., G, 16] "
                         "and [..., G] bytes", BF16_COPY)
        rows, columns = shape[-3], shape[-2] * dequantize.MXFP4_GROUP
        found[name] = Dequantized((blocks_name, scales_name), (*shape[:-3], columns, rows),
                                  lambda parts: dequantize.dequantize_mxfp4(*parts)
                                  .transpose(-1, -2),
                                  torch.bfloat16)  # 2 bits times a power of two
    return found


def _looks_quantized(names: dict) -> Optional[str]:
    return next((n for n in names if n.endswith(FP8_SCALE_SUFFIX) or (
        n.endswith(MXFP4_BLOCKS) and n[:-len(MXFP4_BLOCKS)] + MXFP4_SCALES in names)), None)


def dequantized_tensors(config: dict, names: dict, describe: Callable) -> dict:
    """{name: Dequantized} of the tensors the files (``names``: {stored name: file}) hold
    quantized; ``describe(name)`` gives a stored tensor's (safetensors dtype, shape)."""
    quant_method = method(config)
    if quant_method is None:
        example = _looks_quantized(names)
        if example:
            raise refuse(f"{example} (in {names[example]}) is a quantization scale, but "
                         "config.json has no quantization_config", "restore the model's own "
                         "config.json (with its quantization_config)")
        return {}
    if quant_method == FP8:
        return _fp8(config, names, describe)
    return _mxfp4(names, describe)


def decoded(entry: Dequantized, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The tensor ``entry`` stands for (``read``: a stored tensor by name), as ``entry.dtype``."""
    return entry.decode([read(part) for part in entry.parts]).to(entry.dtype)
