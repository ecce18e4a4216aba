"""Qwen3.5-MoE (``model_type`` ``qwen3_5_moe``: transformers' vision-language
``Qwen3_5MoeForConditionalGeneration``, as the models are released): its text decoder, the layers
of Qwen3-Next (:mod:`megatron.bounded.convert.qwen3_next`: gated DeltaNet and gated full
attention as ``layer_types`` says, zero-centred norms, the gated shared expert), with

* the decoder's fields in ``text_config`` and its tensors under ``model.language_model.``
  (``lm_head.weight`` at the top); ``tie_word_embeddings`` must be the same at the top, which
  transformers' vision-language model follows, and in ``text_config``, which its text model
  (``AutoModelForCausalLM``, what ``verify`` runs) follows;
* the gated DeltaNet's input projections stored apart: ``in_proj_qkv`` (q, k, v), ``in_proj_z``,
  ``in_proj_b`` (β) and ``in_proj_a`` (α), each head after head, are ``in_proj``'s sections
  ``[q, k, v, z, β, α]`` one after another (:func:`separate_in_proj`);
* every layer a MoE layer, the top-k probabilities always renormalized (transformers' router
  divides by their sum whatever the config says): the plain top-k of megatron-core;
* the experts as the files store them, layer by layer: the release's two tensors
  ``mlp.experts.gate_up_proj`` ``[E, 2F, hidden]`` (each expert's gate rows, then its up rows,
  as our fc1) and ``mlp.experts.down_proj``, or one tensor per expert and projection
  (``mlp.experts.{e}.gate_proj.weight``, as transformers' ``save_pretrained`` writes them); the
  export writes them as they were imported;
* the multimodal rotary embedding (``mrope_section``, ``mrope_interleaved``) gives a text token
  the same position on its three axes (time, height, width), so each frequency turns by that
  position: megatron-core's rotary on ``partial_rotary_factor`` of each head (a quarter where
  the config does not say, as in transformers), exact for text; the positions of images and
  video have no counterpart in a text model;
* not converted, as a line of the import says: the vision tower (``model.visual.*``), which a
  text decoder does not use, and the multi-token-prediction module (``mtp.*``), which
  transformers ignores. The export writes the text decoder's tensors with the model's
  ``config.json``: ``AutoModelForCausalLM`` loads it; the vision-language class needs the vision
  tower's tensors of the release beside them.

:mod:`megatron.bounded.convert.qwen3_5_moe_text` maps the text model alone.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import megatron.bounded.convert.core as core
from megatron.bounded.convert import qwen3_next

MODEL_TYPE = "qwen3_5_moe"
DECODER = "model.language_model."  # where the vision-language model keeps the text decoder
FUSED_EXPERTS = dataclasses.replace(
    qwen3_next.NAMES, fused_experts=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
VISION_TOWER = "the vision tower (model.visual.*: only the text decoder is converted)"


def decoder_config(config: dict) -> tuple:
    """(the text decoder's fields, where they are): ``text_config``."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise core.refuse(f"config.json of this {MODEL_TYPE} model has no text_config (the text "
                          "decoder's fields)", "convert the model's own config.json")
    tied, text_tied = (bool(fields.get("tie_word_embeddings", False)) for fields in (config, text))
    if tied != text_tied:
        raise core.refuse(f"config.json sets tie_word_embeddings = {tied} and its text_config "
                          f"{text_tied}: transformers' vision-language model and its text model "
                          "would not have the same output layer",
                          "convert a config.json whose two values agree")
    return text, "config.json's text_config"


def flags(config: core.HFConfig) -> list:
    moe = qwen3_next.shared_expert_moe_flags(config)
    return core.decoder_flags(config, attention=qwen3_next.mixer_flags(config),
                              mlp=core.swiglu_flags(config)) + [str(flag) for flag in moe]


def separate_in_proj(config: core.HFConfig, layer: int) -> core.Rule:
    """``in_proj`` of transformers' ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and
    ``in_proj_a``: the same rows, one tensor after the other."""
    shape = qwen3_next.gdn_shape(config)
    key_rows = shape["key_heads"] * shape["key_dim"]
    value_rows = shape["value_heads"] * shape["value_dim"]
    hf = f"model.layers.{layer}.linear_attn."
    return core.concatenated(
        f"decoder.layers.{layer}.self_attention.in_proj.weight",
        [f"{hf}in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")],
        widths=(2 * key_rows + value_rows, value_rows, shape["value_heads"], shape["value_heads"]))


def _under(rule: core.Rule, decoder: str) -> core.Rule:
    """``rule`` with the names of the text decoder's tensors (``model.*``) under ``decoder``."""
    names = tuple(decoder + name[len("model."):] if name.startswith("model.") else name
                  for name in rule.hf_names)
    return dataclasses.replace(rule, hf_names=names)


def decoder_rules(config: core.HFConfig, decoder: str) -> list:
    """The rules of the text decoder whose tensors are named under ``decoder``."""

    def layer(i):
        fused = f"{decoder}layers.{i}.mlp.experts.gate_up_proj" in config.stored
        names = FUSED_EXPERTS if fused else qwen3_next.NAMES
        return (qwen3_next.mixer_rules(config, i, separate_in_proj)
                + qwen3_next.shared_expert_moe_rules(config, i, names))

    return [_under(rule, decoder) for rule in core.model_rules(config, layer)]


def rules(config: core.HFConfig) -> list:
    return decoder_rules(config, DECODER)


def skipped(config: core.HFConfig, name: str) -> Optional[str]:
    """The vision tower and the multi-token-prediction module."""
    return VISION_TOWER if name.startswith("model.visual.") else qwen3_next.skipped(config, name)
