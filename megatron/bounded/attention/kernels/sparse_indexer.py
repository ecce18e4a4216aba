"""Triton kernel of the lightning indexer's scores, and the top-k over query blocks.

:func:`blockwise_topk_triton` is :func:`megatron.bounded.attention.sparse_indexer.blockwise_topk`
on CUDA: the Python loop visits query blocks only. For a block of queries the kernel writes the
scores against every key the block may see, ``I(i, j) = Σ_h w(i, h) · ReLU(q(i, h) · k(j))``
(fp32; masked keys, causal and before the query's document, -inf), and one ``torch.topk`` per
block picks each query's k best.

The kernel: one program per [:data:`IndexTiling` ``block_queries`` × ``block_keys``] tile. It
loads the tile's keys once ([dim, block_keys]) and loops over the heads: per head one tensor-core
product ``q_h · kᵀ`` ([block_queries, dim] × [dim, block_keys], fp32 accumulation), ReLU, and
``w(·, h)`` times it added to the tile's sum; the loop is pipelined (the next heads' queries
loaded while this one multiplies). A tile wholly above the diagonal, or wholly before the first
document start of its queries, is written -inf without a product. FLOPs ``N²·heads·dim`` (half
of the N × N products are above the diagonal and skipped): DeepSeek-V3.2's 64 heads × 128 at
N = 131,072, 1.4e14.

**Memory bound**: the block's scores, ``b × block rows × min(N, max(block end, k))`` fp32, at
most :data:`SCORE_BUDGET_BYTES` (the rows of a block are sized to it: 2,048 rows at N = 131,072,
256 at N = 1,048,576), plus ``torch.topk``'s values and int64 indices of the block
(``b × block rows × k × 12`` bytes) and the result (``b × N × k`` int32). Nothing N × N.

The scores equal the PyTorch path's up to fp32 summation order (bf16 products are exact in
fp32; fp32 inputs multiply in IEEE fp32, not TF32), so the selection is the same but for keys
whose scores tie or differ by rounding.

Tests: ``tests/unit/attention/test_sparse_attention_kernels.py`` (in Triton's interpreter on CPU against
the PyTorch path). Benchmark: ``tools/benchmarks/bench_sparse_attention.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch
from megatron.bounded.units import GiB

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["INDEX_TILING", "IndexTiling", "SCORE_BUDGET_BYTES", "blockwise_topk_triton",
           "index_block_rows", "index_scores_triton", "kernels_apply"]

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# the scores of one query block (fp32) that torch.topk then reads
SCORE_BUDGET_BYTES = GiB


@dataclasses.dataclass(frozen=True)
class IndexTiling:
    """The kernel's tile (queries × keys, powers of two, at least 16: tensor-core shapes),
    Triton's ``num_warps`` and pipeline ``stages``."""

    block_queries: int = 128
    block_keys: int = 128
    num_warps: int = 8
    stages: int = 3


INDEX_TILING = IndexTiling()


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether DeepSeek sparse attention's Triton kernels (these and
    :mod:`megatron.bounded.attention.kernels.sparse_attention`) run for these tensors: Triton,
    CUDA, a 16- or 32-bit float."""
    return HAVE_TRITON and all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors)


if HAVE_TRITON:

    @cached_launch
    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, starts_ptr, out_ptr, batch, seq, first_query,
                             rows, columns, HEADS: tl.constexpr, DIM: tl.constexpr,
                             DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, RELU: tl.constexpr,
                             DOCUMENTS: tl.constexpr, PRECISION: tl.constexpr,
                             STAGES: tl.constexpr):
        sequence = tl.program_id(2)
        local = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # row in the block
        queries = first_query + local  # positions
        keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_block = local < rows
        query_rows = queries.to(tl.int64) * batch + sequence  # token rows of [s, b] memory
        if DOCUMENTS:
            starts = tl.load(starts_ptr + sequence * seq + queries, mask=in_block, other=seq)
        else:
            starts = tl.zeros([BLOCK_M], tl.int64)
        last_query = first_query + tl.minimum(tl.program_id(1) * BLOCK_M + BLOCK_M, rows) - 1
        out = (out_ptr + (sequence * rows + local.to(tl.int64))[:, None] * columns
               + keys[None, :])
        inside = in_block[:, None] & (keys < columns)[None, :]
        first_key = tl.program_id(0) * BLOCK_N
        if (first_key > last_query) | (first_key + BLOCK_N <= tl.min(starts, axis=0)):
            tl.store(out, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=inside)
        else:
            dims = tl.arange(0, DIM_PAD)
            key_t = tl.load(k_ptr + (keys.to(tl.int64) * batch + sequence)[None, :] * DIM
                            + dims[:, None],
                            mask=(dims < DIM)[:, None] & (keys < seq)[None, :], other=0.0)
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for head in tl.range(0, HEADS, num_stages=STAGES):
                q = tl.load(q_ptr + (query_rows * HEADS + head)[:, None] * DIM + dims[None, :],
                            mask=in_block[:, None] & (dims < DIM)[None, :], other=0.0)
                dots = tl.dot(q, key_t, input_precision=PRECISION)
                if RELU:
                    dots = tl.maximum(dots, 0.0)
                weight = tl.load(w_ptr + query_rows * HEADS + head, mask=in_block, other=0.0)
                total += weight.to(tl.float32)[:, None] * dots
            visible = (keys[None, :] <= queries[:, None]) & (keys[None, :] >= starts[:, None])
            tl.store(out, tl.where(visible, total, float("-inf")), mask=inside)


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                        starts: Optional[torch.Tensor], first_query: int, rows: int,
                        columns: int, relu: bool = True, tiling: IndexTiling = INDEX_TILING,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scores [b, rows, columns] fp32 of queries ``first_query``.. ``+ rows`` against keys
    0 .. ``columns``, masked keys -inf. q [s, b, heads, d] and k [s, b, d] of one dtype, weights
    [s, b, heads], contiguous; ``starts`` [b, s] int64 (documents) or None; ``out``: storage to
    write into."""
    seq, batch, heads, dim = q.shape
    if out is None:
        out = torch.empty(batch * rows * columns, dtype=torch.float32, device=q.device)
    scores = out[:batch * rows * columns].view(batch, rows, columns)
    grid = (triton.cdiv(columns, tiling.block_keys), triton.cdiv(rows, tiling.block_queries),
            batch)
    _index_scores_kernel[grid](
        q, weights, k, starts if starts is not None else scores, scores, batch, seq,
        first_query, rows, columns, HEADS=heads, DIM=dim,
        DIM_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_M=tiling.block_queries,
        BLOCK_N=tiling.block_keys, RELU=relu, DOCUMENTS=starts is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", STAGES=tiling.stages,
        num_warps=tiling.num_warps)
    return scores


def index_block_rows(batch: int, seq: int, budget_bytes: int = SCORE_BUDGET_BYTES,
                     tiling: IndexTiling = INDEX_TILING) -> int:
    """Query rows per block of :func:`blockwise_topk_triton`: as many as ``budget_bytes`` holds
    scores of every key for, a multiple of the kernel's tile (at least one tile), at most s."""
    step = tiling.block_queries
    return min(seq, max(step, budget_bytes // (4 * batch * seq) // step * step))


def blockwise_topk_triton(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, topk: int,
                          starts: Optional[torch.Tensor] = None, relu: bool = True,
                          budget_bytes: int = SCORE_BUDGET_BYTES,
                          tiling: IndexTiling = INDEX_TILING) -> torch.Tensor:
    """:func:`megatron.bounded.attention.sparse_indexer.blockwise_topk` with the kernel: [b, s,
    min(topk, s)] int32, per query its best keys in descending score order, -1 where fewer are
    valid. Query blocks of as many rows as :data:`SCORE_BUDGET_BYTES` (``budget_bytes``) holds
    scores of every key, a multiple of the kernel's tile."""
    seq, batch = q.shape[:2]
    width = min(topk, seq)
    dtype = torch.promote_types(q.dtype, k.dtype)  # one dtype for the tensor-core product
    q, weights, k = q.to(dtype).contiguous(), weights.contiguous(), k.to(dtype).contiguous()
    if starts is not None:
        starts = starts.to(torch.int64).contiguous()
    block_rows = index_block_rows(batch, seq, budget_bytes, tiling)
    result = torch.empty(batch, seq, width, dtype=torch.int32, device=q.device)
    storage = torch.empty(batch * block_rows * seq, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for q0 in range(0, seq, block_rows):
            q1 = min(q0 + block_rows, seq)
            # keys past the block's last query are masked for all of it; k columns at least
            scores = index_scores_triton(q, weights, k, starts, q0, q1 - q0, max(q1, width),
                                         relu, tiling, storage)
            best, chosen = scores.topk(width, dim=-1)
            result[:, q0:q1] = chosen.masked_fill_(best == float("-inf"), -1)
    return result
