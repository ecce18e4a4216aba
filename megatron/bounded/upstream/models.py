"""The model builder: the multi-token-prediction block built from this project's layer spec."""

from __future__ import annotations

import functools
from typing import Callable

from megatron.bounded.model.specs import bounded_decoder_spec, bounded_mtp_block_spec


def mtp_block_from_bounded_spec(original: Callable) -> Callable:
    """``megatron.training.models.gpt.mtp_block_spec``: upstream builds the MTP layers from its
    own layer specs whatever the model config's layer spec is, so a model whose decoder is
    :func:`bounded_decoder_spec` (local implementation) would get upstream's dot-product
    attention (s × s scores) and MoE layer in its MTP layers; the replacement builds them with
    :func:`bounded_mtp_block_spec`. Any other model config keeps upstream's MTP spec."""

    @functools.wraps(original)
    def mtp_block_spec(config, transformer_layer_spec, vp_stage=None):
        if (config.transformer_layer_spec is bounded_decoder_spec
                and config.transformer.transformer_impl == "local"
                and config.transformer.mtp_num_layers is not None):
            return bounded_mtp_block_spec(config, vp_stage)
        return original(config, transformer_layer_spec, vp_stage=vp_stage)

    return mtp_block_spec
