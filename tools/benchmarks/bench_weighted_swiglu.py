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

import sys

import torch
import torch.nn.functional as F

from bench_common import (  # puts the repository on sys.path
    Benchmark, gb_per_s, max_relative_difference,
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


def measure(run) -> None:
    a, valid = run.args, run.args.valid
    fc1 = torch.randn(a.rows, 2 * a.ffn, device=run.device, dtype=torch.bfloat16)
    probs = torch.rand(a.rows, device=run.device)
    grad = torch.randn(a.rows, a.ffn, device=run.device, dtype=torch.bfloat16)
    per_expert = torch.full((a.experts,), valid // a.experts, device=run.device)
    per_expert[-1] += valid - int(per_expert.sum())
    offs = torch.cumsum(per_expert, 0).to(torch.int32)
    activation = _Activation(_SwiGLU)
    variants = {
        "forward_eager": lambda: _scaled_activation(fc1, probs, activation),
        "forward_fused": lambda: weighted_swiglu_forward(fc1, probs, offs),
        "backward_eager": lambda: _scaled_activation_backward(fc1, probs, grad, activation, True),
        "backward_fused": lambda: weighted_swiglu_backward(fc1, probs, offs, grad, True),
    }
    out = {name: work() for name, work in variants.items()}
    pairs = {"forward": (out["forward_fused"], out["forward_eager"])}
    for i, name in enumerate(("grad_fc1", "scaled_in_backward", "grad_probs")):
        pairs[name] = (out["backward_fused"][i], out["backward_eager"][i])
    r = run.record
    r["relative_difference_fused_vs_eager"] = {
        name: max_relative_difference(fused[:valid], eager[:valid])
        for name, (fused, eager) in pairs.items()}
    del out, pairs
    r.update(run.time_variants(variants))
    # bytes the fused kernels read and write for the valid rows (bf16 activations, fp32 probs)
    r["forward_bytes"] = valid * (2 * a.ffn + a.ffn) * 2 + valid * 4
    r["backward_bytes"] = valid * (3 * a.ffn + 3 * a.ffn) * 2 + valid * 8
    for direction in ("forward", "backward"):
        r[f"{direction}_fused_GBps"] = gb_per_s(r[f"{direction}_bytes"], r[f"{direction}_fused_ms"])


main = Benchmark("bench_weighted_swiglu", __doc__,
                 {"--rows": 196_608, "--valid": 131_072, "--ffn": 1024, "--experts": 32},
                 measure).main

if __name__ == "__main__":
    sys.exit(main())
