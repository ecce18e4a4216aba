"""Chunked recompute (--chunked-recompute-tokens): a GPT MoE model with full recompute, on CPU in
float64, gives the losses, the load-balancing loss and the gradients of the unchunked model; the
node saves only its input and frees the checkpoint's output (bad settings: test_bad_input.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    keep_upstream_checkpoint_on_cpu,
    keep_upstream_rotary_on_cpu,
    small_bounded_gpt,
)
from tests.unit.distributed import run_on_ranks

SEQ, BATCH, VOCAB = 24, 1, 64


def _model(chunk_tokens, experts=4, pipelined_llep=True, chunked_attention=False, tp=1,
           gate=False):
    moe = dict(
        num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
        bounded_moe_backend="torch", moe_grouped_gemm=False,
        pipelined_llep=pipelined_llep, pipelined_llep_token_budget=4 if pipelined_llep else None,
    ) if experts else {}
    return small_bounded_gpt(
        SEQ, VOCAB, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, chunked_recompute_tokens=chunk_tokens,
        chunked_recompute_attention=chunked_attention, tensor_model_parallel_size=tp,
        attention_output_gate=gate, **moe,
    )


def _run(model, batch):
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    model.train()
    losses = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"])
    losses.sum().backward()
    metrics = get_moe_metrics_tracker().metrics
    aux = {name: entry.values.clone() for name, entry in metrics.items()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, aux


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}


def _compare(rank, world_size, experts, pipelined_llep, chunk_tokens, chunked_attention=False,
             gate=False):
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    parallel_state.initialize_model_parallel(world_size, 1)  # tensor parallel over the ranks
    try:
        expected = _run(_model(0, experts, pipelined_llep, tp=world_size, gate=gate), _batch())
        chunked = _model(chunk_tokens, experts, pipelined_llep, chunked_attention, tp=world_size,
                         gate=gate)
        layer = chunked.decoder.layers[0]
        layer_class = type(layer).__name__
        # the input norm runs inside the QKV projection's chunks
        assert layer.input_layernorm.forward.__name__ == "input_norm"
        assert layer.self_attention.linear_qkv.forward.__name__ == "norm_and_qkv"
        attention_wrapped = layer.self_attention.forward.__name__ == "forward" and \
            "_chunk_attention" in layer.self_attention.forward.__qualname__
        assert attention_wrapped == chunked_attention
        reduces_in_node_backward = _count_projection_reduces_in_node_backward()
        got = _run(chunked, _batch())
    finally:
        parallel_state.destroy_model_parallel()
    # losses: bitwise, except that the chunked attention's whole-sequence softmax is computed
    # by another (plain PyTorch) kernel than SDPA's on CPU
    loss_rtol = 1e-13 if chunked_attention else 0
    torch.testing.assert_close(got[0], expected[0], rtol=loss_rtol, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-12, atol=1e-14,
                                   msg=name)
    for name in expected[2]:  # logged values: upstream's tracker sums the chunks in fp32
        torch.testing.assert_close(got[2][name], expected[2][name], rtol=1e-6, atol=0)
    # the node's backward differentiates the output projection without its all-reduce
    assert reduces_in_node_backward == [0]
    return layer_class, sorted(expected[2])


def _count_projection_reduces_in_node_backward() -> list:
    """[all-reduces of row-parallel output projections made inside the chunked attention
    node's backward], counted from now on in this process."""
    from megatron.core.tensor_parallel import layers

    from megatron.bounded.activations import chunked_attention

    count, inside = [0], [False]
    reduce = layers.reduce_from_tensor_model_parallel_region
    backward = chunked_attention._ChunkedAttention.backward

    def counted_reduce(*args, **kwargs):
        count[0] += inside[0]
        return reduce(*args, **kwargs)

    def marked_backward(ctx, *grads):
        inside[0] = True
        try:
            return backward(ctx, *grads)
        finally:
            inside[0] = False

    layers.reduce_from_tensor_model_parallel_region = counted_reduce
    chunked_attention._ChunkedAttention.backward = staticmethod(marked_backward)
    return count


@pytest.mark.parametrize("chunk_tokens", [5, 8])
def test_moe_model_equals_unchunked(chunk_tokens):
    layer_class, metrics = run_on_ranks(_compare, 1, args=(4, True, chunk_tokens), timeout_s=180)[0]
    assert layer_class == "ChunkedRecomputeTransformerLayer"
    assert "load_balancing_loss" in metrics


@pytest.mark.parametrize("experts,chunk_tokens", [(4, 5), (None, 8)])
def test_chunked_attention_model_equals_unchunked(experts, chunk_tokens):
    layer_class, _ = run_on_ranks(_compare, 1, args=(experts, bool(experts), chunk_tokens, True),
                                  timeout_s=180)[0]
    assert layer_class == "ChunkedRecomputeTransformerLayer"


@pytest.mark.parametrize("world_size", [1, 2])
def test_chunked_attention_with_an_output_gate_equals_unchunked(world_size):
    """--attention-output-gate (Qwen3-Next's full-attention layers): the gate, recomputed with
    q, k and v per chunk, gates attention's output before the projection; one rank and TP = 2."""
    results = run_on_ranks(_compare, world_size, args=(None, False, 8, True, True),
                           timeout_s=240)
    assert [layer_class for layer_class, _ in results] == \
        ["ChunkedRecomputeTransformerLayer"] * world_size


def test_chunked_attention_with_tensor_parallelism_equals_unchunked():
    """Two gloo ranks, TP = 2 (column-parallel QKV, row-parallel output projection, two heads and
    one key/value group per rank), dense model."""
    results = run_on_ranks(_compare, 2, args=(None, False, 8, True), timeout_s=240)
    assert [layer_class for layer_class, _ in results] == ["ChunkedRecomputeTransformerLayer"] * 2


def test_dense_model_equals_unchunked():
    layer_class, _ = run_on_ranks(_compare, 1, args=(None, False, 7), timeout_s=180)[0]
    assert layer_class == "ChunkedRecomputeTransformerLayer"


def test_chunked_block_saves_only_its_input_and_frees_the_output():
    from megatron.core.tensor_parallel import random as tp_random

    from megatron.bounded.activations.chunked_recompute import chunked_block

    weight = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(10, 1, 6, dtype=torch.float64, requires_grad=True)
    calls = []

    def block(chunk):
        calls.append((chunk.shape[0], torch.is_grad_enabled()))
        return chunk + torch.tanh(chunk @ weight)

    tp_random._set_checkpointing()  # as inside the recompute of upstream's checkpoint
    try:
        out = chunked_block(block, x, 4)
    finally:
        tp_random._unset_checkpointing()
    assert calls == [(4, False), (4, False), (2, False)]
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0] is x
    expected = x + torch.tanh(x @ weight)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert out.untyped_storage().size() == 0  # the output's storage was released
    assert calls[3:] == [(4, True), (4, True), (2, True)]
    gx, gw = torch.autograd.grad(expected, (x, weight), grad)
    torch.testing.assert_close(x.grad, gx, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(weight.grad, gw, rtol=1e-13, atol=1e-14)


def test_chunked_block_keeps_its_output_outside_a_checkpoint_recompute():
    from megatron.bounded.activations.chunked_recompute import chunked_block

    weight = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(10, 1, 6, dtype=torch.float64, requires_grad=True)
    out = chunked_block(lambda chunk: chunk @ weight, x, 3)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(out, x @ weight, rtol=0, atol=0)  # still readable


def test_released_bytes_per_token_counts_each_tensor_once():
    from megatron.bounded.activations.chunked_recompute import released_bytes_per_token

    # the small example: H 1024, 16 heads and 4 groups of 64, 32 experts, bf16
    layer_output, norms, qkv_less_v, router = 1024 * 2, 2 * (1024 * 2 + 4), (1024 + 256) * 2, 2 * 32 * 4
    assert released_bytes_per_token(1024, 1024, 256, 32, 2, fused_qkv=True) == (
        layer_output + norms + qkv_less_v + router)
    assert released_bytes_per_token(1024, 1024, 256, 0, 2, fused_qkv=True) == (
        layer_output + norms + qkv_less_v)
    # without a fused QKV projection (multi-latent attention) the input norm's output stays
    # (the down-projections save it) and so do the attention's inputs: the pre-MLP norm goes
    assert released_bytes_per_token(1024, 1024, 256, 32, 2, fused_qkv=False) == (
        layer_output + norms // 2 + router)
