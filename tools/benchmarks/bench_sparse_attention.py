#!/usr/bin/env python3
"""Benchmark DeepSeek sparse attention's Triton kernels on one GPU: attention and indexer top-k.

DeepSeek-V3.2's per-layer shapes at tensor parallelism 1, batch 1, bf16: attention of 128 heads,
q and k 192 wide, v 128, over k = 2048 selected keys per query; the indexer's 64 heads of 128
and its top-2048. Reported (median of ``--repeats`` CUDA-event timings, one unless given; the
kernels compiled by a first, untimed run at 4,096 tokens):

* attention at each ``--attention-lengths`` N and selection ``--patterns``: forward and backward
  milliseconds, the bytes the kernels gather (N·k·heads·(d_qk + d_v)·2 forward, twice that
  backward, over the valid selected keys) per second, and the peak memory above the inputs.
  ``spread``: each query's k keys at random over its causal keys, one in each of k equal strata
  (no repeats; consecutive queries share almost none: the gathers come from HBM, the worst
  case); ``recent``: its k latest keys (consecutive queries share all but one: the gathers hit
  L2, the best case). A trained indexer's selections lie between.
* indexer top-k at each ``--indexer-lengths`` N: milliseconds of ``blockwise_topk`` (the score
  kernel and ``torch.topk`` per query block), the score kernel's TFLOP/s (the scores of every
  block without the top-k, N²·heads·dim FLOPs counted, half of them skipped above the
  diagonal), and the peak memory above the inputs and the result.
* at ``--small-length`` (attention) and ``--small-indexer-length``: the PyTorch path (as on CPU)
  against the kernels, the time ratio and the largest relative difference of the outputs and
  gradients (attention) or the share of the same keys selected (indexer; bf16 scores summed in
  another order may swap keys whose scores differ by rounding).
* ``--sweep``: the tilings of each attention kernel at the first attention length (spread).

Measurements that would end past ``--time-limit-s`` are skipped and listed as such.

    python tools/benchmarks/bench_sparse_attention.py [--attention-lengths 32768 131072]
        [--indexer-lengths 32768 131072 1048576] [--patterns spread recent] [--repeats 1]
        [--sweep] [--time-limit-s 210] [--out results/sparse_attention.json]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

import torch

from bench_common import (  # puts the repository on sys.path
    Benchmark, PeakMemory, Stopwatch, cuda_event_ms, max_relative_difference, median_cuda_ms,
)
from megatron.bounded.attention.kernels import sparse_attention as kernels
from megatron.bounded.attention.kernels.sparse_indexer import (
    blockwise_topk_triton, index_block_rows, index_scores_triton,
)
from megatron.bounded.attention.sparse_attention import sparse_attention_reference
from megatron.bounded.attention.sparse_indexer import blockwise_topk_reference
from megatron.bounded.units import GiB

BF16 = torch.bfloat16
DEVICE = torch.device("cuda")
# the first, untimed run that compiles the kernels: lengths above k and a multiple of 16 (the
# integer arguments Triton specializes on then specialize as at the measured lengths)
WARM_LENGTH = 4096


def selection(pattern: str, seq: int, topk: int, device) -> torch.Tensor:
    """[1, seq, min(topk, seq)] int32 selected keys of ``pattern`` (module docstring)."""
    width = min(topk, seq)
    result = torch.empty(1, seq, width, dtype=torch.int32, device=device)
    slots = torch.arange(width, device=device, dtype=torch.float64)
    for q0 in range(0, seq, 8192):  # rows at a time: float64 temporaries of 8192 × k
        positions = torch.arange(q0, min(q0 + 8192, seq), device=device).view(-1, 1)
        visible = positions + 1
        if pattern == "recent":
            keys = positions - slots.long()
        else:  # one key in each of k strata of [0, position]; all of them when fewer
            jitter = torch.rand(positions.shape[0], width, device=device, dtype=torch.float64)
            keys = torch.where(visible > width,
                               ((slots + jitter) * visible / width).long().clamp(max=positions),
                               slots.long().expand(positions.shape[0], -1))
        result[0, q0:q0 + positions.shape[0]] = torch.where(keys < visible, keys, -1).clamp(min=-1)
    return result


def attention_inputs(args, seq: int, device):
    def make(width):
        return torch.randn(seq, 1, args.heads, width, device=device, dtype=BF16)

    return make(args.qk_dim), make(args.qk_dim), make(args.v_dim), make(args.v_dim)


def compile_attention(args, tilings) -> None:
    """One forward and backward at :data:`WARM_LENGTH` tokens: Triton compiles the kernels."""
    *leaves, grad = attention_inputs(args, WARM_LENGTH, DEVICE)
    leaves = [t.requires_grad_() for t in leaves]
    indices = selection("recent", WARM_LENGTH, args.topk, DEVICE)
    torch.autograd.grad(kernels.sparse_attention_triton(*leaves, indices, 0.1, tilings), leaves,
                        grad)


def time_attention(args, inputs, indices, scale, tilings=kernels.TILINGS) -> dict:
    """Forward and backward milliseconds (medians of ``--repeats`` runs, CUDA events), gathered
    bytes per second and the peak memory of the first run above the inputs (the output, dQ, dK,
    dV and the kernels' working memory)."""
    query, key, value, grad = inputs
    leaves = [t.requires_grad_() for t in (query, key, value)]
    forward_ms, backward_ms = [], []
    with PeakMemory() as memory:
        for _ in range(args.repeats):
            outputs = []
            forward_ms.append(cuda_event_ms(lambda: outputs.append(
                kernels.sparse_attention_triton(*leaves, indices, scale, tilings))))
            backward_ms.append(cuda_event_ms(
                lambda: torch.autograd.grad(outputs.pop(), leaves, grad)))
    pairs = int((indices >= 0).sum()) * query.shape[2]  # (query, selected key, head)
    gathered = pairs * (query.shape[3] + value.shape[3]) * 2
    forward, backward = statistics.median(forward_ms), statistics.median(backward_ms)
    return {"forward_ms": forward, "backward_ms": backward,
            "forward_gathered_GBps": gathered / forward / 1e6,
            "backward_gathered_GBps": 2 * gathered / backward / 1e6,
            "peak_above_inputs_gib": memory.extra_bytes / GiB}


def attention_rows(args, clock) -> list:
    """Ascending lengths; a measurement whose time, extrapolated from the same pattern's at the
    last length (linear in N, doubled: fewer rows shared in L2), would pass the time limit is
    skipped."""
    rows, last = [], {}
    scale = 1 / math.sqrt(args.qk_dim)
    for seq in sorted(args.attention_lengths):
        inputs = attention_inputs(args, seq, DEVICE)
        for pattern in args.patterns:
            expected_s = 0.0
            if pattern in last:
                shorter, seconds = last[pattern]
                expected_s = 2 * seconds * seq / shorter
            if clock.expired(expected_s, attention=seq, pattern=pattern):
                continue
            indices = selection(pattern, seq, args.topk, DEVICE)
            with Stopwatch() as watch:
                row = {"attention": seq, "pattern": pattern,
                       **time_attention(args, inputs, indices, scale)}
            last[pattern] = (seq, watch.wall_s)
            print(row, flush=True)
            rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def sweep_rows(args, clock) -> list:
    """Each kernel's tiling variants, the others at their defaults."""
    seq, base = args.attention_lengths[0], kernels.TILINGS
    inputs = attention_inputs(args, seq, DEVICE)
    indices = selection("spread", seq, args.topk, DEVICE)
    variants = [("forward", kernels.Tiling(h, r, w)) for h, r, w in
                ((1, 16, 4), (2, 16, 4), (4, 8, 8), (4, 16, 8))]
    variants += [("query_backward", kernels.Tiling(h, r, w)) for h, r, w in
                 ((1, 16, 4), (2, 16, 4), (4, 8, 8))]
    variants += [("key_backward", kernels.Tiling(h, r, w)) for h, r, w in
                 ((1, 32, 4), (2, 8, 4), (4, 8, 8))]
    rows = []
    for kernel, tiling in variants:
        if clock.expired(sweep=kernel, tiling=dataclasses.asdict(tiling)):
            continue
        tilings = dataclasses.replace(base, **{kernel: tiling})
        compile_attention(args, tilings)
        row = {"sweep": kernel, "tiling": dataclasses.asdict(tiling), "attention": seq,
               **time_attention(args, inputs, indices, 1 / math.sqrt(args.qk_dim), tilings)}
        print(row, flush=True)
        rows.append(row)
    return rows


def indexer_inputs(args, seq: int):
    q = torch.randn(seq, 1, args.index_heads, args.index_dim, device=DEVICE, dtype=BF16)
    weights = torch.randn(seq, 1, args.index_heads, device=DEVICE, dtype=BF16)
    k = torch.randn(seq, 1, args.index_dim, device=DEVICE, dtype=BF16)
    return q, weights, k


def indexer_rows(args, clock) -> list:
    """Ascending lengths; a measurement whose time, extrapolated from the last length's
    (quadratic in N), would pass the time limit is skipped."""
    rows, last = [], None
    for seq in sorted(args.indexer_lengths):
        expected_s = 0.0 if last is None else last[1] * (seq / last[0]) ** 2
        if clock.expired(expected_s, indexer=seq):
            continue
        with Stopwatch() as watch:
            rows.append(indexer_row(args, seq))
        last = (seq, watch.wall_s)
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def indexer_row(args, seq: int) -> dict:
    q, weights, k = indexer_inputs(args, seq)
    result = torch.empty(1, seq, min(args.topk, seq), dtype=torch.int32, device=DEVICE)
    with PeakMemory() as memory:
        topk_ms = median_cuda_ms(lambda: result.copy_(blockwise_topk_triton(
            q, weights, k, args.topk)), args.repeats, warmup=0)
    block = index_block_rows(1, seq)
    storage = torch.empty(block * seq, dtype=torch.float32, device=DEVICE)

    def scores():
        for q0 in range(0, seq, block):
            q1 = min(q0 + block, seq)
            index_scores_triton(q, weights, k, None, q0, q1 - q0, q1, out=storage)

    scores_ms = median_cuda_ms(scores, args.repeats, warmup=0)
    flops = seq * seq * args.index_heads * args.index_dim  # 2·N²·H·D, half of it computed
    return {"indexer": seq, "topk_ms": topk_ms, "scores_ms": scores_ms,
            "scores_tflops": flops / scores_ms / 1e9,
            "peak_above_inputs_gib": (memory.extra_bytes - result.numel() * 4) / GiB}


def pytorch_comparison(args) -> list:
    """The PyTorch paths (what CPU tensors run) against the kernels at the small lengths, on the
    same CUDA tensors: one timed run each (the PyTorch attention visits one query row at a
    time at 128 heads × k 2048)."""
    seq, scale = args.small_length, 1 / math.sqrt(args.qk_dim)
    query, key, value, grad = attention_inputs(args, seq, DEVICE)
    indices = selection("spread", seq, args.topk, DEVICE)
    results, times = {}, {}
    for name, attention in (("pytorch", sparse_attention_reference),
                            ("triton", kernels.sparse_attention_triton)):
        leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        with Stopwatch() as clock:
            out = attention(*leaves, indices, scale)
            grads = torch.autograd.grad(out, leaves, grad)
        times[name] = clock.wall_s * 1e3
        results[name] = (out, *grads)
    rows = [{"compare": "attention forward+backward", "length": seq,
             "pytorch_ms": times["pytorch"], "triton_ms": times["triton"],
             "speedup": times["pytorch"] / times["triton"],
             "max_relative_difference": max(max_relative_difference(a, b) for a, b in
                                            zip(results["triton"], results["pytorch"]))}]
    seq = args.small_indexer_length
    q, weights, k = indexer_inputs(args, seq)
    selected = {}
    for name, topk in (("pytorch", blockwise_topk_reference), ("triton", blockwise_topk_triton)):
        with Stopwatch() as clock:
            selected[name] = topk(q, weights, k, args.topk)
        times[name] = clock.wall_s * 1e3
    rows.append({"compare": "indexer top-k", "length": seq, "pytorch_ms": times["pytorch"],
                 "triton_ms": times["triton"], "speedup": times["pytorch"] / times["triton"],
                 "shared_selected_keys": shared_fraction(selected["pytorch"], selected["triton"])})
    for row in rows:
        print(row, flush=True)
    return rows


def shared_fraction(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The share of ``theirs``'s selected keys (-1 aside) that ``ours`` selected for the same
    query: 1 when the selections are equal as sets (their order may differ where scores
    tie)."""
    ours = ours.sort(dim=-1).values
    at = torch.searchsorted(ours, theirs.contiguous()).clamp(max=ours.shape[-1] - 1)
    valid = theirs >= 0
    return ((ours.gather(-1, at) == theirs) & valid).sum().item() / max(valid.sum().item(), 1)


class Clock:
    """The time limit of the run: measurements that would end past it are recorded as
    skipped."""

    def __init__(self, limit_s: float):
        self.deadline = time.perf_counter() + limit_s
        self.skipped = []

    def expired(self, expected_s: float = 0.0, **what) -> bool:
        """Whether the measurement ``what``, expected to take ``expected_s``, would end past
        the limit (then it is recorded as skipped)."""
        if time.perf_counter() + expected_s < self.deadline:
            return False
        self.skipped.append(what)
        print(f"skipped (time limit): {what}", flush=True)
        return True


def measure(run) -> None:
    args, clock = run.args, Clock(run.args.time_limit_s)
    run.record["tilings"] = dataclasses.asdict(kernels.TILINGS)
    compile_attention(args, kernels.TILINGS)
    blockwise_topk_triton(*indexer_inputs(args, WARM_LENGTH), args.topk)
    run.record["comparison"] = pytorch_comparison(args)
    run.record["attention"] = attention_rows(args, clock)
    run.record["indexer"] = indexer_rows(args, clock)
    if args.sweep:
        run.record["sweep"] = sweep_rows(args, clock)
    run.record["skipped"] = clock.skipped


# one timed run unless --repeats says otherwise: a run at 131,072 tokens takes seconds
main = Benchmark("bench_sparse_attention", __doc__, {
    "--attention-lengths": [32768, 131072], "--indexer-lengths": [32768, 131072, 1048576],
    "--patterns": dict(nargs="+", choices=("spread", "recent"), default=["spread", "recent"]),
    "--small-length": 2048, "--small-indexer-length": 16384, "--heads": 128, "--qk-dim": 192,
    "--v-dim": 128, "--topk": 2048, "--index-heads": 64, "--index-dim": 128,
    "--sweep": dict(action="store_true", help="time each kernel's tilings"),
    "--time-limit-s": 210.0}, measure, repeats=1, warmup=None).main

if __name__ == "__main__":
    sys.exit(main())
