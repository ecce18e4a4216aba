"""Qwen3-Next (``model_type`` ``qwen3_next``): gated DeltaNet layers (``linear_attention`` in
``layer_types``) between full-attention layers, every norm zero-centred, a sparse MoE with a
gated shared expert.

* the pattern: ``--experimental-attention-variant gated_delta_net --linear-attention-freq``,
  one entry per layer of ``layer_types`` (1: ``linear_attention``, 0: ``full_attention``);
* transformers' norms (but the gated output norm of the DeltaNet layers) are Gemma's,
  ``x · (1 + w)``: megatron-core's ``--apply-layernorm-1p``, the same weights;
* full attention: grouped-query attention with RMSNorm on each query and key head, rotary
  embedding on ``partial_rotary_factor`` of each head (a quarter where the config does not say,
  as in transformers), and an output gate (``--attention-output-gate``): ``q_proj`` holds each
  head's query rows then its gate's;
* gated DeltaNet (:class:`megatron.bounded.attention.gated_delta_net.BoundedGatedDeltaNet`,
  upstream's names): ``in_proj_qkvz`` (per key head: q, k, then the v and z of the value heads
  it serves) and ``in_proj_ba`` (per key head: β, then α of those value heads) are ``in_proj``'s
  sections ``[q, k, v, z, β, α]`` (:func:`join_in_proj`); the input norm is ``in_proj``'s
  ``layer_norm_weight``; ``conv1d``, ``dt_bias``, ``A_log``, ``out_proj`` as they are; the gated
  output norm multiplies by its weight w, ours (zero-centred) by 1 + w: ``out_norm`` holds
  w − 1 (:func:`norm_shift_rule`);
* the MoE of Qwen3-MoE (softmax top-k, renormalized with ``norm_topk_prob``, dense layers of
  ``mlp_only_layers`` / ``decoder_sparse_step``) with ``shared_expert`` and its sigmoid gate
  ``shared_expert_gate`` (``--moe-shared-expert-gate``);
* the multi-token-prediction weights (``mtp.*``), which transformers does not build, are skipped.

Qwen3.5-MoE (:mod:`megatron.bounded.convert.qwen3_5_moe`) has these layers with the DeltaNet's
input projections stored otherwise: :func:`mixer_flags`, :func:`mixer_rules` (which takes the
family's rule of ``in_proj``), :func:`shared_expert_moe_flags` and
:func:`shared_expert_moe_rules` serve both.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

import megatron.bounded.convert.core as core
from megatron.bounded.convert import qwen3_moe

MODEL_TYPE = "qwen3_next"
LAYER_TYPES = {"linear_attention": 1, "full_attention": 0}
NAMES = core.DecoderNames(shared_expert="mlp.shared_expert")
# transformers' configs of Qwen3-Next and Qwen3.5 rotate a quarter of each head when they do
# not say
PARTIAL_ROTARY_DEFAULT = 0.25
MULTI_TOKEN_PREDICTION = "the multi-token-prediction module (mtp.*, which transformers ignores)"


def gdn_shape(config: core.HFConfig) -> dict:
    return dict(key_heads=config["linear_num_key_heads"],
                value_heads=config["linear_num_value_heads"],
                key_dim=config["linear_key_head_dim"], value_dim=config["linear_value_head_dim"])


def _sections(key_heads, value_heads, key_dim, value_dim) -> tuple:
    """Per key head: the widths of q, k, v, z (of in_proj_qkvz) and of β, α (of in_proj_ba)."""
    ratio = value_heads // key_heads
    return (key_dim, key_dim, ratio * value_dim, ratio * value_dim), (ratio, ratio)


def join_in_proj(qkvz: torch.Tensor, ba: torch.Tensor, *, key_heads: int, value_heads: int,
                 key_dim: int, value_dim: int) -> torch.Tensor:
    """``in_proj`` (rows ``[q, k, v, z, β, α]``, each head after head) from transformers'
    ``in_proj_qkvz`` and ``in_proj_ba`` (rows grouped by key head)."""
    qkvz_widths, ba_widths = _sections(key_heads, value_heads, key_dim, value_dim)
    rest = qkvz.shape[1:]
    parts = (torch.split(qkvz.reshape(key_heads, sum(qkvz_widths), *rest), qkvz_widths, 1)
             + torch.split(ba.reshape(key_heads, sum(ba_widths), *rest), ba_widths, 1))
    return torch.cat([part.reshape(-1, *rest) for part in parts])


def split_in_proj(weight: torch.Tensor, *, key_heads: int, value_heads: int, key_dim: int,
                  value_dim: int) -> list:
    """[in_proj_qkvz, in_proj_ba] of ``in_proj`` (the inverse of :func:`join_in_proj`)."""
    qkvz_widths, ba_widths = _sections(key_heads, value_heads, key_dim, value_dim)
    widths = [key_heads * width for width in (*qkvz_widths, *ba_widths)]
    rest = weight.shape[1:]
    parts = [part.reshape(key_heads, -1, *rest) for part in torch.split(weight, widths)]
    return [torch.cat(parts[:4], 1).reshape(-1, *rest), torch.cat(parts[4:], 1).reshape(-1, *rest)]


def norm_shift_rule(key: str, hf_name: str) -> core.Rule:
    """A norm transformers applies as ``w`` and ours as ``1 + w``: ours is ``w − 1``, computed in
    fp32, where it is exact for every bf16 or fp16 weight (and for fp32 ones in [0.5, 2]), so the
    export's ``(w − 1) + 1`` is ``w`` again; a weight it is not exact for is refused by name."""

    def check(tensors):
        weight = tensors[0]
        if not torch.equal((weight.float() - 1 + 1).to(weight.dtype), weight):
            raise core.refuse(f"{hf_name} has values that w - 1 (our zero-centred norm's weight) "
                              "does not hold exactly in fp32",
                              "convert a model whose gated norm weights are in bf16 or fp16")

    def join(tensors):
        return tensors[0].float() - 1

    def split(tensor):
        return [tensor.float() + 1]

    return core.Rule(key, (hf_name,), join, split, check)


def layer_pattern(config: core.HFConfig) -> list:
    """1 for each gated DeltaNet layer, 0 for each full-attention one (``layer_types``)."""
    types = config["layer_types"]
    unknown = sorted({kind for kind in types if kind not in LAYER_TYPES})
    if unknown or len(types) != config["num_hidden_layers"]:
        raise core.refuse(f"config.json's layer_types {types} (the {config.family} mapping takes "
                          f"one of {sorted(LAYER_TYPES)} per layer)",
                          "convert a model whose layer_types lists every layer")
    return [LAYER_TYPES[kind] for kind in types]


def mixer_flags(config: core.HFConfig) -> list:
    """The token mixers: gated DeltaNet layers where ``layer_types`` says ``linear_attention``,
    gated full attention (partial rotary, norms on query and key heads) elsewhere, every norm
    zero-centred."""
    config.require("attention_bias", (False,), default=False)
    pattern = "[" + ",".join(str(kind) for kind in layer_pattern(config)) + "]"
    shape = gdn_shape(config)
    if shape["value_heads"] % shape["key_heads"]:
        raise core.refuse(f"linear_num_value_heads = {shape['value_heads']} is not a multiple of "
                          f"linear_num_key_heads = {shape['key_heads']}",
                          "convert a model whose value heads share key heads evenly")
    gdn = ["--experimental-attention-variant", "gated_delta_net",
           "--linear-attention-freq", pattern,
           "--linear-conv-kernel-dim", config["linear_conv_kernel_dim"],
           "--linear-key-head-dim", shape["key_dim"], "--linear-value-head-dim",
           shape["value_dim"], "--linear-num-key-heads", shape["key_heads"],
           "--linear-num-value-heads", shape["value_heads"]]
    return (core.rope_flags(config, PARTIAL_ROTARY_DEFAULT)
            + core.gqa_flags(config, qk_norm=True, qkv_bias=False)
            + ["--attention-output-gate", "--apply-layernorm-1p", *gdn])


def shared_expert_moe_flags(config: core.HFConfig) -> list:
    """The routed experts (softmax top-k over ``num_experts``) and the shared expert with its
    sigmoid gate."""
    return ["--num-experts", config["num_experts"],
            "--moe-ffn-hidden-size", config["moe_intermediate_size"],
            "--moe-router-topk", config["num_experts_per_tok"],
            "--moe-shared-expert-intermediate-size", config["shared_expert_intermediate_size"],
            "--moe-shared-expert-gate",
            "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", config.get("router_aux_loss_coef", 0.0)]


def flags(config: core.HFConfig) -> list:
    moe = shared_expert_moe_flags(config) + ["--ffn-hidden-size", config["intermediate_size"]]
    if not config.get("norm_topk_prob", False):
        moe.append("--moe-router-pre-softmax")
    moe += core.moe_layer_pattern(qwen3_moe.dense_layers(config), config["num_hidden_layers"])
    return core.decoder_flags(config, attention=mixer_flags(config),
                              mlp=core.swiglu_flags(config)) + [str(flag) for flag in moe]


def grouped_in_proj(config: core.HFConfig, layer: int) -> core.Rule:
    """``in_proj`` of transformers' ``in_proj_qkvz`` and ``in_proj_ba`` (rows by key head)."""
    ours, hf = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.linear_attn."
    shape = gdn_shape(config)
    return core.Rule(
        f"{ours}in_proj.weight", (f"{hf}in_proj_qkvz.weight", f"{hf}in_proj_ba.weight"),
        lambda tensors: join_in_proj(*tensors, **shape),
        lambda tensor: split_in_proj(tensor, **shape))


def mixer_rules(config: core.HFConfig, layer: int,
                in_proj: Callable[[core.HFConfig, int], core.Rule]) -> list:
    """The token mixer of ``layer``: a gated DeltaNet (``in_proj``: the rule of its input
    projection, which the families store differently) or gated full attention."""
    if not layer_pattern(config)[layer]:
        return core.attention_rules(config, layer, qk_norm=True, qkv_bias=False, gated=True)
    ours, hf = f"decoder.layers.{layer}.self_attention.", f"model.layers.{layer}.linear_attn."
    return [core.same(f"{ours}in_proj.layer_norm_weight",
                      f"model.layers.{layer}.input_layernorm.weight"), in_proj(config, layer),
            *(core.same(f"{ours}{name}", f"{hf}{name}")
              for name in ("conv1d.weight", "dt_bias", "A_log", "out_proj.weight")),
            norm_shift_rule(f"{ours}out_norm.weight", f"{hf}norm.weight")]


def shared_expert_moe_rules(config: core.HFConfig, layer: int, names: core.DecoderNames) -> list:
    """A MoE layer's rules (the experts as ``names`` says) with its shared expert's gate."""
    gate = core.same(f"decoder.layers.{layer}.mlp.shared_experts.gate_weight",
                     f"model.layers.{layer}.mlp.shared_expert_gate.weight")
    return core.moe_rules(layer, names, config["num_experts"]) + [gate]


def rules(config: core.HFConfig) -> list:
    dense = qwen3_moe.dense_layers(config)

    def layer(i):
        mlp = (core.dense_mlp_rules(i, NAMES) if i in dense
               else shared_expert_moe_rules(config, i, NAMES))
        return mixer_rules(config, i, grouped_in_proj) + mlp

    return core.model_rules(config, layer)


def skipped(config: core.HFConfig, name: str) -> Optional[str]:
    """The multi-token-prediction weights (transformers ignores ``mtp.*``)."""
    return MULTI_TOKEN_PREDICTION if name.startswith("mtp.") else None
