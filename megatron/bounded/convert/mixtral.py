"""Mixtral (``model_type`` ``mixtral``): grouped-query attention, every layer a softmax top-k MoE
(the k chosen renormalized: megatron-core's softmax after top-k), experts ``w1`` (gate), ``w3``
(up), ``w2`` (down), no shared expert."""

from __future__ import annotations

import megatron.bounded.convert.core as core

MODEL_TYPE = "mixtral"
NAMES = core.DecoderNames(router="block_sparse_moe.gate.weight",
                          expert="block_sparse_moe.experts.{e}.{proj}.weight",
                          gate="w1", up="w3", down="w2")


def flags(config: core.HFConfig) -> list:
    config.require("sliding_window", (None,), default=None,
                   why=" (sliding-window attention is not mapped)")
    config.require("router_jitter_noise", (0, 0.0, None), default=0.0)
    extra = ["--num-experts", config["num_local_experts"],
             "--moe-ffn-hidden-size", config["intermediate_size"],
             "--ffn-hidden-size", config["intermediate_size"],
             "--moe-router-topk", config["num_experts_per_tok"],
             "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", config.get("router_aux_loss_coef", 0.0)]
    attention = core.rope_flags(config) + core.gqa_flags(config, qk_norm=False, qkv_bias=False)
    return core.decoder_flags(config, attention=attention, mlp=core.swiglu_flags(config)) + [
        str(flag) for flag in extra]


def rules(config: core.HFConfig) -> list:
    def layer(i):
        return (core.attention_rules(config, i, qk_norm=False, qkv_bias=False)
                + core.moe_rules(i, NAMES, config["num_local_experts"]))

    return core.model_rules(config, layer)
