"""The MoE of DeepSeek-V3 that GLM-4.5 shares (``glm4_moe``, ``deepseek_v3``): the first
``first_k_dense_replace`` layers dense, the others sigmoid-routed with the expert bias
``e_score_correction_bias`` (selection only), group-limited routing (``n_group``,
``topk_group``), the chosen weights renormalized and scaled by ``routed_scaling_factor``, and
``n_shared_experts`` shared experts.

The multi-token-prediction layers a checkpoint may carry after the last layer
(``num_nextn_predict_layers``) are not part of the model transformers builds, and are skipped.
"""

from __future__ import annotations

import re
from typing import Optional

import megatron.bounded.convert.core as core

NAMES = core.DecoderNames(expert_bias="mlp.gate.e_score_correction_bias",
                          shared_expert="mlp.shared_experts")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_routing(config: core.HFConfig) -> None:
    config.require("norm_topk_prob", (True,), default=True,
                   why=": megatron-core renormalizes sigmoid scores over the k chosen")
    config.require("scoring_func", ("sigmoid",), default="sigmoid")
    config.require("topk_method", ("noaux_tc",), default="noaux_tc",
                   why=" (the expert bias selects, the sigmoid scores weigh)")
    if config["num_experts_per_tok"] < 2:
        raise core.refuse("num_experts_per_tok = 1 with sigmoid routing (transformers "
                          "renormalizes the one weight to 1, megatron-core keeps the score)",
                          "convert a model that routes to at least two experts")
    groups, chosen = config.get("n_group", 1), config.get("topk_group", 1)
    if groups > 1 and config["num_experts_per_tok"] // chosen != 2:
        raise core.refuse(
            f"n_group = {groups}, topk_group = {chosen}, num_experts_per_tok = "
            f"{config['num_experts_per_tok']}: transformers ranks groups by their top-2 scores, "
            "megatron-core by their top num_experts_per_tok / topk_group",
            "these agree only when num_experts_per_tok / topk_group = 2 (or n_group = 1)")


def first_dense_layers(config: core.HFConfig) -> set:
    """The dense layers of ``glm4_moe`` and ``deepseek_v3``: the first ``first_k_dense_replace``."""
    return set(range(config.get("first_k_dense_replace", 0)))


def flags(config: core.HFConfig, dense_layers: Optional[set] = None) -> list:
    """The MoE flags (experts, routing, shared experts, dense layers: ``dense_layers``, by
    default :func:`first_dense_layers`)."""
    _check_routing(config)
    extra = ["--num-experts", config["n_routed_experts"],
             "--moe-ffn-hidden-size", config["moe_intermediate_size"],
             "--ffn-hidden-size", config["intermediate_size"],
             "--moe-router-topk", config["num_experts_per_tok"],
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-topk-scaling-factor", config.get("routed_scaling_factor", 1.0),
             "--moe-router-load-balancing-type", "none", "--moe-router-dtype", "fp32"]
    if config.get("n_group", 1) > 1:
        extra += ["--moe-router-num-groups", config["n_group"],
                  "--moe-router-group-topk", config["topk_group"]]
    if config.get("n_shared_experts", 0):
        extra += ["--moe-shared-expert-intermediate-size",
                  config["n_shared_experts"] * config["moe_intermediate_size"]]
    dense = first_dense_layers(config) if dense_layers is None else dense_layers
    extra += core.moe_layer_pattern(dense, config["num_hidden_layers"])
    return [str(flag) for flag in extra]


def mlp_rules(config: core.HFConfig, layer: int, fused_norm: bool = True,
              dense_layers: Optional[set] = None) -> list:
    """Layer ``layer``'s dense MLP or MoE (``fused_norm``: see ``core.mlp_norm_rule``;
    ``dense_layers``: as for :func:`flags`)."""
    if layer in (first_dense_layers(config) if dense_layers is None else dense_layers):
        return core.dense_mlp_rules(layer, NAMES, fused_norm)
    names = NAMES if config.get("n_shared_experts", 0) else core.DecoderNames(
        expert_bias=NAMES.expert_bias)
    return core.moe_rules(layer, names, config["n_routed_experts"], fused_norm)


def skipped(config: core.HFConfig, name: str) -> Optional[str]:
    """The multi-token-prediction layers (indices from ``num_hidden_layers`` on)."""
    match = _LAYER.match(name)
    if match and int(match.group(1)) >= config["num_hidden_layers"]:
        return ("the multi-token-prediction layers (model.layers.N from num_hidden_layers on, "
                "which transformers does not build)")
    return None
