"""Qwen3.5-MoE's text model alone (``model_type`` ``qwen3_5_moe_text``: transformers'
``Qwen3_5MoeForCausalLM``, as ``AutoModelForCausalLM`` loads a release and ``save_pretrained``
writes it back): the config holds the decoder's fields, the tensors are named ``model.*`` and
``lm_head.weight``; otherwise the mapping of :mod:`megatron.bounded.convert.qwen3_5_moe`."""

from __future__ import annotations

import megatron.bounded.convert.core as core
from megatron.bounded.convert import qwen3_5_moe

MODEL_TYPE = "qwen3_5_moe_text"
flags = qwen3_5_moe.flags
skipped = qwen3_5_moe.skipped


def rules(config: core.HFConfig) -> list:
    return qwen3_5_moe.decoder_rules(config, "model.")
