#!/usr/bin/env python3
"""Benchmark the grouped experts' weighted SwiGLU: eager chain vs the fused Triton kernels.

Shape of the MoE-layer benchmark (``bench_moe_dispatch.py``): 16,384 tokens per rank, top-8,
EP = 2, capacity factor 1.5, so the static buffer has R = 2 · ceil(1.5 · 16,384 · 8 / 2) =
196,608 rows of which 131,072 are valid (balanced routing), FFN 1024 (fc1 output 2,048 wide),
bf16, one routing probability per row. Reported per direction and path: median time over the
repeats (CUDA events), bytes the fused kernel moves for the valid rows, and the largest
difference between the two paths on the valid rows relative to the largest value.

    python tools/benchmarks/bench_weighted_swiglu.py [--rows 196608 --valid 131072 --ffn 1024]
        [--repeats 20] [--out results/weighted_swiglu.json]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench_common import (  # puts the repository on sys.path
    gb_per_s, max_relative_difference, median_cuda_ms, parse_on_cuda, report,
)

from megatron.bounded.moe.experts import (
    _Activation,
    _scaled_activation,
    _scaled_activation_backward,
)
from megatron.bounded.moe.kernels.weighted_swiglu import (
    weighted_swiglu_backward,
    weighted_swiglu_forward,
)


class _SwiGLU:
    gated_linear_unit, activation_func, glu_linear_offset, activation_func_clamp_value = (
        True, F.silu, 0.0, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--valid", type=int, default=131_072)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    args = parse_on_cuda(parser, argv, "bench_weighted_swiglu")
    if args is None:
        return 2
    device = torch.device("cuda")
    fc1 = torch.randn(args.rows, 2 * args.ffn, device=device, dtype=torch.bfloat16)
    probs = torch.rand(args.rows, device=device)
    grad = torch.randn(args.rows, args.ffn, device=device, dtype=torch.bfloat16)
    per_expert = torch.full((args.experts,), args.valid // args.experts, device=device)
    per_expert[-1] += args.valid - int(per_expert.sum())
    offs = torch.cumsum(per_expert, 0).to(torch.int32)
    activation = _Activation(_SwiGLU)
    valid = args.valid

    eager_fwd = _scaled_activation(fc1, probs, activation)
    fused_fwd = weighted_swiglu_forward(fc1, probs, offs)
    eager_bwd = _scaled_activation_backward(fc1, probs, grad, activation, True)
    fused_bwd = weighted_swiglu_backward(fc1, probs, offs, grad, True)
    differences = {
        "forward": max_relative_difference(fused_fwd[:valid], eager_fwd[:valid]),
        "grad_fc1": max_relative_difference(fused_bwd[0][:valid], eager_bwd[0][:valid]),
        "scaled_in_backward": max_relative_difference(fused_bwd[1][:valid], eager_bwd[1][:valid]),
        "grad_probs": max_relative_difference(fused_bwd[2][:valid], eager_bwd[2][:valid]),
    }
    times = {
        "forward_eager_ms": median_cuda_ms(lambda: _scaled_activation(fc1, probs, activation), args.repeats),
        "forward_fused_ms": median_cuda_ms(lambda: weighted_swiglu_forward(fc1, probs, offs), args.repeats),
        "backward_eager_ms": median_cuda_ms(
            lambda: _scaled_activation_backward(fc1, probs, grad, activation, True), args.repeats),
        "backward_fused_ms": median_cuda_ms(
            lambda: weighted_swiglu_backward(fc1, probs, offs, grad, True), args.repeats),
    }
    bf16 = 2
    moved = {  # bytes the fused kernels read and write for the valid rows
        "forward_bytes": valid * (2 * args.ffn + args.ffn) * bf16 + valid * 4,
        "backward_bytes": valid * (3 * args.ffn + 3 * args.ffn) * bf16 + valid * 8,
    }
    result = {"shape": vars(args), "relative_difference_fused_vs_eager": differences,
              **times, **moved,
              "forward_fused_GBps": gb_per_s(moved["forward_bytes"], times["forward_fused_ms"]),
              "backward_fused_GBps": gb_per_s(moved["backward_bytes"], times["backward_fused_ms"])}
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
