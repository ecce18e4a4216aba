"""The operator registry: every bounded feature of a run, one record each.

A record names the feature's settings dataclass (its flags, defaults and ``check()``, declared in
the feature's own module), where it is wired into the run (model, loss, optimizer or forward
step), the memory-budget terms it bounds, the cost-model terms it adds, and whether it has run
under upstream's whole-iteration CUDA graph. Everything that lists operators derives from
:data:`OPERATORS`: the flags and settings of ``pretrain_gpt.py`` (``RunSettings``), the fields the
model config inherits (``MODEL_SETTINGS``), the budget's settings (``OPERATOR_SETTINGS``) and the
planner's rule for the whole-iteration graph. Adding an operator is one record here plus its module
(``docs/adding_an_operator.md``).

The features made of upstream's flags only (full recompute, the static-capacity dispatch with
paged stash, the whole-iteration graph, the micro-batch) have no settings class of ours; the
planner (:mod:`megatron.bounded.budget.planner`) chooses them beside these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple, Type

from megatron.bounded.activations.chunked_attention import ChunkedAttentionSettings
from megatron.bounded.activations.chunked_recompute import ChunkedRecomputeSettings
from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.loss.ring_dtp import RingDTPSettings
from megatron.bounded.moe.backend import MoEBackendSettings
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPSettings
from megatron.bounded.optimizer.distributed import OffloadStreamSettings
from megatron.bounded.settings import Settings

__all__ = ["OPERATORS", "Operator", "model_settings", "settings_by_name"]


@dataclass(frozen=True)
class Operator:
    """One bounded feature: ``name`` is its field on ``RunSettings`` and ``BudgetConfig``."""

    name: str
    settings: Type[Settings]
    wiring: str  # where pretrain_gpt.py hands the settings over
    memory_terms: Tuple[str, ...]  # the budget terms (megatron.bounded.budget.TERM_LABELS) it bounds
    cost_terms: Tuple[str, ...]  # the cost model's terms (megatron.bounded.budget.cost) it adds
    in_model: bool  # the model config inherits its fields (the model's modules read them there)
    under_graph: bool  # has run under the whole-iteration CUDA graph

    def enabled(self, args) -> bool:
        """Whether ``args`` (parsed flags, or a settings holder) switches it on."""
        return self.settings.from_args(args, check=False).enabled


OPERATORS: Tuple[Operator, ...] = (
    Operator("moe_backend", MoEBackendSettings, "model: the MoE layers' dispatcher and experts",
             ("moe_dispatch", "paged_stash"), ("moe_dispatch",), in_model=True, under_graph=True),
    Operator("pipelined_llep", PipelinedLLEPSettings, "model: the MoE layers' dispatch",
             ("moe_dispatch",), ("pipelined_llep",), in_model=True, under_graph=False),
    Operator("chunked_recompute", ChunkedRecomputeSettings,
             "model: the layers' recompute, in token chunks", ("recompute_working_set",),
             ("chunks",), in_model=True, under_graph=False),
    Operator("chunked_attention", ChunkedAttentionSettings,
             "model: the attention sublayer's recompute and what it keeps",
             ("recompute_working_set", "kept_attention"), ("attention_recompute", "kept_attention"),
             in_model=True, under_graph=False),
    Operator("sco", SCOSettings, "forward step: around each micro-batch's forward",
             ("checkpoint_boundaries",), ("sco",), in_model=False, under_graph=False),
    Operator("ring_dtp", RingDTPSettings, "loss: the output layer and cross-entropy",
             ("vocab_projection",), ("ring_dtp",), in_model=False, under_graph=False),
    Operator("offload_stream", OffloadStreamSettings, "optimizer: inside the distributed optimizer",
             ("model_state", "optimizer_staging"), ("optimizer",), in_model=False,
             under_graph=False),
)


def settings_by_name() -> Dict[str, Type[Settings]]:
    """``{record name: settings class}`` in registry order."""
    return {op.name: op.settings for op in OPERATORS}


def model_settings() -> Tuple[Type[Settings], ...]:
    """The settings classes whose fields the model config inherits."""
    return tuple(op.settings for op in OPERATORS if op.in_model)

