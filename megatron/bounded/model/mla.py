"""Upstream's multi-latent attention with packed documents handed to the core attention only.

Upstream's ``MLASelfAttention.get_query_key_value_tensors`` treats any packed-sequence parameters
as its ``thd`` layout and squeezes the batch dimension away; with one sequence per micro-batch
our :class:`megatron.bounded.attention.documents.DocumentParams` (the ``sbhd`` layout: tokens
keep their sequence positions, only attention is cut at the documents) would then be rotated and
concatenated with mismatched shapes. The queries, keys and values of a packed batch are those of
the same batch without documents, so they are computed without them; the core attention still
gets the documents (upstream's ``forward`` passes them on).
"""

from __future__ import annotations

from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron.bounded.attention.documents import DocumentParams

__all__ = ["BoundedMLASelfAttention"]


class BoundedMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` whose q, k, v ignore :class:`DocumentParams`."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None, *args, **kwargs):
        if isinstance(packed_seq_params, DocumentParams):
            packed_seq_params = None
        return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                   packed_seq_params, *args, **kwargs)
