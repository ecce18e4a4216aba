"""Sliding windows (--window-size, --window-attn-skip-freq) and attention sinks (--softmax-type
off-by-one / learnable) in every attention path, float64 on CPU, against upstream's local
``DotProductAttention`` built from the same ``TransformerConfig`` (it materializes the scores:
exact at this size): the plain path, the blocked backward of the chunked attention sublayer,
packed documents (each document alone), a GPT model with chunked recompute of the attention
sublayer, and context parallelism over two gloo ranks; values and gradients of q, k, v and the
sink. A GPU test checks the flash path in bf16 at 32,768 tokens."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tests.conftest import (
    keep_upstream_masks_on_cpu,
    keep_upstream_rotary_on_cpu,
    one_cpu_rank,
    requires_cuda,
    small_bounded_gpt,
)
from tests.unit.distributed import run_on_ranks
from tests.unit.attention.test_documents import (
    _losses_and_grads,
    _tokens,
    context_parallel_equals_one_rank,
)

from megatron.bounded.attention.blockwise import (
    attention_forward,
    attention_pairs,
    block_bounds,
    query_block_backward,
)
from megatron.bounded.attention.windows import band_allowed

SEQ, BATCH, HEADS, GROUPS, DIM, WINDOW = 24, 2, 4, 2, 8, 5
VOCAB = 64
# two sequences of SEQ tokens cut into documents (cumulative lengths per sequence)
DOCUMENTS = ((0, 7, 8, 19, 24), (0, 13, 24))

# (window_size, window_attn_skip_freq, softmax_type, layer_number): upstream's per-layer rule
# decides whether the layer has the window
CASES = [
    ((WINDOW, 0), None, "vanilla", 1),
    ((WINDOW, 0), None, "learnable", 1),
    ((WINDOW, 0), None, "off-by-one", 1),
    (None, None, "learnable", 1),
    ((WINDOW, 0), 2, "learnable", 1),
    ((WINDOW, 0), 2, "learnable", 2),  # every 2nd layer attends fully
    ((WINDOW, 0), [1, 0, 1, 1], "off-by-one", 2),
    ((WINDOW, 0), [1, 0, 1, 1], "learnable", 3),
]


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=4, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                  num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                  params_dtype=torch.float64, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def _inputs(seed, seq=SEQ, batch=BATCH):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM)]
    return [torch.randn(*shape, dtype=torch.float64, generator=generator) for shape in shapes]


def _leaves(tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _pair(config, layer_number):
    """Our SDPA core attention and upstream's local attention of one layer, the same sink
    logits in both (random ones, so that they matter, when learnable)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.bounded.attention.core import SDPACoreAttention

    kwargs = dict(layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                  attention_type="self")
    ours, theirs = SDPACoreAttention(config, **kwargs), DotProductAttention(config, **kwargs)
    if isinstance(theirs.softmax_offset, torch.nn.Parameter):
        assert [(n, p.shape) for n, p in ours.named_parameters()] == \
            [(n, p.shape) for n, p in theirs.named_parameters()]
        with torch.no_grad():
            ours.softmax_offset.copy_(torch.linspace(-2.0, 1.5, HEADS, dtype=torch.float64))
            theirs.softmax_offset.copy_(ours.softmax_offset)
    else:
        assert not list(ours.parameters()) and not list(theirs.parameters())
    return ours, theirs


def _run(attention, leaves, grad, sink=None):
    """Output [s, b, heads · d] and the gradients of (q, k, v[, sink])."""
    out = attention(*leaves, None)
    wrt = list(leaves) + ([sink] if sink is not None else [])
    return out.detach(), torch.autograd.grad(out, wrt, grad)


def _assert_all_close(got, expected, what):
    for index, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"{what} [{index}]")


@contextlib.contextmanager
def _upstream_on_cpu():
    from megatron.core import parallel_state, tensor_parallel

    keep_upstream_rotary_on_cpu()  # also keeps upstream's scratch buffer of the scores on CPU
    keep_upstream_masks_on_cpu()
    # upstream forks the CUDA generator around its dropout (p = 0 here, nothing is drawn)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


# --- the plain path ------------------------------------------------------------------------------

def _plain_against_upstream(rank, world_size):
    from megatron.core.transformer.utils import is_layer_window_attention

    with _upstream_on_cpu():
        for seed, (window_size, skip, softmax_type, layer) in enumerate(CASES):
            config = _config(window_size=window_size, window_attn_skip_freq=skip,
                             softmax_type=softmax_type)
            ours, theirs = _pair(config, layer)
            windowed = is_layer_window_attention(window_size, skip, layer)
            assert ours.window == (WINDOW if windowed else None), (window_size, skip, layer)
            tensors = _inputs(seed)
            grad = torch.randn(SEQ, BATCH, HEADS * DIM, dtype=torch.float64)
            learnable = softmax_type == "learnable"
            got = _run(ours, _leaves(tensors), grad, ours.softmax_offset if learnable else None)
            expected = _run(theirs, _leaves(tensors), grad,
                            theirs.softmax_offset if learnable else None)
            _assert_all_close((got[0],) + got[1], (expected[0],) + expected[1], CASES[seed])
            # the variant changes the result: the comparison can tell
            full, _ = _run(_pair(_config(), layer)[0], _leaves(tensors), grad)
            assert (full - got[0]).abs().max() > 1e-3, CASES[seed]
        _state_dict_matches_upstream()


def _state_dict_matches_upstream():
    from megatron.core import parallel_state

    ours, theirs = _pair(_config(window_size=(WINDOW, 0), softmax_type="learnable"), 1)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    mine = ours.sharded_state_dict("layer.", metadata=metadata)
    upstream = theirs.sharded_state_dict("layer.", metadata=metadata)
    assert list(mine) == list(upstream) == ["layer.softmax_offset"]
    assert mine["layer.softmax_offset"].global_shape == upstream["layer.softmax_offset"].global_shape
    assert ours.sharded_state_dict("layer.", metadata=metadata) is not None
    off_by_one, _ = _pair(_config(softmax_type="off-by-one"), 1)
    assert off_by_one.state_dict() == {} and off_by_one.sharded_state_dict("layer.") == {}


def test_plain_path_equals_upstreams_local_attention():
    """Windows on the layers upstream's rule picks (an int and a list skip pattern), off-by-one
    and learnable sinks, GQA: output, dQ, dK, dV and the sink's gradient; the learnable sink
    is upstream's parameter (name, shape, sharded state dict)."""
    run_on_ranks(_plain_against_upstream, 1, timeout_s=240)


# --- blocks of the chunked attention sublayer, and documents -------------------------------------

def _blocked(tensors, grad, bounds, sink, sequences=None):
    """Output and (dQ, dK, dV, d sink) through attention_forward and the blocked backward."""
    from megatron.bounded.attention.sinks import sink_gradient

    query, key, value = tensors
    scale = 1 / math.sqrt(DIM)
    out, lse, kernel = attention_forward(query, key, value, scale, sequences=sequences,
                                         window=WINDOW, sink=sink.detach())
    grad_out = grad.view(out.shape)
    grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
    grad_query, grad_sink = torch.empty_like(query), torch.zeros_like(sink)
    for start, end in reversed(bounds):
        grad_query[start:end] = query_block_backward(
            grad_out[start:end], query[start:end], key, value, out[start:end],
            lse[:, :, start:end], start, bounds, grad_key, grad_value, scale, kernel, sequences,
            WINDOW)
        grad_sink += sink_gradient(grad_out[start:end].permute(1, 2, 0, 3),
                                   out[start:end].permute(1, 2, 0, 3), lse[:, :, start:end], sink)
    return out.reshape(grad.shape), (grad_query, grad_key, grad_value, grad_sink)


def _each_document_upstream(theirs, tensors, grad):
    """Upstream's attention of every document of DOCUMENTS alone, placed as packed, and the
    gradients summed over the documents."""
    leaves = _leaves(tensors)
    out = torch.empty_like(grad)
    for index, bounds in enumerate(DOCUMENTS):
        for start, end in zip(bounds, bounds[1:]):
            piece = theirs(*(t[start:end, index:index + 1] for t in leaves), None)
            piece.backward(grad[start:end, index:index + 1])
            out[start:end, index:index + 1] = piece.detach()
    return out, tuple(t.grad for t in leaves) + (theirs.softmax_offset.grad,)


def _blocks_and_documents(rank, world_size):
    from megatron.bounded.attention.documents import DocumentParams, document_attention

    with _upstream_on_cpu():
        ours, theirs = _pair(_config(window_size=(WINDOW, 0), softmax_type="learnable"), 1)
        sink = ours.softmax_offset
        tensors = _inputs(7)
        grad = torch.randn(SEQ, BATCH, HEADS * DIM, dtype=torch.float64)
        expected = _run(theirs, _leaves(tensors), grad, theirs.softmax_offset)
        for block in (4, 7):
            got = _blocked(tensors, grad, block_bounds(SEQ, block), sink)
            _assert_all_close((got[0],) + got[1], (expected[0],) + expected[1], ("block", block))

        ends = torch.tensor([b + index * SEQ for index, bounds in enumerate(DOCUMENTS)
                             for b in bounds[1:]])
        documents = DocumentParams.from_ends(ends, BATCH, SEQ)
        assert documents.sequences == DOCUMENTS
        expected = _each_document_upstream(theirs, tensors, grad)
        leaves = _leaves(tensors)
        out = document_attention(*leaves, documents, 1 / math.sqrt(DIM), WINDOW, sink)
        got = out.reshape(grad.shape).detach(), torch.autograd.grad(out, leaves + [sink],
                                                                     grad.view(out.shape))
        _assert_all_close((got[0],) + got[1], (expected[0],) + expected[1], "documents")
        got = _blocked(tensors, grad, block_bounds(SEQ, 5), sink, documents.sequences)
        _assert_all_close((got[0],) + got[1], (expected[0],) + expected[1], "document blocks")


def test_blocked_backward_and_documents_equal_upstreams_local_attention():
    """The chunked sublayer's forward (sink folded into output and log-sum-exp) and blocked
    backward (blocks of 4 and 7 rows against a window of 5: pairs skipped and cut), and packed
    documents (plain and blocked) against upstream's attention of each document alone."""
    run_on_ranks(_blocks_and_documents, 1, timeout_s=240)


@pytest.mark.parametrize("block,key_blocks", [(3, 1), (5, 1), (8, 1), (3, 4)])
def test_pairs_cover_the_window_within_documents_once_and_skip_the_rest(block, key_blocks):
    bounds = block_bounds(SEQ, block)
    rows, keys = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    for documents in DOCUMENTS + ((0, SEQ),):
        same = torch.bucketize(rows, torch.tensor(documents), right=True) == torch.bucketize(
            keys, torch.tensor(documents), right=True)
        allowed = same & (keys <= rows) & (keys >= rows - WINDOW)
        covered = torch.zeros(SEQ, SEQ, dtype=torch.long)
        calls = 0
        for start, end in bounds:
            pairs = attention_pairs(start, end, bounds, documents, WINDOW, key_blocks)
            calls += len(pairs)
            unmerged = attention_pairs(start, end, bounds, documents, WINDOW, 1)
            assert len(pairs) <= len(unmerged) <= len(attention_pairs(
                start, end, bounds, documents, key_blocks_per_call=1))
            for (qa, qe), (ka, ke), band in pairs:
                window = band_allowed(qe - qa, ke - ka, band)
                assert window.any(dim=1).all(), "a query row that sees no key of its call"
                covered[qa:qe, ka:ke] += window.long()
        assert torch.equal(covered, allowed.long()), (block, documents)
    full_calls = sum(len(attention_pairs(s, e, bounds, (0, SEQ), key_blocks_per_call=1))
                     for s, e in bounds)
    if block < WINDOW:  # block pairs wholly outside the window are skipped
        assert calls < full_calls


# --- a GPT model: chunked recompute of the attention sublayer, and context parallelism -----------

VARIANTS = dict(window_size=(WINDOW, 0), window_attn_skip_freq=2, softmax_type="learnable")


def _model(chunk_tokens=0, context_parallel_size=1):
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1, chunked_recompute_tokens=chunk_tokens,
                     chunked_recompute_attention=True) if chunk_tokens else {}
    return small_bounded_gpt(SEQ, VOCAB, context_parallel_size=context_parallel_size,
                             cp_comm_type="a2a", **VARIANTS, **recompute)


def _chunked_equals_unchunked(rank, world_size):
    from megatron.bounded.attention.documents import DocumentParams

    tokens = _tokens()
    ends = torch.tensor([b + i * SEQ for i, bounds in enumerate(DOCUMENTS) for b in bounds[1:]])
    documents = DocumentParams.from_ends(ends, BATCH, SEQ)
    with one_cpu_rank():
        for packed in (None, documents):
            expected = _losses_and_grads(_model(), tokens, packed)
            got = _losses_and_grads(_model(chunk_tokens=5), tokens, packed)
            torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
            sinks = [name for name in expected[1] if name.endswith("softmax_offset")]
            assert sinks == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset"
                             for i in range(2)]
            for name in expected[1]:
                torch.testing.assert_close(got[1][name], expected[1][name], rtol=1e-10,
                                           atol=1e-12, msg=name)
            assert all(expected[1][name].abs().max() > 0 for name in sinks)


def test_chunked_attention_sublayer_equals_the_model_without_chunking():
    """Two layers (a window of 5 on the first, full attention on the second: skip frequency 2),
    learnable sinks, chunks of 5 rows; whole sequences and packed documents."""
    run_on_ranks(_chunked_equals_unchunked, 1, timeout_s=240)


def _context_parallel(rank, world_size):
    context_parallel_equals_one_rank(_model, _tokens(), None, world_size)


def test_context_parallel_equals_one_rank():
    """CP = 2 (a2a: each rank runs half the heads, with their half of the sinks): losses and
    gradients, the sinks' included, equal CP = 1's."""
    run_on_ranks(_context_parallel, 2, timeout_s=240)


# --- one GPU, bf16 -------------------------------------------------------------------------------

GPU_SEQ, GPU_WINDOW, GPU_HEADS, GPU_GROUPS, GPU_DIM = 32768, 128, 8, 2, 64


def _reference_by_blocks(q, k, v, sink, grad_out, scale, rows=2048):
    """fp32 output and gradients of windowed attention with a sink, by autograd through the
    plain-PyTorch reference, one block of query rows at a time (with the keys it sees)."""
    from megatron.bounded.attention.sinks import with_sink
    from megatron.bounded.attention.windows import reference_forward

    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sink)]
    outputs = []
    for start in range(0, q.shape[2], rows):
        first = max(0, start - GPU_WINDOW)
        block_q = leaves[0][:, :, start:start + rows]
        out, lse = reference_forward(block_q, leaves[1][:, :, first:start + rows],
                                     leaves[2][:, :, first:start + rows], scale, (GPU_WINDOW, 0))
        out, _ = with_sink(out, lse, leaves[3])
        out.backward(grad_out[:, :, start:start + rows].float())
        outputs.append(out.detach())
    return torch.cat(outputs, dim=2), [t.grad for t in leaves]


def _peak_bytes(attention, seq):
    q, k, v = (torch.randn(seq, 1, n, GPU_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for n in (GPU_HEADS, GPU_GROUPS, GPU_GROUPS))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    attention(q, k, v, None).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@requires_cuda
def test_gpu_flash_window_with_sinks_at_32768_tokens():
    """bf16, window 128, learnable sinks, GQA: the flash path's output and dQ, dK, dV, d sink
    within bf16 tolerance (relative norm error ≤ 2 %) of an fp32 reference computed block by
    block; its peak memory grows linearly with the sequence (nothing s × s)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.bounded.attention.core import SDPACoreAttention

    class _SingleRank:
        tp, cp = type("TP", (), {"size": lambda self: 1})(), None

    config = _config(num_attention_heads=GPU_HEADS, num_query_groups=GPU_GROUPS,
                     kv_channels=GPU_DIM, hidden_size=GPU_HEADS * GPU_DIM, bf16=True,
                     params_dtype=torch.float32, window_size=(GPU_WINDOW, 0),
                     softmax_type="learnable")
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self",
                                  pg_collection=_SingleRank()).cuda()
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.linspace(-1.0, 3.0, GPU_HEADS))
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(GPU_SEQ, 1, n, GPU_DIM, device="cuda", generator=generator)
               .to(torch.bfloat16).requires_grad_(True) for n in (GPU_HEADS, GPU_GROUPS, GPU_GROUPS))
    grad = torch.randn(GPU_SEQ, 1, GPU_HEADS * GPU_DIM, device="cuda", generator=generator,
                       dtype=torch.float32).to(torch.bfloat16)
    out = attention(q, k, v, None)
    out.backward(grad)
    heads_first = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
    ref_out, ref_grads = _reference_by_blocks(
        *heads_first, attention.softmax_offset, grad.view(GPU_SEQ, 1, GPU_HEADS, GPU_DIM)
        .permute(1, 2, 0, 3), attention.softmax_scale)
    got = [out.view(GPU_SEQ, 1, GPU_HEADS, GPU_DIM).permute(1, 2, 0, 3)] + [
        t.grad.permute(1, 2, 0, 3) for t in (q, k, v)] + [attention.softmax_offset.grad]
    for name, mine, reference in zip(("out", "dq", "dk", "dv", "dsink"), got,
                                     [ref_out] + ref_grads):
        error = ((mine.float() - reference).norm() / reference.norm()).item()
        assert error <= 2e-2, (name, error)
    peaks = [_peak_bytes(attention, seq) for seq in (GPU_SEQ // 2, GPU_SEQ)]
    assert peaks[1] <= 2.5 * peaks[0], peaks  # linear in s (s² would be 4×)
    square_scores = GPU_HEADS * GPU_SEQ * GPU_SEQ * 2
    assert peaks[1] < square_scores / 8, (peaks, square_scores)
