"""DeepSeek-V3 (``model_type`` ``deepseek_v3``): multi-latent attention and the sigmoid-routed
MoE of :mod:`megatron.bounded.convert.sigmoid_moe` (first layers dense, expert bias, groups,
routed scaling factor, shared experts; the multi-token-prediction layers skipped).

Upstream's ``MLASelfAttention`` (local spec) keeps DeepSeek's layouts, so every attention tensor
maps as it is: ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``,
``q_b_proj`` -> ``linear_q_up_proj`` (per head: the ``qk_nope_head_dim`` rows, then the
``qk_rope_head_dim`` rows), ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj`` (the
``kv_lora_rank`` latent rows, then the shared rope rows), ``kv_a_layernorm`` -> ``kv_layernorm``,
``kv_b_proj`` -> ``linear_kv_up_proj`` (per head: k-nope rows, then v rows), ``o_proj`` ->
``linear_proj``; the layer norms are the layer's ``input_layernorm`` and ``pre_mlp_layernorm``.
transformers' ``rope_interleave`` (pairs of adjacent dimensions rotated together) is what
megatron-core's rotary embedding does for multi-latent attention (it takes the even, then the odd
dimensions), so the rope rows need no permutation.
"""

from __future__ import annotations

import megatron.bounded.convert.core as core
from megatron.bounded.convert import sigmoid_moe

MODEL_TYPE = "deepseek_v3"
skipped = sigmoid_moe.skipped
# transformers' q_a_layernorm and kv_a_layernorm use this epsilon whatever rms_norm_eps says;
# megatron-core's latent norms use --norm-epsilon.
LATENT_NORM_EPSILON = 1e-6
# what megatron-core's MLA config takes for YaRN without a flag for it
MLA_YARN_FIXED = {"original_max_positions": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                  "round_to_int": True}


def _check(config: core.HFConfig) -> None:
    if not config.get("q_lora_rank"):
        raise core.refuse("q_lora_rank = null (queries projected from the hidden state): with "
                          "--qk-layernorm our query projection normalizes its input, "
                          "transformers' q_proj does not", "convert a model with a query latent")
    config.require("rms_norm_eps", (LATENT_NORM_EPSILON,),
                   why=", the epsilon of transformers' latent norms")
    config.require("attention_bias", (False,), default=False)
    config.require("rope_interleave", (True,), default=True,
                   why=": megatron-core's MLA rotates adjacent pairs")
    heads = config["num_attention_heads"]
    config.require("num_key_value_heads", (heads,), default=heads)


def _position_flags(config: core.HFConfig) -> list:
    kind, theta, partial = config.rope(kinds=("default", "yarn"))
    if partial != 1.0:
        raise core.refuse(f"partial_rotary_factor = {partial}", "MLA rotates qk_rope_head_dim")
    flags = ["--position-embedding-type", "rope", "--rotary-base", int(theta)]
    if kind == "default":
        return flags + ["--rope-type", "rope"]
    yarn = core.yarn(config)
    for field, fixed in MLA_YARN_FIXED.items():
        if getattr(yarn, field) != fixed:
            raise core.refuse(f"YaRN with {field} = {getattr(yarn, field)} (megatron-core's "
                              f"multi-latent attention takes {fixed}, with no flag)",
                              "convert a model with megatron-core's value")
    return flags + ["--rope-type", "yarn", "--rotary-scaling-factor", yarn.factor,
                    "--mscale", yarn.mscale, "--mscale-all-dim", yarn.mscale_all_dim]


def mla_flags(config: core.HFConfig) -> list:
    """The multi-latent attention flags (with its rotary embedding)."""
    _check(config)
    return ["--multi-latent-attention", "--q-lora-rank", config["q_lora_rank"],
            "--kv-lora-rank", config["kv_lora_rank"],
            "--qk-head-dim", config["qk_nope_head_dim"],
            "--qk-pos-emb-head-dim", config["qk_rope_head_dim"],
            "--v-head-dim", config["v_head_dim"], "--qk-layernorm", *_position_flags(config)]


def flags(config: core.HFConfig) -> list:
    return core.decoder_flags(config, attention=mla_flags(config),
                              mlp=core.swiglu_flags(config)) + sigmoid_moe.flags(config)


def attention_rules(layer: int) -> list:
    """Layer ``layer``'s input norm and multi-latent attention tensors."""
    ours, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    pairs = (("input_layernorm", "input_layernorm"),
             ("self_attention.linear_q_down_proj", "self_attn.q_a_proj"),
             ("self_attention.q_layernorm", "self_attn.q_a_layernorm"),
             ("self_attention.linear_q_up_proj", "self_attn.q_b_proj"),
             ("self_attention.linear_kv_down_proj", "self_attn.kv_a_proj_with_mqa"),
             ("self_attention.kv_layernorm", "self_attn.kv_a_layernorm"),
             ("self_attention.linear_kv_up_proj", "self_attn.kv_b_proj"),
             ("self_attention.linear_proj", "self_attn.o_proj"))
    return [core.same(f"{ours}{mine}.weight", f"{hf}{theirs}.weight") for mine, theirs in pairs]


def rules(config: core.HFConfig) -> list:
    return core.model_rules(config, lambda i: attention_rules(i)
                            + sigmoid_moe.mlp_rules(config, i, fused_norm=False))
