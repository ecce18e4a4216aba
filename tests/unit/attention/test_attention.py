"""SDPA core attention against a plain softmax reference (causal, GQA), on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.bounded.launch.arguments import BoundedArgumentError
from megatron.bounded.attention.core import SDPACoreAttention, sdpa_backends
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from torch.nn.attention import SDPBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.conftest import requires_cuda


class _SingleRankTP:
    def size(self):
        return 1


class _ProcessGroups:
    tp = _SingleRankTP()


def _config(heads=8, groups=2, head_dim=16, **overrides):
    fields = dict(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                  num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0)
    return TransformerConfig(**{**fields, **overrides})


def _attention(config, **kwargs):
    return SDPACoreAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=_ProcessGroups(), **kwargs,
    )


def reference_attention(query, key, value, scale):
    """Plain causal softmax attention on [s, b, heads, d] with GQA by repeating key/value."""
    seq, _, heads, _ = query.shape
    repeat = heads // key.shape[2]
    key = key.repeat_interleave(repeat, dim=2)
    value = value.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    context = torch.einsum("bhst,tbhd->sbhd", probs, value)
    return context.reshape(seq, query.shape[1], -1)


@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2), (4, 1)])
def test_matches_reference_values_and_gradients(heads, groups):
    torch.manual_seed(0)
    seq, batch, head_dim = 24, 3, 16
    attention = _attention(_config(heads, groups, head_dim))
    query = torch.randn(seq, batch, heads, head_dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(seq, batch, groups, head_dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(seq, batch, groups, head_dim, dtype=torch.float64, requires_grad=True)
    out = attention(query, key, value, attention_mask=None)
    expected = reference_attention(query, key, value, 1.0 / math.sqrt(head_dim))
    assert out.shape == (seq, batch, heads * head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), grad_out)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad_out)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-10)


def test_first_token_attends_only_to_itself():
    attention = _attention(_config(2, 2, 4))
    query, key = torch.randn(5, 1, 2, 4), torch.randn(5, 1, 2, 4)
    value = torch.randn(5, 1, 2, 4)
    out = attention(query, key, value, attention_mask=None)
    torch.testing.assert_close(out[0], value[0].reshape(1, -1))


def test_explicit_softmax_scale_is_used():
    torch.manual_seed(1)
    attention = _attention(_config(2, 2, 8), softmax_scale=0.05)
    query, key, value = (torch.randn(6, 2, 2, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        attention(query, key, value, attention_mask=None),
        reference_attention(query, key, value, 0.05),
    )


def test_dataloader_mask_is_ignored_because_attention_is_causal():
    torch.manual_seed(2)
    attention = _attention(_config(2, 2, 8))
    query, key, value = (torch.randn(6, 2, 2, 8) for _ in range(3))
    causal_mask = torch.triu(torch.ones(2, 1, 6, 6, dtype=torch.bool), diagonal=1)
    torch.testing.assert_close(
        attention(query, key, value, attention_mask=causal_mask),
        attention(query, key, value, attention_mask=None),
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"window_size": (128, 4)}, "--window-size 128,4 .only causal"),  # a right window: not causal
        ({"softmax_type": "off-by-one", "attention_dropout": 0.1},
         "--attention-dropout 0.1 with --softmax-type .*set --attention-dropout 0"),
    ],
)
def test_unsupported_features_are_refused(overrides, message):
    with pytest.raises(BoundedArgumentError, match=message):
        _attention(_config(**overrides))


def test_packed_sequences_are_refused():
    attention = _attention(_config(2, 2, 4))
    query = torch.randn(4, 1, 2, 4)
    with pytest.raises(ValueError, match="packed"):
        attention(query, query, query, attention_mask=None, packed_seq_params=object())


@pytest.mark.parametrize("attention_backend,first", [
    (AttnBackend.auto, SDPBackend.FLASH_ATTENTION),
    (AttnBackend.flash, SDPBackend.FLASH_ATTENTION),
    (AttnBackend.fused, SDPBackend.CUDNN_ATTENTION),
])
def test_attention_backend_picks_the_first_kernel(attention_backend, first):
    backends = sdpa_backends(attention_backend)
    assert backends[0] == first
    # flash and memory-efficient always follow: a kernel that refuses falls through, never to math
    assert backends[-2:] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert SDPBackend.MATH not in backends
    attention = _attention(_config(attention_backend=attention_backend))
    assert attention.backends == backends


@pytest.mark.gpu
@requires_cuda
def test_gpu_cudnn_backend_matches_flash():
    """``--attention-backend fused`` (cuDNN first) against the default (flash) on bf16 inputs of
    the small example's head layout, values and gradients."""
    torch.manual_seed(0)
    seq, batch, heads, groups, head_dim = 2048, 2, 16, 4, 64
    inputs = [torch.randn(seq, batch, h, head_dim, device="cuda", dtype=torch.bfloat16)
              for h in (heads, groups, groups)]
    grad_out = torch.randn(seq, batch, heads * head_dim, device="cuda", dtype=torch.bfloat16)

    def run(backend, only=None):
        attention = _attention(_config(heads, groups, head_dim, attention_backend=backend))
        if only is not None:
            attention.backends = [only]  # no fall-through: fails if the kernel refuses
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attention(*leaves, attention_mask=None)
        return [out, *torch.autograd.grad(out, leaves, grad_out)]

    flash, fused = run(AttnBackend.auto), run(AttnBackend.fused)
    cudnn_only = run(AttnBackend.fused, only=SDPBackend.CUDNN_ATTENTION)
    # the fused setting ran cuDNN's kernel, not a fallback (the forward is deterministic)
    assert torch.equal(fused[0], cudnn_only[0])
    for ours, reference in zip(fused, flash):
        error = ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
        assert error < 2e-2, error
