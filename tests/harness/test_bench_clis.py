"""Every benchmark in tools/benchmarks imports and answers --help on a machine without a GPU;
the ones that need one say so and exit 2."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.harness.benchmark_modules import BENCHMARKS, load_benchmark

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("bench_*.py") if p.name != "bench_common.py")
NEED_CUDA = ["bench_moe_dispatch.py", "bench_rotary.py", "bench_row_gather.py",
             "bench_sdpa_attention.py", "bench_slot_sum.py", "bench_sparse_attention.py",
             "bench_strip_softmax.py",
             "bench_block_backward.py",
             "bench_weighted_swiglu.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, capsys, monkeypatch):
    bench = load_benchmark(script)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script}") and "--out" in out


@pytest.mark.parametrize("script", NEED_CUDA)
def test_without_a_gpu_it_says_so(script, monkeypatch, capsys):
    bench = load_benchmark(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert f"{script.removesuffix('.py')} needs" in capsys.readouterr().err
