"""Multi-latent attention (DeepSeek's MLA) in the TE-free layer, on CPU in float64: our layer (our
spec, SDPA core attention) equals upstream's local MLA layer (upstream's local spec, its
``DotProductAttention`` materializing the scores) with the same weights, outputs and every
gradient; the value padding the CUDA kernels need is exact; a GPT with MLA and our MoE runs
forward and backward under chunked recompute; CP = 2 equals CP = 1; packed documents equal each
document alone. One GPU test: bf16 at 32,768 tokens with DeepSeek's head dimensions."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    one_cpu_rank,
    keep_upstream_rotary_on_cpu,
    requires_cuda,
    small_bounded_gpt,
)
from tests.unit.comparisons import assert_context_parallel_share
from tests.unit.distributed import run_on_ranks

from megatron.bounded.attention.head_dims import pad_value_head_dim, with_value_padded

VOCAB, SEQ = 64, 24
# small MLA dimensions: q/k heads of 8 + 4 (rotary) and values of 6
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, qk_layernorm=True, rope_type="rope")
# without q LoRA (DeepSeek-V2-Lite, Moonlight): upstream's local layer has no norm to put on q
NO_Q_LORA = dict(q_lora_rank=None, qk_layernorm=False)
YARN = dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707,
            original_max_position_embeddings=4)


# --- value padding ---------------------------------------------------------------------------------

def test_value_padding_is_exact():
    """The padded call the CUDA kernels get equals the unpadded one, output and gradients."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 10, 12, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 4, 10, 6, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, 4, 10, 6, generator=generator, dtype=torch.float64)

    def run(padded: bool):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        kernel = lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, scale=0.3)  # noqa: E731
        out = with_value_padded(kernel, *leaves) if padded else kernel(*leaves)
        out.backward(grad)
        return out, [t.grad for t in leaves]

    (out, grads), (expected, expected_grads) = run(True), run(False)
    assert out.shape == expected.shape == v.shape
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)
    assert pad_value_head_dim(v, 12).shape[-1] == 12
    assert torch.equal(pad_value_head_dim(v, 12)[..., 6:], torch.zeros(2, 4, 10, 6, dtype=v.dtype))
    with pytest.raises(ValueError, match="wider"):
        pad_value_head_dim(q, 6)


# --- our layer against upstream's local layer -------------------------------------------------------

def _upstream_core_attention():
    """Upstream's local core attention, as upstream's local MLA spec names it. megatron-core
    0.19.2's ``MLASelfAttention`` passes it ``k_channels``/``v_channels``, which its
    ``DotProductAttention`` does not take: it reads the value head from ``config.kv_channels``
    (set to ``v_head_dim``) and scores with any q/k head, so the two are dropped here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class UpstreamDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return UpstreamDotProductAttention


def _layer(ours: bool, mla: dict):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.bounded.model.config import BoundedMLATransformerConfig
    from megatron.bounded.model.specs import use_bounded_mla, use_sdpa_attention

    fields = dict(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  kv_channels=mla["v_head_dim"], attention_dropout=0.0, hidden_dropout=0.0,
                  normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                  params_dtype=torch.float64, init_method_std=0.2, transformer_impl="local",
                  **mla)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm",
                                    qk_layernorm=mla["qk_layernorm"])
    if ours:
        config = BoundedMLATransformerConfig(**fields)
        use_bounded_mla(use_sdpa_attention(spec), config)
    else:
        config = MLATransformerConfig(**fields)
        spec.submodules.self_attention.submodules.core_attention = _upstream_core_attention()
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=1).double()


def _layers_agree(rank, world_size, mla):
    from megatron.core import tensor_parallel

    with one_cpu_rank():
        ours, upstream = _layer(True, mla), _layer(False, mla)
        upstream.load_state_dict(ours.state_dict())
        # no dropout: upstream's attention forks the CUDA generator for it all the same
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *args: contextlib.nullcontext()
        hidden = torch.randn(SEQ, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        grad = torch.randn_like(hidden)
        # upstream's causal mask (True: masked); ours ignores it, attention being causal
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        results = []
        for layer in (ours, upstream):
            x = hidden.clone().requires_grad_(True)
            out, _ = layer(x, attention_mask=mask)
            out.backward(grad)
            results.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
        kinds = (type(ours.self_attention.core_attention).__name__,
                 type(upstream.self_attention.core_attention).__name__)
    (out, grad_x, grads), (want, want_x, want_grads) = results
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(grad_x, want_x, rtol=1e-11, atol=1e-12)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    return kinds, sorted(grads)


@pytest.mark.parametrize("mla", [
    pytest.param(MLA, id="q-lora-rope"),
    pytest.param({**MLA, **NO_Q_LORA}, id="no-q-lora"),
    pytest.param({**MLA, **YARN}, id="q-lora-yarn-mscale"),
    pytest.param({**MLA, **YARN, **NO_Q_LORA}, id="no-q-lora-yarn-mscale"),
])
def test_mla_layer_equals_upstreams_local_layer(mla):
    kinds, names = run_on_ranks(_layers_agree, 1, args=(mla,), timeout_s=180)[0]
    assert kinds == ("SDPACoreAttention", "UpstreamDotProductAttention")
    q_projections = {"self_attention.linear_q_proj.weight"} if mla["q_lora_rank"] is None else {
        "self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight"}
    assert q_projections <= set(names)


def _softmax_scales(rank, world_size):
    with one_cpu_rank():
        attention = _layer(True, {**MLA, **YARN}).self_attention
        return attention.softmax_scale, attention.core_attention.softmax_scale


def test_yarn_softmax_scale_is_mlas():
    """The scale our core attention applies is the one upstream's MLA hands it: mscale² /
    sqrt(qk + pos) with YaRN's mscale_all_dim (not 1/sqrt of the value head)."""
    mla_scale, core_scale = run_on_ranks(_softmax_scales, 1, timeout_s=120)[0]
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert core_scale == mla_scale
    assert core_scale == pytest.approx(mscale * mscale / math.sqrt(8 + 4), rel=1e-12)


# --- a GPT model with MLA ------------------------------------------------------------------------

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
           moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
           bounded_moe_backend="torch", moe_grouped_gemm=False, pipelined_llep=True,
           pipelined_llep_token_budget=4)


def _gpt(**config):
    return small_bounded_gpt(SEQ, VOCAB, **{**MLA, **YARN, **config})


def _tokens(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _losses_and_grads(model, tokens, documents=None, position_ids=None):
    model.train()
    model.zero_grad()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if position_ids is None:
        position_ids = torch.arange(inputs.shape[1]).expand_as(inputs)
    losses = model(inputs, position_ids, attention_mask=None, labels=labels,
                   packed_seq_params=documents)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def _moe_chunked(rank, world_size):
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    with one_cpu_rank():
        tokens = _tokens(1)
        expected = _losses_and_grads(_gpt(**MOE, **recompute), tokens)
        model = _gpt(**MOE, **recompute, chunked_recompute_tokens=5)
        got = _losses_and_grads(model, tokens)
        kinds = (type(model.decoder.layers[0]).__name__,
                 type(model.decoder.layers[0].self_attention).__name__,
                 type(model.decoder.layers[0].mlp).__name__)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-13, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-12, atol=1e-14,
                                   msg=name)
    return kinds, sorted(got[1])


def test_mla_moe_model_with_chunked_recompute_equals_unchunked():
    """MLA, our MoE layer (PipelinedLLEP), full recompute: chunks of 5 tokens give the losses
    and gradients of the unchunked model."""
    kinds, names = run_on_ranks(_moe_chunked, 1, timeout_s=240)[0]
    assert kinds == ("ChunkedRecomputeTransformerLayer", "BoundedMLASelfAttention",
                     "BoundedMoELayer")
    assert any("linear_kv_down_proj" in name for name in names)


def _context_parallel(rank, world_size):
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    tokens = _tokens(2)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1)
    try:
        expected = _losses_and_grads(_gpt(), tokens)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world_size)
    try:
        model = _gpt(context_parallel_size=world_size, cp_comm_type="a2a")
        return assert_context_parallel_share(model, tokens, expected)
    finally:
        parallel_state.destroy_model_parallel()


def test_context_parallel_mla_equalsone_cpu_rank():
    """CP = 2 with the sequence-to-head all-to-all (values narrower than queries and keys in
    the exchange): the losses and gradients of CP = 1."""
    assert run_on_ranks(_context_parallel, 2, timeout_s=240) == [(2, SEQ // 2)] * 2


def _packed_equals_alone(rank, world_size, batch):
    from megatron.bounded.attention.documents import DocumentParams, ends_from_eod

    with one_cpu_rank():
        model = _gpt()
        tokens = _tokens(batch)
        for row, ends in ((0, (7, 8, 19)), (1, (13,)))[:batch]:  # documents of 7, 1, 11, 5; 13, 11
            tokens[row, list(ends)] = 0
        documents = DocumentParams.from_ends(ends_from_eod(tokens[:, :-1], 0), batch, SEQ)
        packed = _losses_and_grads(model, tokens, documents)
        losses, grads = torch.full((batch, SEQ), float("nan"), dtype=torch.float64), None
        for index, bounds in enumerate(documents.sequences):
            for start, end in zip(bounds, bounds[1:]):
                got, got_grads = _losses_and_grads(model, tokens[index:index + 1, start:end + 1])
                losses[index, start:end] = got[0]
                grads = got_grads if grads is None else {n: grads[n] + g
                                                         for n, g in got_grads.items()}
        whole = _losses_and_grads(model, tokens)
    # rotary angles of a document at another offset are rounded differently (fp32 tables)
    scale = losses.abs().max().item()
    assert (packed[0] - losses).abs().max().item() <= 1e-6 * scale
    for name in grads:
        assert (packed[1][name] - grads[name]).abs().max().item() <= \
            1e-6 * grads[name].abs().max().item(), name
    return documents.count, (whole[0] - packed[0]).abs().max().item()


@pytest.mark.parametrize("batch", [1, 2])
def test_packed_documents_with_mla_equal_each_document_alone(batch):
    """One sequence per micro-batch (upstream's MLA would squeeze it away) and two."""
    count, difference_across_documents = run_on_ranks(_packed_equals_alone, 1, args=(batch,),
                                                      timeout_s=240)[0]
    assert count == (4, 6)[batch - 1]
    assert difference_across_documents > 1e-3  # without documents the losses differ


# --- one GPU, bf16 -------------------------------------------------------------------------------

def _blocked_fp32_reference(query, key, value, scale, block=2048):
    """Causal attention in fp32, [s, heads, d] in, [s, heads, d_v] out, query block by query
    block with plain PyTorch (scores materialized per block, recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    def rows(q, k, v, start):
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~allowed.tril(start), float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)

    pieces = [checkpoint(rows, query[start:start + block], key[:start + block],
                         value[:start + block], start, use_reentrant=False)
              for start in range(0, query.shape[0], block)]
    return torch.cat(pieces)


@pytest.mark.gpu
@requires_cuda
def test_gpu_deepseek_head_dims_at_32768_tokens_match_fp32():
    """bf16 on one GPU, DeepSeek's per-head dimensions (16 heads, q/k 128 + 64, v 128) at
    32,768 tokens through SDPACoreAttention (values padded to 192 for flash): output and dQ, dK,
    dV within 2e-2 relative (Frobenius) error of an fp32 reference from the same bf16 inputs."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.bounded.attention.core import SDPACoreAttention

    class _OneRank:
        tp = type("TP", (), {"size": lambda self: 1})()

    seq, heads, qk_dim, v_dim = 32_768, 16, 192, 128
    config = MLATransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=heads,
                                  attention_dropout=0.0, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                  v_head_dim=v_dim)
    scale = qk_dim ** -0.5
    attention = SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self", softmax_scale=scale,
                                  pg_collection=_OneRank(), k_channels=qk_dim, v_channels=v_dim)
    generator = torch.Generator(device="cuda").manual_seed(3)
    shapes = [(seq, 1, heads, qk_dim), (seq, 1, heads, qk_dim), (seq, 1, heads, v_dim)]
    inputs = [torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=generator)
              for s in shapes]
    grad_out = torch.randn(seq, 1, heads * v_dim, device="cuda", dtype=torch.bfloat16,
                           generator=generator)

    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = attention(*leaves, attention_mask=None)
    out.backward(grad_out)
    got = [out.detach()] + [leaf.grad for leaf in leaves]

    reference_leaves = [t.float().squeeze(1).requires_grad_(True) for t in inputs]
    reference = _blocked_fp32_reference(*reference_leaves, scale).reshape(seq, 1, -1)
    reference.backward(grad_out.float())
    expected = [reference.detach()] + [leaf.grad.unsqueeze(1) for leaf in reference_leaves]

    assert out.shape == (seq, 1, heads * v_dim) and out.dtype == torch.bfloat16
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        error = ((g.float() - e).norm() / e.norm()).item()
        assert error <= 2e-2, (name, error)


# --- the memory budget's MLA terms -----------------------------------------------------------------

def _budget_args(mla: dict, **overrides):
    import argparse

    args = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                kv_channels=8, seq_length=SEQ, max_position_embeddings=SEQ, micro_batch_size=1,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, untie_embeddings_and_output_weights=True,
                vocab_size=VOCAB, make_vocab_size_divisible_by=1, bf16=True,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, world_size=1, data_parallel_size=1, hbm_gb=1.0,
                **{k: v for k, v in mla.items() if k not in ("rope_type", *YARN)})
    return argparse.Namespace(**{**args, **overrides})


def _built_parameters(rank, world_size, mla):
    with one_cpu_rank():
        model = _gpt(**mla)
        return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mla", [
    pytest.param(MLA, id="q-lora"), pytest.param({**MLA, **NO_Q_LORA}, id="no-q-lora")])
def test_budget_parameters_equal_the_built_models(mla):
    from megatron.bounded import budget as B

    built = run_on_ranks(_built_parameters, 1, args=(mla,), timeout_s=180)[0]
    counts = B.parameter_counts(_budget_args(mla))
    assert counts["dense"] + counts["expert"] + counts["ring_output"] == built
    # the projections by hand, per layer (H 32, 4 heads of 8 + 4 and v 6, r_q 16, r_kv 12)
    q = 32 * 16 + 16 * 4 * 12 + 16 if mla["q_lora_rank"] else 32 * 4 * 12
    kv = 32 * (12 + 4) + 12 * 4 * (8 + 6) + (12 if mla["qk_layernorm"] else 0)
    attention = q + kv + 4 * 6 * 32 + 32
    mlp = 32 * 64 * 2 + 64 * 32 + 32
    assert built == 2 * (attention + mlp) + 2 * VOCAB * 32 + 32


def test_budget_activation_widths_of_mla():
    """Per token, bf16: the attention of any layer, b·(4H + 3·q + 2·k) + 4·heads with MLA's q/k
    width heads·(qk+pos) and the values padded to it, plus the latents MLA's projections save
    (q down and its norm 2·r_q, kv down r_kv + pos and its norm r_kv) less the output
    projection's input being heads·v wide; the rotary table the positional part's."""
    from megatron.bounded import budget as B
    from megatron.bounded.budget import widths as W

    config = B.BudgetConfig.from_args(_budget_args(MLA))
    assert W.token_widths(config) == (32, 4 * 12, 4 * 12)
    latents = 2 * (16 + 12) + 4 - 4 * (12 - 6)
    assert W.activation_widths(config)["attn_saved"] == \
        2 * (4 * 32 + 3 * 48 + 2 * 48) + 4 * 4 + 2 * latents
    assert W.boundary_and_rope_bytes(config)[1] == SEQ * 4 * 4
    plain = B.BudgetConfig.from_args(_budget_args({}))
    assert plain.mla is None and W._mla_saved_width(plain) == 0


def test_budget_recomputed_layer_of_mla_and_a_dense_layers_mlp():
    """Full recompute, per token, bf16, tensor by tensor as the allocator's snapshot of a
    multi-latent-attention layer shows them: two residuals 2·H, the two norms' outputs
    2·(H + 4 B), q, k, the padded value and the padded output 4·heads·(qk+pos), the output
    projection's input heads·v, the log-sum-exp, the latents (r_q, r_kv + 2·pos, the qk norms'
    r_q + r_kv + 8 B) and the rotary tables' fp32 pos twice. A stage with a dense layer
    (--moe-layer-freq) peaks in that layer's MLP backward when it is the larger: its fc1 output,
    that output's gradient and the activation's gradient, b·(2·2F + F)."""
    from megatron.bounded import budget as B
    from megatron.bounded.budget import widths as W

    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    # the dense layers' FFN 128 (fc1 256 wide)
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, ffn_hidden_size=128)
    config = B.BudgetConfig.from_args(_budget_args(MLA, **recompute, ffn_hidden_size=128))
    layer = 2 * 32 * 2 + 2 * (32 * 2 + 4) + 2 * 4 * (4 * 12 + 6) + 4 * 4 + 2 * (16 + 12 + 2 * 4) \
        + 2 * (16 + 12) + 8 + 2 * 4 * 4
    assert W.recomputed_layer_bytes_per_token(config, moe=False) == layer
    mlp_backward = 2 * (2 * 256 + 128)
    assert W.dense_mlp_backward_bytes_per_token(config) == mlp_backward
    boundary = SEQ * 32 * 2
    all_moe = B.estimate(_budget_args(MLA, **recompute, **moe, moe_layer_freq=[1, 1]))
    first_dense = B.estimate(_budget_args(MLA, **recompute, **moe, moe_layer_freq=[0, 1]))
    assert all_moe.details["peak_phase"] == first_dense.details["peak_phase"] == "layer"
    assert first_dense.terms["recompute_working_set"] == (
        SEQ * (layer + mlp_backward) + 2 * boundary + B.KERNEL_WORKSPACE_BYTES)
    assert first_dense.terms["moe_dispatch"] == 0
    assert all_moe.terms["recompute_working_set"] < first_dense.terms["recompute_working_set"]


def _normed_projection(rank, world_size, normalization):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.model.mla import NormedColumnParallelLinear

    with one_cpu_rank():
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                   normalization=normalization, use_cpu_initialization=True,
                                   params_dtype=torch.float64, layernorm_epsilon=1e-6)
        projection = NormedColumnParallelLinear(
            16, 24, config=config, init_method=torch.nn.init.normal_, gather_output=False,
            bias=False, skip_bias_add=False)
        with torch.no_grad():
            projection.layer_norm_weight.uniform_(0.5, 1.5)
            if projection.layer_norm_bias is not None:
                projection.layer_norm_bias.uniform_(-0.5, 0.5)
        x = torch.randn(5, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        out, _ = projection(x)
        if normalization == "RMSNorm":
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            normed = normed * projection.layer_norm_weight
        else:
            normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
                x.var(-1, unbiased=False, keepdim=True) + 1e-6)
            normed = normed * projection.layer_norm_weight + projection.layer_norm_bias
        torch.testing.assert_close(out, normed @ projection.weight.t(), rtol=1e-12, atol=1e-12)
        return sorted(name for name, _ in projection.named_parameters())


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_query_projection_with_qk_layernorm_and_no_q_lora_normalizes_its_input(normalization):
    """--qk-layernorm without --q-lora-rank: the query projection normalizes its input first
    (upstream's fused norm + linear, Transformer Engine's parameter names) instead of upstream's
    local layer refusing to build."""
    names = run_on_ranks(_normed_projection, 1, args=(normalization,), timeout_s=120)[0]
    assert names[-1] == "weight" and "layer_norm_weight" in names
    assert ("layer_norm_bias" in names) == (normalization == "LayerNorm")
