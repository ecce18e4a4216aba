"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (causal, GQA).

Upstream's local ``DotProductAttention`` materializes the [b, heads, s, s] score matrix, so its
activation memory grows with s²: at 128K tokens one layer's scores alone exceed a GPU. This
module is a drop-in ``core_attention`` for Megatron's ``SelfAttention`` that calls PyTorch's SDPA,
whose flash / memory-efficient kernels never hold the s × s scores.

Memory bound: O(b · heads · s · head_dim) per layer (inputs, output and the kernel's
log-sum-exp), independent of s². ``tests/unit/attention/test_attention.py`` checks the values against a
plain softmax reference; the GPU functional tests run it at sequence 4096.

Scope: causal self-attention with the same number of query heads per key/value group on every
tensor-parallel rank (grouped-query attention through ``enable_gqa``). Context parallelism
(``--context-parallel-size`` with ``--cp-comm-type a2a``) runs as a sequence-to-head all-to-all
around the kernel (``megatron.bounded.attention.context_parallel``). Sliding windows
(``--window-size LEFT,0``, ``--window-attn-skip-freq``) and attention sinks (``--softmax-type
off-by-one`` / ``learnable``) follow upstream's local ``DotProductAttention`` and run through
flash attention's windowed kernel (:mod:`megatron.bounded.attention.windows`,
:mod:`megatron.bounded.attention.sinks`); the sink logits are the parameter ``softmax_offset``,
as upstream's. Other context-parallel schemes, non-causal windows and attention bias are refused
by :func:`check_sdpa_attention_supported` at argument time, in the config and again here. Packed
documents (``--reset-attention-mask``) arrive as :class:`DocumentParams` and attention stays
inside each document (:mod:`megatron.bounded.attention.documents`), also under context
parallelism: the exchange gives each rank whole sequences, whose boundaries the batch carries.
Multi-latent attention (``k_channels``/``v_channels``: values narrower than queries and keys,
every query head with its own key head) runs on the same paths; on CUDA the values are padded to
the q/k head dimension for the kernels (:mod:`megatron.bounded.attention.head_dims`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron.bounded.attention.context_parallel import expanded_query_groups, heads_to_sequence, sequence_to_heads
from megatron.bounded.attention.documents import DocumentParams, document_attention
from megatron.bounded.attention.head_dims import with_value_padded
from megatron.bounded.attention.sinks import KernelAttention, softmax_offset
from megatron.bounded.attention.windows import (
    NO_MASK,
    causal_band,
    flash_backward,
    flash_forward,
    layer_window,
    reference_block_backward,
    reference_forward,
    window_problems,
)
from megatron.bounded.settings import BoundedArgumentError, flag_name


# flash first; the memory-efficient kernel covers shapes flash does not support
FUSED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def sdpa_backends(attention_backend) -> list:
    """SDPA kernels to try, in order, for Megatron's ``--attention-backend``.

    ``fused`` (in Transformer Engine: cuDNN's fused attention) puts cuDNN's kernel first: it is
    faster than flash on Hopper GPUs (``tools/benchmarks/bench_sdpa_attention.py`` times both;
    figures in ``docs/architecture.md``), but its backward is not documented as deterministic,
    so it is opt-in. Every other value keeps flash first; a kernel that refuses
    the inputs falls through to the next.
    """
    if attention_backend == AttnBackend.fused:
        return [SDPBackend.CUDNN_ATTENTION] + FUSED_SDPA_BACKENDS
    return list(FUSED_SDPA_BACKENDS)


def check_sdpa_attention_supported(config) -> None:
    """Features our SDPA core attention does not implement (on parsed flags or a config, from
    ``validate_bounded_args``, ``BoundedTransformerConfig`` and :class:`SDPACoreAttention`
    itself; the messages name the flags)."""
    problems = window_problems(config)
    variants = [flag_name(field) for field, on in (
        ("window_size", getattr(config, "window_size", None) is not None),
        ("softmax_type", getattr(config, "softmax_type", "vanilla") != "vanilla")) if on]
    if variants and getattr(config, "attention_dropout", 0.0):
        problems.append(f"{flag_name('attention_dropout')} {config.attention_dropout} with "
                        f"{' and '.join(variants)} (windows and sinks run without dropout: set "
                        f"{flag_name('attention_dropout')} 0)")
    problems += _context_parallel_problems(config)
    if problems:
        raise BoundedArgumentError(
            "the local (TE-free) attention of megatron-bounded runs causal "
            "scaled-dot-product attention kernels and does not support: "
            + ", ".join(problems)
            + ". Remove these settings, or install Transformer Engine and use "
            "--transformer-impl transformer_engine."
        )


def _context_parallel_problems(config) -> list:
    """What keeps the SDPA attention's sequence-to-head all-to-all (megatron.bounded.attention.context_parallel)
    from running this context-parallel layout; empty when it can (or CP is off)."""
    cp_size = getattr(config, "context_parallel_size", 1)
    if cp_size == 1:
        return []
    comm_types = config.cp_comm_type
    comm_types = [comm_types] if isinstance(comm_types, str) else list(comm_types or ["p2p"])
    if any(comm_type != "a2a" for comm_type in comm_types):
        return [
            f"{flag_name('cp_comm_type')} {' '.join(comm_types)} with {flag_name('context_parallel_size')} "
            f"{cp_size} (it runs context parallelism as the sequence-to-head all-to-all: pass "
            f"{flag_name('cp_comm_type')} a2a)"
        ]
    if getattr(config, "hierarchical_context_parallel_sizes", None):
        return [f"{flag_name('hierarchical_context_parallel_sizes')}"]
    heads = config.num_attention_heads // getattr(config, "tensor_model_parallel_size", 1)
    if heads % cp_size:
        # then the query groups, repeated to lcm(groups, CP) (a divisor of the heads), split too
        return [
            f"{flag_name('context_parallel_size')} {cp_size} with {heads} attention heads per "
            f"tensor-parallel rank (the heads must split evenly over the CP ranks)"
        ]
    return []


def compact_attention_inputs(*tensors: torch.Tensor) -> tuple:
    """The tensors, each copied out if it is a view of a larger tensor (v of the fused QKV
    projection): what attention saves for backward then keeps nothing else alive."""
    return tuple(
        t.clone() if t._base is not None and t._base.numel() > t.numel() else t for t in tensors
    )


class SDPACoreAttention(MegatronModule):
    """Causal core attention: [s, b, heads, d] query/key/value in, [s, b, heads · d] out."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        # k_channels, v_channels: multi-latent attention's q/k and v head dimensions (the
        # kernels read them from the tensors)
        super().__init__(config=config)
        check_sdpa_attention_supported(config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPACoreAttention supports causal (or unmasked) attention, got {attn_mask_type}"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        self.tp_group = pg_collection.tp  # upstream's sharded_state_dict reads it
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        # multi-latent attention gives every query head its own key/value head
        key_heads = (config.num_attention_heads if getattr(config, "multi_latent_attention", False)
                     else config.num_query_groups)
        self.num_query_groups_per_partition = divide(key_heads, tp_size)
        if self.cp_group is not None:
            # key/value heads as exchanged: repeated so that they split over the CP ranks
            self.exchanged_query_groups = expanded_query_groups(
                self.num_query_groups_per_partition, self.cp_group.size()
            )
        head_dim = config.kv_channels if k_channels is None else k_channels
        # Upstream divides the scale by layer_number for query-key layer scaling and multiplies
        # the scores back inside its softmax: the net scale is the plain one.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.sequence_parallel = config.sequence_parallel
        self.backends = sdpa_backends(getattr(config, "attention_backend", AttnBackend.auto))
        # --chunked-recompute-tokens (megatron.bounded.activations.chunked_recompute)
        self.compact_inputs = bool(getattr(config, "chunked_recompute_tokens", 0))
        # the left extent of this layer's causal window (None: none), upstream's per-layer rule
        self.window = layer_window(config, layer_number)
        # the sink logits, named and shaped as upstream's (a parameter when learnable; fixed
        # zeros, outside the state dict, for off-by-one)
        offset = softmax_offset(config, self.num_heads_per_partition)
        if isinstance(offset, torch.nn.Parameter) or offset is None:
            self.softmax_offset = offset
        else:
            self.register_buffer("softmax_offset", offset, persistent=False)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no attention bias")
        if packed_seq_params is not None and not isinstance(packed_seq_params, DocumentParams):
            raise ValueError("SDPACoreAttention takes packed sequences only as DocumentParams "
                             "(the sbhd layout with document boundaries)")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # The causal mask is implied; a dataloader-made [b, 1, s, s] causal mask carries no more
        # information and would force SDPA onto its s² path, so it is not passed on.
        seq_len, batch = query.shape[0], query.shape[1]
        if self.compact_inputs:
            query, key, value = compact_attention_inputs(query, key, value)
        if self.cp_group is not None:
            query, key, value = self._whole_sequence(query, key, value)
        dropout_p = self.dropout_p if self.training else 0.0
        sink = self._sink_of_heads()
        if packed_seq_params is not None:
            if dropout_p > 0.0:
                raise ValueError("attention within documents runs without dropout: set "
                                 "attention_dropout to 0")
            context = document_attention(query, key, value, packed_seq_params, self.softmax_scale,
                                         self.window, sink)
        elif self.window is not None or sink is not None:
            context = self._kernel_attention(query, key, value, mask_type, sink)
        else:
            context = self._causal_attention(query, key, value, mask_type, dropout_p)
        if self.cp_group is not None:
            context = heads_to_sequence(context, self.cp_group)
        return context.reshape(seq_len, batch, -1)

    def _causal_attention(self, query, key, value, mask_type, dropout_p):
        """[s, b, heads, d] attention over the whole sequence, through SDPA."""
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if dropout_p > 0.0 and not self.sequence_parallel:
            # same RNG discipline as upstream: dropout draws from the tensor-parallel tracker
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, mask_type, dropout_p)
        else:
            context = self._sdpa(q, k, v, mask_type, dropout_p)
        # [b, heads, S, d] -> [S, b, heads, d]
        return context.permute(2, 0, 1, 3)

    def _sink_of_heads(self) -> Optional[torch.Tensor]:
        """The sink logits of the heads attention runs here: under context parallelism the
        exchange leaves this rank heads [r·h/CP, (r+1)·h/CP); the other ranks' heads get no
        gradient here, and the data-parallel gradient reduction (over DP × CP) sums the ranks'."""
        if self.softmax_offset is None or self.cp_group is None:
            return self.softmax_offset
        local_heads = self.num_heads_per_partition // self.cp_group.size()
        return self.softmax_offset.narrow(0, self.cp_group.rank() * local_heads, local_heads)

    def _kernel_attention(self, query, key, value, mask_type, sink):
        """[s, b, heads, d] attention with a window and/or sink: flash attention's windowed
        kernel on CUDA (O(s · window)), the plain-PyTorch reference elsewhere."""
        band = causal_band(self.window) if (
            self.window is not None or mask_type == AttnMaskType.causal) else NO_MASK
        kernels = (flash_forward, flash_backward) if query.is_cuda else (
            reference_forward, reference_block_backward)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # flash takes one head dimension for q, k and v
        context = with_value_padded(
            lambda q, k, v: KernelAttention.apply(kernels, self.softmax_scale, band, q, k, v, sink),
            q, k, v)
        return context.permute(2, 0, 1, 3)

    def _whole_sequence(self, query, key, value):
        """This rank's tokens of all heads -> all tokens of this rank's heads, in one exchange."""
        cp_size = self.cp_group.size()
        repeats = self.exchanged_query_groups // key.shape[2]
        if repeats > 1:
            key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
        seq, batch = query.shape[:2]
        # pack q, k, v per destination rank, heads and head dimension flattened (v's head may be
        # narrower): [s, b, CP, (h·d_qk + g·d_qk + g·d_v)/CP], exchanged as one head per rank
        per_rank = [t.reshape(seq, batch, cp_size, -1) for t in (query, key, value)]
        widths = [t.shape[3] for t in per_rank]
        whole = sequence_to_heads(torch.cat(per_rank, dim=3), self.cp_group).squeeze(2)
        return tuple(
            t.reshape(t.shape[0], batch, source.shape[2] // cp_size, source.shape[3])
            for t, source in zip(torch.split(whole, widths, dim=2), (query, key, value))
        )

    def _sdpa(self, q, k, v, mask_type: AttnMaskType, dropout_p: float) -> torch.Tensor:
        if q.is_cuda:
            # Never fall back to the math kernel on GPU: it materializes the s × s scores, which
            # is exactly the peak this module exists to avoid. Unsupported inputs fail loudly.
            with sdpa_kernel(self.backends, set_priority=True):
                # flash takes one head dimension for q, k and v
                return with_value_padded(
                    lambda q, k, v: self._call_sdpa(q, k, v, mask_type, dropout_p), q, k, v)
        return self._call_sdpa(q, k, v, mask_type, dropout_p)

    def _call_sdpa(self, q, k, v, mask_type: AttnMaskType, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout_p,
            is_causal=mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return {}  # no parameters
        # the learnable sink logits, sharded over tensor parallelism as upstream shards them
        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)
