"""Attention within packed documents (--reset-attention-mask), on CPU in float64: the boundaries
are upstream's, the core attention equals upstream's local attention with its explicit mask, and a
GPT model (plain, chunked recompute with the attention sublayer, context parallelism over two
gloo ranks) gives each document the losses and gradients of that document alone; changing one
document changes nothing of another (refusals: test_bad_input.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    one_cpu_rank,
    keep_upstream_rotary_on_cpu,
    requires_cuda,
    small_bounded_gpt,
)
from tests.unit.comparisons import assert_context_parallel_share
from tests.unit.distributed import run_on_ranks

from megatron.bounded.attention.blockwise import attention_pairs, block_bounds
from megatron.bounded.attention.windows import band_allowed
from megatron.bounded.attention.documents import (
    DocumentParams,
    document_attention,
    ends_from_dataset_lengths,
    ends_from_eod,
)

EOD, VOCAB = 0, 64
# two sequences of 24 tokens: documents of unequal lengths, one of a single token, one that
# spans several chunks of 5 rows; no document as long as the sequence
LENGTHS = ((7, 1, 11, 5), (13, 11))
SEQ = 24


def _tokens(lengths=LENGTHS, seed=1):
    """[b, SEQ + 1] tokens whose first SEQ positions hold documents of ``lengths``, each ending
    in EOD except a sequence's last one (it ends with the sequence)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for sequence in lengths:
        row = torch.randint(1, VOCAB, (SEQ + 1,), generator=generator)
        end = 0
        for length in sequence[:-1]:
            end += length
            row[end - 1] = EOD
        rows.append(row)
    return torch.stack(rows)


def _documents(tokens) -> DocumentParams:
    return DocumentParams.from_ends(ends_from_eod(tokens, EOD), *tokens.shape)


def _allowed(documents: DocumentParams, index: int) -> torch.Tensor:
    """[s, s] True where query row i may see key row j under ``documents`` (sequence index)."""
    bounds = documents.sequences[index]
    doc = torch.zeros(documents.seq_length, dtype=torch.long)
    for number, (start, end) in enumerate(zip(bounds, bounds[1:])):
        doc[start:end] = number
    causal = torch.ones(documents.seq_length, documents.seq_length, dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


def test_boundaries_are_those_of_upstreams_dataset_mask():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = _tokens()[:, :SEQ]
    tokens[1, 3] = tokens[1, 4] = EOD  # two EOD tokens in a row: a one-token document
    tokens[1, -1] = EOD  # an EOD as the last token: no empty document after it
    documents = _documents(tokens)
    assert documents.sequences == ((0, 7, 8, 19, 24), (0, 4, 5, 13, 24))
    assert documents.cu_seqlens_q.tolist() == [0, 7, 8, 19, 24, 28, 29, 37, 48]
    assert documents.longest == 11 and documents.count == 8
    assert documents.max_seqlen_q == SEQ  # upstream's rotary table covers the sequence
    for index in range(2):
        mask, _, _ = _get_ltor_masks_and_position_ids(tokens[index], EOD, False, True, False, True)
        torch.testing.assert_close(~mask[0], _allowed(documents, index), rtol=0, atol=0)


def test_boundaries_from_upstreams_inter_document_lengths():
    # upstream's dataset pads each sample's cu_seqlens to s + 1 entries with s
    padded = torch.tensor([[0, 7, 8, 19, 24] + [24] * 20, [0, 24] + [24] * 23], dtype=torch.int32)
    ends = ends_from_dataset_lengths(padded)
    assert DocumentParams.from_ends(ends, 2, SEQ).sequences == ((0, 7, 8, 19, 24), (0, 24))


def test_attention_pairs_cover_exactly_the_allowed_rows():
    """Every (query, key) pair of the same document, key not after query, is computed once by
    the blocked backward's kernel calls, and no other pair."""
    documents = _documents(_tokens()[:, :SEQ])
    for block in (5, 8, 24):
        bounds = block_bounds(SEQ, block)
        for index in range(2):
            covered = torch.zeros(SEQ, SEQ, dtype=torch.long)
            for start, end in bounds:
                for (qa, qe), (ka, ke), band in attention_pairs(
                        start, end, bounds, documents.sequences[index]):
                    covered[qa:qe, ka:ke] += band_allowed(qe - qa, ke - ka, band).long()
            assert torch.equal(covered, _allowed(documents, index).long()), (block, index)


def _qkv(heads=4, groups=2, dim=8, seed=3):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(SEQ, 2, heads, dim), (SEQ, 2, groups, dim), (SEQ, 2, groups, dim)]
    return [torch.randn(*shape, dtype=torch.float64, generator=generator, requires_grad=True)
            for shape in shapes]


def _against_upstream(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.attention.core import SDPACoreAttention

    import contextlib

    from megatron.core import tensor_parallel

    keep_upstream_rotary_on_cpu()  # also keeps upstream's scratch buffer of the scores on CPU
    # upstream forks the CUDA generator around its dropout (p = 0 here, nothing is drawn)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args: contextlib.nullcontext()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               num_query_groups=2, kv_channels=8, attention_dropout=0.0)
    kwargs = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    tokens = _tokens()[:, :SEQ]
    documents = _documents(tokens)
    mask = torch.stack([_get_ltor_masks_and_position_ids(row, EOD, False, True, False, True)[0]
                        for row in tokens])  # [b, 1, s, s], True = masked
    ours_in, upstream_in = _qkv(), [t.detach().clone().requires_grad_(True) for t in _qkv()]
    parallel_state.initialize_model_parallel(1, 1)
    try:
        ours = SDPACoreAttention(config, **kwargs)(*ours_in, None, packed_seq_params=documents)
        upstream = DotProductAttention(config, **kwargs)(*upstream_in, mask)
        grad = torch.randn_like(ours)
        ours.backward(grad)
        upstream.backward(grad)
    finally:
        parallel_state.destroy_model_parallel()
    torch.testing.assert_close(ours, upstream, rtol=1e-12, atol=1e-13)
    for mine, theirs in zip(ours_in, upstream_in):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-11, atol=1e-13)


def test_core_attention_equals_upstreams_local_attention_with_its_mask():
    """Upstream's DotProductAttention with the [b, 1, s, s] mask its dataset builds (the
    materialized scores: exact at this size), values and gradients."""
    run_on_ranks(_against_upstream, 1, timeout_s=120)


def test_document_attention_equals_each_document_alone():
    query, key, value = _qkv()
    documents = _documents(_tokens()[:, :SEQ])
    out = document_attention(query, key, value, documents, 0.3)
    for index, bounds in enumerate(documents.sequences):
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (t[start:end, index:index + 1] for t in (query, key, value))
            alone = DocumentParams.from_ends(torch.tensor([end - start]), 1, end - start)
            torch.testing.assert_close(out[start:end, index:index + 1],
                                       document_attention(q, k, v, alone, 0.3),
                                       rtol=1e-13, atol=1e-14)


# --- a GPT model ---------------------------------------------------------------------------------

def _model(chunk_tokens=0, context_parallel_size=1):
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1, chunked_recompute_tokens=chunk_tokens,
                     chunked_recompute_attention=True) if chunk_tokens else {}
    return small_bounded_gpt(SEQ, VOCAB, context_parallel_size=context_parallel_size,
                             cp_comm_type="a2a", **recompute)


def _losses_and_grads(model, tokens, documents=None, weights=None):
    """Per-token losses [b, s] and the gradients of their sum (``weights``-weighted)."""
    model.train()
    model.zero_grad()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    losses = model(inputs, positions, attention_mask=None, labels=labels,
                   packed_seq_params=documents)
    (losses if weights is None else losses * weights).sum().backward()
    return losses.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _each_document_alone(model, tokens, documents):
    """Losses placed as in the packed batch, and the gradients summed over the documents, of
    every document run as a sequence of its own."""
    losses, grads = torch.full((tokens.shape[0], SEQ), float("nan")), None
    for index, bounds in enumerate(documents.sequences):
        for start, end in zip(bounds, bounds[1:]):
            got, got_grads = _losses_and_grads(model, tokens[index:index + 1, start:end + 1])
            losses = losses.to(got.dtype)
            losses[index, start:end] = got[0]
            grads = got_grads if grads is None else {n: grads[n] + g for n, g in got_grads.items()}
    return losses, grads


def _assert_close_to_scale(got, expected, relative: float, name: str) -> None:
    """Largest difference within ``relative`` of the largest magnitude of ``expected``."""
    difference = (got - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert difference <= relative * scale, f"{name}: {difference:.3g} > {relative:g} x {scale:.3g}"


def _packed_equals_alone(rank, world_size, chunk_tokens):
    with one_cpu_rank():
        model = _model(chunk_tokens)
        tokens = _tokens()
        documents = _documents(tokens[:, :-1])
        packed = _losses_and_grads(model, tokens, documents)
        alone = _each_document_alone(model, tokens, documents)
        whole = _losses_and_grads(model, tokens)  # attention across documents
    # upstream computes the rotary angles and the loss in fp32: a document at another offset
    # is rotated by angles rounded differently, hence fp32's and not float64's precision
    _assert_close_to_scale(packed[0], alone[0], 1e-6, "losses")
    for name in packed[1]:
        _assert_close_to_scale(packed[1][name], alone[1][name], 1e-6, name)
    # without documents the later documents' losses differ: the test can tell
    return (whole[0][0, 7:] - packed[0][0, 7:]).abs().max().item()


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_packed_model_equals_each_document_alone(chunk_tokens):
    """Plain, and chunked recompute with the attention sublayer (chunks of 5 rows: documents
    that start and end inside chunks and span several)."""
    difference_across_documents = run_on_ranks(_packed_equals_alone, 1, args=(chunk_tokens,),
                                               timeout_s=240)[0]
    assert difference_across_documents > 1e-3


def _one_document_changed(rank, world_size, chunk_tokens):
    with one_cpu_rank():
        model = _model(chunk_tokens)
        tokens = _tokens()
        changed = tokens.clone()
        changed[0, :6] = torch.randint(1, VOCAB, (6,), generator=torch.Generator().manual_seed(9))
        documents = _documents(tokens[:, :-1])
        assert _documents(changed[:, :-1]).sequences == documents.sequences
        # only the losses of the documents after the first: their gradients must not change
        weights = torch.ones(2, SEQ)
        weights[0, :7] = 0
        before = _losses_and_grads(model, tokens, documents, weights)
        after = _losses_and_grads(model, changed, documents, weights)
    assert not torch.equal(before[0][0, :6], after[0][0, :6])  # the changed document changed
    torch.testing.assert_close(after[0][:, 7:], before[0][:, 7:], rtol=0, atol=0)
    torch.testing.assert_close(after[0][1], before[0][1], rtol=0, atol=0)
    for name in before[1]:
        torch.testing.assert_close(after[1][name], before[1][name], rtol=1e-13, atol=1e-15,
                                   msg=name)


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_changing_one_document_changes_no_other(chunk_tokens):
    run_on_ranks(_one_document_changed, 1, args=(chunk_tokens,), timeout_s=240)


def _context_parallel(rank, world_size):
    tokens = _tokens()
    return context_parallel_equals_one_rank(_model, tokens, _documents(tokens[:, :-1]),
                                            world_size)


def context_parallel_equals_one_rank(make_model, tokens, documents, world_size):
    """On this rank of ``world_size`` CP ranks: the model ``make_model(context_parallel_size=)``
    gives this rank's share of the losses of CP = 1, and the gradients summed over the ranks."""
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1)
    try:
        expected = _losses_and_grads(make_model(), tokens, documents)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world_size)
    try:
        return assert_context_parallel_share(make_model(context_parallel_size=world_size),
                                             tokens, expected, documents)
    finally:
        parallel_state.destroy_model_parallel()


def test_context_parallel_keeps_documents():
    """CP = 2 (zigzag split, sequence-to-head all-to-all): the losses and gradients of CP = 1
    with the same documents (which are each document's alone, above)."""
    assert run_on_ranks(_context_parallel, 2, timeout_s=240) == [(2, SEQ // 2)] * 2


# --- one GPU, bf16 -------------------------------------------------------------------------------

def _relative_error(got, expected):
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("path", ["varlen", "blocks"])
def test_gpu_packed_is_as_accurate_as_each_document_alone_at_131072_tokens(path):
    """bf16, 131,072 tokens of documents of unequal lengths (one of a single token), 16 heads of
    64 in 4 groups: the output and dQ, dK, dV of the packed sequence (flash's variable-length
    kernel, or the chunked attention's per-document forward and blocked backward over 16,384-row
    blocks) are within twice the error of each document run alone through SDPA in bf16, both
    against an fp32 reference of each document alone."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron.bounded.attention.blockwise import attention_forward, query_block_backward

    seq, heads, groups, dim, block = 131_072, 16, 4, 64, 16_384
    generator = torch.Generator().manual_seed(7)
    lengths = [1]
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(512, 24_576, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - seq
    ends = torch.tensor(lengths, device="cuda").cumsum(0)
    documents = DocumentParams.from_ends(ends, 1, seq)
    generator = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(seq, 1, heads, dim), (seq, 1, groups, dim), (seq, 1, groups, dim)]
    query, key, value = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=generator)
                         for s in shapes)
    grad_out = torch.randn(seq, 1, heads, dim, device="cuda", dtype=torch.bfloat16,
                           generator=generator)
    scale = dim ** -0.5

    def each_document_alone(tensors, backends):
        """Output and gradients, every document through SDPA on its own."""
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        outputs = []
        bounds = documents.sequences[0]
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (t[start:end].permute(1, 2, 0, 3) for t in leaves)
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            out = out.permute(2, 0, 1, 3)
            out.backward(grad_out[start:end].to(out.dtype))
            outputs.append(out.detach())
        return [torch.cat(outputs)] + [leaf.grad for leaf in leaves]

    reference = each_document_alone([t.float() for t in (query, key, value)],
                                    [SDPBackend.EFFICIENT_ATTENTION])
    alone = each_document_alone([query, key, value],
                                [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION])
    if path == "varlen":
        leaves = [t.clone().requires_grad_(True) for t in (query, key, value)]
        out = document_attention(*leaves, documents, scale)
        out.backward(grad_out)
        packed = [out.detach()] + [leaf.grad for leaf in leaves]
    else:
        out, lse, kernel = attention_forward(query, key, value, scale, ("cudnn", "flash"),
                                             documents.sequences)
        bounds = block_bounds(seq, block)
        grad_key = torch.zeros(key.shape, dtype=torch.float32, device="cuda")
        grad_value = torch.zeros_like(grad_key)
        grad_query = torch.empty_like(query)
        for start, end in reversed(bounds):
            grad_query[start:end] = query_block_backward(
                grad_out[start:end], query[start:end], key, value, out[start:end],
                lse[:, :, start:end], start, bounds, grad_key, grad_value, scale, kernel,
                documents.sequences)
        packed = [out, grad_query, grad_key, grad_value]
    errors = {name: (_relative_error(p, r), _relative_error(a, r))
              for name, p, a, r in zip(("out", "dq", "dk", "dv"), packed, alone, reference)}
    for name, (packed_error, alone_error) in errors.items():
        assert packed_error <= 2 * alone_error + 1e-4, (name, errors)


def test_documents_found_on_the_host_move_with_their_cumulative_lengths():
    """get_batch finds the documents in the loader's host tensors and moves only the cumulative
    lengths; the host bounds stay as they were."""
    documents = _documents(_tokens()[:, :SEQ])
    moved = documents.to("cpu")
    assert moved.sequences == documents.sequences and moved.longest == documents.longest
    assert moved.cu_seqlens_kv is moved.cu_seqlens_q
    assert torch.equal(moved.cu_seqlens_q, documents.cu_seqlens_q)
