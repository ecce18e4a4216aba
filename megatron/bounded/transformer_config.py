"""``BoundedTransformerConfig``: upstream's ``TransformerConfig`` plus this project's checks.

``pretrain_gpt.py`` builds the model config with this class (through upstream's
``core_transformer_config_from_args(args, config_class=BoundedTransformerConfig)``, which copies
every parsed flag whose name matches a field), so every module of the model sees it. Operators
of this project add their fields and cross-checks here; checks that can be phrased with flags
also run at argument time in :mod:`megatron.bounded.arguments`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bounded.arguments import check_sdpa_attention_supported


@dataclass
class BoundedTransformerConfig(TransformerConfig):
    """Transformer config of megatron-bounded models (same fields as upstream so far)."""

    def __post_init__(self):
        super().__post_init__()
        if self.transformer_impl == "local":
            # the local spec of this project runs attention through SDPA
            check_sdpa_attention_supported(self)
