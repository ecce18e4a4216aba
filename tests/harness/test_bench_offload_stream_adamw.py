"""tools/benchmarks/bench_offload_stream_adamw.py on the CPU: the host-link floor, the smoke
comparison's record and its table."""

from __future__ import annotations

import json

import pytest

from tests.harness.benchmark_modules import load_benchmark

bench = load_benchmark("bench_offload_stream_adamw.py")


def test_host_link_floor():
    link = {"each_way_bidirectional": 2.0}  # GB/s
    assert bench.host_link_floor_s({}, 10**9, link) == 0.0  # GPU-resident: nothing crosses
    info = {"h2d_bytes_per_param": 2, "d2h_bytes_per_param": 4}
    assert bench.host_link_floor_s(info, 10**9, link) == pytest.approx(2.0)


def test_tensor_sizes_add_up_and_grow():
    sizes = bench.tensor_sizes(1000, 4)
    assert sum(sizes) == 1000 and sizes == sorted(sizes)


def test_cpu_smoke_record_and_table(tmp_path, capsys):
    out = tmp_path / "o" / "adamw.json"
    report = bench.main(["--numel", "5000", "--num-tensors", "3", "--bucket-numel", "1500",
                         "--repeats", "3", "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["device"] == "cpu" and report["config"]["out"] == str(out)
    rows = report["results"]
    assert [r["variant"] for r in rows] == ["cpu_fused_adamw", "offload_stream_adamw"]
    for row in rows:
        assert len(row["step_times_s"]) == 3
        assert row["median_step_s"] == sorted(row["step_times_s"])[1]
        assert row["bitwise_equal_to_reference"] and row["max_abs_diff_vs_reference"] == 0.0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| variant | median step (s) | vs cpu_fused_adamw |")
    assert table[2].startswith("| cpu_fused_adamw |") and table[2].endswith("| bitwise equal |")
