"""Qwen3-MoE (``model_type`` ``qwen3_moe``): grouped-query attention with RMSNorm on each query
and key head, softmax top-k routing (renormalized over the k chosen with ``norm_topk_prob``,
otherwise the softmax over all experts: ``--moe-router-pre-softmax``), no shared expert; the
layers of ``mlp_only_layers`` and those ``decoder_sparse_step`` skips are dense."""

from __future__ import annotations

import megatron.bounded.convert.core as core

MODEL_TYPE = "qwen3_moe"
NAMES = core.DecoderNames()


def dense_layers(config: core.HFConfig) -> set:
    step = config.get("decoder_sparse_step", 1)
    only_mlp = set(config.get("mlp_only_layers", []))
    return {i for i in range(config["num_hidden_layers"])
            if i in only_mlp or (i + 1) % step != 0}


def flags(config: core.HFConfig) -> list:
    config.require("attention_bias", (False,), default=False,
                   why=" (its bias of o_proj has no counterpart)")
    config.require("use_sliding_window", (False,), default=False)
    extra = ["--num-experts", config.either("num_experts", "num_local_experts"),
             "--moe-ffn-hidden-size", config["moe_intermediate_size"],
             "--ffn-hidden-size", config["intermediate_size"],
             "--moe-router-topk", config["num_experts_per_tok"],
             "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", config.get("router_aux_loss_coef", 0.0)]
    if not config.get("norm_topk_prob", False):
        extra.append("--moe-router-pre-softmax")
    extra += core.moe_layer_pattern(dense_layers(config), config["num_hidden_layers"])
    attention = core.rope_flags(config) + core.gqa_flags(config, qk_norm=True, qkv_bias=False)
    return core.decoder_flags(config, attention=attention, mlp=core.swiglu_flags(config)) + [
        str(flag) for flag in extra]


def rules(config: core.HFConfig) -> list:
    dense = dense_layers(config)

    def layer(i):
        mlp = (core.dense_mlp_rules(i, NAMES) if i in dense
               else core.moe_rules(i, NAMES, config.either("num_experts", "num_local_experts")))
        return core.attention_rules(config, i, qk_norm=True, qkv_bias=False) + mlp

    return core.model_rules(config, layer)
