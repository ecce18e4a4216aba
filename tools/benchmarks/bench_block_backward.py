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

import argparse
import math

import torch

from bench_common import (  # puts the repository on sys.path
    PeakMemory, device_name, max_relative_difference, parse_on_cuda, report,
)
from megatron.bounded.units import GiB
from megatron.bounded.attention.blockwise import (
    KERNELS, accumulation_dtype, attention_forward, attention_pairs, block_bounds,
    query_block_backward,
)


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


def _rows(args, tokens: int) -> list:
    def make(heads):
        return torch.randn(tokens, 1, heads, args.head_dim, device="cuda", dtype=torch.bfloat16)

    query, key, value = make(args.heads), make(args.groups), make(args.groups)
    scale = 1.0 / math.sqrt(args.head_dim)
    out, lse, kernel = attention_forward(query, key, value, scale, ("cudnn",))
    inputs = (query, key, value, out, lse, make(args.heads))
    bounds = block_bounds(tokens, args.block)
    flops = 5 * tokens * tokens * args.heads * args.head_dim
    rows, reference = [], None
    for key_blocks in args.key_blocks:
        shapes = _build_plans(inputs, bounds, scale, kernel, key_blocks)
        calls = sum(len(attention_pairs(s, e, bounds, (0, tokens), None, key_blocks))
                    for s, e in bounds)
        times = []
        for _ in range(args.repeats):
            result = None  # the previous repeat's gradients are not part of this one's peak
            with PeakMemory() as memory:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                result = _backward(inputs, bounds, scale, kernel, key_blocks)
                end.record()
                end.synchronize()
            times.append(start.elapsed_time(end))
        if reference is None:
            reference = result
        # what the loop allocates beyond its own dQ, dK, dV (3 of them, kept as results)
        outputs = sum(t.numel() * t.element_size() for t in result)
        row = {"tokens": tokens, "block": args.block, "key_blocks_per_call": key_blocks,
               "kernel": kernel, "calls": calls, "call_shapes": shapes,
               "backward_ms": min(times), "repeats_ms": times,
               "tflops": flops / min(times) / 1e9,
               "extra_peak_gib": (memory.extra_bytes - outputs) / GiB,
               "rel_diff_vs_first": max(max_relative_difference(a, b)
                                        for a, b in zip(result, reference))}
        print(row, flush=True)
        rows.append(row)
        del result
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072])
    parser.add_argument("--block", type=int, default=16384)
    parser.add_argument("--key-blocks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parse_on_cuda(parser, argv, "bench_block_backward")
    if args is None:
        return 2
    rows = []
    for tokens in args.tokens:
        rows += _rows(args, tokens)
        torch.cuda.empty_cache()
    report({"device": device_name(0), "torch": torch.__version__, "heads": args.heads,
            "groups": args.groups, "head_dim": args.head_dim, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
