"""Sparse multi-latent attention in absorbed form
(:mod:`megatron.bounded.attention.sparse_mla_latent`) against the non-absorbed sparse attention
fed with the expanded per-head keys and values, in float64:

* output and the gradients of q_nope, q_rope, the latent, the key's rotary part, W_UK and W_UV
  equal (1e-10 relative) for the blockwise top-k's indices (causal, packed documents, -1 entries)
  and for random indices with -1 entries, at several block sizes;
* the function keeps for backward its inputs and the log-sum-exp only, and neither its forward
  nor its backward makes a tensor of s × heads × kv_lora elements (the expanded path does);
* the indexer loss's target sums equal the non-absorbed ones;
* the kv up-projection's weight splits as upstream's layer lays it out;
* a DeepSeek-V3.2-shaped model with ``--chunked-recompute-tokens`` attends in latent form (its
  kv up-projection never runs) and gives the loss and gradients of the expanded form (fp32);
  ``--chunked-recompute-attention`` stays refused with it;
* the memory budget's attention of a DSA layer in latent form (DeepSeek-V3.2's widths) grows
  linearly in N, by a few bytes per unit of kv_lora per token (not heads times that), and stays
  below the expanded form's by at least the expanded keys and values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.bounded.attention.sparse_attention import (
    attention_target_sums_reference,
    sparse_attention_reference,
)
from megatron.bounded.attention.sparse_indexer import blockwise_topk, document_starts
from megatron.bounded.attention.sparse_mla_latent import (
    latent_attention_target_sums,
    latent_working_set_bytes,
    sparse_mla_latent_attention,
    split_kv_up_weight,
)
from tests.unit.loss.test_ring_dtp import _LargestTensor
from tests.unit.attention.test_sparse_attention import DOCUMENTS, _documents, _indexer_inputs

F64 = torch.float64
HEADS, NOPE, ROPE, V_DIM, KV_LORA = 3, 5, 4, 6, 7


def _latent_inputs(seq, batch=2, seed=5):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64).requires_grad_()

    return (randn(seq, batch, HEADS, NOPE), randn(seq, batch, HEADS, ROPE),
            randn(seq, batch, KV_LORA), randn(seq, batch, ROPE),
            randn(HEADS, NOPE, KV_LORA), randn(HEADS, V_DIM, KV_LORA))


def _expanded(q_nope, q_rope, latent, krope, w_uk, w_uv):
    """The non-absorbed query, key and value: every head its own key and value."""
    query = torch.cat((q_nope, q_rope), dim=-1)
    key = torch.cat((torch.einsum("sbc,hdc->sbhd", latent, w_uk),
                     krope.unsqueeze(2).expand(*q_rope.shape)), dim=-1)
    value = torch.einsum("sbc,hec->sbhe", latent, w_uv)
    return query, key, value


def _random_indices(seq, batch, topk, seed=7):
    """[b, s, k] random causal keys (repeats allowed) with -1 entries, and some rows all -1."""
    generator = torch.Generator().manual_seed(seed)
    limit = torch.arange(1, seq + 1).view(1, -1, 1)
    indices = (torch.rand(batch, seq, topk, generator=generator, dtype=F64) * limit).long()
    none = torch.rand(batch, seq, topk, generator=generator) < 0.3
    indices = indices.masked_fill(none, -1)
    indices[:, 3] = -1
    return indices.to(torch.int32)


def _topk_indices(seq, topk, packed):
    q, weights, k = _indexer_inputs(seq, seed=3)
    documents = _documents(DOCUMENTS, seq) if packed else None
    return blockwise_topk(q, weights, k, topk, document_starts(documents, 2, seq, "cpu"))


def _assert_relative(got, want, tol=1e-10):
    scale = want.abs().max().clamp_min(1e-300)
    assert ((got - want).abs().max() / scale).item() <= tol


@pytest.mark.parametrize("source", ["causal", "documents", "random"])
def test_absorbed_equals_expanded_sparse_attention(source):
    seq, topk, scale = 40, 9, 0.29
    if source == "random":
        indices = _random_indices(seq, 2, topk)
    else:
        indices = _topk_indices(seq, topk, source == "documents")
    assert (indices < 0).any()  # the -1 entries are exercised
    inputs = _latent_inputs(seq)
    grad = torch.randn(seq, 2, HEADS, V_DIM, dtype=F64,
                       generator=torch.Generator().manual_seed(8))
    expected = sparse_attention_reference(*_expanded(*inputs), indices, scale, rows=11)
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    for rows in (seq, 7, 1):
        out = sparse_mla_latent_attention(*inputs, indices, scale, rows=rows)
        _assert_relative(out, expected)
        grads = torch.autograd.grad(out, inputs, grad)
        for got, want in zip(grads, expected_grads):
            _assert_relative(got, want)
    if source == "random":  # a row without keys attends to nothing
        assert out[3].abs().max() == 0


def test_target_sums_equal_the_expanded_ones():
    seq, topk, scale = 40, 9, 0.29
    indices = _topk_indices(seq, topk, True)
    inputs = _latent_inputs(seq, seed=9)
    query, key, _ = _expanded(*inputs)
    want = attention_target_sums_reference(query.detach(), key.detach(), indices, scale, 5)
    q_nope, q_rope, latent, krope, w_uk, _ = inputs
    got = latent_attention_target_sums(q_nope, q_rope, latent, krope, w_uk, indices, scale, 6)
    _assert_relative(got, want)


def test_saved_tensors_and_working_set_never_hold_s_by_heads_by_kv_lora():
    """Long enough that s·b·heads·kv_lora is the largest tensor the expanded path makes: the
    absorbed path saves only its inputs (no tensor that size) and makes none that size in
    forward or backward."""
    seq, batch, topk, rows = 512, 1, 8, 16
    heads, kv_lora = 8, 128
    generator = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    inputs = (randn(seq, batch, heads, 16), randn(seq, batch, heads, 8), randn(seq, batch, kv_lora),
              randn(seq, batch, 8), randn(heads, 16, kv_lora), randn(heads, 16, kv_lora))
    indices = _random_indices(seq, batch, topk)
    bound = seq * batch * heads * kv_lora
    mode = _LargestTensor()
    with mode:
        out = sparse_mla_latent_attention(*inputs, indices, 0.2, rows=rows)
        saved = out.grad_fn.saved_tensors
        out.sum().backward()
    assert mode.largest < bound // 4, (mode.largest, bound)
    assert {t.data_ptr() for t in saved} >= {t.data_ptr() for t in inputs}
    assert len(saved) == len(inputs) + 2  # the inputs, the indices and the log-sum-exp
    assert max(t.numel() for t in saved) < bound
    # the guard sees it: the expanded keys and values are s × heads × d each
    mode = _LargestTensor()
    with mode:
        _expanded(*(t.detach() for t in inputs))
    assert mode.largest >= seq * batch * heads * 16


def test_working_set_grows_linearly_in_tokens_not_with_heads_times_kv_lora():
    shape = dict(topk=2048, heads=128, kv_lora=512, rope_dim=64)
    small, large = (latent_working_set_bytes(tokens=n, **shape) for n in (1 << 18, 1 << 20))
    assert large["saved"] == 4 * small["saved"]
    assert large["transient"] - small["transient"] == 3 * (1 << 18) * (512 + 64) * 4
    # the expanded keys and values of 1M tokens at DeepSeek-V3.2's widths, bf16: 80 GiB
    expanded = (1 << 20) * 128 * (128 + 64 + 128) * 2
    assert large["saved"] + large["transient"] < expanded / 20


def test_kv_up_weight_splits_as_upstreams_layer_lays_it_out():
    """Upstream's layer views linear_kv_up_proj's output [.., heads · (nope + v)] as
    [.., heads, nope + v] and splits the last dimension into k_nope and v."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(HEADS * (NOPE + V_DIM), KV_LORA, generator=generator, dtype=F64)
    latent = torch.randn(4, 2, KV_LORA, generator=generator, dtype=F64)
    kv = torch.nn.functional.linear(latent, weight).view(4, 2, HEADS, NOPE + V_DIM)
    k_nope, value = torch.split(kv, [NOPE, V_DIM], dim=-1)
    w_uk, w_uv = split_kv_up_weight(weight, HEADS, NOPE, V_DIM)
    torch.testing.assert_close(torch.einsum("sbc,hdc->sbhd", latent, w_uk), k_nope)
    torch.testing.assert_close(torch.einsum("sbc,hec->sbhe", latent, w_uv), value)


def _dsa_model_body(rank, world_size, chunk_flags):
    from tests.conftest import keep_upstream_dispatcher_on_cpu
    from tests.unit.model.test_families import _build, _parse, _train_step
    from tests.unit.attention.test_sparse_attention import _deepseek_v32_flags

    torch._dynamo.config.disable = True
    keep_upstream_dispatcher_on_cpu()
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1", "--bounded-moe-backend", "torch",
                 "--moe-expert-rank-capacity-factor", "8",
                 # seq_aux_loss does not split over chunks
                 "--moe-router-load-balancing-type", "aux_loss"]
    flags = [flag for flag in _deepseek_v32_flags(*recompute, *chunk_flags)
             if flag not in ("--bf16", "--sequence-parallel")]  # fp32: compare within rounding
    args, settings = _parse(flags)
    torch.manual_seed(0)
    model = _build(args, settings)
    attentions = [layer.self_attention for layer in model.decoder.layers]
    latent = [attention.latent_form for attention in attentions]
    calls = []
    for attention in attentions:  # count the kv up-projection's calls
        attention.linear_kv_up_proj.register_forward_hook(lambda *_: calls.append(1))
    loss, missing, bad, _ = _train_step(model, args)
    grads = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    return loss, grads, missing + bad, latent, len(calls)


@pytest.mark.slow  # builds a model or plans at DeepSeek-V3.2's widths
def test_dsa_model_in_latent_form_equals_the_expanded_form():
    """--chunked-recompute-tokens on a DeepSeek-V3.2-shaped model (MLA + DSA with its indexer
    loss): its layers attend in latent form, never call the kv up-projection, and give the loss
    and every gradient of the expanded form without chunks (fp32)."""
    from tests.unit.distributed import run_on_ranks

    loss, grads, problems, latent, calls = run_on_ranks(_dsa_model_body, 1, args=([],),
                                                        timeout_s=300)[0]
    chunked_loss, chunked_grads, chunked_problems, chunked_latent, chunked_calls = run_on_ranks(
        _dsa_model_body, 1, args=(["--chunked-recompute-tokens", "16"],), timeout_s=300)[0]
    assert not problems and not chunked_problems, problems + chunked_problems
    assert latent == [False] * 4 and chunked_latent == [True] * 4
    assert calls > 0 and chunked_calls == 0
    assert sorted(grads) == sorted(chunked_grads)
    assert any(".indexer." in name for name in grads)  # the indexer loss trains the indexer
    assert abs(chunked_loss - loss) <= 1e-6 * abs(loss), (loss, chunked_loss)
    largest = max(float(abs(grad).max()) for grad in grads.values())
    for name, grad in grads.items():  # fp32, sums in another order
        got, want = torch.from_numpy(chunked_grads[name]), torch.from_numpy(grad)
        assert (got - want).abs().max() <= 1e-4 * float(want.abs().max()) + 1e-6 * largest, name


def _parse_body(rank, world_size, extra):
    from tests.unit.model.test_families import _parse
    from tests.unit.attention.test_sparse_attention import _deepseek_v32_flags

    recompute = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1", "--bounded-moe-backend", "torch",
                 "--moe-expert-rank-capacity-factor", "8", "--moe-router-load-balancing-type",
                 "aux_loss", "--chunked-recompute-tokens", "16", *extra)
    flags = [flag for flag in _deepseek_v32_flags(*recompute) if flag != "--sequence-parallel"]
    try:
        return _parse(flags)[0].chunked_recompute_tokens
    except AssertionError as refused:
        return str(refused)


@pytest.mark.slow  # builds a model or plans at DeepSeek-V3.2's widths
def test_dsa_with_chunked_recompute_parses_and_chunked_attention_stays_refused():
    from tests.unit.distributed import run_on_ranks

    assert run_on_ranks(_parse_body, 1, args=((),), timeout_s=180)[0] == 16
    refusal = run_on_ranks(_parse_body, 1, args=(("--chunked-recompute-attention",),),
                           timeout_s=180)[0]
    assert "refused" in refusal, refusal
    assert "--chunked-recompute-attention" in refusal and "--multi-latent-attention" in refusal


def _chunked_recompute_flags():
    from tests.unit.attention.test_sparse_attention import _deepseek_v32_flags

    recompute = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1", "--bounded-moe-backend", "torch",
                 "--moe-expert-rank-capacity-factor", "8", "--moe-router-load-balancing-type",
                 "aux_loss", "--chunked-recompute-tokens", "4096")
    return [flag for flag in _deepseek_v32_flags(*recompute) if flag != "--sequence-parallel"]


def _deepseek_v32_widths_config(flags):
    from megatron.bounded.budget.config import BudgetConfig
    from tests.unit.model.test_families import _parse

    args, settings = _parse(flags)
    cfg = BudgetConfig.from_args(args, settings)
    return cfg.replace(heads=128, mla=dataclasses.replace(
        cfg.mla, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, dsa_topk=2048, dsa_index_heads=64, dsa_index_dim=128))


def _budget_body(rank, world_size):
    """Per-token bytes of the DSA layer's attention in the budget, latent and expanded form, at
    DeepSeek-V3.2's attention widths (128 heads, kv_lora 512, q/k 128 + 64, v 128, top-2048)."""
    from megatron.bounded.budget.widths import activation_widths, recomputed_layer_bytes_per_token

    cfg = _deepseek_v32_widths_config(_chunked_recompute_flags())
    wider = cfg.replace(mla=dataclasses.replace(cfg.mla, kv_lora_rank=1024))

    def attention_bytes(config, tokens):
        """What the recomputed layer keeps plus attention's backward, at ``tokens`` tokens."""
        config = config.replace(seq_length=tokens)
        return tokens * (recomputed_layer_bytes_per_token(config, moe=False)
                         + activation_widths(config)["attn_grad"])

    expanded = cfg.with_flags(chunked_recompute_tokens=0)
    sizes = (1 << 18, 1 << 20)
    return ([attention_bytes(cfg, n) for n in sizes], [attention_bytes(expanded, n) for n in sizes],
            attention_bytes(wider, sizes[1]), cfg.act_bytes)


@pytest.mark.slow  # builds a model or plans at DeepSeek-V3.2's widths
def test_budget_counts_the_latent_form_linearly_without_heads_times_kv_lora():
    from megatron.bounded.units import GiB
    from tests.unit.distributed import run_on_ranks

    (small, large), (_, large_expanded), wider, b = run_on_ranks(
        _budget_body, 1, timeout_s=180)[0]
    n = 1 << 18
    heads, kv_lora, q_dim = 128, 512, 128 + 64
    # linear in N: four times the tokens, four times the bytes but for a part that does not grow
    # (one block's working set, within 256 MiB, or the top-k pass's 1 GiB of scores), counted
    # once at either length
    assert 4 * small - 3 * 2 * GiB <= large <= 4 * small
    # a wider latent costs per token a few times its width, not heads times it (a per-head
    # latent of every token would)
    assert wider - large < 4 * n * 16 * kv_lora
    assert large > 4 * n * heads * q_dim * b  # the query, kept as any attention keeps it
    # below the expanded form by at least its expanded keys and padded values, 2·heads·(qk + pos)
    assert large_expanded - large >= 4 * n * 2 * heads * q_dim * b
    # at 1M tokens the expanded form's attention alone exceeds one 80 GB GPU; the latent form's
    # stays far below
    assert large_expanded > 80e9 and large < large_expanded / 2


def _latent_layer_working_set_body(rank, world_size):
    """The budget's recompute working set of a dense DSA layer (no MoE) under chunked recompute
    at DeepSeek-V3.2's attention widths, at 2**18 tokens, and its bytes per token."""
    from megatron.bounded.budget.phases import recompute_phases

    cfg = _deepseek_v32_widths_config(_chunked_recompute_flags())
    tokens = 1 << 18
    cfg = cfg.replace(seq_length=tokens)
    terms, _ = recompute_phases(cfg, 0, 1, 0, 4, False, (0, ""))["layer"]
    return terms["recompute_working_set"], cfg.act_bytes


def _measured_latent_attention_bytes(seq):
    """(bytes of the distinct storages sparse_mla_latent_attention saves for its backward, bytes
    of its output's gradient and of the gradients it returns) at DeepSeek-V3.2's widths, bf16,
    ``seq`` tokens, every query with 2048 selected-key slots (-1 past the causal ones)."""
    heads, nope, rope, v_dim, kv_lora, topk = 128, 128, 64, 128, 512, 2048
    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    query = torch.randn(seq, 1, heads, nope + rope, generator=gen).to(bf16).requires_grad_()
    key = torch.randn(seq, 1, kv_lora + rope, generator=gen).to(bf16).requires_grad_()
    kv_up = (torch.randn(heads * (nope + v_dim), kv_lora, generator=gen) / 30).to(bf16)
    kv_up.requires_grad_()
    positions = torch.arange(topk).view(1, 1, -1)
    indices = torch.where(positions <= torch.arange(seq).view(1, -1, 1), positions, -1)
    indices = indices.to(torch.int32)
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    q_nope, q_rope = torch.split(query, [nope, rope], dim=-1)
    latent, krope = torch.split(key, [kv_lora, rope], dim=-1)
    w_uk, w_uv = split_kv_up_weight(kv_up, heads, nope, v_dim)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = sparse_mla_latent_attention(q_nope, q_rope, latent, krope, w_uk, w_uv, indices,
                                             heads ** -0.5)
    grad_output = torch.ones_like(output)
    output.backward(grad_output)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (query, key))
    return sum(saved.values()), grad_output.numel() * grad_output.element_size() + grads


@pytest.mark.slow  # builds a model or plans at DeepSeek-V3.2's widths
def test_budget_keeps_what_the_latent_attention_saves_and_its_gradients():
    """Under chunked recompute a DSA layer keeps, while its attention's backward runs, at least
    what the latent attention saved (the query, the latent, the selected keys, the log-sum-exp)
    and the gradients that backward takes and returns: the budget's recompute working set of the
    layer is at least those, measured per token on the function itself (the difference between
    two lengths, so that the weights' views do not count)."""
    from tests.unit.distributed import run_on_ranks

    short, long = _measured_latent_attention_bytes(8), _measured_latent_attention_bytes(16)
    saved_per_token = (long[0] - short[0]) // 8
    grads_per_token = (long[1] - short[1]) // 8
    # the query [heads, qk + pos] alone, in bf16, and the int32 selected keys
    assert saved_per_token >= 128 * 192 * 2 + 2048 * 4
    working_set, _ = run_on_ranks(_latent_layer_working_set_body, 1, timeout_s=180)[0]
    assert working_set >= (1 << 18) * (saved_per_token + grads_per_token), (
        working_set / (1 << 18), saved_per_token, grads_per_token)
