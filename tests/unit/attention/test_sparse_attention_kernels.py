"""DeepSeek sparse attention's Triton kernels, run by Triton's interpreter on CPU in fp32, against
the float64 PyTorch paths (themselves tested against dense references in
``tests/unit/attention/test_sparse_attention.py``):

* the attention's output and its q, k, v gradients: causal and packed-document selections,
  k above the number of valid keys (rows ending in -1), a row with no key at all, head counts
  that the head block divides or not, row widths that are a power of two or a sum of two;
* the indexer loss's target sums;
* the indexer's scores and top-k (causal and packed documents, with and without ReLU, k above
  the valid keys, query blocks smaller than the sequence);
* the inverted selection the key-major backward walks (CPU, plain PyTorch);
* on a GPU: the kernels in bf16 and fp32 against the PyTorch path.

fp32 against float64: relative differences of a few fp32 ulps times the k terms summed; the
tolerances below (1e-5 relative, 1e-6 absolute for values of order 1) hold with margin.
"""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.attention.documents import DocumentParams
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

pytest.importorskip("triton")

F64 = torch.float64
SEQ, BATCH = 10, 2
DOCUMENTS = ((0, 3, 7, 10), (0, 6, 10))  # two sequences of 10 tokens, 3 and 2 documents
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _documents(seq=SEQ):
    ends = torch.tensor([b * seq + e for b, row in enumerate(DOCUMENTS) for e in row[1:]])
    return DocumentParams.from_ends(ends, len(DOCUMENTS), seq)


def _indexer_inputs(seq=SEQ, heads=3, dim=16, seed=0, shift=0.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.rand(seq, BATCH, heads, dim, generator=generator, dtype=F64) - shift
    weights = torch.rand(seq, BATCH, heads, generator=generator, dtype=F64)
    k = torch.rand(seq, BATCH, dim, generator=generator, dtype=F64)
    return q, weights, k


def _selection(topk, packed, seed):
    from megatron.bounded.attention.sparse_indexer import blockwise_topk_reference, document_starts

    starts = document_starts(_documents() if packed else None, BATCH, SEQ, "cpu")
    return blockwise_topk_reference(*_indexer_inputs(seed=seed), topk, starts)


def _attention_inputs(heads, qk_dim, v_dim, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SEQ, BATCH, heads, d, generator=generator, dtype=F64)
            for d in (qk_dim, qk_dim, v_dim)]


def _attention_body(rank, world_size):
    from megatron.bounded.attention.sparse_attention import (
        attention_target_sums_reference, sparse_attention_reference,
    )
    from megatron.bounded.attention.kernels.sparse_attention import (
        Tiling, Tilings, attention_target_sums, sparse_attention_triton,
    )

    # Triton's interpreter runs some 10 programs a second: two cases on 10 tokens
    several_steps = Tilings(  # several steps per query and per key chunk, several chunks a key
        forward=Tiling(heads=2, rows=2), query_backward=Tiling(heads=2, rows=4),
        key_backward=Tiling(heads=2, rows=2, chunk_steps=2), target=Tiling(heads=2, rows=4))
    one_step = Tilings(*(Tiling(heads=2, rows=16, chunk_steps=1),) * 4)
    scale = 0.37
    # (heads, qk_dim, v_dim, k, packed documents, tilings): 4 heads in blocks of 2, rows split
    # 8 + 2 and 4 + 2; 3 heads one a block, power-of-two rows (nothing in the second span),
    # k above every query's valid keys
    cases = ((4, 10, 6, 5, False, several_steps), (3, 16, 8, SEQ + 2, True, one_step))
    for case, (heads, qk_dim, v_dim, topk, packed, tilings) in enumerate(cases):
        indices = _selection(topk, packed, seed=case)
        if case == 0:
            indices[1, 7] = -1  # a query without any key: output and gradients 0
        query, key, value = _attention_inputs(heads, qk_dim, v_dim, seed=10 + case)
        grad = torch.randn(SEQ, BATCH, heads, v_dim, dtype=F64,
                           generator=torch.Generator().manual_seed(20 + case))
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        expected = sparse_attention_reference(*inputs, indices, scale)
        expected_grads = torch.autograd.grad(expected, inputs, grad)
        ours = [t.float().requires_grad_() for t in (query, key, value)]
        out = sparse_attention_triton(*ours, indices, scale, tilings)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, **TOLERANCE)
        grads = torch.autograd.grad(out, ours, grad.float())
        for name, got, want in zip("qkv", grads, expected_grads):
            torch.testing.assert_close(got.double(), want, **TOLERANCE,
                                       msg=lambda m: f"case {case} d{name}: {m}")
        if case == 0:
            assert (out[7, 1] == 0).all() and (grads[0][7, 1] == 0).all()
        target = attention_target_sums(query.float(), key.float(), indices, scale, tilings)
        torch.testing.assert_close(
            target.double(), attention_target_sums_reference(query, key, indices, scale, rows=SEQ),
            **TOLERANCE)
    return True


def test_attention_kernels_match_the_float64_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernels
    assert run_on_ranks(_attention_body, 1, timeout_s=600.0, fresh_process=True) == [True]


def _indexer_body(rank, world_size):
    from megatron.bounded.attention.sparse_indexer import (
        blockwise_topk_reference, document_starts, index_scores, valid_keys,
    )
    from megatron.bounded.attention.kernels.sparse_indexer import (
        IndexTiling, blockwise_topk_triton, index_scores_triton,
    )

    seq = 40
    tiling = IndexTiling(block_queries=16, block_keys=16, num_warps=4, stages=2)
    for case, (packed, relu, topk) in enumerate(
            ((False, True, 7), (True, True, 7), (True, False, 12), (False, True, 50))):
        q, weights, k = _indexer_inputs(seq, heads=3, dim=16 if case else 12, seed=case,
                                        shift=0.3)
        starts = document_starts(_documents_of(seq) if packed else None, BATCH, seq, "cpu")
        expected = blockwise_topk_reference(q, weights, k, topk, starts if packed else None,
                                            relu)
        inputs = [t.float() for t in (q, weights, k)]
        for block_rows in (16, 32, seq):  # the score budget of one block of these rows
            got = blockwise_topk_triton(*inputs, topk, starts if packed else None, relu,
                                        budget_bytes=4 * BATCH * seq * block_rows, tiling=tiling)
            assert got.dtype == torch.int32
            assert torch.equal(got, expected), (case, block_rows)
        # the scores themselves: a block of rows 16..39 against keys 0..39
        scores = index_scores_triton(*inputs, starts if packed else None, 16, seq - 16, seq,
                                     relu, tiling)
        positions = torch.arange(seq)
        want = index_scores(q[16:], weights[16:], k, relu).masked_fill(
            ~valid_keys(starts[:, 16:], positions[16:], positions), float("-inf"))
        torch.testing.assert_close(scores.double(), want, **TOLERANCE)
    return True


def _documents_of(seq):
    """Two sequences of ``seq`` tokens: 3 documents (the last ending at s) and 2."""
    bounds = ((0, 5, 23, seq), (0, 17, seq))
    ends = torch.tensor([b * seq + e for b, row in enumerate(bounds) for e in row[1:]])
    return DocumentParams.from_ends(ends, len(bounds), seq)


def test_indexer_kernel_selects_the_keys_of_the_pytorch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert run_on_ranks(_indexer_body, 1, timeout_s=600.0, fresh_process=True) == [True]


def test_inverted_selection_lists_each_keys_queries_in_order():
    from megatron.bounded.attention.kernels.sparse_attention import key_major_queries

    indices = _selection(9, packed=True, seed=3)
    indices[0, 8, 2:4] = -1  # -1 amid a row's keys too
    offsets, query_rows = key_major_queries(indices, BATCH, SEQ)
    assert offsets.shape == (BATCH * SEQ + 1,) and query_rows.dtype == torch.int32
    for key_row in range(BATCH * SEQ):
        position, sequence = divmod(key_row, BATCH)
        selecting = [i * BATCH + sequence for i in range(SEQ)
                     if position in indices[sequence, i].tolist()]
        assert query_rows[offsets[key_row]:offsets[key_row + 1]].tolist() == selecting
    assert offsets[-1] == (indices >= 0).sum()  # -1 entries are past the last key


def test_cpu_and_float64_tensors_take_the_pytorch_paths():
    from megatron.bounded.attention.kernels.sparse_indexer import kernels_apply

    x = torch.zeros(2)
    assert not kernels_apply(x) and not kernels_apply(x.double())


@pytest.mark.gpu
@requires_cuda
def test_gpu_kernels_match_the_pytorch_path():
    """DeepSeek-V3.2's head widths (192, 128) at 8 heads and 512 tokens of two documents: the
    kernels in bf16 and fp32 against the PyTorch paths in float64 on the GPU, from the same
    inputs."""
    from megatron.bounded.attention.sparse_attention import sparse_attention_reference
    from megatron.bounded.attention.kernels.sparse_attention import sparse_attention_triton
    from megatron.bounded.attention.sparse_indexer import blockwise_topk_reference, document_starts
    from megatron.bounded.attention.kernels.sparse_indexer import blockwise_topk_triton

    seq, batch, heads, topk = 512, 2, 8, 64
    dev = torch.device("cuda")
    generator = torch.Generator(device=dev).manual_seed(0)
    q = torch.rand(seq, batch, 4, 128, device=dev, generator=generator) - 0.3
    weights = torch.rand(seq, batch, 4, device=dev, generator=generator)
    k = torch.rand(seq, batch, 128, device=dev, generator=generator)
    ends = torch.tensor([200, seq, seq + 300, 2 * seq])
    starts = document_starts(DocumentParams.from_ends(ends, batch, seq), batch, seq, dev)
    for dtype in (torch.bfloat16, torch.float32):  # fp32 last: its selection is attended below
        inputs = [t.to(dtype) for t in (q, weights, k)]
        expected = blockwise_topk_reference(*(t.double() for t in inputs), topk, starts)
        indices = blockwise_topk_triton(*inputs, topk, starts)
        agree = (indices == expected).float().mean().item()
        assert agree > 0.99, (dtype, agree)  # another summation order may swap near-ties
    query, key = (torch.randn(seq, batch, heads, 192, device=dev, generator=generator)
                  for _ in range(2))
    value = torch.randn(seq, batch, heads, 128, device=dev, generator=generator)
    grad = torch.randn(seq, batch, heads, 128, device=dev, generator=generator)
    for dtype, tolerance in ((torch.float32, dict(rtol=1e-4, atol=1e-5)),
                             (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))):
        # the reference from the same (rounded) inputs: what differs is the kernels' arithmetic
        # and the output's rounding
        inputs = [t.detach().to(dtype) for t in (query, key, value, grad)]
        reference = [t.double().requires_grad_() for t in inputs[:3]]
        want = sparse_attention_reference(*reference, indices.long(), 0.07, rows=64)
        want_grads = torch.autograd.grad(want, reference, inputs[3].double())
        ours = [t.requires_grad_() for t in inputs[:3]]
        out = sparse_attention_triton(*ours, indices, 0.07)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, **tolerance)
        for got, expected_grad in zip(torch.autograd.grad(out, ours, inputs[3]), want_grads):
            torch.testing.assert_close(got.double(), expected_grad, **tolerance)
