"""Load-balancing loss of a MoE layer whose tokens pass the router in sequence chunks.

Upstream's load-balancing loss (``--moe-router-load-balancing-type aux_loss``) is

    aux = coeff · E / (k · T²) · Σ_e count_e · Σ_t score_te

with count_e the tokens routed to expert e and T the tokens of the micro-batch (both reduced over
the tensor- and context-parallel ranks). It is a sum over tokens with one per-expert weight
count_e, so it splits exactly over sequence chunks once every chunk uses the counts of the whole
micro-batch: the gradient each token's scores receive, coeff · E · count_e / (k · T²), is then the
same number as without chunks. :mod:`megatron.bounded.activations.chunked_recompute` runs the layer's MLP
block chunk by chunk without gradients first (:func:`collecting`: the router adds each chunk's
counts to a :class:`RoutingCounts`), reduces them once (:meth:`RoutingCounts.finalize`) and
recomputes the chunks with gradients under :func:`applying`, where
:class:`ChunkedRoutingTopKRouter` computes the loss from those counts. Outside both contexts the
router computes upstream's ``TopKRouter`` results.

In the common case (softmax after top-k, at most this loss: :meth:`_softmax_topk_applies`) the
router computes the routing and the loss with :mod:`megatron.bounded.moe.topk_routing`: one
autograd node instead of about ten, and fewer tensor ops, whose host launch time dominates an
eager step; outputs and gradients are bitwise upstream's. Other settings take upstream's path.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_utils import (
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter

from megatron.bounded.moe.topk_routing import load_balancing_routing_map, softmax_topk_routing
from megatron.bounded.object_changes import object_change

__all__ = ["RoutingCounts", "collecting", "applying", "ChunkedRoutingTopKRouter"]

_state = threading.local()


class RoutingCounts:
    """Tokens per expert of one micro-batch's pass through one layer, summed over its chunks."""

    def __init__(self):
        self.local_counts: Optional[torch.Tensor] = None
        self.local_tokens = 0
        self.global_counts: Optional[torch.Tensor] = None
        self.total_tokens = 0
        self._group = None

    def add(self, routing_map: torch.Tensor, group) -> None:
        counts = routing_map.sum(dim=0)
        self.local_counts = counts if self.local_counts is None else self.local_counts + counts
        self.local_tokens += routing_map.shape[0]
        self._group = group

    def finalize(self) -> None:
        """Reduce the counts over the router's tensor- and context-parallel group (as upstream
        does for one unchunked pass)."""
        if self.local_counts is None:
            return
        counts = self.local_counts.clone()
        size = 1
        if self._group is not None and self._group.size() > 1:
            torch.distributed.all_reduce(counts, group=self._group)
            size = self._group.size()
        self.global_counts = counts
        self.total_tokens = self.local_tokens * size


@contextmanager
def _set(name: str, value):
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield value
    finally:
        setattr(_state, name, previous)


def collecting(counts: RoutingCounts):
    """Routers called inside add the counts of their load-balancing routing to ``counts``."""
    return _set("collecting", counts)


def applying(counts: RoutingCounts):
    """Routers called inside compute the load-balancing loss from ``counts`` (finalized)."""
    return _set("applying", counts)


class ChunkedRoutingTopKRouter(TopKRouter):
    """Upstream's ``TopKRouter``; inside :func:`collecting` / :func:`applying` its
    load-balancing loss uses the counts of the whole micro-batch (see the module docstring). In
    the common case (:meth:`_softmax_topk_applies`) :func:`softmax_topk_routing` computes the
    routing and the loss in one autograd node, bitwise as upstream's ops.

    ``pads_in_dispatcher`` (set by the torch-native MoE layer, whose dispatcher sizes its slabs
    to the experts' capacity): with ``moe_pad_expert_input_to_capacity`` the router drops each
    expert's pairs beyond its capacity as upstream's does, and adds no padding pairs (upstream's
    router fills each expert up to its capacity with unrouted tokens of probability 0)."""

    pads_in_dispatcher = False

    def _softmax_topk_applies(self, padding_mask: Optional[torch.Tensor]) -> bool:
        """Whether upstream's routing is plain softmax-after-top-k with at most the
        micro-batch load-balancing loss: every setting below changes upstream's computation."""
        config = self.config
        return (
            self.score_function == "softmax"
            and self.routing_type in ("aux_loss", "none")
            and not config.moe_router_pre_softmax
            and not config.moe_router_group_topk
            and not config.moe_router_topk_scaling_factor
            and not config.moe_router_fusion
            and config.moe_expert_capacity_factor is None
            and config.moe_z_loss_coeff is None
            and self.expert_bias is None
            and self.router_replay is None
            and padding_mask is None
            and not (self.is_mtp_layer and config.mtp_use_repeated_layer
                     and config.mtp_num_layers is not None)
            and not torch.are_deterministic_algorithms_enabled()
        )

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        common_case = self._softmax_topk_applies(padding_mask)
        coeff = self.get_aux_loss_coeff("aux_loss")
        counts = getattr(_state, "collecting", None)
        if counts is not None and self.training and coeff > 0:
            flat = logits.reshape(-1, self.config.num_moe_experts)
            with torch.no_grad():
                if common_case:
                    routing_map = load_balancing_routing_map(flat, self.topk)
                else:
                    routing_map, _ = compute_routing_scores_for_aux_loss(
                        flat, self.topk, self.score_function, fused=self.config.moe_router_fusion
                    )
            counts.add(routing_map, self.tp_cp_group)
        if not common_case:
            if not (self.pads_in_dispatcher and self.config.moe_pad_expert_input_to_capacity):
                return super().routing(logits, padding_mask=padding_mask)
            # the config is the model's: the flag is hidden for this call only
            with object_change("router-padding-left-to-the-dispatcher").hidden(
                    self.config, moe_pad_expert_input_to_capacity=False):
                return super().routing(logits, padding_mask=padding_mask)

        if not (self.training and torch.is_grad_enabled() and coeff > 0):
            probs, routing_map, _ = softmax_topk_routing(
                logits, self.config.num_moe_experts, self.topk
            )
            return probs, routing_map
        applied = getattr(_state, "applying", None)
        given_counts, valid_tokens = None, None  # None: this pass's own counts and tokens
        if applied is not None:
            _check_finalized(applied)
            given_counts = (applied.global_counts, applied.total_tokens)
            valid_tokens = applied.local_tokens
        probs, routing_map, aux_loss = softmax_topk_routing(
            logits, self.config.num_moe_experts, self.topk, coeff, self.tp_cp_group, given_counts
        )
        probs = self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=routing_map.shape[0] if valid_tokens is None else valid_tokens,
        )
        return probs, routing_map

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        counts = getattr(_state, "applying", None)
        if counts is None:
            return super()._apply_aux_loss(
                probs, scores_for_aux_loss, routing_map, with_padding_mask=with_padding_mask
            )
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        _check_finalized(counts)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss,
            tokens_per_expert=counts.global_counts,
            total_num_tokens=counts.total_tokens,
            topk=self.topk,
            num_experts=self.config.num_moe_experts,
            moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group,
            valid_token_count=counts.local_tokens,
        )


def _check_finalized(counts: RoutingCounts) -> None:
    if counts.global_counts is None:
        raise RuntimeError("chunked routing: the counts were not collected and finalized")
