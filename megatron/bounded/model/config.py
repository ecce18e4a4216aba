"""``BoundedTransformerConfig``: upstream's ``TransformerConfig`` plus this project's checks.

``pretrain_gpt.py`` builds the model config with this class (through upstream's
``core_transformer_config_from_args(args, config_class=BoundedTransformerConfig)``, which copies
every parsed flag whose name matches a field), so every module of the model sees it. Operators
of this project add their fields and cross-checks here. The checks themselves live next to the
code they protect (:mod:`megatron.bounded.moe.backend`, :mod:`megatron.bounded.attention.core`);
:mod:`megatron.bounded.launch.arguments` runs the same ones on the parsed flags. This module never
imports the command-line layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bounded.attention.core import check_sdpa_attention_supported
from megatron.bounded.activations.chunked_attention import DEFAULT_CHUNKED_ATTENTION, check_chunked_attention
from megatron.bounded.activations.chunked_recompute import DEFAULT_CHUNK_TOKENS, check_chunked_recompute
from megatron.bounded.moe.backend import check_moe_capacity_and_paged_stash, select_moe_backend
from megatron.bounded.moe.pipelined_llep import DEFAULT_MAX_CHUNKS, DEFAULT_MIN_SPILL_TOKENS


@dataclass
class BoundedTransformerConfig(TransformerConfig):
    """Transformer config of megatron-bounded models."""

    bounded_moe_backend: str = "auto"
    """MoE dispatcher and experts: "torch" (torch-native static-capacity dispatcher + grouped
    experts), "upstream" (megatron-core's), or "auto" (torch when a rank capacity factor is set
    and upstream's HybridEP/NCCL-EP + TE path cannot run). Flag: --bounded-moe-backend."""

    pipelined_llep: bool = False
    """Chunked expert dispatch with a per-source token budget (flag: --pipelined-llep)."""

    pipelined_llep_token_budget: Optional[int] = None
    """Tokens per chunk c; the receive buffer is bounded by 2·E_p·k·c rows."""

    pipelined_llep_max_chunks: int = DEFAULT_MAX_CHUNKS
    """K_max: K = min(ceil(N / c), K_max) chunks."""

    llep_imbalance_threshold: Optional[float] = None
    """LLEP: spill overloaded experts' tokens (and weight copies) to the least-loaded ranks when
    the hottest rank's load exceeds this multiple of the mean. None: no balancing."""

    llep_min_spill_tokens: int = DEFAULT_MIN_SPILL_TOKENS
    """LLEP: smallest number of tokens worth moving to a helper rank."""

    chunked_recompute_tokens: int = DEFAULT_CHUNK_TOKENS
    """With full recompute, recompute each layer's MLP block in sequence chunks of this many
    tokens (0: off). Flag: --chunked-recompute-tokens."""

    chunked_recompute_attention: bool = DEFAULT_CHUNKED_ATTENTION
    """With chunked recompute, recompute the whole attention sublayer in the same chunks and
    back-propagate attention block by block. Flag: --chunked-recompute-attention."""

    def __post_init__(self):
        torch_native_moe = self.num_moe_experts is not None and select_moe_backend(self) == "torch"
        if torch_native_moe:
            # Upstream ties the rank capacity factor to HybridEP/NCCL-EP and paged stash to the
            # factor (transformer_config.py:1692-1705, 1904-1921). Our backend provides both, so
            # those two fields are hidden from upstream's checks, which all still run, and are
            # checked by check_moe_capacity_and_paged_stash instead.
            factor, paged_stash = self.moe_expert_rank_capacity_factor, self.moe_paged_stash
            self.moe_expert_rank_capacity_factor, self.moe_paged_stash = None, False
            try:
                super().__post_init__()
            finally:
                self.moe_expert_rank_capacity_factor, self.moe_paged_stash = factor, paged_stash
            self._check_paged_stash_offload_modules()
        else:
            super().__post_init__()
        check_moe_capacity_and_paged_stash(self)
        check_chunked_recompute(self)
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
