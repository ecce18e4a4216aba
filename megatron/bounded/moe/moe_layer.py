"""Our MoE layer: upstream's ``MoELayer`` with the torch-native static-capacity dispatcher.

``BoundedMoELayer`` is a ``MoELayer`` subclass.  When the torch-native backend is selected it
builds upstream's layer (router, experts, shared experts) and then replaces
``self.token_dispatcher`` with ``StaticCapacityTokenDispatcher``; otherwise it is upstream's
layer unchanged (so HybridEP + Transformer Engine keep their own path).

The backend is chosen by :func:`megatron.bounded.moe.backend.select_moe_backend` (re-exported
here); the settings it cannot run are refused by the config
(:func:`megatron.bounded.moe.backend.check_moe_capacity_and_paged_stash`, called from
``BoundedTransformerConfig.__post_init__``) before a layer is built.

The dispatcher reads ``moe_expert_rank_capacity_factor`` (None = dropless), ``num_moe_experts``
and ``moe_router_topk``; the experts read ``hidden_size``, ``moe_ffn_hidden_size``,
``gated_linear_unit``, ``activation_func``, ``glu_linear_offset``,
``activation_func_clamp_value``, ``moe_apply_probs_on_input``, ``moe_paged_stash`` (at every
forward), ``params_dtype``, ``init_method``, ``output_layer_init_method``,
``use_cpu_initialization`` and ``perform_initialization``.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Optional

from megatron.core._rank_utils import log_single_rank
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

from megatron.bounded.moe.backend import (
    BACKEND_FIELD,
    select_moe_backend,
    upstream_static_capacity_available,
)
from megatron.bounded.moe.experts import GroupedExperts
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPMoE
from megatron.bounded.moe.dispatch.token_dispatcher import StaticCapacityTokenDispatcher
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_FIELD",
    "select_moe_backend",
    "upstream_static_capacity_available",
    "BoundedMoELayer",
    "bounded_moe_submodules",
]

_LOGGED = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log_single_rank(logger, logging.INFO, message)


class BoundedMoELayer(MoELayer):
    """``MoELayer`` whose token dispatcher is the torch-native static-capacity one when selected.

    Same constructor as upstream's ``MoELayer``; usable as the ``mlp`` slot of a transformer
    layer spec (see ``bounded_moe_submodules``).  ``self.moe_backend`` says which runs.
    """

    def __init__(
        self,
        config,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ):
        backend = select_moe_backend(config)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        # For the torch backend, build upstream's layer around the cheapest upstream dispatcher
        # (allgather: no streams, no CUDA calls at construction; a flex type would try to build
        # HybridEP), then swap in ours. The config is shared, so the field is restored right away.
        dispatcher_type = config.moe_token_dispatcher_type
        if backend == "torch":
            config.moe_token_dispatcher_type = "allgather"
        try:
            super().__init__(
                config=config,
                submodules=submodules,
                layer_number=layer_number,
                pg_collection=pg_collection,
                is_mtp_layer=is_mtp_layer,
                name=name,
            )
        finally:
            config.moe_token_dispatcher_type = dispatcher_type
        if backend == "torch":
            self.token_dispatcher = StaticCapacityTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
            if hasattr(self, "_training_token_dispatcher"):
                self._training_token_dispatcher = self.token_dispatcher
            if isinstance(self.experts, GroupedExperts):
                # The experts' fc1 weight gradient runs during the dispatch's backward exchange.
                overlap = ExpertWeightGradOverlap(self.experts)
                self.token_dispatcher.wgrad_overlap = overlap
                self.experts.wgrad_overlap = overlap
            factor = self.token_dispatcher.moe_expert_rank_capacity_factor
            mode = (
                f"static capacity, rank capacity factor {factor}"
                if factor is not None
                else "dropless (no capacity factor)"
            )
            _log_once(
                "MoE backend: torch-native all-to-all dispatcher "
                f"({mode}, EP={self.token_dispatcher.ep_size}), "
                f"experts {type(self.experts).__name__}"
            )
            self.pipelined_llep = (
                # Megatron micro-batches all have the same shape: the chunk count needs no
                # agreement collective (uniform_tokens)
                PipelinedLLEPMoE(config, self.experts, self.ep_group, uniform_tokens=True)
                if PipelinedLLEPMoE.enabled(config)
                else None
            )
            if self.pipelined_llep is not None:
                _log_once(
                    f"MoE: PipelinedLLEP, token budget {config.pipelined_llep_token_budget} per "
                    f"chunk, at most {config.pipelined_llep_max_chunks} chunks, LLEP imbalance "
                    f"threshold {config.llep_imbalance_threshold}"
                )
        else:
            self.pipelined_llep = None
            _log_once(
                f"MoE backend: upstream {type(self.token_dispatcher).__name__} "
                f"(moe_token_dispatcher_type={config.moe_token_dispatcher_type}), "
                f"experts {type(self.experts).__name__}"
            )
        self.moe_backend = backend

    # With PipelinedLLEP the whole dispatch -> experts -> combine runs chunk by chunk inside
    # routed_experts_compute; dispatch and combine pass the tensors through unchanged.

    def preprocess(self, hidden_states, probs, routing_map):
        if self.pipelined_llep is None:
            return super().preprocess(hidden_states, probs, routing_map)
        self._pipelined_llep_routing_map = routing_map
        return hidden_states, probs

    def dispatch(self, hidden_states, probs):
        if self.pipelined_llep is None:
            return super().dispatch(hidden_states, probs)
        return hidden_states, probs

    def routed_experts_compute(self, hidden_states, probs):
        if self.pipelined_llep is None:
            return super().routed_experts_compute(hidden_states, probs)
        routing_map, self._pipelined_llep_routing_map = self._pipelined_llep_routing_map, None
        return self.pipelined_llep(hidden_states, probs, routing_map), None

    def combine(self, output):
        if self.pipelined_llep is None:
            return super().combine(output)
        return output

    def postprocess(self, output, shared_expert_output):
        if self.pipelined_llep is None:
            return super().postprocess(output, shared_expert_output)
        return output if shared_expert_output is None else output + shared_expert_output


def bounded_moe_submodules(config=None, experts: str = "auto"):
    """Builder for the ``mlp`` slot of a transformer layer: our MoE layer with its experts.

    ``experts``: ``"grouped"`` (``GroupedExperts`` on ``torch._grouped_mm``), ``"sequential"``
    (upstream's ``SequentialMLP`` with local linears), ``"te"`` (upstream's ``TEGroupedMLP``;
    needs Transformer Engine) or ``"auto"``: ``"te"`` when ``config`` selects upstream's
    HybridEP / NCCL-EP path (its paged stash hooks live in TE's fused experts), else
    ``"grouped"``.  Shared experts are upstream's ``SharedExpertMLP`` with local linears.

    Returns ``functools.partial(BoundedMoELayer, submodules=MoESubmodules(...))``, called by the
    transformer layer as ``mlp(config=..., pg_collection=..., is_mtp_layer=..., name=...)``.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from megatron.bounded.moe.chunk_routing import ChunkedRoutingTopKRouter

    local_mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if experts == "auto":
        use_te = (
            config is not None
            and select_moe_backend(config) == "upstream"
            and upstream_static_capacity_available(config)
        )
        experts = "te" if use_te else "grouped"
    if experts == "grouped":
        experts_builder = GroupedExperts
    elif experts == "sequential":
        experts_builder = partial(SequentialMLP, submodules=local_mlp)
    elif experts == "te":
        from megatron.core.models.backends import TESpecProvider

        experts_builder = TESpecProvider().grouped_mlp_modules(True)
    else:
        raise ValueError(f"unknown experts kind {experts!r}")
    return partial(
        BoundedMoELayer,
        submodules=MoESubmodules(
            experts=experts_builder,
            shared_experts=partial(SharedExpertMLP, submodules=local_mlp),
            # upstream's TopKRouter; splits its load-balancing loss over chunks when
            # megatron.bounded.activations.chunked_recompute runs the layer in chunks
            router=ChunkedRoutingTopKRouter,
        ),
    )
