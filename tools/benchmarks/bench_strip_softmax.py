#!/usr/bin/env python3
"""Benchmark Ring-DTP's strip kernels (``megatron.bounded.loss.ring_dtp.kernels``): eager vs Triton.

Shape of Ring-DTP at P = 2, V = 200,000: one fp32 strip of ``--tokens`` rows × 100,000 columns
(a chunk of tokens against one vocabulary shard). Reported, for the forward fold (running max,
sum of exponentials, target logit) and the backward gradient strip (written in bf16 for the
16-bit GEMMs): the median time of each path (CUDA events), the bytes the fused kernel moves, and
the largest relative difference to the eager result.

    python tools/benchmarks/bench_strip_softmax.py [--tokens 4096 --columns 100000]
        [--repeats 20] [--out results/strip_softmax.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_common import (  # puts the repository on sys.path
    gb_per_s, max_relative_difference, median_cuda_ms, parse_on_cuda, report,
)

from megatron.bounded.loss.ring_dtp.kernels import (
    fold_strip_fused, fold_strip_reference, gradient_strip_fused, gradient_strip_reference,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=100_000)
    args = parse_on_cuda(parser, argv, "bench_strip_softmax")
    if args is None:
        return 2
    device = torch.device("cuda")
    strip = 4 * torch.randn(args.tokens, args.columns, device=device)
    # half the tokens have their label in this shard
    targets = torch.randint(0, args.columns, (args.tokens,), device=device)
    targets[::2] = -1
    state = torch.stack([torch.randn(args.tokens, device=device), torch.rand(args.tokens, device=device) + 0.5,
                         torch.zeros(args.tokens, device=device)])
    lse = torch.logsumexp(strip, dim=1) + 0.5
    gscale = torch.full((args.tokens,), 1.0 / args.tokens, device=device)

    fused_state, eager_state = state.clone(), state.clone()
    fold_strip_fused(strip, targets, fused_state)
    fold_strip_reference(strip.clone(), targets, eager_state)
    fused_grad = gradient_strip_fused(strip, lse, targets, gscale, torch.bfloat16)
    eager_grad = gradient_strip_reference(strip.clone(), lse, targets, gscale, torch.bfloat16)

    work = strip.clone()  # the eager paths overwrite their strip; time them on a scratch copy
    strip_bytes = strip.numel() * 4
    result = {
        "shape": vars(args),
        "relative_difference_fused_vs_eager": {
            "fold_state": max_relative_difference(fused_state, eager_state),
            "gradient_strip": max_relative_difference(fused_grad, eager_grad),
        },
        "fold_eager_ms": median_cuda_ms(
            lambda: (work.copy_(strip), fold_strip_reference(work, targets, state.clone())), args.repeats),
        "fold_fused_ms": median_cuda_ms(lambda: fold_strip_fused(strip, targets, state.clone()), args.repeats),
        "gradient_eager_ms": median_cuda_ms(
            lambda: (work.copy_(strip), gradient_strip_reference(work, lse, targets, gscale, torch.bfloat16)),
            args.repeats),
        "gradient_fused_ms": median_cuda_ms(
            lambda: gradient_strip_fused(strip, lse, targets, gscale, torch.bfloat16), args.repeats),
        "copy_of_the_strip_ms": median_cuda_ms(lambda: work.copy_(strip), args.repeats),
        "fold_fused_bytes": strip_bytes,  # the strip read once
        "gradient_fused_bytes": strip_bytes + strip.numel() * 2,  # read fp32, write bf16
    }
    result["note"] = ("the eager times include copy_of_the_strip_ms (the eager paths overwrite their "
                      "strip, so each timed call restores it first)")
    result["fold_fused_GBps"] = gb_per_s(result["fold_fused_bytes"], result["fold_fused_ms"])
    result["gradient_fused_GBps"] = gb_per_s(result["gradient_fused_bytes"], result["gradient_fused_ms"])
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
