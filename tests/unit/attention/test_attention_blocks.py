"""Blocked causal attention backward (megatron.bounded.attention.blockwise) against autograd through
a plain softmax, float64 on CPU, with grouped-query attention and a shorter last block."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import requires_cuda

from megatron.bounded.attention.blockwise import (
    attention_forward,
    attention_pairs,
    block_bounds,
    query_block_backward,
)
from megatron.bounded.attention.windows import CAUSAL, NO_MASK

SEQ, BATCH, HEADS, GROUPS, DIM = 23, 2, 4, 2, 8


def _plain_attention(query, key, value, scale):
    """[s, b, n, d] causal attention through an explicit s x s softmax."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * scale
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ v).permute(2, 0, 1, 3)


def _inputs():
    generator = torch.Generator().manual_seed(3)
    shapes = [(SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM), (SEQ, BATCH, GROUPS, DIM)]
    return [torch.randn(*shape, dtype=torch.float64, generator=generator) for shape in shapes]


def test_forward_matches_plain_softmax_and_returns_the_log_sum_exp():
    query, key, value = _inputs()
    scale = 1 / math.sqrt(DIM)
    out, lse, kernel = attention_forward(query, key, value, scale)
    assert kernel == "reference"
    torch.testing.assert_close(out, _plain_attention(query, key, value, scale), rtol=1e-12,
                               atol=1e-13)
    q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    assert lse.shape == (BATCH, HEADS, SEQ) and lse.dtype == torch.float64
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-13, atol=1e-13)
    _, lse16, _ = attention_forward(*(t.to(torch.bfloat16) for t in (query, key, value)), scale)
    assert lse16.dtype == torch.float32  # as flash attention's


@pytest.mark.parametrize("block,key_blocks", [(5, 1), (8, 1), (23, 1), (3, 2), (3, 100)])
def test_blocked_backward_equals_autograd(block, key_blocks):
    query, key, value = _inputs()
    scale = 0.3
    leaves = [t.clone().requires_grad_(True) for t in (query, key, value)]
    expected_out = _plain_attention(*leaves, scale)
    grad_out = torch.randn_like(expected_out)
    expected_out.backward(grad_out)

    out, lse, kernel = attention_forward(query, key, value, scale)
    bounds = block_bounds(SEQ, block)
    # float64 accumulators here, so that the comparison is tight
    grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
    grad_query = torch.empty_like(query)
    for start, end in reversed(bounds):
        grad_q = query_block_backward(grad_out[start:end], query[start:end], key, value,
                                      out[start:end], lse[:, :, start:end], start, bounds,
                                      grad_key, grad_value, scale, kernel,
                                      key_blocks_per_call=key_blocks)
        grad_query[start:end] = grad_q
    for got, leaf in zip((grad_query, grad_key, grad_value), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-13)


def test_a_query_block_must_be_one_of_the_blocks():
    query, key, value = _inputs()
    out, lse, kernel = attention_forward(query, key, value, 1.0)
    zeros = torch.zeros(key.shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="not one of the blocks"):
        query_block_backward(out[2:7], query[2:7], key, value, out[2:7], lse[:, :, 2:7], 2,
                             block_bounds(SEQ, 5), zeros, zeros.clone(), 1.0, kernel)


def _relative_error(got, expected):
    return ((got.float() - expected).norm() / expected.norm()).item()


@requires_cuda
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_gpu_blocks_are_as_accurate_as_the_whole_kernel_and_hold_less(kernel):
    """bf16 on the GPU, 8,192 tokens, 16 heads in 4 groups: the blocked backward's dQ, dK, dV are
    as close to an fp32 reference as SDPA's backward of the whole sequence with the same kernel,
    and its extra peak is lower."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    seq, heads, groups, dim, block = 8192, 16, 4, 64, 2048
    generator = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(seq, 1, heads, dim), (seq, 1, groups, dim), (seq, 1, groups, dim)]
    query, key, value = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=generator)
                         for s in shapes)
    grad_out = torch.randn(seq, 1, heads, dim, device="cuda", dtype=torch.bfloat16,
                           generator=generator)
    scale = dim ** -0.5

    def sdpa(q, k, v):
        backend = backends[kernel] if q.dtype == torch.bfloat16 else SDPBackend.MATH
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                 is_causal=True, scale=scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3)

    leaves = [t.float().requires_grad_(True) for t in (query, key, value)]
    sdpa(*leaves).backward(grad_out.float())  # fp32 reference (math kernel)
    reference = [leaf.grad for leaf in leaves]
    del leaves

    bf16 = [t.clone().requires_grad_(True) for t in (query, key, value)]
    whole_out = sdpa(*bf16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    whole_out.backward(grad_out)
    whole_peak = torch.cuda.max_memory_allocated() - before
    whole_errors = [_relative_error(t.grad, r) for t, r in zip(bf16, reference)]

    out, lse, ran = attention_forward(query, key, value, scale, [kernel])
    assert ran == kernel
    torch.testing.assert_close(out, whole_out.detach(), rtol=0, atol=0)  # the same kernel
    del whole_out, bf16
    bounds = block_bounds(seq, block)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grad_key = torch.zeros(key.shape, dtype=torch.float32, device="cuda")
    grad_value = torch.zeros_like(grad_key)
    grad_query = torch.empty_like(query)
    for start, end in reversed(bounds):
        grad_query[start:end] = query_block_backward(
            grad_out[start:end], query[start:end], key, value, out[start:end],
            lse[:, :, start:end], start, bounds, grad_key, grad_value, scale, kernel)
    blocked_peak = torch.cuda.max_memory_allocated() - before
    blocked_errors = [_relative_error(g, r)
                      for g, r in zip((grad_query, grad_key, grad_value), reference)]
    for name, blocked, whole in zip("qkv", blocked_errors, whole_errors):
        assert blocked <= 2 * whole + 1e-4, (name, blocked_errors, whole_errors)
    assert blocked_peak < whole_peak, (blocked_peak, whole_peak)


def test_unmasked_calls_of_a_query_block_are_merged_up_to_the_key_blocks_per_call():
    bounds = block_bounds(23, 3)  # 8 blocks, the last of 2 rows
    start, end = bounds[-1]
    assert attention_pairs(start, end, bounds, (0, 23), key_blocks_per_call=1) == [
        ((21, 23), (k, k + 3), NO_MASK) for k in range(0, 21, 3)] + [((21, 23), (21, 23), CAUSAL)]
    # spans of 3 blocks counted from the first key, then the rest, then the diagonal
    assert attention_pairs(start, end, bounds, (0, 23), key_blocks_per_call=3) == [
        ((21, 23), (0, 9), NO_MASK), ((21, 23), (9, 18), NO_MASK), ((21, 23), (18, 21), NO_MASK),
        ((21, 23), (21, 23), CAUSAL)]
    assert attention_pairs(start, end, bounds, (0, 23), key_blocks_per_call=100) == [
        ((21, 23), (0, 21), NO_MASK), ((21, 23), (21, 23), CAUSAL)]
    # a document that starts inside an earlier key block: its keys from there on, merged
    assert attention_pairs(start, end, bounds, (0, 10, 23), key_blocks_per_call=100) == [
        ((21, 23), (10, 21), NO_MASK), ((21, 23), (21, 23), CAUSAL)]
