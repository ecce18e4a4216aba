"""GLM-4.5-style MoE (``model_type`` ``glm4_moe``): grouped-query attention with bias on Q, K and
V (``attention_bias``), optional RMSNorm on query and key heads (``use_qk_norm``), rotary
embedding on part of each head (``partial_rotary_factor``); the MoE of DeepSeek-V3
(:mod:`megatron.bounded.convert.sigmoid_moe`: first layers dense, sigmoid routing with expert
bias and groups, shared experts; the multi-token-prediction layers skipped)."""

from __future__ import annotations

import megatron.bounded.convert.core as core
from megatron.bounded.convert import sigmoid_moe

MODEL_TYPE = "glm4_moe"
skipped = sigmoid_moe.skipped


def _attention(config: core.HFConfig) -> dict:
    return dict(qk_norm=bool(config.get("use_qk_norm", False)),
                qkv_bias=bool(config.get("attention_bias", False)))


def flags(config: core.HFConfig) -> list:
    attention = core.rope_flags(config) + core.gqa_flags(config, **_attention(config))
    return core.decoder_flags(config, attention=attention,
                              mlp=core.swiglu_flags(config)) + sigmoid_moe.flags(config)


def rules(config: core.HFConfig) -> list:
    def layer(i):
        return (core.attention_rules(config, i, **_attention(config))
                + sigmoid_moe.mlp_rules(config, i))

    return core.model_rules(config, layer)
