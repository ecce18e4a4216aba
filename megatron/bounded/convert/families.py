"""The registry of model families: ``model_type`` of a ``config.json`` -> its module, and the
``model_type`` names of models that are another family's architecture under their own name."""

from __future__ import annotations

from typing import Iterable, Optional

from megatron.bounded.convert import (
    deepseek_v3, deepseek_v32, glm4_moe, gpt_oss, mixtral, qwen3_5_moe, qwen3_5_moe_text,
    qwen3_moe, qwen3_next,
)
from megatron.bounded.convert.core import HFConfig, refuse

FAMILIES = {family.MODEL_TYPE: family for family in (
    qwen3_moe, mixtral, glm4_moe, gpt_oss, deepseek_v3, deepseek_v32, qwen3_next, qwen3_5_moe,
    qwen3_5_moe_text)}
# model_type -> (the family whose layout it has, the transformers class its config names, the
# family's name in words)
ALIASES = {"kimi_k2": (deepseek_v3.MODEL_TYPE, "DeepseekV3ForCausalLM", "DeepSeek-V3")}


def family_type(config: dict) -> str:
    """The family's ``model_type`` of a ``config.json``; refuses one not mapped."""
    model_type = config.get("model_type")
    if model_type in ALIASES:
        family, architecture, _ = ALIASES[model_type]
        named = config.get("architectures") or [architecture]
        if architecture not in named:
            raise refuse(f"config.json's model_type {model_type!r} with architectures {named} "
                         f"(the {family} mapping takes {model_type!r} models of "
                         f"{architecture})", f"convert a model whose config names {architecture}")
        return family
    if model_type not in FAMILIES:
        supported = ", ".join(sorted([*FAMILIES, *ALIASES]))
        what = ("config.json has no model_type" if model_type is None
                else f"model_type {model_type!r} is not supported")
        raise refuse(f"{what} (supported: {supported})", "convert a model of a supported "
                     "family, or add a module for it in megatron/bounded/convert/")
    return model_type


def _whole_file(config: dict) -> tuple:
    return config, "config.json"


def family_for(config: dict, stored: Iterable[str] = ()):
    """(family module, HFConfig) of a ``config.json`` whose files hold the tensors ``stored``;
    refuses a ``model_type`` not mapped. The HFConfig holds the decoder's fields: the family's
    ``decoder_config(config)`` (a vision-language model's text section), else the whole file."""
    family = FAMILIES[family_type(config)]
    values, source = getattr(family, "decoder_config", _whole_file)(config)
    return family, HFConfig(values, family.MODEL_TYPE, source, stored)


def alias_note(config: dict) -> Optional[str]:
    """The line that says which family's layout an aliased ``model_type`` is converted with."""
    model_type = config.get("model_type")
    if model_type not in ALIASES:
        return None
    family, architecture, words = ALIASES[model_type]
    return (f"[convert] model_type {model_type!r} ({architecture}) maps to {words}'s layout: "
            f"converted with the {family} mapping")
