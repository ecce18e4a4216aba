"""Triton kernels of DeepSeek sparse attention: each query over its selected keys only.

The tensors are those of :func:`megatron.bounded.attention.sparse_attention.sparse_attention`:
query and key [s, b, heads, d_qk] (every head its own key: multi-latent attention not absorbed),
value [s, b, heads, d_v], the selected keys ``indices`` [b, s, k] int32 (-1: none).

**Forward** (:func:`sparse_attention_triton`): one program per (query, block of heads). It
walks the query's k selected keys a few at a time (:class:`Tiling`; :data:`TILINGS` the
defaults), gathers their key and value rows of its heads (a head block's rows of one key are
contiguous: ``heads · d`` elements) with the next steps' gathers in flight, and keeps an online
softmax per head in fp32; it writes the output and the log-sum-exp (fp32, base 2:
``log2 Σ exp2(logit · log2 e)``), which is all the backward keeps besides the inputs.

**Backward**, deterministic, no atomics and no fp32 copy of dK, dV:

* query-major (one program per query and head block): recomputes the probabilities from the
  log-sum-exp, ``dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`` and ``dQ = dS · K``; writes dQ and
  ``rowsum(dO ∘ O)`` per query and head;
* key-major (one program per key and head block): the selection inverted — every (query, slot)
  pair sorted by key with a stable ``torch.sort``, so each key has the list of the queries that
  selected it, in query order — recomputes P and dS for those queries and sums
  ``dK = dSᵀ · Q`` and ``dV = Pᵀ · dO`` in registers, in a fixed order, and writes them once in
  the inputs' dtype. A key selected by every query (the first token, say) makes one long program
  among millions; it starts first (programs run in key order).

**Why no tensor cores.** Each (query, head) has its own k keys: a gathered key row is used by one
query-head pair, twice (logit and, in backward, dQ), so the work is ~1 FLOP per byte gathered
(``2 · (d_qk + d_v)`` FLOPs per ``2 · (d_qk + d_v)`` bf16 bytes). H100's fp32 FMA units (about
60 TFLOP/s) outrun what HBM (3.35 TB/s) or L2 can feed at that intensity; an MMA would need the
same key row for 16 or more rows of the M dimension, which only the absorbed form (one latent
key row shared by all heads) has. The kernels are bound by their gathers; what they can do is
make each gather contiguous (a head block's rows) and let queries that select the same keys
share them in L2: programs are launched query-fastest within one head block, so the programs
running at once are a few hundred consecutive queries of the same heads, whose selections
overlap in practice (the key and value rows of one block of 2 heads of one key:
``2 · (d_qk + d_v) · 2`` bytes, 1.25 KiB for DeepSeek-V3.2 in bf16: about 40,000 keys in H100's
50 MB L2).

**Traffic** (N queries, k keys each, H heads, bf16), bytes gathered when nothing is reused:
forward ``N·k·H·(d_qk + d_v)·2``, backward twice that (K and V per query, Q and dO per key), plus
``N·k·4`` of indices per head block and pass. DeepSeek-V3.2 at N = 131,072 (k 2048, 128 heads,
d_qk 192, d_v 128): 22 TB forward, 44 TB backward — about 6.6 s and 13 s at HBM bandwidth; what
consecutive queries share in L2 comes off that. FLOPs (fp32 FMA units): ``2·N·k·H·(d_qk + d_v)``
forward, twice that plus the recomputed logits backward.

**Memory**: the output, the log-sum-exp (N·H fp32) and, in backward, dQ, dK, dV in the inputs'
dtype, ``rowsum(dO ∘ O)`` (N·H fp32) and the inverted selection: ``N·k`` int32 query rows and
N + 1 int64 offsets, built through a stable sort that holds about ``N·k·36`` bytes for its
duration (int32 keys in and out, int64 order in and out, CUB's alternate buffers). No
[rows, k, heads, d] gather.

:func:`attention_target_sums` serves the indexer loss: per query and selected key, the attention
probability summed over heads (the log-sum-exp from the forward kernel without values, then one
program per (query, key tile) summing over head blocks).

Tests: ``tests/unit/attention/test_sparse_attention_kernels.py`` (every kernel in Triton's interpreter on
CPU against the float64 reference). Benchmark: ``tools/benchmarks/bench_sparse_attention.py``.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["TILINGS", "Tiling", "Tilings", "attention_target_sums", "key_major_queries",
           "sparse_attention_triton"]

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one kernel cuts its work: ``heads`` per program (the largest power of two up to it
    that divides the head count), ``rows`` selected keys (forward, dQ, target) or selecting
    queries (dK, dV) per step, Triton's ``num_warps`` and ``stages`` (steps whose gathers are in
    flight at once, Triton's pipeliner staging them through shared memory); dK, dV: a key's
    selecting queries are visited in chunks of ``chunk_steps`` steps (the chunk's last steps
    masked past the key's last query)."""

    heads: int
    rows: int
    num_warps: int = 4
    stages: int = 3
    chunk_steps: int = 4


@dataclasses.dataclass(frozen=True)
class Tilings:
    forward: Tiling
    query_backward: Tiling
    key_backward: Tiling
    target: Tiling


# Chosen without spills on sm_90 (ptxas) and at least ~60 KB of gathers in flight per SM from
# registers and shared memory (latency × bandwidth share of an SM is ~25 KB): 2 heads × 8 keys
# of 192 + 128 bf16 values a step, 2 steps ahead, 3 to 4 programs an SM
TILINGS = Tilings(forward=Tiling(heads=2, rows=8), query_backward=Tiling(heads=2, rows=8),
                  key_backward=Tiling(heads=1, rows=16), target=Tiling(heads=4, rows=16))


def _split(width: int):
    """(power-of-two part, padded rest) of a row width: a row is read as two power-of-two spans,
    192 = 128 + 64 with nothing padded; a rest of 0 is one masked column, never read."""
    low = 1 << (width.bit_length() - 1)
    return low, (triton.next_power_of_2(width - low) if width > low else 1)


def _head_block(heads: int, tiling: Tiling) -> int:
    """The largest power of two up to ``tiling.heads`` (a power of two) that divides
    ``heads``."""
    block = tiling.heads
    while heads % block:
        block //= 2
    return block


def _widths(qk: int, v: int) -> dict:
    (qk_lo, qk_hi), (v_lo, v_hi) = _split(qk), _split(v)
    return dict(QK=qk, QK_LO=qk_lo, QK_HI=qk_hi, V=v, V_LO=v_lo, V_HI=v_hi)


if HAVE_TRITON:

    @triton.jit
    def _rows_part(ptr, rows, heads, rows_mask, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                   START: tl.constexpr, SPAN: tl.constexpr):
        """[R, HB, SPAN] fp32: columns START.. of ``heads`` [HB] in token rows ``rows`` [R]
        (int64) of a contiguous [tokens, HEADS, WIDTH] tensor; masked rows and columns past
        WIDTH read as 0 (not read at all)."""
        cols = START + tl.arange(0, SPAN)
        offsets = (rows[:, None, None] * HEADS + heads[None, :, None]) * WIDTH + cols[None, None, :]
        mask = rows_mask[:, None, None] & (cols < WIDTH)[None, None, :]
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _heads_part(ptr, row, heads, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                    START: tl.constexpr, SPAN: tl.constexpr):
        """[HB, SPAN] fp32: :func:`_rows_part` of one token row."""
        cols = START + tl.arange(0, SPAN)
        offsets = (row * HEADS + heads[:, None]) * WIDTH + cols[None, :]
        return tl.load(ptr + offsets, mask=(cols < WIDTH)[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _store_heads_part(ptr, row, heads, values, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                          START: tl.constexpr, SPAN: tl.constexpr):
        cols = START + tl.arange(0, SPAN)
        offsets = (row * HEADS + heads[:, None]) * WIDTH + cols[None, :]
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=(cols < WIDTH)[None, :])

    @triton.jit
    def _dot_rows(rows_lo, rows_hi, heads_lo, heads_hi):
        """[R, HB]: each row's dot product with its head's vector (both row spans)."""
        return (tl.sum(rows_lo * heads_lo[None, :, :], axis=2)
                + tl.sum(rows_hi * heads_hi[None, :, :], axis=2))

    @triton.jit
    def _weighted_sum(weights, rows):
        """[HB, SPAN]: Σ_r weights[r, h] · rows[r, h, :]."""
        return tl.sum(weights[:, :, None] * rows, axis=0)

    @triton.jit
    def _selected_keys(index_row, start, batch, sequence, TOPK: tl.constexpr,
                       KEY_TILE: tl.constexpr):
        """(valid [KEY_TILE], key token rows [KEY_TILE] int64) of a query's selection
        ``index_row`` (k int32 positions) at slots ``start``.. ."""
        slots = start + tl.arange(0, KEY_TILE)
        selected = tl.load(index_row + slots, mask=slots < TOPK, other=-1)
        return selected >= 0, selected.to(tl.int64) * batch + sequence

    @triton.jit
    def _query_program(index_ptr, batch, seq, TOPK: tl.constexpr, HEAD_BLOCK: tl.constexpr):
        """(token row, heads, sequence, its selection's pointer) of a program of the query-major
        grid (token rows, head blocks)."""
        row = tl.program_id(0).to(tl.int64)  # token row: position · batch + sequence
        heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        sequence = row % batch
        return row, heads, sequence, index_ptr + (sequence * seq + row // batch) * TOPK

    @cached_launch
    @triton.jit
    def _forward_kernel(q_ptr, k_ptr, v_ptr, index_ptr, out_ptr, lse_ptr, batch, seq, scale_log2,
                        TOPK: tl.constexpr, HEADS: tl.constexpr, QK: tl.constexpr,
                        QK_LO: tl.constexpr, QK_HI: tl.constexpr, V: tl.constexpr,
                        V_LO: tl.constexpr, V_HI: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                        KEY_TILE: tl.constexpr, STAGES: tl.constexpr,
                        WITH_VALUES: tl.constexpr):
        row, heads, sequence, index_row = _query_program(index_ptr, batch, seq, TOPK, HEAD_BLOCK)
        q_lo = _heads_part(q_ptr, row, heads, HEADS, QK, 0, QK_LO)
        q_hi = _heads_part(q_ptr, row, heads, HEADS, QK, QK_LO, QK_HI)
        running_max = tl.full([HEAD_BLOCK], float("-inf"), tl.float32)  # of logit · log2 e
        total = tl.zeros([HEAD_BLOCK], tl.float32)
        acc_lo = tl.zeros([HEAD_BLOCK, V_LO], tl.float32)
        acc_hi = tl.zeros([HEAD_BLOCK, V_HI], tl.float32)
        for start in tl.range(0, TOPK, KEY_TILE, num_stages=STAGES):
            valid, key_rows = _selected_keys(index_row, start, batch, sequence, TOPK, KEY_TILE)
            logits = _dot_rows(_rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, 0, QK_LO),
                               _rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, QK_LO, QK_HI),
                               q_lo, q_hi) * scale_log2
            logits = tl.where(valid[:, None], logits, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, axis=0))
            # no valid key yet: subtract 0, so that exp2(-inf) = 0 rather than exp2(nan)
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(logits - base[None, :])
            rescale = tl.exp2(running_max - base)
            total = total * rescale + tl.sum(probs, axis=0)
            if WITH_VALUES:
                v_lo = _rows_part(v_ptr, key_rows, heads, valid, HEADS, V, 0, V_LO)
                v_hi = _rows_part(v_ptr, key_rows, heads, valid, HEADS, V, V_LO, V_HI)
                acc_lo = acc_lo * rescale[:, None] + _weighted_sum(probs, v_lo)
                acc_hi = acc_hi * rescale[:, None] + _weighted_sum(probs, v_hi)
            running_max = new_max
        lse = tl.where(total > 0, running_max + tl.log2(total), float("-inf"))
        tl.store(lse_ptr + row * HEADS + heads, lse)
        if WITH_VALUES:
            inverse = tl.where(total > 0, 1.0 / total, 0.0)  # no valid key: output 0
            _store_heads_part(out_ptr, row, heads, acc_lo * inverse[:, None], HEADS, V, 0, V_LO)
            _store_heads_part(out_ptr, row, heads, acc_hi * inverse[:, None], HEADS, V, V_LO, V_HI)

    @cached_launch
    @triton.jit
    def _query_backward_kernel(q_ptr, k_ptr, v_ptr, index_ptr, out_ptr, grad_out_ptr, lse_ptr,
                               delta_ptr, grad_q_ptr, batch, seq, scale_log2, scale,
                               TOPK: tl.constexpr, HEADS: tl.constexpr, QK: tl.constexpr,
                               QK_LO: tl.constexpr, QK_HI: tl.constexpr, V: tl.constexpr,
                               V_LO: tl.constexpr, V_HI: tl.constexpr,
                               HEAD_BLOCK: tl.constexpr, KEY_TILE: tl.constexpr,
                               STAGES: tl.constexpr):
        row, heads, sequence, index_row = _query_program(index_ptr, batch, seq, TOPK, HEAD_BLOCK)
        q_lo = _heads_part(q_ptr, row, heads, HEADS, QK, 0, QK_LO)
        q_hi = _heads_part(q_ptr, row, heads, HEADS, QK, QK_LO, QK_HI)
        do_lo = _heads_part(grad_out_ptr, row, heads, HEADS, V, 0, V_LO)
        do_hi = _heads_part(grad_out_ptr, row, heads, HEADS, V, V_LO, V_HI)
        delta = (tl.sum(do_lo * _heads_part(out_ptr, row, heads, HEADS, V, 0, V_LO), axis=1)
                 + tl.sum(do_hi * _heads_part(out_ptr, row, heads, HEADS, V, V_LO, V_HI), axis=1))
        tl.store(delta_ptr + row * HEADS + heads, delta)
        lse = tl.load(lse_ptr + row * HEADS + heads)
        lse = tl.where(lse == float("-inf"), 0.0, lse)  # no valid key: every probability 0
        dq_lo = tl.zeros([HEAD_BLOCK, QK_LO], tl.float32)
        dq_hi = tl.zeros([HEAD_BLOCK, QK_HI], tl.float32)
        for start in tl.range(0, TOPK, KEY_TILE, num_stages=STAGES):
            valid, key_rows = _selected_keys(index_row, start, batch, sequence, TOPK, KEY_TILE)
            k_lo = _rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, 0, QK_LO)
            k_hi = _rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, QK_LO, QK_HI)
            v_lo = _rows_part(v_ptr, key_rows, heads, valid, HEADS, V, 0, V_LO)
            v_hi = _rows_part(v_ptr, key_rows, heads, valid, HEADS, V, V_LO, V_HI)
            logits = _dot_rows(k_lo, k_hi, q_lo, q_hi) * scale_log2
            probs = tl.where(valid[:, None], tl.exp2(logits - lse[None, :]), 0.0)
            grad_logits = probs * (_dot_rows(v_lo, v_hi, do_lo, do_hi) - delta[None, :])
            dq_lo += _weighted_sum(grad_logits, k_lo)
            dq_hi += _weighted_sum(grad_logits, k_hi)
        _store_heads_part(grad_q_ptr, row, heads, dq_lo * scale, HEADS, QK, 0, QK_LO)
        _store_heads_part(grad_q_ptr, row, heads, dq_hi * scale, HEADS, QK, QK_LO, QK_HI)

    @cached_launch
    @triton.jit
    def _key_backward_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, offsets_ptr,
                             query_rows_ptr, grad_k_ptr, grad_v_ptr, scale_log2, scale,
                             HEADS: tl.constexpr, QK: tl.constexpr, QK_LO: tl.constexpr,
                             QK_HI: tl.constexpr, V: tl.constexpr, V_LO: tl.constexpr,
                             V_HI: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                             QUERY_TILE: tl.constexpr, QUERY_CHUNK: tl.constexpr,
                             STAGES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # the key's token row
        heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        k_lo = _heads_part(k_ptr, row, heads, HEADS, QK, 0, QK_LO)
        k_hi = _heads_part(k_ptr, row, heads, HEADS, QK, QK_LO, QK_HI)
        v_lo = _heads_part(v_ptr, row, heads, HEADS, V, 0, V_LO)
        v_hi = _heads_part(v_ptr, row, heads, HEADS, V, V_LO, V_HI)
        dk_lo = tl.zeros([HEAD_BLOCK, QK_LO], tl.float32)
        dk_hi = tl.zeros([HEAD_BLOCK, QK_HI], tl.float32)
        dv_lo = tl.zeros([HEAD_BLOCK, V_LO], tl.float32)
        dv_hi = tl.zeros([HEAD_BLOCK, V_HI], tl.float32)
        chunk = tl.load(offsets_ptr + row)
        end = tl.load(offsets_ptr + row + 1)
        # the segment's bounds are loaded values: a while loop over chunks of QUERY_CHUNK entries
        # (Triton's interpreter takes no loaded value as a range() bound), each chunk a
        # constant-length loop that Triton's pipeliner can run STAGES tiles ahead
        while chunk < end:
            for step in tl.range(0, QUERY_CHUNK, QUERY_TILE, num_stages=STAGES):
                slots = chunk + step + tl.arange(0, QUERY_TILE)
                valid = slots < end
                rows = tl.load(query_rows_ptr + slots, mask=valid, other=0).to(tl.int64)
                q_lo = _rows_part(q_ptr, rows, heads, valid, HEADS, QK, 0, QK_LO)
                q_hi = _rows_part(q_ptr, rows, heads, valid, HEADS, QK, QK_LO, QK_HI)
                do_lo = _rows_part(grad_out_ptr, rows, heads, valid, HEADS, V, 0, V_LO)
                do_hi = _rows_part(grad_out_ptr, rows, heads, valid, HEADS, V, V_LO, V_HI)
                per_head = rows[:, None] * HEADS + heads[None, :]
                lse = tl.load(lse_ptr + per_head, mask=valid[:, None], other=0.0)
                delta = tl.load(delta_ptr + per_head, mask=valid[:, None], other=0.0)
                logits = _dot_rows(q_lo, q_hi, k_lo, k_hi) * scale_log2
                # a query that selected this key has a finite log-sum-exp
                probs = tl.where(valid[:, None], tl.exp2(logits - lse), 0.0)
                grad_logits = probs * (_dot_rows(do_lo, do_hi, v_lo, v_hi) - delta)
                dv_lo += _weighted_sum(probs, do_lo)
                dv_hi += _weighted_sum(probs, do_hi)
                dk_lo += _weighted_sum(grad_logits, q_lo)
                dk_hi += _weighted_sum(grad_logits, q_hi)
            chunk += QUERY_CHUNK
        _store_heads_part(grad_k_ptr, row, heads, dk_lo * scale, HEADS, QK, 0, QK_LO)
        _store_heads_part(grad_k_ptr, row, heads, dk_hi * scale, HEADS, QK, QK_LO, QK_HI)
        _store_heads_part(grad_v_ptr, row, heads, dv_lo, HEADS, V, 0, V_LO)
        _store_heads_part(grad_v_ptr, row, heads, dv_hi, HEADS, V, V_LO, V_HI)

    @cached_launch
    @triton.jit
    def _target_kernel(q_ptr, k_ptr, index_ptr, lse_ptr, target_ptr, batch, seq, scale_log2,
                       TOPK: tl.constexpr, HEADS: tl.constexpr, QK: tl.constexpr,
                       QK_LO: tl.constexpr, QK_HI: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                       KEY_TILE: tl.constexpr, STAGES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        sequence = row % batch
        index_row = (sequence * seq + row // batch) * TOPK
        start = tl.program_id(1) * KEY_TILE
        valid, key_rows = _selected_keys(index_ptr + index_row, start, batch, sequence, TOPK,
                                         KEY_TILE)
        summed = tl.zeros([KEY_TILE], tl.float32)
        for first_head in tl.range(0, HEADS, HEAD_BLOCK, num_stages=STAGES):
            heads = first_head + tl.arange(0, HEAD_BLOCK)
            logits = _dot_rows(
                _rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, 0, QK_LO),
                _rows_part(k_ptr, key_rows, heads, valid, HEADS, QK, QK_LO, QK_HI),
                _heads_part(q_ptr, row, heads, HEADS, QK, 0, QK_LO),
                _heads_part(q_ptr, row, heads, HEADS, QK, QK_LO, QK_HI)) * scale_log2
            lse = tl.load(lse_ptr + row * HEADS + heads)
            summed += tl.sum(tl.where(valid[:, None], tl.exp2(logits - lse[None, :]), 0.0), axis=1)
        slots = start + tl.arange(0, KEY_TILE)
        tl.store(target_ptr + index_row + slots, summed, mask=slots < TOPK)


def _shape(query: torch.Tensor, value: torch.Tensor) -> dict:
    return dict(HEADS=query.shape[2], **_widths(query.shape[3], value.shape[3]))


def _forward(query, key, value, indices, scale: float, with_values: bool, tiling: Tiling):
    """(output or None, base-2 log-sum-exp [s·b, heads] fp32)."""
    seq, batch, heads = query.shape[:3]
    block = _head_block(heads, tiling)
    lse = torch.empty(seq * batch, heads, dtype=torch.float32, device=query.device)
    out = value.new_empty(value.shape, dtype=query.dtype) if with_values else None
    _forward_kernel[(seq * batch, heads // block)](
        query, key, value, indices, out if with_values else lse, lse, batch, seq,
        scale * LOG2E, TOPK=indices.shape[-1], **_shape(query, value), HEAD_BLOCK=block,
        KEY_TILE=tiling.rows, STAGES=tiling.stages, WITH_VALUES=with_values,
        num_warps=tiling.num_warps)
    return out, lse


def key_major_queries(indices: torch.Tensor, batch: int, seq: int):
    """The selection inverted: (offsets [b·s + 1] int64, query rows [n] int32) such that the
    queries that selected the key at token row r (position · b + sequence) are the token rows
    ``query_rows[offsets[r]:offsets[r + 1]]``, in ascending order. ``indices`` [b, s, k] int32,
    -1 entries left out (sorted past the last key)."""
    topk = indices.shape[-1]
    sequence = torch.arange(batch, dtype=torch.int32, device=indices.device).view(-1, 1, 1)
    keys = torch.where(indices >= 0, indices * batch + sequence, batch * seq)
    sorted_keys, order = torch.sort(keys.view(-1), stable=True)
    del keys
    offsets = torch.searchsorted(sorted_keys, torch.arange(
        batch * seq + 1, dtype=torch.int32, device=indices.device))
    del sorted_keys
    order = order.div_(topk, rounding_mode="floor")  # slot -> sequence · s + position
    if batch > 1:
        order = order % seq * batch + order.div_(seq, rounding_mode="floor")
    return offsets, order.to(torch.int32)


def _backward(query, key, value, indices, out, lse, grad_out, scale: float, tilings: Tilings):
    seq, batch, heads = query.shape[:3]
    shape = _shape(query, value)
    grad_q, delta = torch.empty_like(query), torch.empty_like(lse)
    tiling = tilings.query_backward
    block = _head_block(heads, tiling)
    _query_backward_kernel[(seq * batch, heads // block)](
        query, key, value, indices, out, grad_out, lse, delta, grad_q, batch, seq,
        scale * LOG2E, scale, TOPK=indices.shape[-1], **shape, HEAD_BLOCK=block,
        KEY_TILE=tiling.rows, STAGES=tiling.stages, num_warps=tiling.num_warps)
    offsets, query_rows = key_major_queries(indices, batch, seq)
    grad_k, grad_v = torch.empty_like(key), torch.empty_like(value)
    tiling = tilings.key_backward
    block = _head_block(heads, tiling)
    _key_backward_kernel[(seq * batch, heads // block)](
        query, key, value, grad_out, lse, delta, offsets, query_rows, grad_k, grad_v,
        scale * LOG2E, scale, **shape, HEAD_BLOCK=block, QUERY_TILE=tiling.rows,
        QUERY_CHUNK=tiling.rows * tiling.chunk_steps, STAGES=tiling.stages,
        num_warps=tiling.num_warps)
    return grad_q, grad_k, grad_v


class _SparseAttentionTriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, indices, scale, tilings):
        query, key, value = (t.contiguous() for t in (query, key, value))
        indices = indices.to(torch.int32).contiguous()
        out, lse = _forward(query, key, value, indices, scale, True, tilings.forward)
        ctx.save_for_backward(query, key, value, indices, out, lse)
        ctx.scale, ctx.tilings = scale, tilings
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = _backward(*ctx.saved_tensors, grad_out.contiguous(), ctx.scale, ctx.tilings)
        return grads + (None, None, None)


def sparse_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            indices: torch.Tensor, scale: float,
                            tilings: Tilings = TILINGS) -> torch.Tensor:
    """:func:`megatron.bounded.attention.sparse_attention.sparse_attention` with the kernels:
    query, key [s, b, heads, d_qk], value [s, b, heads, d_v], ``indices`` [b, s, k] (-1: none)
    -> [s, b, heads, d_v]; differentiable in query, key and value."""
    return _SparseAttentionTriton.apply(query, key, value, indices, scale, tilings)


def attention_target_sums(query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor,
                          scale: float, tilings: Tilings = TILINGS) -> torch.Tensor:
    """[b, s, k] fp32: per query and selected key, the attention's probability summed over the
    heads (0 for -1 entries); no gradient."""
    seq, batch, heads = query.shape[:3]
    query, key = query.detach().contiguous(), key.detach().contiguous()
    indices = indices.to(torch.int32).contiguous()
    _, lse = _forward(query, key, key, indices, scale, False, tilings.forward)
    target = torch.empty(indices.shape, dtype=torch.float32, device=query.device)
    tiling = tilings.target
    widths = _widths(query.shape[3], 1)
    _target_kernel[(seq * batch, triton.cdiv(indices.shape[-1], tiling.rows))](
        query, key, indices, lse, target, batch, seq, scale * LOG2E, TOPK=indices.shape[-1],
        HEADS=heads, QK=widths["QK"], QK_LO=widths["QK_LO"], QK_HI=widths["QK_HI"],
        HEAD_BLOCK=_head_block(heads, tiling), KEY_TILE=tiling.rows, STAGES=tiling.stages,
        num_warps=tiling.num_warps)
    return target
