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

Latent form (a DSA core attention whose ``latent_form`` is set:
:func:`megatron.bounded.attention.sparse_mla_latent.attends_in_latent_form`): in training and
evaluation (not in inference with a KV cache) the layer skips the kv up-projection. It hands the
core attention the query (rotated as upstream rotates it), as ``key`` the normalized kv latent
with the key's rotated rotary part [s, b, kv_lora + rope], no value, and the up-projection's
weight as ``kv_up_weight``; the core attention applies the weight per selected key block, so the
heads' keys and values are never built for the whole sequence. The parameters and their names
are upstream's.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import multi_latent_attention as upstream_mla
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.bounded.attention.documents import DocumentParams
from megatron.bounded.model.norms import initial_norm_weight, normalize
from megatron.bounded.settings import BoundedArgumentError, flag_name

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


def check_mla_dimensions(config) -> None:
    """Refuse multi-latent attention widths that build a layer which cannot learn or cannot run
    (on parsed flags or a config; the messages name the flags)."""
    if not getattr(config, "multi_latent_attention", False):
        return
    problems = [f"{flag_name(field)} {getattr(config, field)} ({what}: give a width >= 1)"
                for field, what in MLA_WIDTHS.items() if getattr(config, field) < 1]
    q_rank = config.q_lora_rank
    if q_rank is not None and q_rank < 1:
        problems.append(f"{flag_name('q_lora_rank')} {q_rank} (the rank of the queries' latent, >= 1: "
                        "at 0 every query is 0; leave it out for a full-rank query projection, as "
                        "DeepSeek-V2-Lite and Moonlight do)")
    rotary = config.qk_pos_emb_head_dim
    if rotary < 2 or rotary % 2:
        problems.append(f"{flag_name('qk_pos_emb_head_dim')} {rotary} (the rotary part of each query "
                        "and key head, the model's only position signal: rotary embeddings turn "
                        "pairs of channels, so an even width >= 2, e.g. 64)")
    if problems:
        raise BoundedArgumentError(
            f"{flag_name('multi_latent_attention')} cannot train with: " + "; ".join(problems) + ".")


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
    """``MLASelfAttention`` whose q, k, v ignore :class:`DocumentParams`, which builds the
    fused norm + linear projections of ``--qk-layernorm`` without Transformer Engine, and which
    hands a latent-form core attention the latent instead of the expanded keys and values."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.latent_form = getattr(self.core_attention, "latent_form", False)
        if self.latent_form:
            for field in ("apply_rope_fusion", "cache_mla_latents"):
                if getattr(config, field, False):
                    raise ValueError(f"multi-latent attention in latent form takes no {field}")
            if self.recompute_up_proj:
                raise ValueError("multi-latent attention in latent form builds no expanded keys "
                                 "or values to recompute: no mla_up_proj in --recompute-modules")

    def _resolve_qk_norm_config(self, submodules):
        return LocalQKNormConfigResolver(self.config, submodules).resolve()

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None, *args, **kwargs):
        if isinstance(packed_seq_params, DocumentParams):
            packed_seq_params = None
        inference = kwargs.get("inference_context") or kwargs.get("inference_params") or (
            args[0] if args else None)
        if self.latent_form and key_value_states is None and packed_seq_params is None \
                and inference is None:
            return self.latent_query_and_key(hidden_states)
        return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                   packed_seq_params, *args, **kwargs)

    def latent_query_and_key(self, hidden_states):
        """(query [s, b, heads, d_nope + rope], the kv latent and the key's rotary part
        [s, b, kv_lora + rope], None, the normalized q latent, the normalized kv latent): upstream's
        down-projections, norms, query up-projection and rotary embedding, without the kv
        up-projection."""
        config = self.config
        rope = config.qk_pos_emb_head_dim
        q_compressed, kv_combined = self._qkv_down_projection(hidden_states)
        if kv_combined.shape[-1] != config.kv_lora_rank + rope:
            raise ValueError("multi-latent attention in latent form runs without tensor "
                             "parallelism of the kv down-projection")
        kv_compressed, k_rope = torch.split(kv_combined, [config.kv_lora_rank, rope], dim=-1)
        if config.q_lora_rank is not None:
            q_compressed = self.q_layernorm(q_compressed)
            q, _ = self.linear_q_up_proj(q_compressed)
        else:
            q, _ = self.linear_q_proj(q_compressed)
        kv_compressed = self.kv_layernorm(kv_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_rope = torch.split(q, [config.qk_head_dim, rope], dim=-1)

        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, config,
                                                                None)
        if config.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(rotary_seq_len, packed_seq=False), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(rotary_seq_len, packed_seq=False)
        freqs = freqs[:q.shape[0]]

        def rotate(t):  # the binding upstream's layer calls, with its arguments
            return upstream_mla.apply_rotary_pos_emb(
                t, freqs, config=config, cu_seqlens=None, mscale=mscale,
                cp_group=self.pg_collection.cp, mla_rotary_interleaved=True)

        query = torch.cat([q_nope, rotate(q_rope)], dim=-1).contiguous()
        key = torch.cat([kv_compressed, rotate(k_rope.unsqueeze(-2)).squeeze(-2)], dim=-1)
        return query, key.contiguous(), None, q_compressed, kv_compressed

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        if self.latent_form and value is None:  # the latent: the core attention up-projects
            extra_kwargs["kv_up_weight"] = self.linear_kv_up_proj.weight
        return super()._run_core_attention(query, key, value, attention_mask,
                                           packed_seq_params=packed_seq_params,
                                           attn_mask_type=attn_mask_type, **extra_kwargs)
