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

import sys

import torch

from bench_common import (  # puts the repository on sys.path
    Benchmark, gb_per_s, max_relative_difference,
)

from megatron.bounded.loss.ring_dtp.kernels import (
    fold_strip_fused, fold_strip_reference, gradient_strip_fused, gradient_strip_reference,
)


def measure(run) -> None:
    n, device, bf16 = run.args.tokens, run.device, torch.bfloat16
    strip = 4 * torch.randn(n, run.args.columns, device=device)
    targets = torch.randint(0, run.args.columns, (n,), device=device)
    targets[::2] = -1  # half the tokens have their label in this shard
    state = torch.stack([torch.randn(n, device=device), torch.rand(n, device=device) + 0.5,
                         torch.zeros(n, device=device)])
    lse = torch.logsumexp(strip, dim=1) + 0.5
    gscale = torch.full((n,), 1.0 / n, device=device)

    fused_state, eager_state = state.clone(), state.clone()
    fold_strip_fused(strip, targets, fused_state)
    fold_strip_reference(strip.clone(), targets, eager_state)
    run.record["relative_difference_fused_vs_eager"] = {
        "fold_state": max_relative_difference(fused_state, eager_state),
        "gradient_strip": max_relative_difference(
            gradient_strip_fused(strip, lse, targets, gscale, bf16),
            gradient_strip_reference(strip.clone(), lse, targets, gscale, bf16))}

    work = strip.clone()  # the eager paths overwrite their strip; time them on a scratch copy
    r = run.record
    r.update(run.time_variants({
        "fold_eager": lambda: (work.copy_(strip), fold_strip_reference(work, targets, state.clone())),
        "fold_fused": lambda: fold_strip_fused(strip, targets, state.clone()),
        "gradient_eager": lambda: (work.copy_(strip),
                                   gradient_strip_reference(work, lse, targets, gscale, bf16)),
        "gradient_fused": lambda: gradient_strip_fused(strip, lse, targets, gscale, bf16),
        "copy_of_the_strip": lambda: work.copy_(strip)}))
    r["fold_fused_bytes"] = strip.numel() * 4  # the strip read once
    r["gradient_fused_bytes"] = strip.numel() * (4 + 2)  # read fp32, write bf16
    r["note"] = ("the eager times include copy_of_the_strip_ms (the eager paths overwrite their "
                 "strip, so each timed call restores it first)")
    for name in ("fold_fused", "gradient_fused"):
        r[f"{name}_GBps"] = gb_per_s(r[f"{name}_bytes"], r[f"{name}_ms"])


main = Benchmark("bench_strip_softmax", __doc__, {"--tokens": 4096, "--columns": 100_000},
                 measure).main

if __name__ == "__main__":
    sys.exit(main())
