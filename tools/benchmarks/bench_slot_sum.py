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

import sys

import torch

from bench_common import Benchmark, gb_per_s  # puts the repository on sys.path

from megatron.bounded.moe.kernels.slot_sum import slot_sum, slot_sum_reference


def measure(run) -> None:
    a = run.args
    source = torch.randn(a.rows, a.hidden, device=run.device, dtype=torch.bfloat16)
    slot_rows = torch.randperm(a.rows, device=run.device)[: a.tokens * a.topk].view(a.tokens, a.topk)
    slot_keep = torch.rand(a.tokens, a.topk, device=run.device) >= a.drop
    variants = {"eager": slot_sum_reference, "fused": slot_sum}
    run.check("bitwise_equal", torch.equal(*(f(source, slot_rows, slot_keep) for f in variants.values())))
    run.record.update(run.time_variants(
        {name: lambda f=f: f(source, slot_rows, slot_keep) for name, f in variants.items()}))
    # kept rows read, tokens written
    run.record["fused_bytes"] = (int(slot_keep.sum()) + a.tokens) * a.hidden * 2
    run.record["fused_GBps"] = gb_per_s(run.record["fused_bytes"], run.record["fused_ms"])


main = Benchmark("bench_slot_sum", __doc__, {
    "--tokens": 16_384, "--topk": 8, "--hidden": 2048, "--rows": 196_608,
    "--drop": dict(type=float, default=0.0, help="fraction of slots not kept")}, measure).main

if __name__ == "__main__":
    sys.exit(main())
