"""Upstream's selective recompute (``--recompute-granularity selective --recompute-modules ...``)
in the layers of the local implementation: what recomputes each module, and the modules refused.

The layers this project builds are upstream's classes or subclasses of them, so each module runs
through upstream's own code:

* ``core_attn``: upstream's attention checkpoints its core attention (SDPA here) and runs it
  again in backward from q, k and v;
* ``layernorm``: upstream's ``TransformerLayer`` runs the input and pre-MLP norms under its
  output-discarding checkpoint: their outputs are freed once the attention and the MLP have run,
  and computed again from the norms' inputs in backward (megatron-core 0.19.2 needs the patch
  ``checkpoint-without-output-fp8-off-without-te`` without Transformer Engine);
* ``mla_up_proj``: upstream's ``MLASelfAttention``, which ``BoundedMLASelfAttention`` is, runs the
  query and key/value up-projections and the rotary embedding under the same checkpoint: q, k and
  v are freed after the core attention and computed again from the latents in backward;
* ``moe_act``: the grouped experts of the torch-native backend save only their input rows and
  fc1 output and compute the activation again in every backward, asked or not
  (``megatron.bounded.moe.experts``); upstream's ``SequentialMLP``, which the local
  implementation builds on upstream's backend, saves the activation: refused there;
* ``mlp``: upstream's ``TransformerLayer`` checkpoints the MLP of a dense layer;
* ``moe``: upstream's ``MoELayer`` (``BoundedMoELayer``) checkpoints the whole layer: router,
  dispatch, experts, shared experts, combine;
* ``shared_experts``: upstream's ``MoELayer`` checkpoints its shared experts.

A module the model has no part for (``mlp`` without a dense layer, ``moe``, ``moe_act`` or
``shared_experts`` without MoE layers or shared experts, ``mla_up_proj`` without multi-latent
attention) would be ignored: :func:`check_selective_recompute` refuses it, naming the module.
Modules named without selective recompute are refused with upstream's flags
(``megatron.bounded.launch.upstream_checks``). The memory budget counts what each module saves
(``megatron.bounded.budget.widths.selective_savings``).
"""

from __future__ import annotations

from typing import Tuple

from megatron.bounded.moe.backend import (
    moe_layer_pattern,
    select_moe_backend,
    upstream_static_capacity_available,
)
from megatron.bounded.settings import BoundedArgumentError, flag_name

__all__ = ["MLA_RECOMPUTE_MODULES", "check_selective_recompute", "selected_modules"]

# The modules upstream allows only with multi-latent attention.
MLA_RECOMPUTE_MODULES = frozenset({"mla_up_proj"})


def selected_modules(config) -> Tuple[str, ...]:
    """The modules selective recompute runs for ``config`` (a model config, or flags after
    upstream's validation), read as upstream reads them: ``core_attn`` when none are named,
    ``moe`` added by ``--moe-layer-recompute``; () without selective recompute."""
    granularity = getattr(config, "recompute_granularity", None)
    layer_recompute = bool(getattr(config, "moe_layer_recompute", False))
    if granularity != "selective" and not (layer_recompute and granularity is None):
        return ()
    modules = getattr(config, "recompute_modules", None)
    modules = ["core_attn"] if modules is None else list(modules)
    if layer_recompute:
        modules.append("moe")
    return tuple(dict.fromkeys(modules))


def check_selective_recompute(config) -> None:
    """Refuse the selected modules that would change nothing in the layers of the local
    implementation (on parsed flags or a model config; the messages name the flags)."""
    modules = selected_modules(config)
    if not modules or getattr(config, "transformer_impl", "local") != "local":
        return  # Transformer Engine's layers are upstream's, which apply every module
    experts = getattr(config, "num_moe_experts", getattr(config, "num_experts", None))
    pattern = moe_layer_pattern(getattr(config, "moe_layer_freq", 1), config.num_layers, experts)
    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    missing = {
        "mla_up_proj": (not getattr(config, "multi_latent_attention", False), "the model has "
                        f"no multi-latent attention ({flag_name('multi_latent_attention')})"),
        "mlp": (all(pattern), "every layer is a MoE layer ('moe' recomputes those, 'moe_act' "
                              "their experts' activation)"),
        "moe": (not any(pattern), f"the model has no MoE layer ({flag_name('num_experts')})"),
        "moe_act": (not any(pattern), f"the model has no MoE layer ({flag_name('num_experts')})"),
        "shared_experts": (not any(pattern) or not shared, "the model has no shared experts "
                           f"({flag_name('moe_shared_expert_intermediate_size')})"),
    }
    for module in modules:
        absent, why = missing.get(module, (False, ""))
        if absent:
            raise BoundedArgumentError(
                f"{flag_name('recompute_modules')} {module} would recompute nothing: {why}. Remove "
                f"{module} from {flag_name('recompute_modules')}.")
    if "moe_act" in modules and select_moe_backend(config) == "upstream" \
            and not upstream_static_capacity_available(config):
        raise BoundedArgumentError(
            f"{flag_name('recompute_modules')} moe_act: upstream's experts of the local "
            "implementation (SequentialMLP) keep their activation for backward and have no "
            "recompute of it; the torch-native backend's grouped experts always recompute it. "
            f"Use {flag_name('bounded_moe_backend')} torch (or auto with {flag_name('moe_grouped_gemm')}), "
            f"or remove moe_act from {flag_name('recompute_modules')}.")
