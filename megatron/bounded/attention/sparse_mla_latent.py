"""DeepSeek sparse attention in multi-latent attention's absorbed form: the selected keys and
values stay the shared latent, never expanded per head.

Multi-latent attention's key of head h at token j is ``k_h(j) = W_UK[h] c(j) ⊕ r(j)`` and its
value ``v_h(j) = W_UV[h] c(j)``: ``c`` the normalized kv latent (``--kv-lora-rank`` wide, shared
by every head), ``r`` the key's rotary part (shared too), ``W_UK`` [heads, d_nope, kv_lora] and
``W_UV`` [heads, d_v, kv_lora] the two halves of each head's rows of upstream's
``linear_kv_up_proj`` weight ([heads · (d_nope + d_v), kv_lora], head after head, each head's
key rows before its value rows: :func:`split_kv_up_weight`). Moving the up-projections to the
query and the output side (associativity, the same numbers up to rounding):

* ``q_lat(i, h) = q_nope(i, h) · W_UK[h]`` (kv_lora wide);
* ``score(i, h, j) = (q_lat(i, h) · c(j) + q_rope(i, h) · r(j)) · scale`` over the selected j;
* ``o_lat(i, h) = Σ_j softmax_j(score) · c(j)``; ``out(i, h) = W_UV[h] · o_lat(i, h)``.

:func:`sparse_mla_latent_attention` runs this in blocks of query rows: a block gathers the
latent rows of its selected keys (rows × k × (kv_lora + rope), shared by the heads), so nothing is
s × s and no tensor is s × heads × kv_lora; the heads' expanded keys and values (s × heads ×
(d_nope + rope + d_v)) are never built. It keeps for backward only its inputs and the per-row
log-sum-exp, and its backward recomputes each block. Compared with
:func:`megatron.bounded.attention.sparse_attention.sparse_attention` on the expanded keys, each
selected key costs heads · (2 · kv_lora + rope) multiply-adds instead of heads · (d_nope + rope
+ d_v): more arithmetic for far less memory at long context.

:func:`latent_attention_target_sums` is the indexer loss's target (the attention's probabilities
at the selected keys, summed over heads) in the same form, and :func:`latent_working_set_bytes`
the formula of what one such layer holds, read by the memory budget.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.bounded.attention.sparse_attention import GATHER_BUDGET_BYTES
from megatron.bounded.attention.sparse_indexer import gather_rows

__all__ = ["attends_in_latent_form", "latent_attention_target_sums", "latent_rows_per_block", "latent_working_set_bytes",
           "sparse_mla_latent_attention", "split_kv_up_weight"]


def attends_in_latent_form(config) -> bool:
    """Whether the DeepSeek sparse attention layers of ``config`` (parsed flags, a model config
    or the chunked recompute's settings) attend in latent form: under chunked recompute
    (``--chunked-recompute-tokens``), the long-sequence setting, where the heads' expanded keys
    and values would be the layer's largest tensors. Elsewhere the expanded form runs, with its
    CUDA kernels and less arithmetic per selected key."""
    return bool(getattr(config, "chunked_recompute_tokens", 0))


def split_kv_up_weight(weight: torch.Tensor, heads: int, nope_dim: int,
                       v_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [heads, d_nope, kv_lora], W_UV [heads, d_v, kv_lora]): views of upstream's
    ``linear_kv_up_proj`` weight [heads · (d_nope + d_v), kv_lora] (a linear's [out, in]; its
    output is viewed as [heads, d_nope + d_v] and split into the key's and the value's part)."""
    per_head = weight.view(heads, nope_dim + v_dim, weight.shape[-1])
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def latent_rows_per_block(topk: int, heads: int, kv_lora: int, rope_dim: int,
                          budget_bytes: int = GATHER_BUDGET_BYTES) -> int:
    """Query rows per block of :func:`sparse_mla_latent_attention` within ``budget_bytes``
    (fp32, the backward's working set, at least one row): the gathered latent and rotary rows
    and their gradients 2·k·(kv_lora + rope), q_lat, o_lat and their gradients 4·heads·kv_lora,
    scores, probabilities and their gradients 4·heads·k."""
    per_row = 4 * (2 * topk * (kv_lora + rope_dim) + 4 * heads * kv_lora + 4 * heads * topk)
    return max(1, budget_bytes // per_row)


def _block_probabilities(q_lat, q_rope, latent, rope, valid, scale):
    """(probabilities [b, rows, heads, k], log-sum-exp [b, rows, heads]) of the block's absorbed
    queries q_lat [b, rows, heads, kv_lora], q_rope [b, rows, heads, rope] over its gathered
    latent [b, rows, k, kv_lora] and rotary rows [b, rows, k, rope]."""
    logits = (torch.einsum("bqhc,bqkc->bqhk", q_lat, latent)
              + torch.einsum("bqhr,bqkr->bqhk", q_rope, rope)) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(logits - finite.unsqueeze(-1)), lse


def _block_inputs(q_nope, q_rope, latent, krope, w_uk, block, q0, q1, dtype):
    """One block's absorbed queries and gathered latent and rotary rows, in ``dtype``."""
    q_nope_block = q_nope[q0:q1].transpose(0, 1).to(dtype)
    q_lat = torch.einsum("bqhd,hdc->bqhc", q_nope_block, w_uk.to(dtype))
    return (q_nope_block, q_lat, q_rope[q0:q1].transpose(0, 1).to(dtype),
            gather_rows(latent, block).to(dtype), gather_rows(krope, block).to(dtype))


class _SparseLatentAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q_nope, q_rope, latent, krope, w_uk, w_uv, indices, scale, rows):
        seq, batch, heads = q_nope.shape[:3]
        dtype = torch.promote_types(q_nope.dtype, torch.float32)
        output = q_nope.new_empty(seq, batch, heads, w_uv.shape[1])
        lse = torch.empty(batch, seq, heads, dtype=dtype, device=q_nope.device)
        w_uv_c = w_uv.to(dtype)
        for q0 in range(0, seq, rows):
            q1 = min(q0 + rows, seq)
            block = indices[:, q0:q1]
            _, q_lat, q_rope_block, gathered, gathered_rope = _block_inputs(
                q_nope, q_rope, latent, krope, w_uk, block, q0, q1, dtype)
            probs, lse[:, q0:q1] = _block_probabilities(q_lat, q_rope_block, gathered,
                                                        gathered_rope, block >= 0, scale)
            o_lat = torch.einsum("bqhk,bqkc->bqhc", probs, gathered)
            out = torch.einsum("bqhc,hec->bqhe", o_lat, w_uv_c)
            output[q0:q1] = out.transpose(0, 1).to(output.dtype)
        ctx.save_for_backward(q_nope, q_rope, latent, krope, w_uk, w_uv, indices, lse)
        ctx.scale, ctx.rows = scale, rows
        return output

    @staticmethod
    def backward(ctx, grad_output):
        q_nope, q_rope, latent, krope, w_uk, w_uv, indices, lse = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        seq, batch = q_nope.shape[:2]
        dtype = lse.dtype
        w_uk_c, w_uv_c = w_uk.to(dtype), w_uv.to(dtype)
        grad_q_nope = torch.empty_like(q_nope)
        grad_q_rope = torch.empty_like(q_rope)
        grad_w_uk = torch.zeros_like(w_uk, dtype=dtype)
        grad_w_uv = torch.zeros_like(w_uv, dtype=dtype)
        # accumulated over blocks in the compute dtype, rows flattened sequence after sequence
        grad_latent = torch.zeros(batch * seq, latent.shape[-1], dtype=dtype,
                                  device=latent.device)
        grad_krope = torch.zeros(batch * seq, krope.shape[-1], dtype=dtype, device=krope.device)
        offsets = torch.arange(batch, device=indices.device).view(-1, 1, 1) * seq
        for q0 in range(0, seq, rows):
            q1 = min(q0 + rows, seq)
            block = indices[:, q0:q1]
            valid = block >= 0
            q_nope_block, q_lat, q_rope_block, gathered, gathered_rope = _block_inputs(
                q_nope, q_rope, latent, krope, w_uk, block, q0, q1, dtype)
            logits = (torch.einsum("bqhc,bqkc->bqhk", q_lat, gathered)
                      + torch.einsum("bqhr,bqkr->bqhk", q_rope_block, gathered_rope)) * scale
            block_lse = lse[:, q0:q1]
            finite = torch.where(torch.isfinite(block_lse), block_lse,
                                 torch.zeros_like(block_lse))
            probs = torch.exp(logits - finite.unsqueeze(-1)).masked_fill(
                ~valid.unsqueeze(2), 0.0)
            del logits
            o_lat = torch.einsum("bqhk,bqkc->bqhc", probs, gathered)
            d_out = grad_output[q0:q1].transpose(0, 1).to(dtype)
            grad_w_uv += torch.einsum("bqhe,bqhc->hec", d_out, o_lat)
            d_o_lat = torch.einsum("bqhe,hec->bqhc", d_out, w_uv_c)
            # rowsum(dO ∘ O) of the softmax's backward, in the latent: dO·O = dO_lat·O_lat
            delta = (d_o_lat * o_lat).sum(-1, keepdim=True)
            del o_lat
            d_scores = probs * (torch.einsum("bqhc,bqkc->bqhk", d_o_lat, gathered) - delta)
            d_scores = d_scores * scale
            d_q_lat = torch.einsum("bqhk,bqkc->bqhc", d_scores, gathered)
            grad_q_rope[q0:q1] = torch.einsum("bqhk,bqkr->bqhr", d_scores, gathered_rope
                                              ).transpose(0, 1).to(q_rope.dtype)
            grad_q_nope[q0:q1] = torch.einsum("bqhc,hdc->bqhd", d_q_lat, w_uk_c
                                              ).transpose(0, 1).to(q_nope.dtype)
            grad_w_uk += torch.einsum("bqhd,bqhc->hdc", q_nope_block, d_q_lat)
            del d_q_lat
            d_gathered = (torch.einsum("bqhk,bqhc->bqkc", d_scores, q_lat)
                          + torch.einsum("bqhk,bqhc->bqkc", probs, d_o_lat))
            flat = (block.clamp(min=0) + offsets).reshape(-1)  # invalid: zero gradients
            grad_latent.index_add_(0, flat, d_gathered.reshape(-1, latent.shape[-1]))
            d_gathered_rope = torch.einsum("bqhk,bqhr->bqkr", d_scores, q_rope_block)
            grad_krope.index_add_(0, flat, d_gathered_rope.reshape(-1, krope.shape[-1]))

        def unflatten(grad, like):
            return grad.view(batch, seq, like.shape[-1]).transpose(0, 1).to(like.dtype)

        return (grad_q_nope, grad_q_rope, unflatten(grad_latent, latent),
                unflatten(grad_krope, krope), grad_w_uk.to(w_uk.dtype), grad_w_uv.to(w_uv.dtype),
                None, None, None)


def sparse_mla_latent_attention(q_nope: torch.Tensor, q_rope: torch.Tensor,
                                latent: torch.Tensor, krope: torch.Tensor, w_uk: torch.Tensor,
                                w_uv: torch.Tensor, indices: torch.Tensor, scale: float,
                                rows: int = 0) -> torch.Tensor:
    """Sparse attention of multi-latent attention in absorbed form (the module docstring):
    q_nope [s, b, heads, d_nope], q_rope [s, b, heads, rope], the normalized kv latent
    [s, b, kv_lora], the key's rotary part [s, b, rope], W_UK [heads, d_nope, kv_lora], W_UV
    [heads, d_v, kv_lora] (:func:`split_kv_up_weight`), ``indices`` [b, s, k] (-1: none) ->
    [s, b, heads, d_v]. Blocks of ``rows`` query rows (0: :func:`latent_rows_per_block`);
    differentiable in every tensor but ``indices``."""
    if not rows:
        rows = latent_rows_per_block(indices.shape[-1], q_nope.shape[2], latent.shape[-1],
                                     krope.shape[-1])
    return _SparseLatentAttention.apply(q_nope, q_rope, latent, krope, w_uk, w_uv, indices,
                                        scale, rows)


def latent_attention_target_sums(q_nope: torch.Tensor, q_rope: torch.Tensor,
                                 latent: torch.Tensor, krope: torch.Tensor, w_uk: torch.Tensor,
                                 indices: torch.Tensor, scale: float,
                                 rows: int = 0) -> torch.Tensor:
    """[b, s, k]: per query and selected key, the probability of :func:`sparse_mla_latent_attention`
    summed over this rank's heads (the indexer loss's target before its normalization), blocks
    of ``rows`` query rows; no gradient."""
    if not rows:
        rows = latent_rows_per_block(indices.shape[-1], q_nope.shape[2], latent.shape[-1],
                                     krope.shape[-1])
    dtype = torch.promote_types(q_nope.dtype, torch.float32)
    target = torch.empty(*indices.shape, dtype=dtype, device=q_nope.device)
    with torch.no_grad():
        for q0 in range(0, q_nope.shape[0], rows):
            q1 = min(q0 + rows, q_nope.shape[0])
            block = indices[:, q0:q1]
            _, q_lat, q_rope_block, gathered, gathered_rope = _block_inputs(
                q_nope, q_rope, latent, krope, w_uk, block, q0, q1, dtype)
            probs, _ = _block_probabilities(q_lat, q_rope_block, gathered, gathered_rope,
                                            block >= 0, scale)
            target[:, q0:q1] = probs.sum(dim=2)
    return target


def latent_working_set_bytes(tokens: int, topk: int, heads: int, kv_lora: int, rope_dim: int,
                             budget_bytes: int = GATHER_BUDGET_BYTES) -> Dict[str, int]:
    """What :func:`sparse_mla_latent_attention` holds for ``tokens`` tokens (per micro-batch and
    rank), in bytes, besides its inputs and output (the layer's q, latent and output, which any
    attention keeps):

    * ``saved``: the per-row, per-head fp32 log-sum-exp, N·heads·4;
    * ``transient``: the backward's fp32 accumulators of the latent's and the rotary part's
      gradients N·(kv_lora + rope)·4 (the weights' are heads-sized) and one block's working set,
      :func:`latent_rows_per_block` rows at their per-row bytes.

    Linear in N; nothing N × heads × kv_lora."""
    n, k = tokens, min(topk, tokens)
    rows = min(n, latent_rows_per_block(k, heads, kv_lora, rope_dim, budget_bytes))
    per_row = 4 * (2 * k * (kv_lora + rope_dim) + 4 * heads * kv_lora + 4 * heads * k)
    return {"saved": n * heads * 4, "transient": n * (kv_lora + rope_dim) * 4 + rows * per_row}
