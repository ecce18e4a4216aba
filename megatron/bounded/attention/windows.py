"""Sliding-window causal attention: which keys a query sees, and the kernels that run it.

Semantics are those of upstream's local ``DotProductAttention``: a layer uses the window when
``megatron.core.transformer.utils.is_layer_window_attention(window_size, window_attn_skip_freq,
layer_number)`` says so, and then query i sees the keys j with i − left ≤ j ≤ i + right
(``window_size = (left, right)``; upstream's ``get_sliding_window_causal_mask``). This project runs
causal windows (right = 0): left + 1 keys per query. A left of −1 means no window, as in the
config's documentation.

A kernel call's mask is a *band* ``(left, right)`` in flash attention's convention: for ``sq``
queries and ``sk`` keys aligned at their ends, query r sees key c when
``r + sk − sq − left ≤ c ≤ r + sk − sq + right``; −1 leaves that side open. :data:`CAUSAL` is
(−1, 0) and :data:`NO_MASK` (−1, −1). Kernels, in the ``[b, heads, s, d]`` layout (key/value
with ``groups`` heads): flash attention's ``aten._flash_attention_forward/_backward``, which take
the band and skip the tiles outside it (time and memory O(s · window), nothing s × s), dense or
over variable-length documents; :func:`reference_forward` and :func:`reference_block_backward`,
plain PyTorch that materializes the scores (CPU, tests).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from megatron.core.transformer.utils import is_layer_window_attention

from megatron.bounded.settings import BoundedArgumentError, flag_name

__all__ = [
    "CAUSAL",
    "NO_MASK",
    "band_allowed",
    "causal_band",
    "check_window_flags",
    "flash_backward",
    "flash_forward",
    "flash_varlen_kernels",
    "layer_window",
    "pair_band",
    "reference_block_backward",
    "reference_forward",
    "window_problems",
    "window_setting_problems",
]

Band = Tuple[int, int]
CAUSAL: Band = (-1, 0)
NO_MASK: Band = (-1, -1)


def layer_window(config, layer_number: int) -> Optional[int]:
    """The left extent of layer ``layer_number``'s (1-based) causal window, or None for full
    causal attention, decided by upstream's rule."""
    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
        return None
    return None if window[0] < 0 else int(window[0])


def window_setting_problems(config) -> list:
    """What of ``window_size`` and ``window_attn_skip_freq`` no attention runs, in any
    implementation (the messages name the flags)."""
    problems = []
    window = getattr(config, "window_size", None)
    if window is not None and (len(window) != 2 or window[0] == 0 or min(window) < -1):
        problems.append(
            f"{flag_name('window_size')} {','.join(map(str, window))} (a window is LEFT,RIGHT: the keys "
            "before and after each token that it sees, -1 for no limit; LEFT 0 would leave each "
            "token only itself: give e.g. 128,0)")
    skip = getattr(config, "window_attn_skip_freq", None)
    if isinstance(skip, int) and skip < 1:
        # upstream takes the layer number modulo N: 0 divides by zero, a negative N matches
        # every layer, so no layer would use the window
        problems.append(
            f"{flag_name('window_attn_skip_freq')} {skip} (every N-th layer runs full attention and "
            "the others the window: give N >= 1, or a pattern such as [1,1,0])")
    layers = getattr(config, "num_layers", None)
    if isinstance(skip, list) and layers is not None and len(skip) != layers:
        problems.append(
            f"{flag_name('window_attn_skip_freq')} with {len(skip)} entries for {flag_name('num_layers')} "
            f"{layers} (the pattern has one entry per layer, 1 for the window and 0 for full "
            "attention: e.g. \"[1,0]*6\" for 12 layers)")
    return problems


def check_window_flags(args) -> None:
    """Refuse the window flags that no attention runs (parsed flags, before upstream's
    validation; the layers would divide by zero, index past the pattern or see only
    themselves)."""
    problems = window_setting_problems(args)
    if problems:
        raise BoundedArgumentError("sliding-window attention cannot run with: "
                                   + "; ".join(problems) + ".")


def window_problems(config) -> list:
    """What of ``window_size`` and ``window_attn_skip_freq`` the attention of this project
    cannot run (the messages name the flags)."""
    problems = window_setting_problems(config)
    window = getattr(config, "window_size", None)
    if not problems and window is not None and window[1] != 0:
        problems.append(f"{flag_name('window_size')} {','.join(map(str, window))} (only causal "
                        f"windows run here: pass LEFT,0 with LEFT >= 1, or -1 for none)")
    return problems


def causal_band(window: Optional[int]) -> Band:
    """The band of causal attention over a whole sequence with ``window`` (or none)."""
    return CAUSAL if window is None else (window, 0)


def pair_band(rows: Tuple[int, int], keys: Tuple[int, int], window: Optional[int]):
    """The kernel call for query rows ``rows`` against key rows ``keys`` (absolute [start, end)
    positions, keys not after the rows' end) under causal attention with ``window``: the rows and
    keys that meet trimmed to those that do, with their band; None when no query sees a key."""
    (row_start, row_end), (key_start, key_end) = rows, keys
    if window is not None:
        key_start = max(key_start, row_start - window)  # keys before every row's window
        row_end = min(row_end, key_end + window)  # rows whose window starts after the keys
    if row_start >= row_end or key_start >= key_end or key_start > row_end - 1:
        return None
    # band in the kernel's end-aligned convention (see the module docstring)
    right = row_end - key_end if row_start < key_end - 1 else -1
    left = -1 if window is None or key_start >= row_end - 1 - window else window + key_end - row_end
    return (row_start, row_end), (key_start, key_end), (left, right)


def band_allowed(queries: int, keys: int, band: Band, device=None) -> torch.Tensor:
    """[queries, keys] booleans: which keys each query sees under ``band``."""
    offset = (torch.arange(keys, device=device)[None, :]
              - torch.arange(queries, device=device)[:, None] - (keys - queries))
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device)
    if band[0] >= 0:
        allowed &= offset >= -band[0]
    if band[1] >= 0:
        allowed &= offset <= band[1]
    return allowed


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each group repeated for its query heads."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, s, d]: the query heads of each group summed."""
    b, heads, s, d = t.shape
    return t.reshape(b, groups, heads // groups, s, d).sum(dim=2)


def _scores(q, k, scale: float, band: Band) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if band != NO_MASK:
        allowed = band_allowed(q.shape[-2], k.shape[-2], band, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradient shares and log-sum-exps are kept in: fp32, or the input's if wider."""
    return torch.promote_types(dtype, torch.float32)


def reference_forward(q, k, v, scale: float, band: Band = CAUSAL):
    """Attention of [b, h, sq, d] queries on [b, g, sk, d] keys/values under ``band``: output
    [b, h, sq, d] and log-sum-exp [b, h, sq] in :func:`accumulation_dtype` (s × s scores)."""
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    scores = _scores(q, k, scale, band)
    lse = torch.logsumexp(scores.to(accumulation_dtype(q.dtype)), dim=-1)
    probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    return torch.matmul(probs, v), lse


def reference_block_backward(grad_out, q, k, v, out, lse, scale: float, band: Band):
    """(dQ, dK, dV) of queries [b, h, sq, d] against keys/values [b, g, sk, d] under ``band``,
    given the queries' output and log-sum-exp over all the keys they see (a share of them when
    these keys are a block of those)."""
    heads, groups = q.shape[1], k.shape[1]
    k_all, v_all = _expand_groups(k, heads), _expand_groups(v, heads)
    probs = torch.exp(_scores(q, k_all, scale, band) - lse.to(q.dtype).unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out, v_all.transpose(-1, -2))
    # softmax backward with the whole row's D = sum_j P_ij dP_ij = rowsum(dO * O)
    row_dot = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_q = torch.matmul(grad_scores, k_all)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
    return grad_q, _sum_groups(grad_k, groups), _sum_groups(grad_v, groups)


def _rows_major(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [b, s, h, d] as flash attention reads it (unit stride in d)."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def unread_rng_state(device: torch.device, shape: Tuple[int, ...], dtype: torch.dtype):
    """A random state shaped as a kernel's forward returns it; without dropout no backward reads
    it, so one per device and kind serves every call."""
    return torch.zeros(shape, dtype=dtype, device=device)


def flash_forward(q, k, v, scale: float, band: Band = CAUSAL):
    """Flash attention of [b, h, sq, d] queries on [b, g, sk, d] keys/values under ``band``:
    output [b, h, sq, d] and log-sum-exp [b, h, sq] (fp32)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        _rows_major(q), _rows_major(k), _rows_major(v), None, None, q.shape[2], k.shape[2], 0.0,
        band == CAUSAL, False, scale=scale, window_size_left=band[0], window_size_right=band[1],
    )[:2]
    return out.transpose(1, 2), lse


def flash_backward(grad_out, q, k, v, out, lse, scale: float, band: Band):
    """The flash kernel's (dQ, dK, dV) for :func:`flash_forward`'s inputs, output and
    log-sum-exp (or a share of them, as :func:`reference_block_backward`)."""
    seed = unread_rng_state(q.device, (2,), torch.uint64)
    offset = unread_rng_state(q.device, (), torch.uint64)
    grads = torch.ops.aten._flash_attention_backward(
        _rows_major(grad_out), _rows_major(q), _rows_major(k), _rows_major(v), _rows_major(out),
        lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, band == CAUSAL, seed, offset,
        scale=scale, window_size_left=band[0], window_size_right=band[1],
    )
    return tuple(g.transpose(1, 2) for g in grads)


def flash_varlen_kernels(cu_seqlens: torch.Tensor, longest: int):
    """(forward, backward) of flash attention's variable-length kernel over the documents of
    ``cu_seqlens``, the band applying within each document, in the [1, h, tokens, d] layout
    (views of [tokens, h, d]); log-sum-exp [1, h, tokens]."""

    def tokens_major(t):  # [1, h, T, d] -> [T, h, d]
        t = t[0].transpose(0, 1)
        return t if t.stride(-1) == 1 else t.contiguous()

    def forward(q, k, v, scale: float, band: Band):
        out, lse = torch.ops.aten._flash_attention_forward(
            tokens_major(q), tokens_major(k), tokens_major(v), cu_seqlens, cu_seqlens, longest,
            longest, 0.0, band == CAUSAL, False, scale=scale, window_size_left=band[0],
            window_size_right=band[1],
        )[:2]
        return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)

    def backward(grad_out, q, k, v, out, lse, scale: float, band: Band):
        seed = unread_rng_state(q.device, (2,), torch.uint64)
        offset = unread_rng_state(q.device, (), torch.uint64)
        grads = torch.ops.aten._flash_attention_backward(
            tokens_major(grad_out), tokens_major(q), tokens_major(k), tokens_major(v),
            tokens_major(out), lse[0].contiguous(), cu_seqlens, cu_seqlens, longest, longest,
            0.0, band == CAUSAL, seed, offset, scale=scale, window_size_left=band[0],
            window_size_right=band[1],
        )
        return tuple(g.transpose(0, 1).unsqueeze(0) for g in grads)

    return forward, backward
