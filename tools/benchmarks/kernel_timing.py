"""Helpers of the single-kernel GPU benchmarks (``bench_weighted_swiglu.py``, ``bench_slot_sum.py``)."""

from __future__ import annotations

import statistics

import torch


def median_cuda_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median of ``repeats`` timings of ``fn()`` (CUDA events) after ``warmup`` untimed calls
    (Triton compiles on the first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_relative_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours − reference| / max |reference|, in fp32."""
    ours, reference = ours.float(), reference.float()
    return ((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()
