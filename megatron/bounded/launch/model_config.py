"""The model of a parsed command line: upstream's ``GPTModelConfig`` with our transformer config
class and layer spec, as ``pretrain_gpt.py`` builds it and ``bounded-convert-hf`` builds the same
model to lay out and verify a checkpoint."""

from __future__ import annotations

from megatron.training.argument_utils import gpt_config_from_args

from megatron.bounded.launch.arguments import RunSettings
from megatron.bounded.loss.ring_dtp import shard_output_layer
from megatron.bounded.model.specs import bounded_decoder_spec


def build_model_config(args, settings: RunSettings):
    """``GPTModelConfig`` with our transformer config class (``BoundedMLATransformerConfig`` with
    multi-latent attention; settings fields taken from ``settings``) and layer spec."""
    transformer_config = settings.transformer_config(args)
    model_config = gpt_config_from_args(args, config=transformer_config)
    if args.spec is None:
        model_config.transformer_layer_spec = bounded_decoder_spec
    if settings.ring_dtp.enabled:
        model_config.pre_wrap_hooks.append(shard_output_layer)
    return model_config
