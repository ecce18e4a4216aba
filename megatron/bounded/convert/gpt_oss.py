"""gpt-oss (``model_type`` ``gpt_oss``): grouped-query attention with biases on Q, K, V and O,
a learnable sink logit per head (``self_attn.sinks`` -> upstream's ``softmax_offset``), a
sliding window on the layers ``layer_types`` marks ``sliding_attention`` (``sliding_window``
keys: ``--window-size sliding_window - 1,0``), plain or YaRN rotary embeddings; every layer a
softmax top-k MoE (top k of the router's logits, with its bias, softmax over the k) of experts
with biases and the clamped quick-GeGLU ``(clamp(up, ±limit) + 1) · g · sigmoid(1.702 g)``,
``g = clamp(gate, max=limit)``.

The experts are stored fused: ``gate_up_proj`` ``[E, hidden, 2F]`` with gate and up columns
interleaved (gate at even columns), ``down_proj`` ``[E, F, hidden]``, and their biases; ours are
megatron-core's ``[E, 2F, hidden]`` (gate rows, then up rows) and ``[E, hidden, F]``. This
project's grouped experts have no biases: the flags select upstream's experts
(``--bounded-moe-backend upstream``). The MXFP4 release's experts (``*_blocks`` / ``*_scales``)
read as these tensors, dequantized (:mod:`megatron.bounded.convert.quantized`).
"""

from __future__ import annotations

import torch

import megatron.bounded.convert.core as core

MODEL_TYPE = "gpt_oss"
QUICK_GELU_ALPHA = 1.702  # the constant of megatron-core's quick_gelu
SLIDING, FULL = "sliding_attention", "full_attention"


def _check(config: core.HFConfig) -> None:
    config.require("attention_bias", (True,), default=True,
                   why=": --add-bias-linear gives every linear layer a bias")
    config.require("swiglu_alpha", (QUICK_GELU_ALPHA,), default=QUICK_GELU_ALPHA,
                   why=", megatron-core's quick-GeGLU constant")


def _window_flags(config: core.HFConfig) -> list:
    layer_types = list(config.get("layer_types") or [FULL] * config["num_hidden_layers"])
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise core.refuse(f"layer_types has {unknown[0]!r}", f"only {SLIDING!r} and {FULL!r} "
                          "layers are mapped")
    if SLIDING not in layer_types:
        return []
    pattern = "[" + ",".join("1" if kind == SLIDING else "0" for kind in layer_types) + "]"
    return ["--window-size", f"{config['sliding_window'] - 1},0",
            "--window-attn-skip-freq", pattern]


def _position_flags(config: core.HFConfig) -> list:
    kind, theta, partial = config.rope(kinds=("default", "yarn"))
    if partial != 1.0:
        raise core.refuse(f"partial_rotary_factor = {partial}", "the gpt-oss mapping rotates "
                          "whole heads")
    if kind == "default":
        return core.rope_flags(config)
    yarn = core.yarn(config)
    return ["--position-embedding-type", "yarn", "--rotary-base", int(theta),
            "--rotary-scaling-factor", yarn.factor,
            "--yarn-original-max-position-embeddings", yarn.original_max_positions,
            "--yarn-beta-fast", yarn.beta_fast, "--yarn-beta-slow", yarn.beta_slow,
            "--mscale", yarn.mscale, "--mscale-all-dim", yarn.mscale_all_dim,
            "--yarn-correction-range-round-to-int" if yarn.round_to_int
            else "--no-yarn-correction-range-round-to-int"]


def flags(config: core.HFConfig) -> list:
    _check(config)
    attention = (_position_flags(config) + core.gqa_flags(config, qk_norm=False, qkv_bias=False)
                 + _window_flags(config) + ["--softmax-type", "learnable"])
    # --no-bias-gelu-fusion: megatron-core's fused quick-GeGLU clamps before adding the bias,
    # gpt-oss (and megatron-core's unfused path) after
    mlp = ["--quick-geglu", "--glu-linear-offset", 1.0, "--no-bias-gelu-fusion",
           "--activation-func-clamp-value", config["swiglu_limit"],
           "--num-experts", config["num_local_experts"],
           "--moe-ffn-hidden-size", config["intermediate_size"],
           "--ffn-hidden-size", config["intermediate_size"],
           "--moe-router-topk", config["num_experts_per_tok"],
           "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", config.get("router_aux_loss_coef", 0.0),
           "--bounded-moe-backend", "upstream"]
    return core.decoder_flags(config, attention=attention, mlp=mlp)


def _deinterleaved(key: str, hf_name: str) -> core.Rule:
    """Ours ``[E, 2F(, hidden)]`` (gate rows, then up rows) from the fused ``[E(, hidden), 2F]``
    whose last dimension alternates gate and up."""

    def join(tensors):
        fused = tensors[0]
        ours = torch.cat([fused[..., 0::2], fused[..., 1::2]], dim=-1)
        return ours.transpose(1, 2) if ours.dim() == 3 else ours

    def split(tensor):
        fused = tensor.transpose(1, 2) if tensor.dim() == 3 else tensor
        gate, up = fused.chunk(2, dim=-1)
        return [torch.stack([gate, up], dim=-1).flatten(-2)]

    return core.Rule(key, (hf_name,), join, split)


def _transposed(key: str, hf_name: str) -> core.Rule:
    return core.Rule(key, (hf_name,), lambda tensors: tensors[0].transpose(1, 2),
                     lambda tensor: [tensor.transpose(1, 2)])


def _layer_rules(config: core.HFConfig, layer: int) -> list:
    ours, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    experts = f"{ours}mlp.experts.experts."
    return core.attention_rules(config, layer, qk_norm=False, qkv_bias=True) + [
        core.same(f"{ours}self_attention.linear_proj.bias", f"{hf}self_attn.o_proj.bias"),
        core.same(f"{ours}self_attention.core_attention.softmax_offset", f"{hf}self_attn.sinks"),
        core.same(f"{ours}mlp.linear_fc1.layer_norm_weight", f"{hf}post_attention_layernorm.weight"),
        core.same(f"{ours}mlp.router.weight", f"{hf}mlp.router.weight"),
        core.same(f"{ours}mlp.router.bias", f"{hf}mlp.router.bias"),
        _deinterleaved(f"{experts}linear_fc1.weight", f"{hf}mlp.experts.gate_up_proj"),
        _deinterleaved(f"{experts}linear_fc1.bias", f"{hf}mlp.experts.gate_up_proj_bias"),
        _transposed(f"{experts}linear_fc2.weight", f"{hf}mlp.experts.down_proj"),
        core.same(f"{experts}linear_fc2.bias", f"{hf}mlp.experts.down_proj_bias"),
    ]


def rules(config: core.HFConfig) -> list:
    return core.model_rules(config, lambda i: _layer_rules(config, i))
