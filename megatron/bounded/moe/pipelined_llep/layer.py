"""``PipelinedLLEPMoE``: the routed-experts path of a MoE layer as PipelinedLLEP, configured from
the layer's config and run by ``BoundedMoELayer``."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron.bounded.moe.pipelined_llep.chunks import CHUNKINGS, as_int
from megatron.bounded.moe.pipelined_llep.function import pipelined_moe
from megatron.bounded.units import log_once

logger = logging.getLogger(__name__)


class PipelinedLLEPMoE:
    """The routed-experts path of a MoE layer as PipelinedLLEP (replaces dispatch/experts/combine).

    ``PipelinedLLEPMoE(config, experts, ep_group=None)``; ``experts`` is the layer's
    ``GroupedExperts`` (its ``weight1``, ``weight2`` and activation are used; it is referenced,
    not registered, so the layer's state dict is unchanged); ``ep_group`` defaults to
    ``experts.ep_group``.  Call ``moe(hidden_states, probs, routing_map) -> output`` with the
    router's ``probs`` / ``routing_map`` ``[N, E]``; the output has the shape of
    ``hidden_states`` and holds the routed experts' sum (add shared experts outside).

    Config fields: the fields of ``PipelinedLLEPSettings`` (``pipelined_llep_token_budget``,
    tokens per rank and chunk; ``pipelined_llep_max_chunks``; ``llep_imbalance_threshold``,
    None: no balancing; ``llep_min_spill_tokens``), ``moe_router_topk``, ``num_moe_experts``,
    ``moe_apply_probs_on_input``.  ``last_stats`` describes the last call.

    Keyword options: ``chunking`` ("strided" or "contiguous"), ``overlap`` (side-stream schedule
    on CUDA), ``uniform_tokens`` (every EP rank has the same token count: K needs no
    collective when LLEP is off; see ``pipelined_moe``).
    """

    def __init__(self, config, experts, ep_group=None, *, chunking: str = "strided",
                 overlap: bool = True, uniform_tokens: bool = False):
        for name in ("weight1", "weight2", "activation"):
            if not hasattr(experts, name):
                raise TypeError(
                    f"PipelinedLLEP needs grouped experts (weight1, weight2, activation); "
                    f"{type(experts).__name__} has no {name!r}"
                )
        if chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {CHUNKINGS}, got {chunking!r}")
        self.config = config
        self.experts = experts
        self.ep_group = ep_group if ep_group is not None else getattr(experts, "ep_group", None)
        self.topk = as_int(config.moe_router_topk, "moe_router_topk")
        self.num_experts = as_int(config.num_moe_experts, "num_moe_experts")
        # the values were refused where they were set: PipelinedLLEPSettings.check_values, run
        # on the flags and by the model config
        self.token_budget = config.pipelined_llep_token_budget
        self.max_chunks = config.pipelined_llep_max_chunks
        self.imbalance_threshold = config.llep_imbalance_threshold
        self.min_spill_tokens = config.llep_min_spill_tokens
        self.apply_probs_on_input = bool(getattr(config, "moe_apply_probs_on_input", False))
        self.chunking = chunking
        self.overlap = overlap
        self.uniform_tokens = uniform_tokens
        self._stats: Optional[dict] = None
        log_once(
            logger,
            f"MoE: PipelinedLLEP, token budget {self.token_budget} per chunk, at most "
            f"{self.max_chunks} chunks, LLEP imbalance threshold {self.imbalance_threshold}"
        )

    @staticmethod
    def enabled(config) -> bool:
        return bool(getattr(config, "pipelined_llep", False))

    def __call__(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> torch.Tensor:
        stats: dict = {}
        out = pipelined_moe(
            hidden_states,
            probs,
            routing_map,
            self.experts.weight1,
            self.experts.weight2,
            self.experts.activation,
            topk=self.topk,
            token_budget=self.token_budget,
            max_chunks=self.max_chunks,
            ep_group=self.ep_group,
            imbalance_threshold=self.imbalance_threshold,
            min_spill_tokens=self.min_spill_tokens,
            chunking=self.chunking,
            overlap=self.overlap,
            uniform_tokens=self.uniform_tokens,
            apply_probs_on_input=self.apply_probs_on_input,
            stats=stats,
        )
        self._stats = stats
        return out

    forward = __call__

    @property
    def last_stats(self) -> Optional[dict]:
        """The last call's stats with device values read back (a host sync)."""
        if self._stats is None:
            return None
        out = dict(self._stats)
        for key in ("max_recv_rows", "max_send_rows"):
            out[key] = int(out[key].item())
        out["dropped"] = bool(out["dropped"].item())
        return out
