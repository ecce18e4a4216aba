"""Causal attention whose backward runs in query × key blocks.

A whole-sequence attention backward holds, besides its gradients, a kernel workspace that grows
with the sequence: flash attention keeps an fp32 accumulator of dQ and, for grouped-query
attention, dK and dV expanded to every query head, 8·heads·d bytes per token on top of the
gradients themselves. Here the backward is cut into blocks of the sequence: the softmax
probabilities of a (query block, key block) pair only need the query rows' whole-sequence
log-sum-exp and output, so each block's kernel computes that block's exact share of dQ, dK and dV
(the block-wise backward ring attention uses). Per query block dQ is summed in fp32 over its key
blocks; dK and dV are summed in fp32 over the query blocks (one fp32 pair, 8·groups·d bytes per
token, for the whole sequence).

Layout: ``[s, b, heads, d]`` tensors in and out; key/value tensors carry ``groups`` heads (the
query heads of a group are consecutive, as in Megatron and ``enable_gqa``). Causal only, no
dropout. A sliding window (:mod:`megatron.bounded.attention.windows`) skips the block pairs
wholly outside it and gives the pairs it cuts a banded kernel call; a sink
(:mod:`megatron.bounded.attention.sinks`) is folded once into the forward's output and
log-sum-exp, which the blocks' backward then reads. With packed documents (each sequence's cumulative document lengths) the forward runs
document by document and a block pair is back-propagated only where a document spans it:
:func:`attention_pairs` cuts each pair to the rows of documents it shares, so no kernel sees a
token of another document. On CUDA the kernels are PyTorch's cuDNN or flash attention forward
and backward; elsewhere the plain-PyTorch reference of :mod:`megatron.bounded.attention.windows`,
in the input's dtype, is the kernel (``tests/unit/attention/test_attention_blocks.py`` checks the blocked backward
against autograd through a plain softmax).

Exact up to the order of sums: every block's contribution is the same number the whole
sequence's kernel forms; the blocks' 16-bit dQ, dK, dV shares are added in fp32.
"""

from __future__ import annotations

import bisect
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron.bounded.attention.sinks import with_sink
from megatron.bounded.attention.windows import (
    CAUSAL,
    NO_MASK,
    Band,
    accumulation_dtype,
    causal_band,
    flash_backward,
    flash_forward,
    pair_band,
    reference_block_backward,
    reference_forward,
    unread_rng_state,
)

__all__ = [
    "KERNELS",
    "KEY_BLOCKS_PER_CALL",
    "accumulation_dtype",
    "attention_forward",
    "attention_pairs",
    "block_bounds",
    "query_block_backward",
    "rows_by_block",
]


# Key blocks one unmasked backward call covers at most. One call per key block pays each call's
# fixed cost (launch, the dQ pre- and post-processing kernels, a partly filled last wave of
# thread blocks) once per pair; a longer call's workspace grows with its keys (cuDNN expands dK
# and dV to every query head), which chunked_attention.chunk_backward_bytes_per_token counts.
# 8 blocks of 16,384 tokens: the whole backward of a layer 4% faster than one block per call at
# 524,288 and 1,048,576 tokens for 0.66 GiB (docs/operators/chunked_recompute.md).
KEY_BLOCKS_PER_CALL = 8


def block_bounds(rows: int, block_rows: int) -> List[Tuple[int, int]]:
    """[start, end) row ranges of ``block_rows`` (the last one shorter)."""
    return [(start, min(rows, start + block_rows)) for start in range(0, rows, block_rows)]


def rows_by_block(rows: int, bounds: Sequence[Tuple[int, int]], compute: Callable) -> tuple:
    """Whole-sequence tensors assembled block by block: ``compute(start, end)`` returns a tuple
    of tensors of ``end - start`` rows; each output is allocated at the first block (``rows``
    rows) and filled in place, so only one block's pieces are alive beside the outputs."""
    outputs = None
    for start, end in bounds:
        pieces = compute(start, end)
        if outputs is None:
            outputs = tuple(p.new_empty((rows,) + tuple(p.shape[1:])) for p in pieces)
        for output, piece in zip(outputs, pieces):
            output[start:end] = piece
        del pieces
    return outputs


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b, n, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


def _cudnn_forward(q, k, v, scale: float, band: Band = CAUSAL):
    if band != CAUSAL:  # cuDNN's kernel takes no window: the next kernel runs
        raise RuntimeError("cuDNN attention runs no sliding window")
    output, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )[:2]
    return output, lse  # lse: [b, h, s, 1]


def _cudnn_block_backward(grad_out, q, k, v, out, lse, scale: float, band: Band):
    if band not in (CAUSAL, NO_MASK):
        raise ValueError(f"cuDNN attention runs no sliding window (band {band})")
    seed = unread_rng_state(q.device, (), torch.int64)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, seed, None, None, None, q.shape[2],
        k.shape[2], 0.0, band == CAUSAL, scale=scale,
    )


# name -> (forward, block backward); the log-sum-exp a forward returns is read by its own backward
KERNELS = {
    "cudnn": (_cudnn_forward, _cudnn_block_backward),
    "flash": (flash_forward, flash_backward),
    "reference": (reference_forward, reference_block_backward),
}


def attention_forward(query, key, value, scale: float, kernels: Sequence[str] = ("flash",),
                      sequences: Optional[Sequence[Sequence[int]]] = None,
                      window: Optional[int] = None, sink: Optional[torch.Tensor] = None):
    """Causal attention of the whole sequence: ``[s, b, heads, d]`` output, the log-sum-exp
    ``[b, heads, s(, 1)]`` (fp32; float64 for float64 inputs) that the blocked backward reads,
    and the name of the kernel that ran. On CUDA the first of ``kernels`` that accepts the
    inputs runs (cuDNN takes no window); elsewhere the reference. ``sequences``: per sequence of
    the batch, its documents' cumulative lengths; attention then stays within each document
    (flash kernels only: cuDNN refuses the one-row blocks that documents can leave).
    ``window``: the causal window's left extent; ``sink``: the per-head sink logits
    (:mod:`megatron.bounded.attention.sinks`), folded into the output and log-sum-exp here."""
    q, k, v = (_heads_first(t) for t in (query, key, value))
    band = causal_band(window)
    if sequences is None:
        names = [name for name in kernels if name != "reference"] if q.is_cuda else ["reference"]
        for position, name in enumerate(names):  # as SDPA falls through its backends
            try:
                output, lse = KERNELS[name][0](q, k, v, scale, band)
            except RuntimeError:
                if position == len(names) - 1:
                    raise
                continue
            return _sunk(output, lse, sink) + (name,)
        raise ValueError(f"no attention kernel among {list(kernels)} for CUDA inputs")
    # cuDNN refuses the one-row blocks documents can leave (s_q = s_kv = 1): flash kernels
    name = "flash" if q.is_cuda else "reference"
    output, lse = q.new_empty(q.shape), None
    for index, bounds in enumerate(sequences):
        for start, end in zip(bounds, bounds[1:]):
            rows = (slice(index, index + 1), slice(None), slice(start, end))
            piece_out, piece_lse = KERNELS[name][0](q[rows], k[rows], v[rows], scale, band)
            if lse is None:
                lse = piece_lse.new_empty(q.shape[:3] + piece_lse.shape[3:])
            output[rows], lse[rows] = piece_out, piece_lse
    return _sunk(output, lse, sink) + (name,)


def _sunk(output, lse, sink) -> tuple:
    """[b, heads, s, d] output and its log-sum-exp -> ([s, b, heads, d], log-sum-exp), with the
    sink folded in when there is one."""
    if sink is not None:
        output, lse = with_sink(output, lse, sink)
    return output.permute(2, 0, 1, 3), lse


def attention_pairs(start: int, end: int, bounds: Sequence[Tuple[int, int]],
                    documents: Sequence[int], window: Optional[int] = None,
                    key_blocks_per_call: int = KEY_BLOCKS_PER_CALL,
                    ) -> List[Tuple[Tuple[int, int], Tuple[int, int], Band]]:
    """The kernel calls that back-propagate the query rows [start, end) (one of ``bounds``)
    within ``documents`` (one sequence's cumulative lengths) under causal attention with
    ``window`` (its left extent, or None): ``((query rows), (key rows), band)``, the band in the
    end-aligned convention of :mod:`megatron.bounded.attention.windows`. The diagonal block
    gives one call per document it holds; an earlier key block is seen only by the document
    that holds row ``start``, if that document reaches into it (the rows of that document).
    Each call is trimmed to the rows and keys that meet within the window; pairs that do not
    meet (blocks no document spans, or wholly outside the window) are skipped. Unmasked calls
    of the same rows on adjoining keys are merged, ``key_blocks_per_call`` blocks' worth of
    keys at most, counted from the first key (few distinct shapes for the kernels' caches)."""
    pairs = []
    for key_start, key_end in bounds:
        if key_start >= end:
            break
        if key_start == start:
            candidates = [((max(start, first), min(end, last)),) * 2
                          for first, last in zip(documents, documents[1:])]
        else:
            index = bisect.bisect_right(documents, start) - 1
            first, last = documents[index], documents[index + 1]
            candidates = [((start, min(end, last)), (max(key_start, first), key_end))]
        for rows, keys in candidates:
            if rows[0] < rows[1] and keys[0] < keys[1]:
                pair = pair_band(rows, keys, window)
                if pair is not None:
                    pairs.append(pair)
    return _merged(pairs, key_blocks_per_call * (bounds[0][1] - bounds[0][0]))


def _merged(pairs: list, max_keys: int) -> list:
    """``pairs`` with each run of unmasked calls of the same rows on adjoining keys joined into
    calls of at most ``max_keys`` keys."""
    merged = []
    for rows, keys, band in pairs:
        if merged:
            last_rows, last_keys, last_band = merged[-1]
            if (band == last_band == NO_MASK and rows == last_rows and keys[0] == last_keys[1]
                    and keys[1] - last_keys[0] <= max_keys):
                merged[-1] = (rows, (last_keys[0], keys[1]), NO_MASK)
                continue
        merged.append((rows, keys, band))
    return merged


def query_block_backward(grad_out, query, key, value, out, lse, start: int,
                         bounds: Sequence[Tuple[int, int]], grad_key_acc, grad_value_acc,
                         scale: float, kernel: str,
                         sequences: Optional[Sequence[Sequence[int]]] = None,
                         window: Optional[int] = None,
                         key_blocks_per_call: int = KEY_BLOCKS_PER_CALL) -> torch.Tensor:
    """Back-propagate the query rows [start, start + len) through every key block they see.

    ``grad_out``, ``query`` and ``out`` are that query block's rows ``[sq, b, heads, d]``, ``lse``
    its log-sum-exp as ``kernel`` (the forward's) returned it, sink included; ``key``/``value``
    the whole sequence ``[s, b, groups, d]``; ``bounds`` the blocks (the query block is one of
    them); ``sequences`` and ``window`` as :func:`attention_forward` took them;
    ``key_blocks_per_call`` as :func:`attention_pairs` takes it. The key blocks'
    dK, dV shares are added into the fp32 accumulators ``grad_key_acc``/``grad_value_acc``
    (shaped like ``key``); the query block's dQ is returned, summed over the key blocks in
    :func:`accumulation_dtype`. Processing query blocks from the last to the first makes each
    key block's accumulators final as soon as its own query block is done."""
    end = start + query.shape[0]
    if (start, end) not in bounds:
        raise ValueError(f"query rows [{start}, {end}) are not one of the blocks {list(bounds)}")
    backward = KERNELS[kernel][1]
    q, g_out, o, k, v = (_heads_first(t) for t in (query, grad_out, out, key, value))
    grad_q = torch.zeros(q.shape, dtype=accumulation_dtype(query.dtype), device=query.device)
    grad_k, grad_v = (_heads_first(t) for t in (grad_key_acc, grad_value_acc))
    # the whole batch as one sequence of one document, or each sequence with its documents
    groups = [(slice(None), (0, key.shape[0]))] if sequences is None else [
        (slice(index, index + 1), documents) for index, documents in enumerate(sequences)]
    for batch_rows, documents in groups:
        for (q_start, q_end), (k_start, k_end), band in attention_pairs(
                start, end, bounds, documents, window, key_blocks_per_call):
            rows = (batch_rows, slice(None), slice(q_start - start, q_end - start))
            keys = (batch_rows, slice(None), slice(k_start, k_end))
            dq, dk, dv = backward(g_out[rows], q[rows], k[keys], v[keys], o[rows],
                                  lse[rows].contiguous(), scale, band)
            grad_q[rows] += dq
            grad_k[keys] += dk
            grad_v[keys] += dv
    return grad_q.permute(2, 0, 1, 3)
