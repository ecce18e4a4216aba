"""Top-k softmax routing and its load-balancing loss in one autograd node, bitwise as upstream.

For ``--moe-router-score-function softmax`` (softmax over the top-k logits) upstream's
``TopKRouter.routing`` computes

    scores, idx   = topk(logits, k)              probs = softmax(scores) (in fp32, cast back)
    routing_probs = zeros.scatter(idx, probs)    routing_map = zeros.int().scatter(idx, 1).bool()
    aux_loss      = Σ_e count_e · Σ_t softmax(logits)_te · E · coeff / (k · T²)
                    (count_e: tokens whose top-k of softmax(logits) holds e, summed over tp × cp)

in about 25 tensor ops and 10 autograd nodes per layer and micro-batch; in an eager step their
host launch time rivals the kernels'. :func:`softmax_topk_routing` runs the same forward ops
(minus the int/bool round trip of the map) inside one ``torch.autograd.Function``, and its
backward performs upstream's backward arithmetic in the same order: the gathers, casts and
``_softmax_backward_data`` calls autograd would run, and one addition of the two contributions to
the logits' gradient (routing and load-balancing loss), as autograd's input buffer does. The
outputs and gradients are therefore bitwise upstream's. The loss is returned, not attached:
the router attaches and logs it with upstream's ``attach_and_log_load_balancing_loss``
(``MoEAuxLossAutoScaler``), so its gradient scale is upstream's.

Memory: what upstream's nodes save (the top-k indices and fp32 probabilities; with the loss,
the fp32 ``[N, E]`` softmax and the counts). Traffic: upstream's, less the map's int copies.
Tests: ``tests/unit/moe/test_topk_routing.py`` (bitwise against upstream's ``TopKRouter.routing``
on CPU, and on CUDA with ``-m gpu``; op counts).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["softmax_topk_routing", "load_balancing_routing_map"]


def _softmax_fp32(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1, dtype=torch.float32)


def _softmax_fp32_backward(
    grad: torch.Tensor, out: torch.Tensor, input_dtype: torch.dtype, on_cuda: bool
) -> torch.Tensor:
    """Autograd's backward of ``_softmax_fp32`` for an input of ``input_dtype``. aten's softmax
    with dtype=float32 runs one half-to-float kernel for a CUDA fp16 input (torch 2.11; its
    backward returns fp16 directly) and otherwise casts the input to fp32 first (the backward
    then casts the fp32 gradient back)."""
    if on_cuda and input_dtype == torch.float16:
        return torch._softmax_backward_data(grad, out, -1, input_dtype)
    return torch._softmax_backward_data(grad, out, -1, torch.float32).to(input_dtype)


def _topk_map(like: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Bool map of ``like``'s shape, True at ``idx`` (upstream builds it in int, then casts)."""
    return torch.zeros(like.shape, dtype=torch.bool, device=like.device).scatter_(1, idx, True)


def load_balancing_routing_map(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """``[N, E]`` bool map of each token's top-k experts by fp32 softmax score: the map whose
    column sums are the load-balancing loss's counts (upstream's
    ``compute_routing_scores_for_aux_loss`` for the softmax score function)."""
    scores = _softmax_fp32(logits)
    return _topk_map(scores, torch.topk(scores, k=topk, dim=1).indices)


class _SoftmaxTopKRouting(torch.autograd.Function):
    """logits -> (routing_probs, routing_map[, aux_loss]); see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        num_experts: int,
        topk: int,
        sorted_topk: bool,
        aux_loss_coeff: float,
        reduce_group: Optional[torch.distributed.ProcessGroup],
        counts: Optional[Tuple[torch.Tensor, int]],
    ):
        flat = logits.view(-1, num_experts)
        scores, idx = torch.topk(flat, k=topk, dim=1, sorted=sorted_topk)
        probs_fp32 = _softmax_fp32(scores)
        routing_probs = torch.zeros_like(flat).scatter_(1, idx, probs_fp32.to(flat.dtype))
        routing_map = _topk_map(flat, idx)
        ctx.mark_non_differentiable(routing_map)
        ctx.set_materialize_grads(False)  # an unused output contributes nothing, as in upstream
        ctx.logits_shape, ctx.flat_shape = logits.shape, flat.shape
        ctx.logits_dtype, ctx.on_cuda = logits.dtype, logits.is_cuda
        if aux_loss_coeff <= 0:
            ctx.save_for_backward(idx, probs_fp32)
            return routing_probs, routing_map

        scores_aux = _softmax_fp32(flat)
        if counts is None:
            aux_idx = torch.topk(scores_aux, k=topk, dim=1).indices
            tokens_per_expert = _topk_map(flat, aux_idx).sum(dim=0)
            if reduce_group.size() > 1:
                torch.distributed.all_reduce(tokens_per_expert, group=reduce_group)
            total_tokens = flat.shape[0] * reduce_group.size()
        else:
            tokens_per_expert, total_tokens = counts
        # upstream's switch_load_balancing_loss_func, same expressions in the same order
        ctx.aux_scale = num_experts * aux_loss_coeff / (topk * total_tokens * total_tokens)
        aux_loss = torch.sum(scores_aux.sum(dim=0) * tokens_per_expert) * ctx.aux_scale
        ctx.save_for_backward(idx, probs_fp32, scores_aux, tokens_per_expert)
        return routing_probs, routing_map, aux_loss

    @staticmethod
    def backward(ctx, grad_routing_probs, _grad_routing_map, grad_aux_loss=None):
        idx, probs_fp32, *aux_saved = ctx.saved_tensors
        num_tokens, num_experts = ctx.flat_shape
        dtype = ctx.logits_dtype
        grad_logits = None
        if grad_routing_probs is not None:
            # backward of scatter (gather), of the cast to the logits' dtype, of the softmax and
            # of topk (zeros, scatter)
            grad_probs = grad_routing_probs.gather(1, idx).to(torch.float32)
            grad_scores = _softmax_fp32_backward(grad_probs, probs_fp32, dtype, ctx.on_cuda)
            grad_logits = torch.zeros(
                num_tokens, num_experts, dtype=dtype, device=grad_scores.device
            ).scatter_(1, idx, grad_scores)
        if grad_aux_loss is not None:
            scores_aux, tokens_per_expert = aux_saved
            # backward of `* aux_scale`, of sum and of `* tokens_per_expert` (the expand of sum's
            # backward left to broadcasting: the counts are integers, so the product is fp32
            # either way), of sum(dim=0) (expand)
            grad_per_expert = (grad_aux_loss * ctx.aux_scale) * tokens_per_expert
            grad_aux = _softmax_fp32_backward(
                grad_per_expert.expand(num_tokens, num_experts), scores_aux, dtype, ctx.on_cuda
            )
            # autograd's input buffer adds the two contributions (a + b, commutative); a
            # scatter_add into grad_aux would save two ops but keep −0 where upstream has 0 + −0
            grad_logits = grad_aux if grad_logits is None else grad_logits.add_(grad_aux)
        if grad_logits is not None:
            grad_logits = grad_logits.view(ctx.logits_shape)
        return grad_logits, None, None, None, None, None, None


def softmax_topk_routing(
    logits: torch.Tensor,
    num_experts: int,
    topk: int,
    aux_loss_coeff: float = 0.0,
    reduce_group: Optional[torch.distributed.ProcessGroup] = None,
    counts: Optional[Tuple[torch.Tensor, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``logits`` (any shape ending in ``num_experts``) -> ``routing_probs`` ``[N, E]`` (the
    logits' dtype), ``routing_map`` ``[N, E]`` (bool) and, when ``aux_loss_coeff > 0``, the
    load-balancing loss (fp32 scalar, not yet attached to the probabilities; else None), in one
    autograd node.

    The loss's counts are the column sums of :func:`load_balancing_routing_map` all-reduced over
    ``reduce_group``, with ``T = N × reduce_group.size()``; or, when given (chunked recompute),
    ``counts = (tokens_per_expert, T)`` with integer ``tokens_per_expert``. Like upstream, the
    top-k is sorted only while gradients are enabled.
    """
    outputs = _SoftmaxTopKRouting.apply(
        logits, num_experts, topk, torch.is_grad_enabled(), aux_loss_coeff, reduce_group, counts
    )
    return outputs if len(outputs) == 3 else (*outputs, None)
