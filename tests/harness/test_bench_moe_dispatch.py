"""tools/benchmarks/bench_moe_dispatch.py's pure parts on the CPU: the records compared with
upstream and static_nodrop, the printed summary, and the paged stash's bytes in use."""

from __future__ import annotations

import types

import pytest
import torch

from tests.harness.benchmark_modules import load_benchmark
from megatron.bounded.units import MiB

bench = load_benchmark("bench_moe_dispatch.py")


def _result(variant, out, xgrad, **fields):
    return {"variant": variant, "ms": 2.0, "extra_peak_gib": 0.5, "host_ms": 1.0,
            "queued_ms": 1.5, "out": out, "xgrad": xgrad, **fields}


@pytest.fixture
def results():
    out, xgrad = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0])
    upstream = _result("upstream_alltoall_sequential", out, xgrad)
    static = _result("static_cf1.5", out * 2, xgrad, capacity_factor=1.5, over_budget=True)
    nodrop = _result("static_nodrop", out.clone(), xgrad.clone(), capacity_factor=2.0,
                     over_budget=False)
    dropless = _result("dropless", out.clone(), xgrad.clone(), capacity_factor=None,
                       over_budget=False)
    stash = _result("paged_stash", out.clone(), xgrad + 1, capacity_factor=2.0,
                    over_budget=False, stash_overflow=False, stash_page_bytes=3 * MiB,
                    stash_bytes_in_use_after_forward=MiB, stash_in_use_over_routed=1.25,
                    routed_bytes_paged_layers=MiB * 0.8,
                    static_buffer_bytes_paged_layers=2 * MiB)
    return [upstream, static, nodrop, dropless, stash]


def test_rows_compare_with_upstream_and_nodrop(results):
    upstream, nodrop = results[0], results[2]
    rows = bench.comparison_rows(results, upstream, nodrop)
    assert [r["variant"] for r in rows] == [r["variant"] for r in results]
    assert all("out" not in r and "xgrad" not in r for r in rows)
    assert rows[0]["rel_out_vs_upstream"] == 0.0
    assert rows[1]["rel_out_vs_upstream"] == pytest.approx(1.0)  # ‖2o − o‖ / ‖o‖
    assert rows[4]["rel_xgrad_vs_upstream"] == pytest.approx(2 ** 0.5)
    # only dropless and paged stash are checked against static_nodrop
    assert [r.get("bitwise_equal_static_nodrop") for r in rows] == [None, None, None, True, False]


def test_rows_without_upstream_have_no_difference_to_it(results):
    rows = bench.comparison_rows(results[1:], None, results[2])
    assert not any("rel_out_vs_upstream" in r for r in rows)


def test_summary_table_ratios_checks_and_stash(results):
    results[1]["bitwise_equal_overlapped"] = True
    rows = bench.comparison_rows(results, results[0], results[2])
    rows[1]["ms"] = 3.0
    args = bench.parse_args([])
    text = bench.summary(args, {"world_size": 2, "gpu": "GPU"}, rows)
    lines = text.splitlines()
    assert lines[1].startswith("MoE fwd+bwd, 2 layers, EP=2, 16384 tokens/rank") and "GPU" in lines[1]
    table = [line for line in lines if line.startswith("| static_cf1.5 |")]
    assert table == ["| static_cf1.5 | 1.5 | 3.00 | 1.50 | 1.00 | 1.50 | 0.50 | True | 1.00e+00 |"]
    assert ("static_cf1.5: output and input gradient bitwise equal with the fc1 weight gradient "
            "overlapped: True") in lines
    stash = lines[-1]
    assert stash.startswith("paged stash: pages in use after forward 1.0 MiB = 1.250 x the 0.8 MiB")
    assert stash.endswith("stash overflow False, bitwise equal to static_nodrop False")


def test_stash_bytes_in_use_counts_the_pages_off_the_free_lists():
    buf = types.SimpleNamespace(
        free_list_head=torch.tensor([1, 0]), free_list_tail=torch.tensor([4, 2]),
        num_cuda_pages=10, num_host_pages=5, page_size=64, hidden_size=8,
        cuda_buffer=torch.empty(0, dtype=torch.bfloat16))
    manager = types.SimpleNamespace(stash_buffers={"layer": {torch.bfloat16: buf}})
    # (10 - 3) CUDA pages + (5 - 2) host pages in use, 64 rows of 8 bf16 values each
    assert bench.stash_bytes_in_use(manager) == 10 * 64 * 8 * 2
    assert bench.stash_bytes_in_use(types.SimpleNamespace(stash_buffers=None)) == 0
