#!/usr/bin/env python3
"""Benchmark rotary position embedding (``megatron.bounded.attention.rotary``): upstream's eager vs Triton.

Shape of one attention layer of the small example: q ``[4096, 1, 16, 64]`` and k
``[4096, 1, 4, 64]`` in bf16, angles ``[4096, 1, 1, 64]``; ``--layers`` such layers (their own q
and k, the same angles) per call, forward and then one backward pass for all of them, as in a
training step (autograd's fixed cost per backward pass is shared as there). Reported per layer for
upstream's ``_apply_rotary_pos_emb_bshd`` and for ``apply_rotary``: the median GPU time (CUDA
events), the host time (``time.perf_counter`` around ``--host-calls`` calls without
synchronizing: what a launch-bound step pays), forward and backward and forward alone, and
whether outputs and gradients are bitwise equal (they must be). The fused path's tables are
computed once for the unchanged angles, as they are once per forward for all layers.

    python tools/benchmarks/bench_rotary.py [--seq 4096 --batch 1 --q-heads 16 --kv-heads 4
        --head-dim 64 --layers 8] [--host-calls 50] [--repeats 20] [--out results/rotary.json]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from bench_common import (  # puts the repository on sys.path
    Stopwatch, median_cuda_ms, parse_on_cuda, report,
)

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron.bounded.attention.rotary import apply_rotary


def host_us_per_call(fn, calls: int) -> float:
    """Host microseconds per ``fn()`` over ``calls`` calls, the GPU left to run behind."""
    fn()  # compiled and cached before the clock starts
    with Stopwatch() as clock:
        for _ in range(calls):
            fn()
    return clock.host_s / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--host-calls", type=int, default=50)
    args = parse_on_cuda(parser, argv, "bench_rotary")
    if args is None:
        return 2
    device = torch.device("cuda")
    inputs = [
        torch.randn(args.seq, args.batch, heads, args.head_dim, device=device,
                    dtype=torch.bfloat16, requires_grad=True)
        for _ in range(args.layers) for heads in (args.q_heads, args.kv_heads)
    ]
    output_grads = [torch.randn_like(t) for t in inputs]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, args.head_dim, 2, device=device) / args.head_dim)
    angles = torch.outer(torch.arange(args.seq, device=device, dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # upstream's layout

    def forward(rope):
        return [rope(t, freqs) for t in inputs]

    def forward_backward(rope):
        outputs = forward(rope)
        return outputs + list(torch.autograd.grad(outputs, inputs, output_grads))

    paths = {"eager": _apply_rotary_pos_emb_bshd, "fused": apply_rotary}
    eager, fused = [forward_backward(rope) for rope in paths.values()]
    result = {"shape": vars(args),
              "bitwise_equal": all(torch.equal(a, b) for a, b in zip(eager, fused))}
    for name, rope in paths.items():
        step = functools.partial(forward_backward, rope)
        forward_only = functools.partial(forward, rope)
        result[f"{name}_ms_per_layer"] = median_cuda_ms(step, args.repeats) / args.layers
        result[f"{name}_host_us_per_layer"] = host_us_per_call(step, args.host_calls) / args.layers
        result[f"{name}_forward_host_us_per_layer"] = (
            host_us_per_call(forward_only, args.host_calls) / args.layers)
    report(result, args.out)
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
