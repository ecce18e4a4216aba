"""Our MoE layer: upstream's ``MoELayer`` with the torch-native static-capacity dispatcher.

``BoundedMoELayer`` is a ``MoELayer`` subclass.  When the torch-native backend is selected it
builds upstream's layer (router, experts, shared experts) and then replaces
``self.token_dispatcher`` with ``StaticCapacityTokenDispatcher``; otherwise it is upstream's
layer unchanged (so HybridEP + Transformer Engine keep their own path).

The backend is chosen by :func:`megatron.bounded.moe.backend.select_moe_backend` (re-exported
here); the settings it cannot run are refused by the config
(:func:`megatron.bounded.moe.backend.check_moe_capacity_and_paged_stash`, called from
``BoundedTransformerConfig.__post_init__``) before a layer is built.

With ``moe_shared_expert_overlap`` the torch-native layer computes its shared experts on a side
CUDA stream while the router, the dispatch, the routed experts and the combine run on the
current one, and joins them before adding their output (on CPU: inline, as without the flag);
upstream's overlap is a schedule of hooks inside its own dispatchers, which ours does not have.

The dispatcher reads ``moe_expert_rank_capacity_factor`` (None = dropless), ``num_moe_experts``
and ``moe_router_topk``; the experts read ``hidden_size``, ``moe_ffn_hidden_size``,
``gated_linear_unit``, ``activation_func``, ``glu_linear_offset``,
``activation_func_clamp_value``, ``moe_apply_probs_on_input``, ``moe_paged_stash`` (at every
forward), ``params_dtype``, ``init_method``, ``output_layer_init_method``,
``use_cpu_initialization`` and ``perform_initialization``.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

from megatron.bounded.moe.backend import (
    BACKEND_FIELD,
    select_moe_backend,
    upstream_static_capacity_available,
)
from megatron.bounded.moe.chunk_routing import ChunkedRoutingTopKRouter
from megatron.bounded.moe.experts import GroupedExperts
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPMoE
from megatron.bounded.moe.dispatch.token_dispatcher import StaticCapacityTokenDispatcher
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap
from megatron.bounded.object_changes import object_change
from megatron.bounded.units import log_once

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_FIELD",
    "select_moe_backend",
    "upstream_static_capacity_available",
    "BoundedMoELayer",
    "bounded_moe_submodules",
]


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
        # For the torch backend, build upstream's layer around the cheapest upstream dispatcher,
        # then swap in ours; upstream's shared-expert overlap is hidden too: this layer overlaps
        # them itself. The config is shared, so the fields are restored right away.
        shared_overlap = config.moe_shared_expert_overlap
        with contextlib.ExitStack() as upstream_build:
            if backend == "torch":
                upstream_build.enter_context(object_change(
                    "moe-layer-built-with-allgather-dispatcher").hidden(
                        config, moe_token_dispatcher_type="allgather"))
                upstream_build.enter_context(object_change(
                    "moe-layer-built-without-upstream-shared-expert-overlap").hidden(
                        config, moe_shared_expert_overlap=False))
            super().__init__(
                config=config,
                submodules=submodules,
                layer_number=layer_number,
                pg_collection=pg_collection,
                is_mtp_layer=is_mtp_layer,
                name=name,
            )
        self.shared_experts_on_side_stream = bool(
            backend == "torch" and shared_overlap and self.shared_experts is not None)
        self.shared_experts_side_stream = None  # this layer's, made on its first CUDA forward
        self._shared_experts_stream = None  # the stream of this forward's shared experts
        self.pipelined_llep = None
        if backend == "torch":
            self._use_torch_native_dispatch(config, pg_collection)
        else:
            log_once(
                logger,
                f"MoE backend: upstream {type(self.token_dispatcher).__name__} "
                f"(moe_token_dispatcher_type={config.moe_token_dispatcher_type}), "
                f"experts {type(self.experts).__name__}"
            )
        self.moe_backend = backend

    def _use_torch_native_dispatch(self, config, pg_collection) -> None:
        """Our dispatcher in place of upstream's, wired to the router, the experts and
        PipelinedLLEP."""
        self.token_dispatcher = StaticCapacityTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
        )
        if hasattr(self, "_training_token_dispatcher"):
            self._training_token_dispatcher = self.token_dispatcher
        if self.token_dispatcher.expert_capacity_factor is not None:
            if not isinstance(self.router, ChunkedRoutingTopKRouter):
                raise ValueError(
                    "moe_pad_expert_input_to_capacity with the torch-native dispatcher needs "
                    "the router of bounded_moe_submodules (ChunkedRoutingTopKRouter), which "
                    f"adds no padding pairs; got {type(self.router).__name__}")
            self.router.pads_in_dispatcher = True
        if isinstance(self.experts, GroupedExperts):
            # The experts' fc1 weight gradient runs during the dispatch's backward exchange.
            overlap = ExpertWeightGradOverlap(self.experts)
            self.token_dispatcher.wgrad_overlap = overlap
            self.experts.wgrad_overlap = overlap
        factor = self.token_dispatcher.moe_expert_rank_capacity_factor
        if factor is not None:
            mode = f"static capacity, rank capacity factor {factor}"
        elif self.token_dispatcher.expert_capacity_factor is not None:
            mode = ("static capacity, padded to the experts' capacity (factor "
                    f"{self.token_dispatcher.expert_capacity_factor})")
        else:
            mode = "dropless (no capacity factor)"
        log_once(
            logger,
            "MoE backend: torch-native all-to-all dispatcher "
            f"({mode}, EP={self.token_dispatcher.ep_size}), "
            f"experts {type(self.experts).__name__}"
        )
        if PipelinedLLEPMoE.enabled(config):
            # Megatron micro-batches all have the same shape: the chunk count needs no
            # agreement collective (uniform_tokens)
            self.pipelined_llep = PipelinedLLEPMoE(config, self.experts, self.ep_group,
                                                   uniform_tokens=True)

    def shared_experts_compute(self, hidden_states):
        if not (self.shared_experts_on_side_stream and hidden_states.is_cuda):
            return super().shared_experts_compute(hidden_states)
        device = hidden_states.device
        stream = self.shared_experts_side_stream
        if stream is None:
            stream = self.shared_experts_side_stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            output = super().shared_experts_compute(hidden_states)
        # the input is read on the side stream: its memory is not reused before that is done
        hidden_states.record_stream(stream)
        self._shared_experts_stream = stream
        return output

    def _join_shared_experts(self, shared_expert_output):
        """The shared experts' output, usable on the current stream (joined from the side one)."""
        stream, self._shared_experts_stream = self._shared_experts_stream, None
        if stream is not None and shared_expert_output is not None:
            current = torch.cuda.current_stream(shared_expert_output.device)
            current.wait_stream(stream)
            shared_expert_output.record_stream(current)
        return shared_expert_output

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
        shared_expert_output = self._join_shared_experts(shared_expert_output)
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
