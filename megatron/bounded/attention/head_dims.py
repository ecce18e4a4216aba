"""Attention whose values have a narrower head than its queries and keys (multi-latent attention).

DeepSeek-style multi-latent attention scores with q·k heads of ``qk_head_dim +
qk_pos_emb_head_dim`` (192) and averages values of ``v_head_dim`` (128). PyTorch's flash kernels
(``scaled_dot_product_attention``'s flash backend and ``torch.nn.attention.varlen.varlen_attn``)
require one head dimension for q, k and v, so on CUDA the values are padded with zero columns to
the q/k head dimension and the output is sliced back (:func:`with_value_padded`). Exact: a zero
column of v gives a zero column of the output and nothing else; the slice's backward hands the
padding a zero gradient, which the pad's backward drops. Cost: the kernel's value and output
tensors are qk/v (1.5×) wider. On the CPU the kernels take unequal head dimensions and nothing is
padded; ``tests/unit/model/test_mla.py`` checks the padded call against the unpadded one there.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["pad_value_head_dim", "with_value_padded"]


def pad_value_head_dim(value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``value`` ``[..., d_v]`` with zero columns appended up to ``head_dim`` (itself if equal)."""
    extra = head_dim - value.shape[-1]
    if extra < 0:
        raise ValueError(f"value head dimension {value.shape[-1]} is wider than {head_dim}")
    return F.pad(value, (0, extra)) if extra else value


def with_value_padded(kernel: Callable, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor) -> torch.Tensor:
    """``kernel(query, key, value)`` with ``value`` padded to the q/k head dimension and the
    output's last dimension sliced back to the value's (a plain call when they are equal)."""
    value_dim = value.shape[-1]
    if value_dim == query.shape[-1]:
        return kernel(query, key, value)
    output = kernel(query, key, pad_value_head_dim(value, query.shape[-1]))
    return output[..., :value_dim]
