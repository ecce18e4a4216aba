"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (causal, GQA).

Upstream's local ``DotProductAttention`` materializes the [b, heads, s, s] score matrix, so its
activation memory grows with s²: at 128K tokens one layer's scores alone exceed a GPU. This
module is a drop-in ``core_attention`` for Megatron's ``SelfAttention`` that calls PyTorch's SDPA,
whose flash / memory-efficient kernels never hold the s × s scores.

Memory bound: O(b · heads · s · head_dim) per layer (inputs, output and the kernel's
log-sum-exp), independent of s². ``tests/unit/test_attention.py`` checks the values against a
plain softmax reference; the GPU functional tests run it at sequence 4096.

Scope: causal self-attention with the same number of query heads per key/value group on every
tensor-parallel rank (grouped-query attention through ``enable_gqa``). Sliding windows, softmax
variants, context parallelism, packed sequences and attention bias are refused at argument time
(``megatron.bounded.arguments.check_sdpa_attention_supported``) and again here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron.bounded.arguments import check_sdpa_attention_supported


# flash first; the memory-efficient kernel covers shapes flash does not support
FUSED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


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
    ):
        super().__init__(config=config)
        check_sdpa_attention_supported(config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"SDPACoreAttention supports causal (or unmasked) attention, got {attn_mask_type}"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        head_dim = config.kv_channels
        # Upstream divides the scale by layer_number for query-key layer scaling and multiplies
        # the scores back inside its softmax: the net scale is the plain one.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.sequence_parallel = config.sequence_parallel

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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # The causal mask is implied; a dataloader-made [b, 1, s, s] causal mask carries no more
        # information and would force SDPA onto its s² path, so it is not passed on.
        seq_len, batch = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.sequence_parallel:
            # same RNG discipline as upstream: dropout draws from the tensor-parallel tracker
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, mask_type, dropout_p)
        else:
            context = self._sdpa(q, k, v, mask_type, dropout_p)
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)

    def _sdpa(self, q, k, v, mask_type: AttnMaskType, dropout_p: float) -> torch.Tensor:
        if q.is_cuda:
            # Never fall back to the math kernel on GPU: it materializes the s × s scores, which
            # is exactly the peak this module exists to avoid. Unsupported inputs fail loudly.
            with sdpa_kernel(FUSED_SDPA_BACKENDS, set_priority=True):
                return self._call_sdpa(q, k, v, mask_type, dropout_p)
        return self._call_sdpa(q, k, v, mask_type, dropout_p)

    def _call_sdpa(self, q, k, v, mask_type: AttnMaskType, dropout_p: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout_p,
            is_causal=mask_type == AttnMaskType.causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads_per_partition != self.num_query_groups_per_partition,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters (softmax variants with learnable offsets are refused)
