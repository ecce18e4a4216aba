"""tools/benchmarks/bench_sco.py on the CPU: its argument checks, and the smoke run's record."""

from __future__ import annotations

import json

import pytest

from tests.harness.benchmark_modules import load_benchmark

bench = load_benchmark("bench_sco.py")


def test_arguments_that_cannot_run_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--impl", "megatron", "--device", "cpu"])
    assert "--impl megatron needs CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--hidden", "200", "--head-dim", "64"])
    assert "multiple of --head-dim" in capsys.readouterr().err
    assert bench.heads_of(bench.parse_args(["--hidden", "256", "--head-dim", "64"])) == 4


def test_cpu_run_offloads_every_boundary_and_matches_the_baseline(tmp_path, capsys):
    out_path = tmp_path / "sco.json"
    out = bench.main(["--layers", "3", "--seq", "16", "--hidden", "32", "--head-dim", "16",
                      "--repeats", "2", "--warmup", "1", "--dtype", "fp32", "--device", "cpu",
                      "--out", str(out_path)])
    assert json.loads(out_path.read_text()) == json.loads(json.dumps(out))
    assert out["config"]["heads"] == 2 and out["config"]["device_name"] == "cpu"
    assert out["config"]["boundary_bytes"] == 16 * 32 * 4
    assert out["config"]["host_budget_bytes"] == 3 * out["config"]["boundary_bytes"]
    assert out["sco"]["offloaded_boundaries"] == 3
    assert out["grads_bitwise_equal"] is True
    assert out["baseline"]["peak_gib"] is None and "peak_saved_gib" not in out  # CUDA only
    assert out["time_ratio_sco_over_baseline"] == pytest.approx(
        out["sco"]["median_ms"] / out["baseline"]["median_ms"])
    printed = capsys.readouterr().out
    assert "| sco |" in printed and "| 3 |" in printed
