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

import functools
import sys

import torch

from bench_common import Benchmark, Stopwatch  # puts the repository on sys.path

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron.bounded.attention.rotary import apply_rotary


def host_us_per_call(fn, calls: int) -> float:
    """Host microseconds per ``fn()`` over ``calls`` calls, the GPU left to run behind."""
    fn()  # compiled and cached before the clock starts
    with Stopwatch() as clock:
        for _ in range(calls):
            fn()
    return clock.host_s / calls * 1e6


def measure(run) -> None:
    a = run.args
    inputs = [torch.randn(a.seq, a.batch, heads, a.head_dim, device=run.device,
                          dtype=torch.bfloat16, requires_grad=True)
              for _ in range(a.layers) for heads in (a.q_heads, a.kv_heads)]
    output_grads = [torch.randn_like(t) for t in inputs]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, a.head_dim, 2, device=run.device) / a.head_dim)
    angles = torch.outer(torch.arange(a.seq, device=run.device, dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # upstream's layout

    def forward(rope):
        return [rope(t, freqs) for t in inputs]

    def forward_backward(rope):
        outputs = forward(rope)
        return outputs + list(torch.autograd.grad(outputs, inputs, output_grads))

    paths = {"eager": _apply_rotary_pos_emb_bshd, "fused": apply_rotary}
    eager, fused = [forward_backward(rope) for rope in paths.values()]
    run.check("bitwise_equal", all(torch.equal(x, y) for x, y in zip(eager, fused)))
    for name, rope in paths.items():
        step, forward_only = (functools.partial(f, rope) for f in (forward_backward, forward))
        run.record[f"{name}_ms_per_layer"] = run.median_ms(step) / a.layers
        run.record[f"{name}_host_us_per_layer"] = host_us_per_call(step, a.host_calls) / a.layers
        run.record[f"{name}_forward_host_us_per_layer"] = (
            host_us_per_call(forward_only, a.host_calls) / a.layers)


main = Benchmark("bench_rotary", __doc__, {
    "--seq": 4096, "--batch": 1, "--q-heads": 16, "--kv-heads": 4, "--head-dim": 64,
    "--layers": 8, "--host-calls": 50}, measure).main

if __name__ == "__main__":
    sys.exit(main())
