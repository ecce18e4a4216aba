"""``BoundedTransformerConfig``: upstream's ``TransformerConfig`` plus the settings that reach the model;
``BoundedMLATransformerConfig``: the same on upstream's ``MLATransformerConfig`` (multi-latent attention).

``pretrain_gpt.py`` builds the model config with this class (through upstream's
``core_transformer_config_from_args(args, config_class=BoundedTransformerConfig)``, which copies
every parsed flag whose name matches a field), so every module of the model sees it. The fields
of this project are inherited from the settings dataclasses of the operators that live in the
model (each declared once, in its operator's module); the checks that protect the model run
here too, for configs built in code (:class:`BoundedConfigChecks`, shared by both classes), each
settings class's own rules through its ``check_values``. This
module never imports the command-line layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron.bounded.activations.chunked_attention import (
    ChunkedAttentionSettings,
    check_chunked_attention,
)
from megatron.bounded.activations.chunked_recompute import check_chunked_recompute
from megatron.bounded.activations.selective_recompute import check_selective_recompute
from megatron.bounded.attention.core import check_sdpa_attention_supported
from megatron.bounded.model.mla import check_mla_dimensions
from megatron.bounded.moe.backend import check_moe_capacity_and_paged_stash, select_moe_backend
from megatron.bounded.object_changes import object_change
from megatron.bounded.registry import model_settings

# The settings whose fields the model config inherits (the model's modules read them there).
MODEL_SETTINGS = model_settings()


class BoundedConfigChecks:
    """The model checks of megatron-bounded configs, around the upstream config's own
    ``__post_init__`` (the next class in the method resolution order)."""

    def __post_init__(self):
        torch_native_moe = self.num_moe_experts is not None and select_moe_backend(self) == "torch"
        if torch_native_moe:
            # Upstream ties the rank capacity factor to HybridEP/NCCL-EP and paged stash to the
            # factor (transformer_config.py:1692-1705, 1904-1921), and its shared-expert overlap
            # to its alltoall/flex dispatchers. Our backend provides all three (the overlap on a
            # side stream, BoundedMoELayer), so those fields are hidden from upstream's checks,
            # which all still run, and are checked by check_moe_capacity_and_paged_stash instead.
            with object_change("hybridep-only-moe-checks-hidden").hidden(
                    self, moe_expert_rank_capacity_factor=None, moe_paged_stash=False,
                    moe_shared_expert_overlap=False):
                super().__post_init__()
            self._check_paged_stash_offload_modules()
        else:
            super().__post_init__()
        check_moe_capacity_and_paged_stash(self)
        check_mla_dimensions(self)
        check_chunked_recompute(self)
        check_selective_recompute(self)
        for settings in MODEL_SETTINGS:  # each operator's rules on its own fields
            settings.check_values(self)
        ChunkedAttentionSettings.check_placed(self)
        check_chunked_attention(self)
        if self.transformer_impl == "local":
            # the local spec of this project runs attention through SDPA
            check_sdpa_attention_supported(self)

    def _check_paged_stash_offload_modules(self) -> None:
        # upstream's rule, hidden above with the paged-stash field: the stash already keeps
        # these activations, so offloading them as well would store them twice
        conflict = {"expert_fc1", "moe_act", "fused_group_mlp"} & set(self.offload_modules or [])
        if self.moe_paged_stash and conflict:
            raise ValueError(
                f"moe_paged_stash covers the routed-expert activations: remove {sorted(conflict)} "
                "from offload_modules."
            )


@dataclass
class BoundedTransformerConfig(BoundedConfigChecks, TransformerConfig, *MODEL_SETTINGS):
    """Transformer config of megatron-bounded models."""


@dataclass
class BoundedMLATransformerConfig(BoundedConfigChecks, MLATransformerConfig, *MODEL_SETTINGS):
    """Transformer config of megatron-bounded models with multi-latent attention."""


def transformer_config_class(multi_latent_attention: bool) -> type:
    """The config class of a model with (or without) multi-latent attention."""
    return BoundedMLATransformerConfig if multi_latent_attention else BoundedTransformerConfig
