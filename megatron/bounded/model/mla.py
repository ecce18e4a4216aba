"""Upstream's multi-latent attention with packed documents handed to the core attention only.

Upstream's ``MLASelfAttention.get_query_key_value_tensors`` treats any packed-sequence parameters
as its ``thd`` layout and squeezes the batch dimension away; with one sequence per micro-batch
our :class:`megatron.bounded.attention.documents.DocumentParams` (the ``sbhd`` layout: tokens
keep their sequence positions, only attention is cut at the documents) would then be rotated and
concatenated with mismatched shapes. The queries, keys and values of a packed batch are those of
the same batch without documents, so they are computed without them; the core attention still
gets the documents (upstream's ``forward`` passes them on).

``--qk-layernorm`` without ``--q-lora-rank`` (Moonlight, DeepSeek-V2-Lite): upstream normalizes
the queries' input inside a fused norm + linear query projection, which only Transformer Engine
provides; :class:`NormedColumnParallelLinear` is that projection unfused (norm, then upstream's
column-parallel linear), with Transformer Engine's parameter names.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.bounded.attention.documents import DocumentParams
from megatron.bounded.model.norms import initial_norm_weight, normalize
from megatron.bounded.settings import BoundedArgumentError, option_name

__all__ = ["BoundedMLASelfAttention", "NormedColumnParallelLinear", "check_mla_dimensions"]

# MLA's widths, each of which must be >= 1, and what a 0 does (upstream builds a layer of empty
# projections and trains it)
MLA_WIDTHS = {
    "kv_lora_rank": "the keys' and values' shared latent; at 0 every key and value is 0 and no "
                    "attention projection gets a gradient",
    "qk_head_dim": "the part of each query and key head computed from the latents; at 0 the "
                   "keys never see the latent",
    "v_head_dim": "each value head; at 0 attention outputs nothing and no attention projection "
                  "gets a gradient",
}


def check_mla_dimensions(config, flag_style: bool = False) -> None:
    """Refuse multi-latent attention widths that build a layer which cannot learn or cannot run;
    ``config`` is args (``flag_style``: flags in the message) or a config."""
    if not getattr(config, "multi_latent_attention", False):
        return

    def name(field: str) -> str:
        return option_name(field, flag_style)

    problems = [f"{name(field)} {getattr(config, field)} ({what}: give a width >= 1)"
                for field, what in MLA_WIDTHS.items() if getattr(config, field) < 1]
    q_rank = config.q_lora_rank
    if q_rank is not None and q_rank < 1:
        problems.append(f"{name('q_lora_rank')} {q_rank} (the rank of the queries' latent, >= 1: "
                        "at 0 every query is 0; leave it out for a full-rank query projection, as "
                        "DeepSeek-V2-Lite and Moonlight do)")
    rotary = config.qk_pos_emb_head_dim
    if rotary < 2 or rotary % 2:
        problems.append(f"{name('qk_pos_emb_head_dim')} {rotary} (the rotary part of each query "
                        "and key head, the model's only position signal: rotary embeddings turn "
                        "pairs of channels, so an even width >= 2, e.g. 64)")
    if problems:
        raise BoundedArgumentError(
            f"{name('multi_latent_attention')} cannot train with: " + "; ".join(problems) + ".")


class NormedColumnParallelLinear(ColumnParallelLinear):
    """The config's normalization (RMSNorm or LayerNorm) of the input, then upstream's
    column-parallel linear; the norm's parameters are ``layer_norm_weight`` (and
    ``layer_norm_bias``), as in Transformer Engine's fused module."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.rms_norm = config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.layer_norm_weight = torch.nn.Parameter(initial_norm_weight(
            input_size, self.zero_centered, device=device, dtype=config.params_dtype))
        self.layer_norm_bias = None if self.rms_norm else torch.nn.Parameter(
            torch.zeros(input_size, device=device, dtype=config.params_dtype))
        for parameter in (self.layer_norm_weight, self.layer_norm_bias):
            if parameter is not None:  # replicated; summed over TP ranks under sequence parallel
                parameter.sequence_parallel = config.sequence_parallel

    def forward(self, input_, *args, **kwargs):
        normed = normalize(input_, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                           self.rms_norm, self.zero_centered)
        return super().forward(normed, *args, **kwargs)


class LocalQKNormConfigResolver(QKNormConfigResolver):
    """Upstream's resolver of the MLA q/kv norms, with :class:`NormedColumnParallelLinear` as the
    fused norm + linear projection where the backend has none (the local implementation)."""

    def __init__(self, config, submodules) -> None:
        super().__init__(config, submodules)
        if self.fused_norm_linear_impl is None:
            self.fused_norm_linear_impl = NormedColumnParallelLinear


class BoundedMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose q, k, v ignore :class:`DocumentParams`, and which builds the
    fused norm + linear projections of ``--qk-layernorm`` without Transformer Engine."""

    def _resolve_qk_norm_config(self, submodules):
        return LocalQKNormConfigResolver(self.config, submodules).resolve()

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None, *args, **kwargs):
        if isinstance(packed_seq_params, DocumentParams):
            packed_seq_params = None
        return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                   packed_seq_params, *args, **kwargs)
