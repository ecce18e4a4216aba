"""The model layers' calls: the linear function and the tensor-parallel regions without tensor
parallelism, and the rotary embedding fused in one kernel each way."""

from __future__ import annotations

import functools
from typing import Callable


def fused_rotary_embedding(original: Callable) -> Callable:
    """``megatron.core.transformer.attention.apply_rotary_pos_emb``: without Transformer Engine
    upstream rotates with a dozen small eager kernels; where ``fused_rotary_supported`` holds and
    TE's fusion is off, one kernel each way, bitwise upstream's (every other call is upstream's)."""

    from megatron.bounded.attention.rotary import apply_rotary, fused_rotary_supported

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        # None: upstream reads the MLA setting from the config; leave that case to upstream
        if (not config.apply_rope_fusion and mla_rotary_interleaved is not None
                and fused_rotary_supported(t, freqs, config.rotary_interleaved,
                                           mla_rotary_interleaved, cu_seqlens)):
            return apply_rotary(t, freqs, mscale)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                        cp_group=cp_group, mla_rotary_interleaved=mla_rotary_interleaved)

    return apply_rotary_pos_emb


def linear_without_tensor_parallelism(original: Callable) -> Callable:
    """``layers.linear_with_grad_accumulation_and_async_allreduce``: a call with no tensor or
    sequence parallelism, fusion, deferral or autocast runs
    :func:`megatron.bounded.model.linear.linear`, the same operations without the bookkeeping
    (bitwise upstream's); every other call is upstream's."""

    from megatron.bounded.model.linear import linear, runs_lean

    @functools.wraps(original)
    def linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1,
    ):
        if runs_lean(input, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                     grad_output_buffer, gtp_remat_size):
            return linear(input, weight, bias)
        return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                        sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group,
                        gtp_remat_size)

    return linear_with_grad_accumulation_and_async_allreduce


def identity_without_tensor_parallelism(original: Callable) -> Callable:
    """``layers.copy_to_tensor_model_parallel_region`` and ``reduce_from_...``: with one
    tensor-parallel rank both directions are the identity, so the tensor itself is returned (no
    autograd node per layer and micro-batch); a larger group gets upstream's."""

    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    @functools.wraps(original)
    def region(input_, group=None):
        resolved = group if group is not None else get_tensor_model_parallel_group_if_none(None)
        if resolved is not None and resolved.size() == 1:
            return input_
        return original(input_, group)

    return region
