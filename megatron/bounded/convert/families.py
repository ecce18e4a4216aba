"""The registry of model families: ``model_type`` of a ``config.json`` -> its module."""

from __future__ import annotations

from megatron.bounded.convert import deepseek_v3, glm4_moe, gpt_oss, mixtral, qwen3_moe
from megatron.bounded.convert.core import HFConfig, refuse

FAMILIES = {family.MODEL_TYPE: family for family in (
    qwen3_moe, mixtral, glm4_moe, gpt_oss, deepseek_v3)}


def family_for(config: dict):
    """(family module, HFConfig) of a ``config.json``; refuses a ``model_type`` not mapped."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise refuse(f"model_type {model_type!r} is not supported (supported: "
                     f"{', '.join(sorted(FAMILIES))})", "convert a model of a supported family, "
                     "or add a module for it in megatron/bounded/convert/")
    return FAMILIES[model_type], HFConfig(config, model_type)

