"""Our MoE layer: upstream's ``MoELayer`` with the torch-native static-capacity dispatcher.

``BoundedMoELayer`` is a ``MoELayer`` subclass.  When the torch-native backend is selected it
builds upstream's layer (router, experts, shared experts) and then replaces
``self.token_dispatcher`` with ``StaticCapacityTokenDispatcher``; otherwise it is upstream's
layer unchanged (so HybridEP + Transformer Engine keep their own path).

Backend selection (``select_moe_backend``), from the config:

* ``config.bounded_moe_backend`` (optional field, default ``"auto"``): ``"torch"`` forces the
  torch-native dispatcher, ``"upstream"`` forces upstream's dispatcher;
* ``"auto"``: torch-native iff ``config.moe_expert_rank_capacity_factor`` is set and upstream's
  static-capacity backend cannot run (it needs ``moe_token_dispatcher_type == "flex"`` with
  ``moe_flex_dispatcher_backend`` ``"hybridep"`` / ``"ncclep"``, Transformer Engine, and for
  HybridEP DeepEP's ``HybridEPBuffer``).

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

from megatron.bounded.moe.experts import GroupedExperts
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPMoE
from megatron.bounded.moe.token_dispatcher import StaticCapacityTokenDispatcher
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_FIELD",
    "select_moe_backend",
    "upstream_static_capacity_available",
    "BoundedMoELayer",
    "bounded_moe_submodules",
]

# Optional config field that overrides the automatic backend choice.
BACKEND_FIELD = "bounded_moe_backend"
_VALID_BACKENDS = ("auto", "torch", "upstream")
_LOGGED = set()


def upstream_static_capacity_available(config) -> bool:
    """Whether upstream's own static-capacity MoE path (HybridEP / NCCL-EP + TE) can run."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return False
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:  # pragma: no cover - the module exists in megatron-core 0.19.2
        HAVE_TE = False
    if not HAVE_TE:
        return False
    if backend == "hybridep":
        from megatron.core.transformer.moe.fused_a2a import HAVE_HYBRIDEP

        return bool(HAVE_HYBRIDEP)
    return backend == "ncclep"


def select_moe_backend(config) -> str:
    """``"torch"`` (our static-capacity dispatcher) or ``"upstream"``."""
    choice = getattr(config, BACKEND_FIELD, "auto") or "auto"
    if choice not in _VALID_BACKENDS:
        raise ValueError(f"{BACKEND_FIELD} must be one of {_VALID_BACKENDS}, got {choice!r}")
    if choice != "auto":
        return choice
    if getattr(config, "pipelined_llep", False):
        return "torch"  # PipelinedLLEP is built on the torch-native slabs and grouped experts
    factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if factor is not None and not upstream_static_capacity_available(config):
        return "torch"
    return "upstream"


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
        from megatron.bounded.arguments import check_moe_capacity_and_paged_stash

        check_moe_capacity_and_paged_stash(config)
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
    from megatron.core.transformer.moe.router import TopKRouter
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
            router=TopKRouter,
        ),
    )
