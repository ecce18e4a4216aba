"""Layer specs of megatron-bounded models.

With ``--transformer-impl transformer_engine`` (needs Transformer Engine) or another non-local
implementation, upstream's default decoder spec is used unchanged. Otherwise (the default without TE) the spec is upstream's local
MoE/dense decoder spec with one substitution: core attention is
:class:`megatron.bounded.attention.core.SDPACoreAttention`, so long sequences never materialize the
s × s scores (with ``--multi-latent-attention`` upstream's local MLA layer, ``MLASelfAttention``,
whose ``core_attention`` slot is the same, as :class:`megatron.bounded.model.mla.BoundedMLASelfAttention`
for packed documents; with ``--experimental-attention-variant dsa`` its core attention is
DeepSeek sparse attention, :mod:`megatron.bounded.model.dsa`). MoE layers: when ``megatron.bounded.moe.backend.select_moe_backend`` picks the
torch-native backend (``--bounded-moe-backend torch``, or ``auto`` with
``--moe-expert-rank-capacity-factor`` and no HybridEP/TE), the ``mlp`` slot is our
``BoundedMoELayer`` with grouped experts; otherwise upstream's MoE layer, dispatcher
(``--moe-token-dispatcher-type``) and experts (``SequentialMLP``) are kept. With
``--chunked-recompute-tokens`` the layer is
:class:`megatron.bounded.activations.chunked_recompute.ChunkedRecomputeTransformerLayer`. The
multi-token-prediction layers (``--mtp-num-layers``) are built from the decoder's last layer with
the same substitutions (:func:`bounded_mtp_block_spec`). With ``--apply-layernorm-1p`` every
torch norm of these specs (the block's final norm and the MTP norms too) is
:class:`megatron.bounded.model.norms.ZeroCenteredNorm`. With ``--experimental-attention-variant
gated_delta_net`` the layers that ``--linear-attention-freq`` makes linear attention hold
:class:`megatron.bounded.attention.gated_delta_net.BoundedGatedDeltaNet` in their ``self_attention``
slot (their MLP as any layer's), the others are built as above (:func:`_gated_delta_net_block`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.ssm.gated_delta_net.common import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron.bounded.attention.core import SDPACoreAttention
from megatron.bounded.attention.gated_delta_net import (
    BoundedGatedDeltaNet,
    gated_delta_net_pattern,
    is_gated_delta_net,
)
from megatron.bounded.activations.chunked_recompute import ChunkedRecomputeTransformerLayer
from megatron.bounded.model.dsa import dsa_core_attention_spec, uses_dsa
from megatron.bounded.model.mla import BoundedMLASelfAttention, NormedColumnParallelLinear
from megatron.bounded.model.norms import use_zero_centered_norms
from megatron.bounded.moe.moe_layer import bounded_moe_submodules, select_moe_backend
from megatron.bounded.object_changes import object_change


def use_sdpa_attention(layer_spec: ModuleSpec) -> ModuleSpec:
    """Point a (freshly built) local layer spec's core attention at SDPA; returns the spec
    (``SelfAttentionSubmodules`` and ``MLASelfAttentionSubmodules`` name the slot alike)."""
    layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return layer_spec


def use_bounded_mla(layer_spec: ModuleSpec, config) -> ModuleSpec:
    """Point a (freshly built) local MLA layer spec's attention at
    :class:`BoundedMLASelfAttention` when ``config.multi_latent_attention``; returns the spec."""
    if getattr(config, "multi_latent_attention", False):
        attention = layer_spec.submodules.self_attention
        attention.module = BoundedMLASelfAttention
        if config.q_lora_rank is None:
            # no query latent to normalize: --qk-layernorm is the key/value latent's norm alone
            # (DeepSeek-V2-Lite, Moonlight); upstream's MLA refuses a q norm it would not use
            attention.submodules.q_layernorm = IdentityOp
    return layer_spec


def use_sparse_attention(layer_spec: ModuleSpec, config) -> ModuleSpec:
    """Point a (freshly built) local MLA layer spec's core attention at DeepSeek sparse
    attention (:mod:`megatron.bounded.model.dsa`) when ``--experimental-attention-variant dsa``;
    returns the spec."""
    if uses_dsa(config):
        layer_spec.submodules.self_attention.submodules.core_attention = dsa_core_attention_spec()
    return layer_spec


def upstream_spec_config(config):
    """``config`` as upstream's local spec builders take it: they assert that no experimental
    attention variant is set (its spec is Transformer Engine's); DSA's core attention
    (:func:`use_sparse_attention`) and the gated DeltaNet mixers (:func:`_gated_delta_net_block`)
    are put in afterwards."""
    if getattr(config, "experimental_attention_variant", None) is None:
        return config
    return object_change("local-spec-without-attention-variant").copy_with(
        config, experimental_attention_variant=None)


def use_chunked_recompute(layer_spec: ModuleSpec, config) -> ModuleSpec:
    """Point a (freshly built) local layer spec's layer at
    :class:`ChunkedRecomputeTransformerLayer` when ``config.chunked_recompute_tokens`` is set;
    returns the spec."""
    if getattr(config, "chunked_recompute_tokens", 0):
        layer_spec.module = ChunkedRecomputeTransformerLayer
    return layer_spec


def bounded_decoder_spec(model_config, vp_stage: Optional[int] = None):
    """``GPTModelConfig.transformer_layer_spec`` callable: the spec for ``model_config``."""
    config = model_config.transformer
    if config.transformer_impl != "local":
        from megatron.training.models.gpt import default_layer_spec

        return default_layer_spec(model_config, vp_stage)
    if is_gated_delta_net(config):
        return _gated_delta_net_block(config, vp_stage)
    if config.num_moe_experts is None:
        spec = _use_bounded_modules(get_gpt_layer_local_spec(
            num_experts=None,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        ), config)
        if not config.layernorm_zero_centered_gamma:
            return spec
        # the block's final norm is not in a layer spec: the block spec names it (as upstream's
        # block builds one from a layer spec)
        return use_zero_centered_norms(TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
            layer_norm=LayerNormImpl), config)
    block_spec: TransformerBlockSubmodules = get_gpt_decoder_block_spec(
        upstream_spec_config(config),
        use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    # Dense and MoE layers share one spec object each; rewrite each distinct object once.
    for layer_spec in {id(spec): spec for spec in block_spec.layer_specs}.values():
        _use_bounded_modules(layer_spec, config)
    return use_zero_centered_norms(block_spec, config)


def gated_delta_net_spec() -> ModuleSpec:
    """The ``self_attention`` slot of a gated DeltaNet layer on local modules (the layer's
    ``input_layernorm`` is the identity: ``in_proj`` normalises its input, as upstream's spec
    fuses it)."""
    return ModuleSpec(
        module=BoundedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=NormedColumnParallelLinear, out_norm=WrappedTorchNorm,
            out_proj=RowParallelLinear),
    )


def _gated_delta_net_block(config, vp_stage: Optional[int]) -> TransformerBlockSubmodules:
    """The block of a hybrid gated DeltaNet model: every layer as :func:`bounded_decoder_spec`
    builds a MoE model's (dense or MoE per --moe-layer-freq), the gated DeltaNet layers with
    :func:`gated_delta_net_spec` as their token mixer and no separate input norm; this stage's
    layers, as upstream slices a block."""
    # the full-attention layers are what upstream's builder makes
    layer_specs = get_gpt_decoder_layer_specs(
        upstream_spec_config(config), use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm)
    for spec in {id(spec): spec for spec in layer_specs}.values():
        _use_bounded_modules(spec, config)
    linear = gated_delta_net_pattern(config)
    layer_specs = [
        ModuleSpec(module=spec.module, params=dict(spec.params), submodules=dataclasses.replace(
            spec.submodules, input_layernorm=IdentityOp, self_attention=gated_delta_net_spec()))
        if linear[index] else spec
        for index, spec in enumerate(layer_specs)
    ]
    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        local_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return use_zero_centered_norms(TransformerBlockSubmodules(
        layer_specs=[layer_specs[index] for index in local_ids], layer_norm=LayerNormImpl), config)


def bounded_mtp_block_spec(model_config, vp_stage: Optional[int] = None):
    """The multi-token-prediction block spec (``--mtp-num-layers``) of a local-implementation
    model: upstream's MTP layer (norms, projection, shared head) around the decoder's last layer
    as :func:`bounded_decoder_spec` builds it; None on a stage without MTP layers."""
    config = model_config.transformer
    # the whole model's layers (freshly built), not this stage's: a last stage may hold MTP
    # layers only
    last_layer = _use_bounded_modules(get_gpt_decoder_layer_specs(
        upstream_spec_config(config), use_transformer_engine=False, normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
    )[-1], config)
    # given as a block: upstream checks a single layer spec's class against TransformerLayer
    return use_zero_centered_norms(get_gpt_mtp_block_spec(
        config, TransformerBlockSubmodules(layer_specs=[last_layer]),
        use_transformer_engine=False, vp_stage=vp_stage,
    ), config)


def _use_bounded_modules(layer_spec: ModuleSpec, config) -> ModuleSpec:
    """SDPA core attention (DSA's with --experimental-attention-variant dsa), our MLA attention
    (multi-latent attention), the chunked-recompute
    layer and our MoE layer (torch-native backend) in a freshly built local layer spec; returns
    the spec."""
    use_chunked_recompute(use_sparse_attention(
        use_bounded_mla(use_sdpa_attention(layer_spec), config), config), config)
    if _is_moe_layer(layer_spec) and select_moe_backend(config) == "torch":
        layer_spec.submodules.mlp = bounded_moe_submodules(config)
    return layer_spec


def _is_moe_layer(layer_spec: ModuleSpec) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer_spec.submodules.mlp
    builder = getattr(mlp, "func", getattr(mlp, "module", mlp))
    return isinstance(builder, type) and issubclass(builder, MoELayer)
