"""Tests for Ring-DTP (megatron.bounded.loss.ring_dtp).

Ground truth is ``reference_cross_entropy`` on fp64 copies of the (possibly bf16-rounded) inputs,
with the full weight. Multi-rank tests run on gloo CPU ranks spawned by ``run_on_ranks``; each body
runs many configurations in one spawn to keep the suite fast, asserts on every rank and returns the
measured errors so the parent asserts them again.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.bounded.loss.ring_dtp import function, single, strips
from megatron.bounded.loss.ring_dtp import (
    choose_ring_mode,
    gradient_group_rows,
    reference_cross_entropy,
    reset_ring_dtp_stats,
    ring_dtp_cross_entropy,
    ring_dtp_stats,
    ring_dtp_workspace_bytes,
    vocab_shard_range,
)
from tests.conftest import requires_cuda, requires_two_gpus
from tests.unit.distributed import run_on_ranks
from megatron.bounded.units import MiB, ceil_div

IGNORE = -100
FP32_TOL = 1e-5
BF16_LOSS_TOL = 1e-4
BF16_GRAD_TOL = 1e-2
FP64_TOL = 1e-12


# --------------------------------------------------------------------------------------------
# Shared helpers (module level: the spawned ranks import them)
# --------------------------------------------------------------------------------------------


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 for empty tensors)."""
    if expected.numel() == 0:
        assert actual.numel() == 0
        return 0.0
    diff = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    return diff / max(scale, 1e-30)


def _problem(seed, token_counts, hidden, vocab, ignore_every=5):
    """Full weight, every rank's batch, labels (some ignored) and loss gradients, in fp64."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / math.sqrt(hidden) * 3
    hiddens, labels, grads = [], [], []
    for n in token_counts:
        hiddens.append(torch.randn(n, hidden, generator=gen, dtype=torch.float64))
        lab = torch.randint(0, vocab, (n,), generator=gen)
        if ignore_every:
            lab[1::ignore_every] = IGNORE
        labels.append(lab)
        grads.append(torch.rand(n, generator=gen, dtype=torch.float64) + 0.5)
    return weight, hiddens, labels, grads


def _reference_grads(weight, hiddens, labels, grads, dtype):
    """Per-rank loss and dX, and the full-weight dW summed over all ranks' batches (fp64)."""
    w = weight.to(dtype).double().requires_grad_()
    losses, dxs = [], []
    for h, lab, g in zip(hiddens, labels, grads):
        x = h.to(dtype).double().requires_grad_()
        loss = reference_cross_entropy(x, w, lab, IGNORE)
        loss.backward(g)
        losses.append(loss.detach())
        dxs.append(x.grad if x.grad is not None else torch.zeros_like(x))
    dw = w.grad if w.grad is not None else torch.zeros_like(w)
    return losses, dxs, dw


def _run_case(rank, world, group, token_counts, hidden, vocab, mode, chunk, dtype, seed,
              grad_in_forward=False, uniform_grads=False):
    """Run one configuration on this rank; assert and return the errors and counters.
    ``uniform_grads``: every token's loss gradient is 0.75 (a scaled sum), else random."""
    weight, hiddens, labels, grads = _problem(seed, token_counts, hidden, vocab)
    if uniform_grads:
        grads = [torch.full_like(g, 0.75) for g in grads]
    start, end = vocab_shard_range(vocab, rank, world)
    x = hiddens[rank].to(dtype).requires_grad_()
    w = weight[start:end].to(dtype).clone().requires_grad_()

    reset_ring_dtp_stats()
    loss = ring_dtp_cross_entropy(x, w, labels[rank], group=group, mode=mode, chunk_tokens=chunk,
                                  grad_in_forward=grad_in_forward)
    fwd = ring_dtp_stats()
    loss.backward(grads[rank].to(loss.dtype))
    total = ring_dtp_stats()

    ref_losses, ref_dxs, ref_dw = _reference_grads(weight, hiddens, labels, grads, dtype)
    expect_acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == expect_acc, loss.dtype
    assert loss.shape == (token_counts[rank],)
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert x.grad.shape == x.shape and w.grad.shape == w.shape

    ignored = labels[rank] == IGNORE
    assert torch.all(loss[ignored] == 0)
    assert torch.all(x.grad[ignored] == 0)

    errs = {
        "loss": _rel(loss, ref_losses[rank]),
        "dx": _rel(x.grad, ref_dxs[rank]),
        "dw": _rel(w.grad, ref_dw[start:end]),
    }
    loss_tol, grad_tol = {
        torch.float32: (FP32_TOL, FP32_TOL),
        torch.bfloat16: (BF16_LOSS_TOL, BF16_GRAD_TOL),
        torch.float64: (FP64_TOL, FP64_TOL),
    }[dtype]
    case = (f"rank {rank} P={world} N={token_counts} V={vocab} mode={mode} chunk={chunk} {dtype}"
            f"{' grad_in_forward' if grad_in_forward else ''}{' uniform' if uniform_grads else ''}")
    assert errs["loss"] <= loss_tol, (case, errs)
    assert errs["dx"] <= grad_tol, (case, errs)
    assert errs["dw"] <= grad_tol, (case, errs)
    return {"case": case, "errs": errs, "fwd": fwd, "total": total, "tols": (loss_tol, grad_tol)}


def _expected_bytes(rank, world, token_counts, hidden, vocab, mode, in_bytes, acc_bytes):
    """Payload bytes this rank sends in forward and in backward for each schedule."""
    sizes = [e - s for s, e in (vocab_shard_range(vocab, r, world) for r in range(world))]
    visiting = [(rank - s) % world for s in range(world)]  # owner / home held at step s
    if mode == "weights":
        hops = sum(sizes[o] * hidden * in_bytes for o in visiting[:-1])
        fwd = hops
        bwd = hops + sum(sizes[o] * hidden * acc_bytes for o in visiting)  # dW travels
    else:
        acts = sum(token_counts[o] * (hidden * in_bytes + 8) for o in visiting[:-1])
        fwd = acts + sum(3 * token_counts[o] * acc_bytes for o in visiting)  # (m, z, y) travels
        bwd = (
            acts
            + sum(2 * token_counts[o] * acc_bytes for o in visiting[:-1])  # (lse, grad scale)
            + sum(token_counts[o] * hidden * acc_bytes for o in visiting)  # dX returns home
        )
    return fwd, bwd


def _check_schedule(rank, world, res, token_counts, hidden, vocab, mode, chunk, dtype):
    """The right operand moved (exact byte counts) and strips never exceeded the bound."""
    in_bytes = torch.tensor([], dtype=dtype).element_size()
    acc_bytes = 8 if dtype == torch.float64 else 4
    fwd_bytes, bwd_bytes = _expected_bytes(
        rank, world, token_counts, hidden, vocab, mode, in_bytes, acc_bytes
    )
    assert res["fwd"]["last_mode"] == mode
    assert res["fwd"]["bytes_sent"] == fwd_bytes, (res["case"], res["fwd"], fwd_bytes)
    assert res["total"]["bytes_sent"] == fwd_bytes + bwd_bytes, (res["case"], res["total"])

    shard_max = ceil_div(vocab, world)
    n_max = max(token_counts)
    rows_cap = n_max if chunk is None else min(chunk, n_max)
    largest = res["total"]["max_strip_elements"]
    assert largest <= rows_cap * shard_max, (res["case"], largest, rows_cap * shard_max)
    # The counter is live: it records exactly the strip the schedule forms.
    start, end = vocab_shard_range(vocab, rank, world)
    if mode == "activations":  # every batch visits this rank's own shard
        expected = min(rows_cap, n_max) * (end - start)
    else:  # this rank's tokens meet every shard; the largest has ceil(V/P) rows
        n = token_counts[rank]
        expected = (n if chunk is None else min(chunk, n)) * shard_max
    assert largest == expected, (res["case"], largest, expected)


def _ring_body(rank, world, hidden, vocab, token_sets, chunks, extra_dtypes):
    group = dist.group.WORLD
    results = []
    seed = 0
    for token_counts in token_sets:
        for mode in ("weights", "activations", "auto"):
            for chunk in chunks:
                seed += 1
                res = _run_case(rank, world, group, token_counts, hidden, vocab, mode, chunk,
                                torch.float32, seed)
                resolved = choose_ring_mode(max(token_counts), vocab, world)
                if mode == "auto":
                    assert res["fwd"]["last_mode"] == resolved, (res["case"], res["fwd"])
                _check_schedule(rank, world, res, token_counts, hidden, vocab,
                                resolved if mode == "auto" else mode, chunk, torch.float32)
                results.append(res)
    for dtype in extra_dtypes:
        for mode in ("weights", "activations"):
            seed += 1
            token_counts = token_sets[-1]
            res = _run_case(rank, world, group, token_counts, hidden, vocab, mode, chunks[-1],
                            dtype, seed)
            _check_schedule(rank, world, res, token_counts, hidden, vocab, mode, chunks[-1], dtype)
            results.append(res)
    return [(r["case"], r["errs"], r["tols"]) for r in results]


def _assert_results(per_rank, world):
    assert len(per_rank) == world
    count = None
    for rank_results in per_rank:
        assert rank_results, "a rank ran no cases"
        count = len(rank_results) if count is None else count
        assert len(rank_results) == count
        for case, errs, (loss_tol, grad_tol) in rank_results:
            assert errs["loss"] <= loss_tol, (case, errs)
            assert errs["dx"] <= grad_tol and errs["dw"] <= grad_tol, (case, errs)


def _with_grads_body(rank, world, hidden, vocab, token_sets, chunks, dtypes):
    """grad_in_forward against the fp64 reference, with a uniform loss gradient (strips formed
    once, no ring traffic in backward) and a random one (replayed, still exact)."""
    group = dist.group.WORLD if world > 1 else None
    results = []
    seed = 100
    for token_counts in token_sets:
        for mode in ("activations", "weights", "auto"):
            for chunk in chunks:
                for dtype in dtypes:
                    for uniform in (True, False):
                        seed += 1
                        res = _run_case(rank, world, group, token_counts, hidden, vocab, mode,
                                        chunk, dtype, seed, grad_in_forward=True,
                                        uniform_grads=uniform)
                        fwd, total = res["fwd"], res["total"]
                        if world > 1 and mode == "auto":  # whatever N is against V / P
                            assert fwd["last_mode"] == "activations", (res["case"], fwd)
                        takes_effect = world == 1 or mode != "weights"
                        if takes_effect and uniform:
                            # every strip formed once, in forward; nothing sent in backward
                            assert total["num_strips"] == fwd["num_strips"], (res["case"], fwd, total)
                            assert total["bytes_sent"] == fwd["bytes_sent"], (res["case"], fwd, total)
                        else:  # the strips are formed again in backward
                            assert total["num_strips"] == 2 * fwd["num_strips"], (res["case"], fwd, total)
                        results.append(res)
    return [(r["case"], r["errs"], r["tols"]) for r in results]


def test_grad_in_forward_single_rank():
    per_rank = run_on_ranks(
        _with_grads_body, 1, args=(16, 103, [[37]], (None, 8), (torch.float32, torch.bfloat16)))
    _assert_results(per_rank, 1)


@pytest.mark.parametrize("world, vocab, token_sets", [
    (2, 103, [[24, 24], [0, 37], [0, 0]]),  # unequal N with an empty rank; no token at all
    (3, 103, [[13, 0, 40]]),
    (4, 50, [[3, 0, 30, 17]]),
])
def test_grad_in_forward_on_a_ring(world, vocab, token_sets):
    per_rank = run_on_ranks(
        _with_grads_body, world, args=(16, vocab, token_sets, (None, 5), (torch.float32,)))
    _assert_results(per_rank, world)


def test_grad_in_forward_does_nothing_extra_without_autograd(monkeypatch):
    """Evaluation (no_grad) and inputs without gradients take the plain forward."""
    def forbidden(*args, **kwargs):
        raise AssertionError("gradients computed in a forward nobody differentiates")

    monkeypatch.setattr(function, "single_with_grads", forbidden)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 8, generator=gen, requires_grad=True)
    w = torch.randn(30, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 30, (12,), generator=gen)
    with torch.no_grad():
        evaluated = ring_dtp_cross_entropy(x, w, labels, grad_in_forward=True)
    frozen = ring_dtp_cross_entropy(x.detach(), w.detach(), labels, grad_in_forward=True)
    torch.testing.assert_close(evaluated, frozen, rtol=0, atol=0)


def test_grad_in_forward_keeps_dx_in_the_input_dtype_bitwise_the_replay_at_unit_scale():
    """The dX computed in forward is kept in the input dtype (each chunk's fp32 sum rounded once):
    with a loss gradient of 1 it is bitwise the gradient the replay computes in backward."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    w = torch.randn(103, 16, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, 103, (40,), generator=gen)
    grads = {}
    for grad_in_forward in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = ring_dtp_cross_entropy(xi, wi, labels, chunk_tokens=8,
                                      grad_in_forward=grad_in_forward)
        if grad_in_forward:
            kept = [t for t in loss.grad_fn.saved_tensors if t.shape == x.shape and t is not xi]
            assert [t.dtype for t in kept] == [torch.bfloat16]
        loss.sum().backward()
        grads[grad_in_forward] = (xi.grad, wi.grad)
    assert torch.equal(grads[True][0], grads[False][0])
    assert torch.equal(grads[True][1], grads[False][1])


def test_grad_in_forward_ring_bf16():
    per_rank = run_on_ranks(_with_grads_body, 2, args=(16, 103, [[40, 9]], (6,), (torch.bfloat16,)))
    _assert_results(per_rank, 2)


# --------------------------------------------------------------------------------------------
# Shard layout and mode choice
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 50, 103, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_vocab_shard_range_covers_contiguously(vocab, world):
    ranges = [vocab_shard_range(vocab, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 == s1  # contiguous, in rank order
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == vocab
    assert sorted(sizes, reverse=True) == sizes  # extra rows go to the first ranks


def test_vocab_shard_range_rejects_bad_rank():
    with pytest.raises(ValueError):
        vocab_shard_range(10, 2, 2)
    with pytest.raises(ValueError):
        vocab_shard_range(10, 0, 0)


def test_choose_ring_mode_threshold():
    # N > V/P moves weights (smaller per hop), N <= V/P moves activations.
    assert choose_ring_mode(40, 103, 2) == "activations"  # 40 < 51.5
    assert choose_ring_mode(52, 103, 2) == "weights"  # 52 > 51.5
    assert choose_ring_mode(25_000, 200_000, 8) == "activations"  # tie
    assert choose_ring_mode(25_001, 200_000, 8) == "weights"
    assert choose_ring_mode(16_384, 200_000, 8) == "activations"
    assert choose_ring_mode(32_768, 200_000, 8) == "weights"
    assert choose_ring_mode(32_768, 200_000, 8, grad_in_forward=True) == "activations"


# --------------------------------------------------------------------------------------------
# One rank: fused chunked linear + cross-entropy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
@pytest.mark.parametrize(
    "dtype,loss_tol,grad_tol",
    [
        (torch.float32, FP32_TOL, FP32_TOL),
        (torch.float64, FP64_TOL, FP64_TOL),
        (torch.bfloat16, BF16_LOSS_TOL, BF16_GRAD_TOL),
    ],
)
def test_single_rank_matches_reference(chunk, dtype, loss_tol, grad_tol):
    token_counts, hidden, vocab = [37], 24, 101
    weight, hiddens, labels, grads = _problem(11, token_counts, hidden, vocab)
    x = hiddens[0].to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    reset_ring_dtp_stats()
    loss = ring_dtp_cross_entropy(x, w, labels[0], chunk_tokens=chunk)
    loss.backward(grads[0].to(loss.dtype))
    ref_losses, ref_dxs, ref_dw = _reference_grads(weight, hiddens, labels, grads, dtype)

    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    assert _rel(loss, ref_losses[0]) <= loss_tol
    assert _rel(x.grad, ref_dxs[0]) <= grad_tol
    assert _rel(w.grad, ref_dw) <= grad_tol
    assert ring_dtp_stats()["last_mode"] == "single"
    assert ring_dtp_stats()["bytes_sent"] == 0


@pytest.mark.parametrize("chunk", [None, 7])
def test_sixteen_bit_gemms_writing_fp32_match_reference(monkeypatch, chunk):
    """The CUDA path for bf16 inputs (16-bit GEMMs with fp32 results, a bf16 gradient strip),
    run on CPU with the fp32-result GEMM emulated exactly: loss as exact as the upcast path,
    gradients within bf16 tolerance."""
    used = []

    def mm_writing_fp32(a, b, acc):
        used.append(a.dtype)
        return a @ b if a.dtype == acc else a.to(acc) @ b.to(acc)  # exact products, fp32 sums

    monkeypatch.setattr(strips, "mixed_gemm_supported", lambda device, dtype: True)
    monkeypatch.setattr(strips, "mm", mm_writing_fp32)
    token_counts, hidden, vocab = [37], 24, 101
    weight, hiddens, labels, grads = _problem(11, token_counts, hidden, vocab)
    x = hiddens[0].to(torch.bfloat16).requires_grad_()
    w = weight.to(torch.bfloat16).requires_grad_()
    loss = ring_dtp_cross_entropy(x, w, labels[0], chunk_tokens=chunk)
    loss.backward(grads[0].to(loss.dtype))
    ref_losses, ref_dxs, ref_dw = _reference_grads(weight, hiddens, labels, grads, torch.bfloat16)
    assert used and set(used) == {torch.bfloat16}  # every GEMM took 16-bit operands
    assert _rel(loss, ref_losses[0]) <= BF16_LOSS_TOL
    assert _rel(x.grad, ref_dxs[0]) <= BF16_GRAD_TOL
    assert _rel(w.grad, ref_dw) <= BF16_GRAD_TOL


def test_gradient_group_rows():
    """The rows of G kept per weight-gradient GEMM: with a separate fp32 strip (16-bit G),
    rows * 2 + chunk * 4 <= H * 2 bytes per vocabulary row; with the strips formed in an fp32
    buffer, rows * 4 <= H * b; never less than one chunk, always whole chunks."""
    assert gradient_group_rows(512, 4096, 2, 2, 4, True) == 3072
    assert gradient_group_rows(1024, 4096, 2, 2, 4, True) == 2048
    assert gradient_group_rows(256, 4096, 2, 2, 4, True) == 3584
    assert gradient_group_rows(2048, 4096, 2, 2, 4, True) == 2048  # one chunk at least
    assert gradient_group_rows(8, 64, 4, 4, 4, False) == 64
    assert gradient_group_rows(8, 64, 2, 4, 4, False) == 32
    for chunk in (1, 7, 100, 333, 1000, 5000):
        rows = gradient_group_rows(chunk, 4096, 2, 2, 4, True)
        assert rows % chunk == 0 and rows >= chunk
        assert rows == chunk or rows * 2 + chunk * 4 <= 4096 * 2
        assert (rows + chunk) * 2 + chunk * 4 > 4096 * 2  # as many as fit


@pytest.mark.parametrize("sixteen_bit_gemms", [False, True])
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_single_rank_groups_the_weight_gradient_gemms(monkeypatch, sixteen_bit_gemms, grad_in_forward):
    """One GEMM adds into the fp32 dW per group of chunks, not per chunk, and the result is the
    reference's: with the strips formed in an fp32 buffer (CPU), and with bf16 GEMMs writing fp32
    (the CUDA path, emulated) whose G rows are kept in bf16 beside the fp32 strip."""
    n, hidden, vocab, chunk = 100, 64, 101, 4
    dtype = torch.bfloat16
    if sixteen_bit_gemms:
        monkeypatch.setattr(strips, "mixed_gemm_supported", lambda device, dtype: True)
        monkeypatch.setattr(strips, "mm", lambda a, b, acc: a @ b if a.dtype == acc else a.to(acc) @ b.to(acc))
        group = gradient_group_rows(chunk, hidden, 2, 2, 4, True)
    else:
        group = gradient_group_rows(chunk, hidden, 2, 4, 4, False)
    assert chunk < group < n
    weight, hiddens, labels, grads = _problem(21, [n], hidden, vocab)
    x = hiddens[0].to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    reset_ring_dtp_stats()
    loss = ring_dtp_cross_entropy(x, w, labels[0], chunk_tokens=chunk, grad_in_forward=grad_in_forward)
    # a uniform loss gradient: with grad_in_forward nothing is replayed
    loss.backward(torch.full_like(loss, 0.5))
    stats = ring_dtp_stats()
    assert stats["weight_grad_gemms"] == ceil_div(n, group) < ceil_div(n, chunk)
    assert stats["max_strip_elements"] == chunk * vocab
    assert stats["num_strips"] == (1 if grad_in_forward else 2) * ceil_div(n, chunk)
    ref_losses, ref_dxs, ref_dw = _reference_grads(weight, hiddens, labels,
                                                   [torch.full((n,), 0.5, dtype=torch.float64)], dtype)
    assert _rel(loss, ref_losses[0]) <= BF16_LOSS_TOL
    assert _rel(x.grad, ref_dxs[0]) <= BF16_GRAD_TOL
    assert _rel(w.grad, ref_dw) <= BF16_GRAD_TOL


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_gradient_rows_set_the_group(grad_in_forward):
    """``gradient_rows`` replaces the default rule: one weight-gradient GEMM per that many rows,
    the same gradients within rounding, and the bound counts the rows."""
    n, hidden, vocab, chunk = 100, 64, 101, 4
    weight, hiddens, labels, _ = _problem(21, [n], hidden, vocab)
    grads = {}
    for rows in (None, 12, 48):
        x = hiddens[0].to(torch.bfloat16).requires_grad_()
        w = weight.to(torch.bfloat16).requires_grad_()
        reset_ring_dtp_stats()
        ring_dtp_cross_entropy(x, w, labels[0], chunk_tokens=chunk, grad_in_forward=grad_in_forward,
                               gradient_rows=rows).sum().backward()
        default = gradient_group_rows(chunk, hidden, 2, 4, 4, False)  # fp32 G on CPU
        assert ring_dtp_stats()["weight_grad_gemms"] == ceil_div(n, rows or default)
        grads[rows] = (x.grad.float(), w.grad.float())
    for rows in (12, 48):
        assert _rel(grads[rows][0], grads[None][0]) <= BF16_GRAD_TOL
        assert _rel(grads[rows][1], grads[None][1]) <= BF16_GRAD_TOL
    bound = functools.partial(ring_dtp_workspace_bytes, n, hidden, vocab, chunk_tokens=chunk,
                              input_bytes=2, grad_in_forward=grad_in_forward)
    default = gradient_group_rows(chunk, hidden, 2, 2, 4, True)  # bf16 G (CUDA)
    more = bound(gradient_rows=default + 4 * chunk) - bound(gradient_rows=default)
    assert more >= 4 * chunk * vocab * 2


def test_gradient_rows_are_checked():
    x, w, labels = torch.randn(8, 4), torch.randn(10, 4), torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="gradient_rows needs chunk_tokens"):
        ring_dtp_cross_entropy(x, w, labels, gradient_rows=8)
    for rows in (0, 6, -4):
        with pytest.raises(ValueError, match="positive multiple of chunk_tokens \\(4\\)"):
            ring_dtp_cross_entropy(x, w, labels, chunk_tokens=4, gradient_rows=rows)


def test_grouped_gradients_in_forward_are_bitwise_the_replay_at_unit_scale():
    """With G kept for several chunks per GEMM, gradients in forward and the replay group alike,
    so at a loss gradient of 1 they agree bitwise."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(90, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(103, 64, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, 103, (90,), generator=gen)
    labels[::9] = IGNORE
    grads = {}
    for grad_in_forward in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        reset_ring_dtp_stats()
        ring_dtp_cross_entropy(xi, wi, labels, chunk_tokens=5,
                               grad_in_forward=grad_in_forward).sum().backward()
        assert ring_dtp_stats()["weight_grad_gemms"] == ceil_div(90, 30)  # 64 * 2 / 4 = 32 -> 30
        grads[grad_in_forward] = (xi.grad, wi.grad)
    assert torch.equal(grads[True][0], grads[False][0])
    assert torch.equal(grads[True][1], grads[False][1])


@pytest.mark.gpu
@requires_cuda
def test_gpu_grouped_gradients_in_forward_are_bitwise_the_replay_at_unit_scale():
    """The same on CUDA, where the fused kernels run: the gradient strip after the fold forms its
    log-sum-exp in the kernel, the replay's comes from the forward, and they agree bitwise."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(8)
    x = torch.randn(2048, 256, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(30_011, 256, device=dev, generator=gen) / 16).to(torch.bfloat16)
    labels = torch.randint(0, 30_011, (2048,), device=dev, generator=gen)
    labels[::9] = IGNORE
    grads = {}
    for grad_in_forward in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        ring_dtp_cross_entropy(xi, wi, labels, chunk_tokens=256,
                               grad_in_forward=grad_in_forward).sum().backward()
        grads[grad_in_forward] = (xi.grad, wi.grad)
    assert torch.equal(grads[True][0], grads[False][0])
    assert torch.equal(grads[True][1], grads[False][1])


def test_single_rank_fp32_matches_torch_reference_directly():
    """Plain fp32 comparison with the fp32 reference path, as the benchmark does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(29, 32, generator=gen, requires_grad=True)
    w = torch.randn(77, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 77, (29,), generator=gen)
    go = torch.rand(29, generator=gen)
    loss = ring_dtp_cross_entropy(x, w, labels, chunk_tokens=8)
    loss.backward(go)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = reference_cross_entropy(x, w, labels)
    ref.backward(go)
    assert _rel(loss, ref) <= FP32_TOL
    assert _rel(dx, x.grad) <= FP32_TOL and _rel(dw, w.grad) <= FP32_TOL
    # Inputs and results are not trivial.
    assert ref.abs().min() > 0 and dx.abs().max() > 0


def test_ignore_index_single_rank():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (12,), generator=gen)
    labels[[0, 4, 5, 11]] = 7  # a custom ignore_index that is also a valid vocabulary id
    loss = ring_dtp_cross_entropy(x, w, labels, chunk_tokens=5, ignore_index=7)
    loss.sum().backward()
    ignored = labels == 7
    assert torch.all(loss[ignored] == 0) and torch.all(loss[~ignored] > 0)
    assert torch.all(x.grad[ignored] == 0) and torch.all(x.grad[~ignored].abs().sum(1) > 0)
    ref = reference_cross_entropy(x.detach(), w.detach(), labels, ignore_index=7)
    assert _rel(loss, ref) <= FP64_TOL

    # All tokens ignored: zero loss and zero gradients everywhere.
    x.grad = w.grad = None
    loss = ring_dtp_cross_entropy(x, w, torch.full((12,), IGNORE))
    loss.sum().backward()
    assert torch.all(loss == 0) and torch.all(x.grad == 0) and torch.all(w.grad == 0)


def test_empty_batch_single_rank():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    loss = ring_dtp_cross_entropy(x, w, torch.zeros(0, dtype=torch.long), chunk_tokens=4)
    assert loss.shape == (0,) and loss.dtype == torch.float32
    loss.sum().backward()
    assert w.grad is not None and torch.all(w.grad == 0) and x.grad.shape == (0, 16)


def test_invalid_arguments_raise():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="labels"):
        ring_dtp_cross_entropy(x, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="labels"):
        ring_dtp_cross_entropy(x, w, torch.tensor([0, -3, 1, 2]))
    with pytest.raises(ValueError, match="mode"):
        ring_dtp_cross_entropy(x, w, torch.tensor([0, 1, 2, 3]), mode="both")
    with pytest.raises(ValueError, match="chunk_tokens"):
        ring_dtp_cross_entropy(x, w, torch.tensor([0, 1, 2, 3]), chunk_tokens=0)
    with pytest.raises(ValueError, match="shape"):
        ring_dtp_cross_entropy(x, torch.randn(10, 9), torch.tensor([0, 1, 2, 3]))


# --------------------------------------------------------------------------------------------
# Memory bound, instrumented on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 8, 13])
def test_strip_bound_single_rank(chunk):
    n, hidden, vocab = 64, 8, 103
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    reset_ring_dtp_stats()
    ring_dtp_cross_entropy(x, w, labels, chunk_tokens=chunk).sum().backward()
    stats = ring_dtp_stats()
    rows = n if chunk is None else chunk
    assert stats["max_strip_elements"] == rows * vocab  # never more, and the counter is live
    assert stats["num_strips"] == 2 * ceil_div(n, rows)  # forward + backward replay


class _LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor any operator produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_no_tensor_exceeds_bound_single_rank(grad_in_forward):
    """Independently of the module's own counter: no operator output during forward and backward
    is larger than the strip bound or the input-sized gradient accumulators, while the standard
    path's logits are."""
    n, hidden, vocab, chunk = 64, 8, 103, 8
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    bound = max(chunk * vocab, vocab * hidden, n * hidden)
    assert bound < n * vocab  # the sizes make the check meaningful

    with _LargestTensor() as watch:
        ring_dtp_cross_entropy(x, w, labels, chunk_tokens=chunk,
                               grad_in_forward=grad_in_forward).sum().backward()
    assert 0 < watch.largest <= bound, (watch.largest, bound)

    with _LargestTensor() as watch_ref:
        reference_cross_entropy(x, w, labels).sum().backward()
    assert watch_ref.largest >= n * vocab > bound


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that operators create while it is on; ``quiet()``
    leaves out what is allocated inside (the temporaries of the eager stand-ins of CUDA
    kernels, which write only into tensors they are given)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.muted = False

    def quiet(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            muted, self.muted = self.muted, True
            try:
                return fn(*args, **kwargs)
            finally:
                self.muted = muted
        return call

    def _freed(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or self.muted:
                continue
            storage = leaf.untyped_storage()
            if id(storage) in known or getattr(storage, "_counted", False):
                continue
            storage._counted = True
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("gradient_rows", [None, 32])
def test_one_rank_live_bytes_on_the_cuda_path_within_its_bound(monkeypatch, dtype, grad_in_forward,
                                                               gradient_rows):
    """One rank as CUDA runs it, on CPU: the strip kernels (eager stand-ins, their temporaries
    left out), 16-bit GEMMs writing fp32 and adding into it in place. The live bytes beyond the
    inputs and the returned gradients reach ``ring_dtp_workspace_bytes(cuda_kernels=True)``
    within the per-token allowance, and stay within it."""
    n, hidden, vocab, chunk = 256, 16, 1000, 16
    watch = _LiveBytes()
    if dtype == torch.bfloat16:
        monkeypatch.setattr(strips, "mixed_gemm_supported", lambda device, dtype: True)
        monkeypatch.setattr(strips, "mm", lambda a, b, acc: a @ b if a.dtype == acc
                            else watch.quiet(lambda: a.to(acc) @ b.to(acc))().clone())
        monkeypatch.setattr(strips, "accumulate_mm", watch.quiet(
            lambda total, a, b: total.add_(a.to(total.dtype) @ b.to(total.dtype))))
    for module in (single, strips):
        for name in ("fold_strip", "gradient_strip", "gradient_strip_after_fold"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, watch.quiet(getattr(module, name)))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    with watch:
        ring_dtp_cross_entropy(x, w, labels, chunk_tokens=chunk, grad_in_forward=grad_in_forward,
                               gradient_rows=gradient_rows).sum().backward()
    b = x.element_size()
    bound = ring_dtp_workspace_bytes(n, hidden, vocab, 1, "auto", chunk, input_bytes=b,
                                     grad_in_forward=grad_in_forward, gradient_rows=gradient_rows,
                                     cuda_kernels=True)
    # the returned gradients are outside the bound (dX is formed as one; in fp32 the dW
    # accumulator is the returned dW, counted)
    returned = (n * hidden + vocab * hidden) * b if b != 4 else n * hidden * 4
    per_token = 8 * n * 4  # the bound's allowance for per-token vectors
    assert bound - per_token <= watch.peak <= bound + returned + per_token, (watch.peak, bound)
    assert bound < ring_dtp_workspace_bytes(n, hidden, vocab, 1, "auto", chunk, input_bytes=b,
                                            grad_in_forward=grad_in_forward,
                                            gradient_rows=gradient_rows)


def test_workspace_bound_formula():
    args = dict(hidden_size=1024, vocab_size=200_000, world_size=8, chunk_tokens=4096)
    # With chunking the strip term is fixed; only O(N * H) terms grow with N.
    small = ring_dtp_workspace_bytes(32_768, mode="weights", **args)
    large = ring_dtp_workspace_bytes(65_536, mode="weights", **args)
    strip_bytes = 4 * 4096 * 25_000 * 4
    assert small >= strip_bytes and large - small <= 32_768 * (1024 * 4 + 8 * 4)
    # Without chunking the strip term is 4 strips of N x V/P.
    unchunked = ring_dtp_workspace_bytes(32_768, 1024, 200_000, 8, "weights")
    assert unchunked >= 4 * 32_768 * 25_000 * 4
    assert unchunked < 3 * 32_768 * 200_000 * 4  # well under the standard path's 3 N x V fp32
    # auto resolves with choose_ring_mode.
    assert ring_dtp_workspace_bytes(10, 64, 1000, 4, "auto") == ring_dtp_workspace_bytes(
        10, 64, 1000, 4, "activations"
    )


def test_single_rank_bound_with_gradients_in_forward_is_flat_in_n():
    """One rank, bf16, gradients in forward, 512-token chunks: the bound is the fp32 dW, the kept
    G rows (3,072 bf16) and one fp32 strip, plus terms of one group; only per-token vectors grow
    with N."""
    args = dict(hidden_size=4096, vocab_size=200_000, world_size=1, chunk_tokens=512,
                input_bytes=2, grad_in_forward=True)
    small = ring_dtp_workspace_bytes(8192, **args)
    large = ring_dtp_workspace_bytes(131_072, **args)
    assert large - small == 8 * 4 * (131_072 - 8192)
    v, h = 200_000, 4096
    assert small >= v * h * 4 + 3072 * v * 2 + 512 * v * 4
    # the replay writes dX in the input dtype (the returned gradient, not the working set): flat
    # in N too
    replay = dict(args, grad_in_forward=False)
    assert (ring_dtp_workspace_bytes(131_072, **replay) - ring_dtp_workspace_bytes(8192, **replay)
            == 8 * 4 * (131_072 - 8192))


# --------------------------------------------------------------------------------------------
# Several ranks (gloo, CPU)
# --------------------------------------------------------------------------------------------


def test_ring_two_ranks_all_modes():
    # V = 103 -> shards 52 / 51. Equal N, unequal N with one empty rank; fp64 and bf16 too.
    token_sets = [[24, 24], [0, 37], [40, 9]]
    per_rank = run_on_ranks(
        _ring_body, 2, args=(16, 103, token_sets, (None, 5), (torch.float64, torch.bfloat16))
    )
    _assert_results(per_rank, 2)


def test_ring_three_ranks_all_modes():
    # V = 103 -> shards 35 / 34 / 34.
    token_sets = [[20, 20, 20], [13, 0, 40]]
    per_rank = run_on_ranks(_ring_body, 3, args=(24, 103, token_sets, (None, 6), (torch.bfloat16,)))
    _assert_results(per_rank, 3)


def test_ring_four_ranks_all_modes():
    # V = 50 -> shards 13 / 13 / 12 / 12; N > V/P on some ranks only.
    token_sets = [[3, 0, 30, 17]]
    per_rank = run_on_ranks(_ring_body, 4, args=(32, 50, token_sets, (None, 4), ()))
    _assert_results(per_rank, 4)


def _subgroup_and_auto_body(rank, world):
    results = {}
    # A ring over global ranks {0, 2}: group ranks differ from global ranks; rank 1 stays out.
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        res = _run_case(dist.get_rank(sub), 2, sub, [11, 30], 16, 61, "weights", 4,
                        torch.float32, 123)
        results["subgroup_weights"] = res["errs"]
        res = _run_case(dist.get_rank(sub), 2, sub, [11, 30], 16, 61, "activations", None,
                        torch.float32, 124)
        results["subgroup_activations"] = res["errs"]
    dist.barrier()

    # auto: decided from the max N over the ring, so all ranks agree even if their own N differ.
    world_group = dist.group.WORLD
    records = []

    class _Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = _Capture(level=logging.INFO)
    logger = logging.getLogger("megatron.bounded.loss.ring_dtp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        vocab = 60  # V/P = 20
        for counts, expected in (([25, 3, 0], "weights"), ([25, 3, 0], "weights"),
                                 ([20, 19, 5], "activations")):
            res = _run_case(rank, world, world_group, counts, 8, vocab, "auto", None,
                            torch.float32, 7)
            assert res["fwd"]["last_mode"] == expected, (counts, res["fwd"])
            results.setdefault("auto", []).append(res["fwd"]["last_mode"])
    finally:
        logger.removeHandler(handler)
    # Logged on rank 0 only: once for the first choice (not repeated for the identical second
    # call), once on change.
    if rank == 0:
        assert len(records) == 2, records
        assert "weights" in records[0] and "activations" in records[1]
    else:
        assert records == [], records
    results["log"] = records
    return results


def test_ring_subgroup_and_auto_choice_agree():
    per_rank = run_on_ranks(_subgroup_and_auto_body, 3)
    for rank, res in enumerate(per_rank):
        assert res["auto"] == ["weights", "weights", "activations"]
        if rank != 1:
            for key in ("subgroup_weights", "subgroup_activations"):
                assert max(res[key].values()) <= FP32_TOL, (rank, key, res[key])
        else:
            assert "subgroup_weights" not in res


def _mismatch_body(rank, world):
    # Rank 1 passes a wrong shard size; every rank must raise the same error (no hang).
    w = torch.randn(5 if rank == 0 else 7, 8)
    try:
        ring_dtp_cross_entropy(torch.randn(3, 8), w, torch.tensor([0, 1, 2]),
                               group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_ring_inconsistent_shards_raise_on_every_rank():
    messages = run_on_ranks(_mismatch_body, 2)
    assert all(m is not None and "vocab_shard_range" in m for m in messages), messages


# --------------------------------------------------------------------------------------------
# GPU (run on a CUDA machine; skipped here)
# --------------------------------------------------------------------------------------------

def _peak_delta(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
@requires_cuda
def test_gpu_16bit_products_are_added_into_the_fp32_accumulators_in_place():
    """bf16 G^T . h into an fp32 dW accumulator: the same sum as through an fp32 product, and no
    product of the accumulator's size allocated (V/P x H x 4 B, 1.5 GiB at V = 200,000, P = 2,
    H = 4096)."""
    from megatron.bounded.loss.ring_dtp.strips import accumulate_mm, mixed_addmm_supported

    dev = torch.device("cuda")
    assert mixed_addmm_supported(dev, torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(0)
    grad_strip = torch.randn(2048, 8192, device=dev, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(2048, 1024, device=dev, generator=gen).to(torch.bfloat16)
    total = torch.randn(8192, 1024, device=dev, generator=gen)
    expected = total + torch.mm(grad_strip.T, hidden, out_dtype=torch.float32)
    extra = _peak_delta(lambda: accumulate_mm(total, grad_strip.T, hidden))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)
    assert extra < total.numel() * total.element_size() // 4, extra


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("gradient_rows", [None, 8192])
def test_gpu_peak_memory_within_bound(dtype, grad_in_forward, gradient_rows):
    n, hidden, vocab, chunk = 16_384, 1024, 32_768, 2048
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(n, hidden, device=dev, generator=gen) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=dev, generator=gen) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    labels[::7] = IGNORE
    # grad_in_forward applies to a loss gradient of one value on every token (else it replays)
    go = torch.full((n,), 0.75, device=dev) if grad_in_forward else torch.rand(n, device=dev, generator=gen) + 0.5

    def ring():
        ring_dtp_cross_entropy(x, w, labels, chunk_tokens=chunk, grad_in_forward=grad_in_forward,
                               gradient_rows=gradient_rows).backward(go)

    def standard():
        reference_cross_entropy(x, w, labels).backward(go)

    ring()  # warm-up (cuBLAS workspaces)
    standard()
    x.grad = w.grad = None
    ring_peak = _peak_delta(ring)
    ring_dx, ring_dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    std_peak = _peak_delta(standard)

    b = x.element_size()
    grads = (n * hidden + vocab * hidden) * b
    bound = ring_dtp_workspace_bytes(n, hidden, vocab, 1, "auto", chunk, input_bytes=b,
                                     grad_in_forward=grad_in_forward, gradient_rows=gradient_rows)
    slack = 64 * 512 + 32 * MiB  # allocator rounding and cuBLAS workspace
    assert ring_peak <= bound + grads + slack, (ring_peak, bound, grads)
    assert std_peak >= 2 * n * vocab * 4  # the standard path holds N x V fp32 logits + gradient
    assert ring_peak < 0.25 * std_peak, (ring_peak, std_peak)
    tol = FP32_TOL * 10 if dtype == torch.float32 else BF16_GRAD_TOL
    assert _rel(ring_dx, x.grad) <= tol and _rel(ring_dw, w.grad) <= tol


def _nccl_body(rank, world):
    """Every ring mode on two GPUs over NCCL against the fp64 reference: relative errors."""
    dev = torch.device("cuda", rank)
    errs = []
    # grad_in_forward with a uniform loss gradient: the fused kernels and the kept strips
    cases = [(mode, False) for mode in ("weights", "activations", "auto")] + [("activations", True)]
    for mode, grad_in_forward in cases:
        for counts in ([300, 0], [257, 1000]):
            weight, hiddens, labels, grads = _problem(9, counts, 64, 1001)
            if grad_in_forward:
                grads = [torch.full_like(g, 0.75) for g in grads]
            start, end = vocab_shard_range(1001, rank, world)
            x = hiddens[rank].float().to(dev).requires_grad_()
            w = weight[start:end].float().to(dev).requires_grad_()
            loss = ring_dtp_cross_entropy(x, w, labels[rank].to(dev), group=dist.group.WORLD,
                                          mode=mode, chunk_tokens=128,
                                          grad_in_forward=grad_in_forward)
            loss.backward(grads[rank].float().to(dev))
            ref_l, ref_dx, ref_dw = _reference_grads(weight, hiddens, labels, grads,
                                                     torch.float32)
            errs.append((mode, grad_in_forward, counts, _rel(loss.cpu(), ref_l[rank]),
                         _rel(x.grad.cpu(), ref_dx[rank]),
                         _rel(w.grad.cpu(), ref_dw[start:end])))
    return errs


@pytest.mark.gpu
@requires_two_gpus
def test_gpu_nccl_two_ranks_match_reference():
    for rank, payload in enumerate(run_on_ranks(_nccl_body, 2, backend="nccl", timeout_s=300)):
        for mode, grad_in_forward, counts, e_loss, e_dx, e_dw in payload:
            assert max(e_loss, e_dx, e_dw) <= 1e-4, (rank, mode, grad_in_forward, counts, e_loss, e_dx, e_dw)
