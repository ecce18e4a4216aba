"""DeepSeek sparse attention (``--experimental-attention-variant dsa``) on the local
implementation: the blockwise indexer top-k, the sparse attention, the indexer loss and the
model, against float64 references that materialize the s × s scores.

* the blockwise top-k equals the dense scores' top-k (causal, packed documents, fewer valid keys
  than k), with tiles smaller than the sequence, and never makes an s × s tensor;
* the sparse attention's output and its gradients in q, k, v equal dense attention whose mask
  keeps exactly the selected keys;
* the indexer loss equals a float64 transcription of upstream's definition (and upstream's
  own function in fp32), with the gradients of its inputs;
* a DeepSeek-V3.2-shaped model (DeepSeek-V3's scaled flags, MLA + DSA, 4 layers) parses through
  ``pretrain_gpt.py``, builds with our DSA core attention and trains a step on CPU;
* what the local implementation does not run is refused naming the flag.
"""

from __future__ import annotations

import types

import pytest
import torch
from megatron.bounded.attention.documents import DocumentParams
from megatron.bounded.attention.sparse_attention import dsa_working_set_bytes, sparse_attention
from megatron.bounded.attention.sparse_attention import sparse_indexer_loss
from megatron.bounded.attention.sparse_indexer import blockwise_topk, document_starts
from megatron.bounded.attention.sparse_indexer import hadamard_rotate
from tests.unit.loss.test_ring_dtp import _LargestTensor
from megatron.bounded.units import ceil_div

F64 = torch.float64


def _indexer_inputs(seq, batch=2, heads=3, dim=8, seed=0, dtype=F64):
    """Indexer q, weights, k with positive entries: every dot product is positive, so ReLU cuts
    nothing and (random reals) no two scores of a row tie."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.rand(seq, batch, heads, dim, generator=generator, dtype=dtype)
    weights = torch.rand(seq, batch, heads, generator=generator, dtype=dtype)
    k = torch.rand(seq, batch, dim, generator=generator, dtype=dtype)
    return q, weights, k


def _visible(seq, starts):
    """[b, s, s] bool: causal and within the query's document (the reference's own mask)."""
    i = torch.arange(seq).view(1, -1, 1)
    j = torch.arange(seq).view(1, 1, -1)
    return (j <= i) & (j >= starts.unsqueeze(-1))


def _dense_topk(q, weights, k, topk, starts, relu=True):
    """The s × s scores (upstream's formula, written out), masked, then top-k; -1 for -inf."""
    scores = []
    for b in range(q.shape[1]):
        dots = torch.einsum("shd,td->sht", q[:, b], k[:, b])
        if relu:
            dots = dots.relu()
        scores.append((dots * weights[:, b].unsqueeze(-1)).sum(1))
    scores = torch.stack(scores).masked_fill(~_visible(q.shape[0], starts), float("-inf"))
    values, indices = scores.topk(min(topk, q.shape[0]), dim=-1)
    return indices.masked_fill(values == float("-inf"), -1)


def _documents(bounds, seq):
    ends = torch.tensor([b * seq + e for b, row in enumerate(bounds) for e in row[1:]])
    return DocumentParams.from_ends(ends, len(bounds), seq)


DOCUMENTS = ((0, 5, 23, 40), (0, 17, 40))  # two sequences of 40 tokens, 3 and 2 documents


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_blockwise_topk_equals_dense_topk(packed, relu):
    seq, topk = 40, 7
    q, weights, k = _indexer_inputs(seq)
    if not relu:  # mixed signs: scores of both signs, the ReLU-free sum
        q = q - 0.5
    documents = _documents(DOCUMENTS, seq) if packed else None
    starts = document_starts(documents, 2, seq, "cpu")
    expected = _dense_topk(q, weights, k, topk, starts, relu)
    for query_block, key_block in ((40, 40), (8, 6), (3, 11)):
        got = blockwise_topk(q, weights, k, topk, starts if packed else None, relu,
                             query_block=query_block, key_block=key_block)
        assert torch.equal(got, expected), (query_block, key_block)
    # rows with fewer valid keys than k end in -1; every selected key is visible
    assert (expected[:, 0, 1:] == -1).all() and (expected[:, topk - 1:, :] >= 0).all() == (
        not packed)
    chosen = expected.clamp(min=0)
    visible = _visible(seq, starts).gather(-1, chosen)
    assert (visible | (expected < 0)).all()
    if packed:  # the first token of a document sees only itself
        assert expected[0, 5].tolist() == [5] + [-1] * (topk - 1)
        assert expected[1, 17].tolist() == [17] + [-1] * (topk - 1)


def test_blockwise_paths_never_make_an_s_by_s_tensor():
    """At s = 2048 (s² = 4M), every tensor the top-k, the sparse attention forward and backward
    and the indexer loss create stays under s²/4 elements."""
    seq, batch, topk, heads = 2048, 1, 16, 2
    q, weights, k = _indexer_inputs(seq, batch=batch, heads=2, dim=8, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    query, key = (torch.randn(seq, batch, heads, 12, generator=generator, requires_grad=True)
                  for _ in range(2))
    value = torch.randn(seq, batch, heads, 8, generator=generator, requires_grad=True)
    q.requires_grad_(), weights.requires_grad_(), k.requires_grad_()
    mode = _LargestTensor()
    with mode:
        indices = blockwise_topk(q, weights, k, topk, query_block=128, key_block=256)
        out = sparse_attention(query, key, value, indices, 0.3, rows=64)
        loss = sparse_indexer_loss(q, weights, k, query, key, indices, 0.3, 0.5, rows=64)
        (out.sum() + loss).backward()
    assert mode.largest < seq * seq // 4, mode.largest
    # and the guard sees what it should: the dense reference's scores are s × s
    mode = _LargestTensor()
    with mode:
        _dense_topk(q.detach()[:256], weights.detach()[:256], k.detach()[:256], topk,
                    torch.zeros(batch, 256, dtype=torch.int64))
    assert mode.largest >= 256 * 256


def _attention_inputs(seq, batch=2, heads=3, qk_dim=10, v_dim=6, seed=2):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(seq, batch, heads, qk_dim, generator=generator, dtype=F64)
    key = torch.randn(seq, batch, heads, qk_dim, generator=generator, dtype=F64)
    value = torch.randn(seq, batch, heads, v_dim, generator=generator, dtype=F64)
    return [t.requires_grad_() for t in (query, key, value)]


def _selected_mask(indices, seq):
    """[b, s, s] bool: the selected keys of each query."""
    mask = torch.zeros(indices.shape[0], seq, seq + 1, dtype=torch.bool)
    mask.scatter_(-1, indices.masked_fill(indices < 0, seq), True)
    return mask[..., :seq]


def _dense_masked_attention(query, key, value, mask, scale):
    """Softmax attention over [s, b, heads, d] whose [b, s, s] mask keeps the True keys."""
    logits = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", logits.softmax(-1), value)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_sparse_attention_equals_dense_attention_on_the_selected_keys(packed):
    seq, topk, scale = 40, 9, 0.37
    q, weights, k = _indexer_inputs(seq, seed=3)
    documents = _documents(DOCUMENTS, seq) if packed else None
    indices = blockwise_topk(q, weights, k, topk, document_starts(documents, 2, seq, "cpu"))
    query, key, value = _attention_inputs(seq)
    grad = torch.randn(seq, 2, 3, 6, dtype=F64, generator=torch.Generator().manual_seed(4))
    expected = _dense_masked_attention(query, key, value, _selected_mask(indices, seq), scale)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad)
    for rows in (40, 7, 1):
        out = sparse_attention(query, key, value, indices, scale, rows=rows)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(out, (query, key, value), grad)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    # attention is sparse: each query sees at most k keys, and without documents every query
    # past the k-th token sees exactly k of its more than k causal keys
    assert (_selected_mask(indices, seq).sum(-1) <= topk).all()
    assert packed or (indices[:, topk:] >= 0).all()


def test_sparse_attention_runs_in_bf16_close_to_fp32():
    seq, topk = 48, 8
    q, weights, k = _indexer_inputs(seq, seed=5, dtype=torch.float32)
    indices = blockwise_topk(q, weights, k, topk)
    query, key, value = (t.detach().float() for t in _attention_inputs(seq, seed=6))
    want = sparse_attention(query, key, value, indices, 0.3)
    got = sparse_attention(*(t.bfloat16() for t in (query, key, value)), indices, 0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _upstream_sparse_loss_f64(q, weights, k, query, key, indices, scale, coeff, relu, starts):
    """Upstream's sparse indexer loss (``compute_dsa_indexer_loss``, ``sparse_loss=True``),
    written out in float64 on the s × s scores."""
    seq, batch, heads = query.shape[:3]
    index_scores = torch.stack([
        ((torch.einsum("shd,td->sht", q[:, b], k[:, b]).relu() if relu else
          torch.einsum("shd,td->sht", q[:, b], k[:, b])) * weights[:, b].unsqueeze(-1)).sum(1)
        for b in range(batch)])  # [b, s, s]
    attention = torch.einsum("sbhd,tbhd->bhst", query.detach(), key.detach()) * scale
    valid = _visible(seq, starts) & _selected_mask(indices, seq)  # base mask & top-k mask
    attention = attention.masked_fill(~valid.unsqueeze(1), float("-inf")).softmax(-1)
    target = attention.sum(1)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    log_prediction = index_scores.masked_fill(~valid, float("-inf")).log_softmax(-1)
    log_prediction = log_prediction.masked_fill(~valid, 0.0)
    kl = target * (torch.log(target.clamp_min(1e-10)) - log_prediction)
    return kl.sum(-1).mean() * coeff


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_indexer_loss_equals_upstreams_definition(packed):
    seq, topk, scale, coeff = 40, 6, 0.41, 0.3
    q, weights, k = _indexer_inputs(seq, seed=7)
    q = (q - 0.3).requires_grad_()  # some scores below 0: ReLU at work
    weights, k = weights.requires_grad_(), k.requires_grad_()
    documents = _documents(DOCUMENTS, seq) if packed else None
    starts = document_starts(documents, 2, seq, "cpu")
    indices = blockwise_topk(q.detach(), weights.detach(), k.detach(), topk,
                             starts if packed else None)
    query, key, _ = _attention_inputs(seq, seed=8)
    expected = _upstream_sparse_loss_f64(q, weights, k, query, key, indices, scale, coeff, True,
                                         starts)
    expected_grads = torch.autograd.grad(expected, (q, weights, k))
    for rows in (40, 5):
        loss = sparse_indexer_loss(q, weights, k, query, key, indices, scale, coeff, rows=rows)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
        grads = torch.autograd.grad(loss, (q, weights, k))
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
        assert all(g.abs().sum() > 0 for g in grads)
    assert expected.item() > 0
    # the attention's query and key get nothing from the loss (detached, as upstream)
    loss = sparse_indexer_loss(q, weights, k, query, key, indices, scale, coeff)
    assert not loss.grad_fn or all(
        g is None for g in torch.autograd.grad(loss, (query, key), allow_unused=True))


def test_indexer_loss_equals_upstreams_function():
    """Upstream's own ``compute_dsa_indexer_loss`` (fp32, its causal mask) on the same
    selection: the definition transcribed above is upstream's."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        _compute_index_scores,
        compute_dsa_indexer_loss,
    )

    seq, topk, scale, coeff = 32, 5, 0.5, 0.7
    q, weights, k = _indexer_inputs(seq, seed=9, dtype=torch.float32)
    q = q - 0.3
    indices = blockwise_topk(q, weights, k, topk)
    query, key, _ = (t.detach().float() for t in _attention_inputs(seq, seed=10))
    single = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    upstream = compute_dsa_indexer_loss(
        _compute_index_scores(q, weights, k), indices, query, key, scale, coeff,
        sparse_loss=True, pg_collection=single)
    ours = sparse_indexer_loss(q, weights, k, query, key, indices, scale, coeff)
    torch.testing.assert_close(ours, upstream, rtol=1e-5, atol=1e-7)


def test_hadamard_rotation_is_upstreams_orthonormal_transform():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=F64)
    sylvester = torch.kron(torch.kron(h2, h2), h2) / 8 ** 0.5
    x = torch.randn(5, 8, dtype=F64)
    torch.testing.assert_close(hadamard_rotate(x), x @ sylvester.T)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.ones(3, 6))


def test_working_set_grows_with_n_times_k_not_n_squared():
    shape = dict(topk=2048, heads=16, qk_dim=192, v_dim=128, index_heads=64, index_dim=128,
                 act_bytes=2, indexer_loss=True)
    small, large = (dsa_working_set_bytes(tokens=n, **shape) for n in (1 << 17, 1 << 19))
    # saved: linear in N at fixed k
    assert large["saved"] == 4 * small["saved"]
    assert small["saved"] >= (1 << 17) * 2048 * 8  # the selected keys alone
    assert large["transient"] < 5 * small["transient"]
    # at 512K tokens one head's s × s fp32 scores would be 1 TiB; the working set is far below
    assert large["saved"] + large["transient"] < (1 << 19) ** 2 * 4 / 16


# DeepSeek-V3.2: DeepSeek-V3's architecture with the indexer (64 heads of 128, top-2048) on
# every layer; scaled as tests/families.py scales DeepSeek-V3 (heads 128 -> 8), the indexer
# 64 -> 4 heads of 128 -> 32 (a power of two, above the rotary 16) and top-k 2048 -> 16 of 64
DSA_FLAGS = ("--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4",
             "--dsa-indexer-head-dim", "32", "--dsa-indexer-topk", "16",
             "--dsa-indexer-loss-coeff", "0.01", "--dsa-indexer-use-sparse-loss")
SEQ_LENGTH = 64


def _deepseek_v32_flags(*extra):
    from tests.families import DEEPSEEK_V3

    return [*DEEPSEEK_V3.command_line(SEQ_LENGTH), *DSA_FLAGS, *extra]


def _model_body(rank, world_size, extra):
    from megatron.bounded.model.dsa import BoundedDSAIndexer, SparseMLACoreAttention
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexerLossLoggingHelper,
    )
    from tests.unit.model.test_families import _build, _parse, _train_step

    torch._dynamo.config.disable = True
    args, settings = _parse(_deepseek_v32_flags(*extra))
    model = _build(args, settings)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert len(cores) == 4 and all(isinstance(core, SparseMLACoreAttention) for core in cores)
    assert all(isinstance(core.indexer, BoundedDSAIndexer) for core in cores)
    indexer = cores[0].indexer
    shapes = {name: tuple(p.shape) for name, p in indexer.named_parameters()}
    loss, missing, bad, zero = _train_step(model, args)
    grads = {name: p.grad.abs().sum().item() for name, p in model.named_parameters()
             if p.grad is not None}
    logged = DSAIndexerLossLoggingHelper.tracker.get("values")
    return dict(loss=loss, missing=missing, bad=bad, shapes=shapes,
                substitutions=list(getattr(args, "bounded_substitutions", None) or []),
                zero=zero,
                indexer_grads=sum(total for name, total in grads.items() if ".indexer." in name),
                logged=None if logged is None else logged.tolist())


def test_deepseek_v32_model_parses_builds_and_trains_a_step():
    from tests.unit.distributed import run_on_ranks

    result = run_on_ranks(_model_body, 1, args=((),), timeout_s=240)[0]
    assert result["loss"] == result["loss"] and abs(result["loss"]) < float("inf"), result
    assert not result["missing"], result["missing"]  # the indexer included: its loss trains it
    assert not result["bad"], result["bad"]
    assert not result["zero"], result["zero"]
    assert result["indexer_grads"] > 0
    # upstream's parameter names and shapes (linear weights are [out, in])
    assert result["shapes"] == {
        "linear_wq_b.weight": (4 * 32, 96), "linear_wk.weight": (32, 256),
        "k_norm.weight": (32,), "k_norm.bias": (32,), "linear_weights_proj.weight": (4, 256)}
    # every layer's indexer loss logged, positive
    assert result["logged"] is not None and all(value > 0 for value in result["logged"])


def _refusal(flags):
    from tests.unit.model.test_families import _parse

    with pytest.raises(AssertionError, match="refused") as refused:
        _parse(flags)
    return str(refused.value)


@pytest.mark.parametrize("extra,named", [
    (("--dsa-indexer-topk-freq", "2"), "--dsa-indexer-topk-freq"),
    (("--dsa-indexer-head-dim", "24"), "--no-dsa-indexer-rotate-activation"),
    (("--dsa-indexer-head-dim", "8"), "--qk-pos-emb-head-dim"),
    (("--context-parallel-size", "2", "--cp-comm-type", "a2a"), "--context-parallel-size"),
])
def test_what_does_not_run_is_refused_naming_the_flag(extra, named):
    message = _refusal(_deepseek_v32_flags(*extra))
    assert named in message and "--experimental-attention-variant dsa" in message, message


def test_dense_indexer_loss_is_refused_and_kernel_backend_replaced():
    flags = [flag for flag in _deepseek_v32_flags() if flag != "--dsa-indexer-use-sparse-loss"]
    assert "--dsa-indexer-use-sparse-loss" in _refusal(flags)
    from megatron.bounded.launch import te_choices

    args = types.SimpleNamespace(experimental_attention_variant="dsa",
                                 dsa_kernel_backend="tilelang", transformer_impl="local")
    notes = te_choices.substitute(args)
    assert args.dsa_kernel_backend == "none"
    assert any(note.startswith("--dsa-kernel-backend tilelang -> none") for note in notes), notes


def test_memory_budget_counts_the_dsa_layer_by_its_formula():
    import dataclasses

    from megatron.bounded.budget.config import BudgetConfig
    from megatron.bounded.budget.widths import activation_widths
    from tests.unit.model.test_families import _memory_budget_tool, _parse

    flags = _deepseek_v32_flags()
    args, settings = _parse(flags)
    cfg = BudgetConfig.from_args(args, settings)
    assert (cfg.mla.dsa_topk, cfg.mla.dsa_index_heads, cfg.mla.dsa_index_dim) == (16, 4, 32)
    assert cfg.mla.dsa_indexer_loss
    dense = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, dsa_topk=0))
    with_dsa, without = activation_widths(cfg), activation_widths(dense)
    formula = dsa_working_set_bytes(
        tokens=cfg.tokens, topk=16, heads=8, qk_dim=32 + 16, v_dim=32, index_heads=4,
        index_dim=32, act_bytes=cfg.act_bytes, indexer_loss=True)
    assert with_dsa["attn_saved"] - without["attn_saved"] == ceil_div(formula["saved"], cfg.tokens)
    assert with_dsa["attn_grad"] - without["attn_grad"] == ceil_div(formula["transient"], cfg.tokens)
    status, printed = _memory_budget_tool(flags)
    assert status in (0, 3) and "dominant" in printed, printed[-2000:]
