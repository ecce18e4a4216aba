"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2), block by block.

For query i and key j the indexer's score is megatron-core's (``dsa._compute_index_scores``):
``I(i, j) = Σ_h w(i, h) · ReLU(q(i, h) · k(j))`` (ReLU off with
``--no-dsa-indexer-scoring-relu``), ``q`` of ``--dsa-indexer-n-heads`` heads of
``--dsa-indexer-head-dim``, ``k`` one head, ``w`` per query and head. Each query attends to the
``--dsa-indexer-topk`` keys of highest score among the keys it may see: causal (j ≤ i) and, with
packed documents, within its own document. Fewer valid keys than k: the rest of the row is -1.

Upstream materializes the [b, s, s] scores and takes their top-k. :func:`blockwise_topk` never
does. On CUDA with Triton it runs
:func:`megatron.bounded.attention.kernels.sparse_indexer.blockwise_topk_triton`: a kernel writes
a query block's scores against every key (heads fused, tensor cores) and one ``topk`` per block
selects. Elsewhere (CPU, float64) :func:`blockwise_topk_reference` visits the scores one
[query block × key block] tile at a time (key blocks past the query block's last row skipped)
and keeps a running top-k per query: the tile's scores and the running k are merged by one
``topk`` of k + block candidates. Memory O(b·s·k + b·block_q·block_k·heads). Nothing is s × s on
either path, and either gives upstream's result (same values, same descending order; ties
aside, which either may break either way).

:func:`selected_index_scores` gives the indexer's scores at the selected keys only ([b, s, k],
differentiable in q, w and k), one query block at a time under activation checkpointing: the
indexer loss (:mod:`megatron.bounded.attention.sparse_attention`) needs nothing more.

:func:`hadamard_rotate` is the Walsh-Hadamard rotation upstream applies to q and k before scoring
(``fast_hadamard_transform`` with scale dim^-1/2, Sylvester order) in plain PyTorch: orthonormal,
so it changes the scores only through rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from megatron.bounded.attention.kernels.sparse_indexer import blockwise_topk_triton, kernels_apply

__all__ = [
    "QUERY_BLOCK", "KEY_BLOCK", "blockwise_topk", "blockwise_topk_reference", "document_starts",
    "hadamard_rotate",
    "gather_rows", "index_scores", "selected_index_scores", "valid_keys",
]

# tile of the indexer's score pass: b·QUERY_BLOCK·KEY_BLOCK·heads fp32 values at a time
QUERY_BLOCK = 256
KEY_BLOCK = 1024


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` times the orthonormal Walsh-Hadamard matrix (Sylvester order) over its last
    dimension, a power of two."""
    dim = x.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {dim}")
    lead = x.shape[:-1]
    y = x.reshape(-1, dim)
    span = 1
    while span < dim:
        # pairs (a, b) span apart -> (a + b, a - b)
        pairs = y.reshape(-1, dim // (2 * span), 2, span)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        span *= 2
    return (y.reshape(*lead, dim) * dim ** -0.5).to(x.dtype)


def document_starts(documents, batch: int, seq: int, device) -> torch.Tensor:
    """[b, s] int64: the position of the first token of each token's document (0 without
    documents). ``documents``: :class:`megatron.bounded.attention.documents.DocumentParams` or
    None."""
    if documents is None:
        return torch.zeros(batch, seq, dtype=torch.int64, device=device)
    rows = []
    for bounds in documents.sequences:
        lengths = torch.tensor([end - start for start, end in zip(bounds, bounds[1:])])
        rows.append(torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths))
    return torch.stack(rows).to(device)


def valid_keys(starts: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[b, queries, keys] bool: key position ``keys[j]`` is visible from query position
    ``queries[i]``: causal, and not before the query's document start (``starts``: [b, queries])."""
    return (keys.view(1, 1, -1) <= queries.view(1, -1, 1)) & (
        keys.view(1, 1, -1) >= starts.unsqueeze(-1))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs (upstream scores in fp32), the inputs' own dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def index_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                 relu: bool = True) -> torch.Tensor:
    """Indexer scores [b, sq, sk] (fp32 or wider) of q [sq, b, heads, d], weights
    [sq, b, heads] and k [sk, b, d]."""
    dtype = _compute_dtype(q.dtype)
    per_head = torch.einsum("sbhd,tbd->bsht", q.to(dtype), k.to(dtype))
    if relu:
        per_head = torch.relu(per_head)
    return torch.einsum("bsht,sbh->bst", per_head, weights.to(dtype))


def blockwise_topk(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, topk: int,
                   starts: Optional[torch.Tensor] = None, relu: bool = True,
                   query_block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK) -> torch.Tensor:
    """[b, s, min(topk, s)] int32: per query, the keys of highest indexer score among its valid
    keys, in descending score order; -1 where fewer keys are valid. q [s, b, heads, d],
    weights [s, b, heads], k [s, b, d]; ``starts`` [b, s] (:func:`document_starts`), None for
    plain causal attention. No gradient. On CUDA with Triton:
    :func:`megatron.bounded.attention.kernels.sparse_indexer.blockwise_topk_triton`; elsewhere
    :func:`blockwise_topk_reference` (tiles of ``query_block`` × ``key_block``)."""
    if kernels_apply(q, weights, k):
        return blockwise_topk_triton(q, weights, k, topk, starts, relu)
    return blockwise_topk_reference(q, weights, k, topk, starts, relu, query_block, key_block)


def blockwise_topk_reference(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, topk: int,
                             starts: Optional[torch.Tensor] = None, relu: bool = True,
                             query_block: int = QUERY_BLOCK,
                             key_block: int = KEY_BLOCK) -> torch.Tensor:
    """:func:`blockwise_topk` in PyTorch, a running top-k over [query_block × key_block]
    tiles."""
    seq, batch = q.shape[:2]
    width = min(topk, seq)
    positions = torch.arange(seq, device=q.device)
    if starts is None:
        starts = torch.zeros(batch, seq, dtype=torch.int64, device=q.device)
    dtype = _compute_dtype(q.dtype)
    # kept from forward to backward: int32 halves the N·k indices (positions < 2**31)
    result = torch.empty(batch, seq, width, dtype=torch.int32, device=q.device)
    with torch.no_grad():
        for q0 in range(0, seq, query_block):
            q1 = min(q0 + query_block, seq)
            best = torch.full((batch, q1 - q0, width), float("-inf"), dtype=dtype,
                              device=q.device)
            best_index = torch.full((batch, q1 - q0, width), -1, dtype=torch.int64,
                                    device=q.device)
            for k0 in range(0, q1, key_block):  # keys past the block's last query: none valid
                k1 = min(k0 + key_block, q1)
                scores = index_scores(q[q0:q1], weights[q0:q1], k[k0:k1], relu)
                scores = scores.masked_fill(
                    ~valid_keys(starts[:, q0:q1], positions[q0:q1], positions[k0:k1]),
                    float("-inf"))
                candidates = torch.cat((best, scores), dim=-1)
                candidate_index = torch.cat(
                    (best_index, positions[k0:k1].expand(batch, q1 - q0, -1)), dim=-1)
                best, chosen = candidates.topk(width, dim=-1)
                best_index = candidate_index.gather(-1, chosen)
            result[:, q0:q1] = best_index.masked_fill(best == float("-inf"), -1)
    return result


def _selected_block(q: torch.Tensor, weights: torch.Tensor, gathered_k: torch.Tensor,
                    relu: bool) -> torch.Tensor:
    """Scores [b, bq, k] of q [bq, b, heads, d], weights [bq, b, heads] at their gathered keys
    [b, bq, k, d]."""
    dtype = _compute_dtype(q.dtype)
    per_head = torch.einsum("sbhd,bskd->bshk", q.to(dtype), gathered_k.to(dtype))
    if relu:
        per_head = torch.relu(per_head)
    return torch.einsum("bshk,sbh->bsk", per_head, weights.to(dtype))


def gather_rows(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``t`` [s, b, ...] at ``indices`` [b, rows, k] (-1 read as row 0): [b, rows, k, ...]."""
    seq, batch = t.shape[:2]
    flat = t.transpose(0, 1).reshape(batch * seq, *t.shape[2:])
    offsets = torch.arange(batch, device=indices.device).view(-1, 1, 1) * seq
    picked = flat.index_select(0, (indices.clamp(min=0) + offsets).reshape(-1))
    return picked.view(*indices.shape, *t.shape[2:])


def _selected_scores_of_block(q, weights, k, indices, relu):
    return _selected_block(q, weights, gather_rows(k, indices), relu)


def selected_index_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                          indices: torch.Tensor, relu: bool = True,
                          query_block: int = QUERY_BLOCK) -> torch.Tensor:
    """The indexer's scores at the selected keys, [b, s, k] (invalid entries: the score of key
    0, to be masked by the caller); differentiable in q, weights and k, each query block
    recomputed in backward (what a block gathers is not kept)."""
    blocks = []
    for q0 in range(0, q.shape[0], query_block):
        q1 = min(q0 + query_block, q.shape[0])
        args = (q[q0:q1], weights[q0:q1], k, indices[:, q0:q1], relu)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, weights, k)):
            blocks.append(checkpoint(_selected_scores_of_block, *args, use_reentrant=False))
        else:
            blocks.append(_selected_scores_of_block(*args))
    return torch.cat(blocks, dim=1)
