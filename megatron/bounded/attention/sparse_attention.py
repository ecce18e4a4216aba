"""DeepSeek sparse attention over the indexer's selected keys, and the indexer's KL loss.

:func:`sparse_attention`: each query attends to its selected keys only (``indices`` [b, s, k]
from :func:`megatron.bounded.attention.sparse_indexer.blockwise_topk`, -1 = none), with
multi-latent attention's tensors as our MLA layer makes them: query and key [s, b, heads, d_qk]
(every head its own key), value [s, b, heads, d_v]. On CUDA with Triton the kernels of
:mod:`megatron.bounded.attention.kernels.sparse_attention` run (gathers of the selected rows
inside the kernels, online softmax, a deterministic query-major and key-major backward).
Elsewhere (CPU, float64) :func:`sparse_attention_reference`: query blocks gather their keys and
values ([b, rows, k, heads, d]), attend in fp32 (or the inputs' wider dtype) and keep the output
and the log-sum-exp; backward gathers them again and scatters dK, dV back with ``index_add``.
Memory: the output, the log-sum-exp and one block's gathered keys, values and scores, never
s × s. Exact: the numbers of dense attention whose mask keeps exactly the selected keys.

:func:`sparse_indexer_loss`: upstream's indexer loss with ``--dsa-indexer-use-sparse-loss``
(``dsa.compute_dsa_indexer_loss`` with ``sparse_loss=True``): per query, the target is the
attention's softmax over the selected keys (the queries and keys detached) summed over heads and
L1-normalized; the prediction the indexer's log-softmax over the same keys; the loss
``coeff · mean over rows of Σ_j target·(log max(target, 1e-10) − log prediction)``. Only the
indexer's q, weights and k get its gradient. The target's sums over heads run in a kernel on
CUDA (:func:`megatron.bounded.attention.kernels.sparse_attention.attention_target_sums`), in
PyTorch elsewhere (:func:`attention_target_sums_reference`).

:func:`dsa_working_set_bytes` is the formula of what one DSA layer holds, used by the memory
budget.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron.bounded.attention.kernels.sparse_attention import (
    attention_target_sums,
    sparse_attention_triton,
)
from megatron.bounded.attention.kernels.sparse_indexer import index_block_rows, kernels_apply
from megatron.bounded.attention.sparse_indexer import gather_rows, selected_index_scores
from megatron.bounded.units import MiB

__all__ = ["GATHER_BUDGET_BYTES", "attention_rows_per_block", "attention_target_sums_reference",
           "dsa_working_set_bytes", "sparse_attention", "sparse_attention_reference",
           "sparse_indexer_loss"]

# bytes one query block of the sparse attention may gather (keys, values, scores, fp32)
GATHER_BUDGET_BYTES = 256 * MiB
# upstream's floor of the target's L1 norm and of the target inside its log
INDEXER_LOSS_EPS = 1e-10


def attention_rows_per_block(topk: int, heads: int, qk_dim: int, v_dim: int,
                             budget_bytes: int = GATHER_BUDGET_BYTES) -> int:
    """Query rows per block of :func:`sparse_attention`: its gathered keys and values and its
    scores and probabilities, fp32, within ``budget_bytes`` (at least one row)."""
    per_row = 4 * topk * heads * (qk_dim + v_dim + 2)
    return max(1, budget_bytes // per_row)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_probabilities(query, gathered_key, valid, scale):
    """(probabilities [b, rows, heads, k], log-sum-exp [b, rows, heads]) of query
    [b, rows, heads, d] over its gathered keys [b, rows, k, heads, d]."""
    logits = torch.einsum("bqhd,bqkhd->bqhk", query, gathered_key) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(logits - finite.unsqueeze(-1)), lse


class _SparseAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query, key, value, indices, scale, rows):
        seq, batch, heads = query.shape[:3]
        dtype = _compute_dtype(query.dtype)
        output = query.new_empty(seq, batch, heads, value.shape[-1])
        lse = torch.empty(batch, seq, heads, dtype=dtype, device=query.device)
        for q0 in range(0, seq, rows):
            q1 = min(q0 + rows, seq)
            block = indices[:, q0:q1]
            probs, lse[:, q0:q1] = _block_probabilities(
                query[q0:q1].transpose(0, 1).to(dtype), gather_rows(key, block).to(dtype),
                block >= 0, scale)
            out = torch.einsum("bqhk,bqkhd->bqhd", probs, gather_rows(value, block).to(dtype))
            output[q0:q1] = out.transpose(0, 1).to(output.dtype)
        ctx.save_for_backward(query, key, value, indices, output, lse)
        ctx.scale, ctx.rows = scale, rows
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, indices, output, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        seq, batch = query.shape[:2]
        dtype = lse.dtype
        grad_query = torch.empty_like(query)
        # accumulated over blocks in the compute dtype, rows flattened sequence after sequence
        grad_key = torch.zeros(batch * seq, *key.shape[2:], dtype=dtype, device=key.device)
        grad_value = torch.zeros(batch * seq, *value.shape[2:], dtype=dtype, device=key.device)
        offsets = torch.arange(batch, device=indices.device).view(-1, 1, 1) * seq
        for q0 in range(0, seq, rows):
            q1 = min(q0 + rows, seq)
            block = indices[:, q0:q1]
            valid = block >= 0
            q_block = query[q0:q1].transpose(0, 1).to(dtype)
            keys = gather_rows(key, block).to(dtype)
            values = gather_rows(value, block).to(dtype)
            logits = torch.einsum("bqhd,bqkhd->bqhk", q_block, keys) * scale
            block_lse = lse[:, q0:q1]
            finite = torch.where(torch.isfinite(block_lse), block_lse,
                                 torch.zeros_like(block_lse))
            probs = torch.exp(logits - finite.unsqueeze(-1)).masked_fill(
                ~valid.unsqueeze(2), 0.0)
            d_out = grad_output[q0:q1].transpose(0, 1).to(dtype)
            out = output[q0:q1].transpose(0, 1).to(dtype)
            d_probs = torch.einsum("bqhd,bqkhd->bqhk", d_out, values)
            d_logits = probs * (d_probs - (d_out * out).sum(-1, keepdim=True))
            grad_query[q0:q1] = (torch.einsum("bqhk,bqkhd->bqhd", d_logits, keys) * scale
                                 ).transpose(0, 1).to(query.dtype)
            flat = (block.clamp(min=0) + offsets).reshape(-1)  # invalid: zero gradients
            d_keys = torch.einsum("bqhk,bqhd->bqkhd", d_logits, q_block) * scale
            grad_key.index_add_(0, flat, d_keys.reshape(-1, *key.shape[2:]))
            d_values = torch.einsum("bqhk,bqhd->bqkhd", probs, d_out)
            grad_value.index_add_(0, flat, d_values.reshape(-1, *value.shape[2:]))

        def unflatten(grad, like):
            return grad.view(batch, seq, *like.shape[2:]).transpose(0, 1).to(like.dtype)

        return grad_query, unflatten(grad_key, key), unflatten(grad_value, value), None, None, None


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     indices: torch.Tensor, scale: float, rows: int = 0) -> torch.Tensor:
    """Attention of each query over its selected keys: query, key [s, b, heads, d_qk], value
    [s, b, heads, d_v], ``indices`` [b, s, k] (-1: none) -> [s, b, heads, d_v]. On CUDA with
    Triton the kernels of :mod:`megatron.bounded.attention.kernels.sparse_attention`; elsewhere
    :func:`sparse_attention_reference` (blocks of ``rows`` query rows)."""
    if kernels_apply(query, key, value):
        return sparse_attention_triton(query, key, value, indices, scale)
    return sparse_attention_reference(query, key, value, indices, scale, rows)


def sparse_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               indices: torch.Tensor, scale: float,
                               rows: int = 0) -> torch.Tensor:
    """:func:`sparse_attention` in PyTorch: query blocks of ``rows`` rows (0:
    :func:`attention_rows_per_block`) gather their keys and values."""
    if not rows:
        rows = attention_rows_per_block(indices.shape[-1], query.shape[2], query.shape[3],
                                        value.shape[3])
    return _SparseAttention.apply(query, key, value, indices, scale, rows)


def _attention_target(query, key, indices, scale, rows, tp_group=None):
    """[b, s, k]: per query, the attention's softmax over its selected keys summed over heads
    (over every tensor-parallel rank's heads) and L1-normalized; no gradient. On CUDA with
    Triton: :func:`megatron.bounded.attention.kernels.sparse_attention.attention_target_sums`."""
    with torch.no_grad():
        if kernels_apply(query, key):
            target = attention_target_sums(query, key, indices, scale)
        else:
            target = attention_target_sums_reference(query, key, indices, scale, rows)
        if tp_group is not None and tp_group.size() > 1:
            torch.distributed.all_reduce(target, group=tp_group)
        return target / target.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)


def attention_target_sums_reference(query: torch.Tensor, key: torch.Tensor,
                                    indices: torch.Tensor, scale: float,
                                    rows: int) -> torch.Tensor:
    """[b, s, k]: per query and selected key, the attention's probability summed over this
    rank's heads, in PyTorch, blocks of ``rows`` query rows; no gradient."""
    dtype = _compute_dtype(query.dtype)
    target = torch.empty(*indices.shape, dtype=dtype, device=query.device)
    for q0 in range(0, query.shape[0], rows):
        q1 = min(q0 + rows, query.shape[0])
        block = indices[:, q0:q1]
        probs, _ = _block_probabilities(
            query[q0:q1].transpose(0, 1).to(dtype), gather_rows(key, block).to(dtype),
            block >= 0, scale)
        target[:, q0:q1] = probs.sum(dim=2)
    return target


def sparse_indexer_loss(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                        query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor,
                        scale: float, coeff: float, relu: bool = True, rows: int = 0,
                        tp_group=None) -> torch.Tensor:
    """Upstream's sparse indexer loss (a scalar): the indexer's q [s, b, heads, d], weights
    [s, b, heads], k [s, b, d] (differentiable); the attention's query and key (detached
    here) and its scale; the selected keys ``indices`` [b, s, k]."""
    if not rows:
        rows = attention_rows_per_block(indices.shape[-1], query.shape[2], query.shape[3], 0)
    valid = indices >= 0
    target = _attention_target(query.detach(), key.detach(), indices, scale, rows, tp_group)
    scores = selected_index_scores(q, weights, k, indices, relu)
    scores = scores.masked_fill(~valid, float("-inf"))
    log_prediction = torch.log_softmax(scores, dim=-1).masked_fill(~valid, 0.0)
    terms = target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - log_prediction)
    rows_total = indices.shape[0] * indices.shape[1]
    return terms.sum() / max(rows_total, 1) * coeff


def dsa_working_set_bytes(tokens: int, topk: int, heads: int, qk_dim: int, v_dim: int,
                          index_heads: int, index_dim: int, act_bytes: int,
                          indexer_loss: bool) -> Dict[str, int]:
    """What one DSA layer of ``tokens`` tokens (per micro-batch and rank) holds, in bytes:

    * ``saved``: kept from its forward to its backward besides the attention's q, k, v, output
      and log-sum-exp, which any attention keeps: the selected keys (int32, N·k) and, with the
      indexer loss, the indexer's q, weights and k (N·(index_heads·index_dim + index_heads +
      index_dim) in the activations' dtype) and its selected scores, log-probabilities and
      target (3 · fp32 N·k);
    * ``transient``: the largest working set at one time, on CUDA with the kernels: the top-k
      pass (one query block's scores against every key, fp32, within
      :data:`megatron.bounded.attention.kernels.sparse_indexer.SCORE_BUDGET_BYTES`, and
      ``torch.topk``'s values and int64 indices of the block) or the backward's inverted
      selection (the stable sort of the N·k selected keys: its int32 keys in and out, int64
      order in and out and CUB's alternate buffers, N·k·36) with rowsum(dO ∘ O) (N·heads fp32).
      dQ, dK and dV are the inputs' dtype, as any attention's.
    """
    n, k = tokens, min(topk, tokens)
    saved = n * k * 4
    if indexer_loss:
        saved += n * (index_heads * index_dim + index_heads + index_dim) * act_bytes + 3 * n * k * 4
    block_rows = index_block_rows(1, n)
    topk_pass = block_rows * n * 4 + block_rows * k * 12
    backward = n * k * 36 + n * heads * 4
    return {"saved": saved, "transient": max(topk_pass, backward)}
