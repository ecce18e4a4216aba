#!/usr/bin/env python3
"""The blocked causal attention backward of one layer, by key blocks per kernel call (one GPU).

    python tools/benchmarks/bench_block_backward.py --tokens 524288 --block 16384 \
        --key-blocks 1 4 16 --out block_backward.json

What ``--chunked-recompute-attention``'s backward runs for each layer: query blocks of
``--block`` rows (the recompute's chunk) from the last to the first, each back-propagated
through the keys it sees (``megatron.bounded.attention.blockwise.query_block_backward``), dK and
dV summed in fp32 for the whole sequence. ``--key-blocks K`` lets one unmasked kernel call
cover K key blocks; per K: the GPU time of the whole backward (every distinct call shape run
once before, so the kernels' plans are built), its TFLOP/s (causal, 5 GEMMs: 5·N²·heads·d),
the calls per layer, the peak allocated above the inputs and accumulators, and the largest
difference of dQ, dK, dV from the first K's (list 1 first). The shape is the small example's
attention (16 query heads, 4 key/value groups, head dim 64, bf16, batch 1), on cuDNN's kernels.
"""

from __future__ import annotations

import math

import torch

from bench_common import (  # puts the repository on sys.path
    Benchmark, PeakMemory, cuda_event_ms, max_relative_difference,
)
from megatron.bounded.attention.blockwise import (
    KERNELS, accumulation_dtype, attention_forward, attention_pairs, block_bounds,
    query_block_backward,
)
from megatron.bounded.units import GiB


def _backward(inputs, bounds, scale, kernel, key_blocks):
    """dQ, dK, dV of the whole sequence, query block by query block."""
    query, key, value, out, lse, grad_out = inputs
    grad_key = torch.zeros(key.shape, dtype=accumulation_dtype(key.dtype), device=key.device)
    grad_value = torch.zeros_like(grad_key)
    grad_query = torch.empty_like(query)
    for start, end in reversed(bounds):
        grad_query[start:end] = query_block_backward(
            grad_out[start:end], query[start:end], key, value, out[start:end],
            lse[:, :, start:end], start, bounds, grad_key, grad_value, scale, kernel,
            key_blocks_per_call=key_blocks)
    return grad_query, grad_key, grad_value


def _build_plans(inputs, bounds, scale, kernel, key_blocks):
    """Run each distinct call shape once (the kernels build and cache a plan per shape)."""
    query, key, value, out, lse, grad_out = inputs
    heads_first = [t.permute(1, 2, 0, 3) for t in (grad_out, query, key, value, out)]
    seen = set()
    for start, end in bounds:
        for (qa, qe), (ka, ke), band in attention_pairs(start, end, bounds, (0, query.shape[0]),
                                                        None, key_blocks):
            if (qe - qa, ke - ka, band) in seen:
                continue
            seen.add((qe - qa, ke - ka, band))
            g, q, k, v, o = heads_first
            rows, keys = slice(qa, qe), slice(ka, ke)
            KERNELS[kernel][1](g[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                               o[:, :, rows], lse[:, :, rows].contiguous(), scale, band)
    torch.cuda.synchronize()
    return len(seen)


def measure(run) -> None:
    for tokens in run.args.tokens:
        _measure_length(run, tokens)
        torch.cuda.empty_cache()  # the length's tensors are gone with its call


def _measure_length(run, tokens: int) -> None:
    a = run.args

    def make(heads):
        return torch.randn(tokens, 1, heads, a.head_dim, device="cuda", dtype=torch.bfloat16)

    query, key, value = make(a.heads), make(a.groups), make(a.groups)
    scale = 1.0 / math.sqrt(a.head_dim)
    out, lse, kernel = attention_forward(query, key, value, scale, ("cudnn",))
    inputs = (query, key, value, out, lse, make(a.heads))
    bounds = block_bounds(tokens, a.block)
    reference = None
    for key_blocks in a.key_blocks:
        shapes = _build_plans(inputs, bounds, scale, kernel, key_blocks)
        calls = sum(len(attention_pairs(s, e, bounds, (0, tokens), None, key_blocks))
                    for s, e in bounds)
        times = []
        for _ in range(a.repeats):
            result, outcome = None, []  # the last repeat's gradients are not in this one's peak
            with PeakMemory() as memory:
                times.append(cuda_event_ms(lambda: outcome.append(
                    _backward(inputs, bounds, scale, kernel, key_blocks))))
            result = outcome.pop()
        reference = result if reference is None else reference
        # what the loop allocates beyond its own dQ, dK, dV (3 of them, kept as results)
        outputs = sum(t.numel() * t.element_size() for t in result)
        run.add_row({"tokens": tokens, "block": a.block, "key_blocks_per_call": key_blocks,
                     "kernel": kernel, "calls": calls, "call_shapes": shapes,
                     "backward_ms": min(times), "repeats_ms": times,
                     "tflops": 5 * tokens * tokens * a.heads * a.head_dim / min(times) / 1e9,
                     "extra_peak_gib": (memory.extra_bytes - outputs) / GiB,
                     "rel_diff_vs_first": max(max_relative_difference(x, y)
                                              for x, y in zip(result, reference))})
        del result


main = Benchmark("bench_block_backward", __doc__, {
    "--tokens": [131072], "--block": 16384, "--key-blocks": [1, 4, 16], "--heads": 16,
    "--groups": 4, "--head-dim": 64}, measure, warmup=None).main

if __name__ == "__main__":
    raise SystemExit(main())
