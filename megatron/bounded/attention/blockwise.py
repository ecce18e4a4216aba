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
dropout. With packed documents (each sequence's cumulative document lengths) the forward runs
document by document and a block pair is back-propagated only where a document spans it:
:func:`attention_pairs` cuts each pair to the rows of documents it shares, so no kernel sees a
token of another document. On CUDA the kernels are PyTorch's cuDNN or flash attention forward
and backward; elsewhere :func:`reference_forward` and :func:`reference_block_backward`, plain PyTorch in the
input's dtype, are the kernels (``tests/unit/test_attention_blocks.py`` checks the blocked backward
against autograd through a plain softmax).

Exact up to the order of sums: every block's contribution is the same number the whole
sequence's kernel forms; the blocks' 16-bit dQ, dK, dV shares are added in fp32.
"""

from __future__ import annotations

import bisect
import functools
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "KERNELS",
    "accumulation_dtype",
    "attention_forward",
    "attention_pairs",
    "block_bounds",
    "query_block_backward",
    "reference_block_backward",
    "reference_forward",
    "rows_by_block",
]


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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the blocks' gradient shares are summed in: fp32, or the input's if wider."""
    return torch.promote_types(dtype, torch.float32)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b, n, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each group repeated for its query heads."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, s, d]: the query heads of each group summed."""
    b, heads, s, d = t.shape
    return t.reshape(b, groups, heads // groups, s, d).sum(dim=2)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    """Scaled scores of [b, h, sq, d] queries against [b, h, sk, d] keys; ``causal`` masks a
    diagonal block (sq == sk): query row r sees key rows 0..r."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(cols - rows)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def reference_forward(q, k, v, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of [b, h, s, d] queries on [b, g, s, d] keys/values: output
    [b, h, s, d] and log-sum-exp [b, h, s] in fp32, or in the input's dtype when that is wider
    (plain PyTorch, s × s scores)."""
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    scores = _scores(q, k, scale, causal=True)
    lse = torch.logsumexp(scores.to(accumulation_dtype(q.dtype)), dim=-1)
    probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    return torch.matmul(probs, v), lse


def reference_block_backward(grad_out, q, k, v, out, lse, scale: float, causal: bool):
    """One block's share of (dQ, dK, dV): queries [b, h, sq, d] with their whole-sequence output
    and log-sum-exp, keys/values [b, g, sk, d]; ``causal`` for a diagonal block (sq == sk)."""
    heads, groups = q.shape[1], k.shape[1]
    k_all, v_all = _expand_groups(k, heads), _expand_groups(v, heads)
    probs = torch.exp(_scores(q, k_all, scale, causal) - lse.to(q.dtype).unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out, v_all.transpose(-1, -2))
    # softmax backward with the whole row's D = sum_j P_ij dP_ij = rowsum(dO * O)
    row_dot = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = probs * (grad_probs - row_dot) * scale
    grad_q = torch.matmul(grad_scores, k_all)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
    return grad_q, _sum_groups(grad_k, groups), _sum_groups(grad_v, groups)


def _flash_forward(q, k, v, scale: float):
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale
    )[:2]
    return output, lse


@functools.lru_cache(maxsize=None)
def _unread_rng_state(device: torch.device, shape: Tuple[int, ...], dtype: torch.dtype):
    """A random state shaped as a kernel's forward returns it; without dropout no backward reads
    it, so one per device and kind serves every block."""
    return torch.zeros(shape, dtype=dtype, device=device)


def _flash_block_backward(grad_out, q, k, v, out, lse, scale: float, causal: bool):
    # dense (not variable-length) blocks: no cumulative sequence lengths
    seed = _unread_rng_state(q.device, (2,), torch.uint64)
    offset = _unread_rng_state(q.device, (), torch.uint64)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
        offset, scale=scale,
    )


def _cudnn_forward(q, k, v, scale: float):
    output, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )[:2]
    return output, lse  # lse: [b, h, s, 1]


def _cudnn_block_backward(grad_out, q, k, v, out, lse, scale: float, causal: bool):
    seed = _unread_rng_state(q.device, (), torch.int64)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, seed, None, None, None, q.shape[2],
        k.shape[2], 0.0, causal, scale=scale,
    )


# name -> (forward, block backward); the log-sum-exp a forward returns is read by its own backward
KERNELS = {
    "cudnn": (_cudnn_forward, _cudnn_block_backward),
    "flash": (_flash_forward, _flash_block_backward),
    "reference": (reference_forward, reference_block_backward),
}


def attention_forward(query, key, value, scale: float, kernels: Sequence[str] = ("flash",),
                      sequences: Optional[Sequence[Sequence[int]]] = None):
    """Causal attention of the whole sequence: ``[s, b, heads, d]`` output, the log-sum-exp
    ``[b, heads, s(, 1)]`` (fp32; float64 for float64 inputs) that the blocked backward reads,
    and the name of the kernel that ran. On CUDA the first of ``kernels`` that accepts the
    inputs runs; elsewhere the reference. ``sequences``: per sequence of the batch, its
    documents' cumulative lengths; attention then stays within each document (flash kernels
    only: cuDNN refuses the one-row blocks that documents can leave)."""
    q, k, v = (_heads_first(t) for t in (query, key, value))
    if sequences is None:
        names = [name for name in kernels if name != "reference"] if q.is_cuda else ["reference"]
        for position, name in enumerate(names):  # as SDPA falls through its backends
            try:
                output, lse = KERNELS[name][0](q, k, v, scale)
            except RuntimeError:
                if position == len(names) - 1:
                    raise
                continue
            return output.permute(2, 0, 1, 3), lse, name
        raise ValueError(f"no attention kernel among {list(kernels)} for CUDA inputs")
    # cuDNN refuses the one-row blocks documents can leave (s_q = s_kv = 1): flash kernels
    name = "flash" if q.is_cuda else "reference"
    output, lse = q.new_empty(q.shape), None
    for index, bounds in enumerate(sequences):
        for start, end in zip(bounds, bounds[1:]):
            rows = (slice(index, index + 1), slice(None), slice(start, end))
            piece_out, piece_lse = KERNELS[name][0](q[rows], k[rows], v[rows], scale)
            if lse is None:
                lse = piece_lse.new_empty(q.shape[:3] + piece_lse.shape[3:])
            output[rows], lse[rows] = piece_out, piece_lse
    return output.permute(2, 0, 1, 3), lse, name


def attention_pairs(start: int, end: int, bounds: Sequence[Tuple[int, int]],
                    documents: Sequence[int]) -> List[Tuple[Tuple[int, int], Tuple[int, int], bool]]:
    """The kernel calls that back-propagate the query rows [start, end) (one of ``bounds``)
    within ``documents`` (one sequence's cumulative lengths): ``((query rows), (key rows),
    causal)``. The diagonal block gives one causal call per document it holds; an earlier key
    block is seen only by the document that holds row ``start``, if that document reaches into
    it (the rows of that document, no mask); blocks no document spans are skipped."""
    pairs = []
    for key_start, key_end in bounds:
        if key_start >= end:
            break
        if key_start == start:
            for first, last in zip(documents, documents[1:]):
                rows = (max(start, first), min(end, last))
                if rows[0] < rows[1]:
                    pairs.append((rows, rows, True))
            continue
        index = bisect.bisect_right(documents, start) - 1
        first, last = documents[index], documents[index + 1]
        if first < key_end:
            pairs.append(((start, min(end, last)), (max(key_start, first), key_end), False))
    return pairs


def query_block_backward(grad_out, query, key, value, out, lse, start: int,
                         bounds: Sequence[Tuple[int, int]], grad_key_acc, grad_value_acc,
                         scale: float, kernel: str,
                         sequences: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """Back-propagate the query rows [start, start + len) through every key block they see.

    ``grad_out``, ``query`` and ``out`` are that query block's rows ``[sq, b, heads, d]``, ``lse``
    its log-sum-exp as ``kernel`` (the forward's) returned it; ``key``/``value`` the whole sequence
    ``[s, b, groups, d]``; ``bounds`` the blocks (the query block is one of them); ``sequences``
    the documents as :func:`attention_forward` took them. The key blocks' dK, dV shares are added
    into the fp32 accumulators ``grad_key_acc``/``grad_value_acc`` (shaped like ``key``); the
    query block's dQ is returned, summed over the key blocks in :func:`accumulation_dtype`.
    Processing query blocks from the last to the first makes each key block's accumulators final
    as soon as its own query block is done."""
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
        for (q_start, q_end), (k_start, k_end), causal in attention_pairs(
                start, end, bounds, documents):
            rows = (batch_rows, slice(None), slice(q_start - start, q_end - start))
            keys = (batch_rows, slice(None), slice(k_start, k_end))
            dq, dk, dv = backward(g_out[rows], q[rows], k[keys], v[keys], o[rows],
                                  lse[rows].contiguous(), scale, causal)
            grad_q[rows] += dq
            grad_k[keys] += dk
            grad_v[keys] += dv
    return grad_q.permute(2, 0, 1, 3)
