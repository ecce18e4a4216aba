#!/usr/bin/env python3
"""Benchmark the combine's slot sum (``megatron.bounded.moe.kernels.slot_sum``): eager vs Triton.

Shape of the MoE-layer benchmark: 16,384 tokens per rank, top-8, H = 2048, bf16, EP = 2 with
capacity factor 1.5, so the returned rows are R = 2 · 98,304 = 196,608 and every token's 8 slots
point at distinct rows (balanced routing, nothing dropped unless ``--drop`` > 0). Reported:
median time of each path (CUDA events), the bytes the kernel moves, and whether the two results
are bitwise equal (they must be).

    python tools/benchmarks/bench_slot_sum.py [--tokens 16384 --topk 8 --hidden 2048]
        [--drop 0.0] [--repeats 20] [--out results/slot_sum.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_common import (  # puts the repository on sys.path
    gb_per_s, median_cuda_ms, parse_on_cuda, report,
)

from megatron.bounded.moe.kernels.slot_sum import slot_sum, slot_sum_reference


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--drop", type=float, default=0.0, help="fraction of slots not kept")
    args = parse_on_cuda(parser, argv, "bench_slot_sum")
    if args is None:
        return 2
    device = torch.device("cuda")
    source = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16)
    slot_rows = torch.randperm(args.rows, device=device)[: args.tokens * args.topk].view(args.tokens, args.topk)
    slot_keep = torch.rand(args.tokens, args.topk, device=device) >= args.drop
    fused = slot_sum(source, slot_rows, slot_keep)
    reference = slot_sum_reference(source, slot_rows, slot_keep)
    kept = int(slot_keep.sum())
    result = {
        "shape": vars(args),
        "bitwise_equal": bool(torch.equal(fused, reference)),
        "eager_ms": median_cuda_ms(lambda: slot_sum_reference(source, slot_rows, slot_keep), args.repeats),
        "fused_ms": median_cuda_ms(lambda: slot_sum(source, slot_rows, slot_keep), args.repeats),
        "fused_bytes": (kept + args.tokens) * args.hidden * 2,  # kept rows read, tokens written
    }
    result["fused_GBps"] = gb_per_s(result["fused_bytes"], result["fused_ms"])
    report(result, args.out)
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
