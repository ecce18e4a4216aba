"""tools/benchmarks/bench_reach.py: the stored report renders to its stored tables, --report-only
writes both files, and with jobs held to G GiB (--gpu-memory-gib): the allocator setting, trials
named apart, the fit over every trained point, the prediction for the held memory in the
variant's granularity, and the confirming runs (jobs replaced by a recorder: no GPU)."""

from __future__ import annotations

import json

import pytest

from tests.tool_modules import load_tool
from megatron.bounded.units import GiB



def _trial(bench, variant, layers, length, peak, outcome="ok", cap=None):
    return bench.Trial(variant=variant, layers=layers, seq_length=length, num_gpus=1,
                       flags=bench.variant_flags(variant, length, layers), outcome=outcome,
                       wall_s=1.0, peak_allocated_gib=peak if outcome == "ok" else None,
                       gpu_memory_gib=cap)


def test_held_jobs_get_the_fraction_of_the_gpu():
    bench = load_tool("benchmarks/bench_reach.py")
    assert bench.allocator_conf(None, 139.8) == bench.ALLOCATOR_CONF
    conf = bench.allocator_conf(20.0, 80.0)
    assert conf == bench.ALLOCATOR_CONF + ",per_process_memory_fraction:0.250000"
    with pytest.raises(SystemExit, match="--gpu-memory-gib 200"):
        bench.allocator_conf(200.0, 139.8)
    with pytest.raises(SystemExit, match="found 0.0"):
        bench.allocator_conf(20.0, None)


def test_held_memory_trials_are_named_and_reported_apart():
    bench = load_tool("benchmarks/bench_reach.py")
    # 8 KiB per token over 4 GiB: the fit comes from the whole-GPU points
    points = [_trial(bench, "chunked_attention", 8, n, 4 + n * 8192 / GiB)
              for n in (524_288, 1_048_576)]
    capped = [_trial(bench, "chunked_attention", 8, 1_835_008, 18.0, cap=20.0),
              _trial(bench, "chunked_attention", 8, 1_900_544, None, outcome="oom", cap=20.0)]
    assert capped[0].name == "chunked_attention_8L_1835008_20GiB"
    granularity = {v: 65_536 for v in bench.VARIANTS}
    report = bench.build_report(points + capped, 137.8, granularity, with_budget=False)
    whole, held = (report["variants"]["chunked_attention/8L"],
                   report["variants"]["chunked_attention/8L/20GiB"])
    assert whole["bytes_per_token"] == held["bytes_per_token"] == 8192.0
    # (20 - 2 - 4) GiB at 8 KiB per token, in granules of 65,536
    assert held["predicted_longest"] == 1_835_008
    assert (held["longest_trained"], held["shortest_oom"]) == (1_835_008, 1_900_544)
    assert whole["shortest_oom"] is None  # an out-of-memory under the held GPU is not the GPU's
    assert "8 (20 GiB GPU)" in bench.markdown(report)


def test_confirm_runs_the_prediction_for_the_held_memory(tmp_path, monkeypatch):
    bench = load_tool("benchmarks/bench_reach.py")
    for n in (524_288, 1_048_576):
        trial = _trial(bench, "chunked_attention", 8, n, 4 + n * 8192 / GiB)
        (tmp_path / f"{trial.name}.trial.json").write_text(json.dumps(bench.asdict(trial)))
    runs = []

    def record(self, variant, layers, length, snapshot, concurrent, gpu_memory_gib=None):
        runs.append((variant, layers, length, gpu_memory_gib, concurrent))

    monkeypatch.setattr(bench.Runner, "run", record)
    monkeypatch.setattr(bench, "device_total_gib", lambda: 139.8)
    bench.main(["--results-dir", str(tmp_path), "--variants", "chunked_attention", "--confirm",
                "--gpu-memory-gib", "20", "--confirm-layers", "chunked_attention=1",
                "--no-budget"])
    assert runs == [("chunked_attention", 1, 1_835_008, 20.0, False),
                    ("chunked_attention", 1, 1_900_544, 20.0, False)]


def test_held_memory_and_granularity_per_variant(tmp_path, monkeypatch):
    bench = load_tool("benchmarks/bench_reach.py")
    for variant, per_token in (("offload_stream", 32768), ("chunked_attention", 16384)):
        for n in (131_072, 262_144):
            trial = _trial(bench, variant, 8, n, 4 + n * per_token / GiB)
            (tmp_path / f"{trial.name}.trial.json").write_text(json.dumps(bench.asdict(trial)))
    runs = []

    def record(self, variant, layers, length, snapshot, concurrent, gpu_memory_gib=None):
        runs.append((variant, length, gpu_memory_gib, concurrent))

    monkeypatch.setattr(bench.Runner, "run", record)
    monkeypatch.setattr(bench, "device_total_gib", lambda: 139.8)
    bench.main(["--results-dir", str(tmp_path), "--variants", "offload_stream",
                "chunked_attention", "--confirm", "--jobs", "2",
                "--gpu-memory-gib", "offload_stream=14.5", "chunked_attention=15",
                "--granularity", "131072", "chunked_attention=262144", "--no-budget"])
    # (14.5 - 2 - 4) GiB at 32 KiB per token: 278,528 -> 262,144 in granules of 131,072;
    # (15 - 2 - 4) GiB at 16 KiB per token: 589,824 -> 524,288 in granules of 262,144
    assert sorted(runs) == [("chunked_attention", 524_288, 15.0, True),
                            ("chunked_attention", 786_432, 15.0, True),
                            ("offload_stream", 262_144, 14.5, True),
                            ("offload_stream", 393_216, 14.5, True)]


def test_the_stored_report_renders_to_its_stored_tables():
    from tests.tool_modules import REPO_ROOT

    bench = load_tool("benchmarks/bench_reach.py")
    stored = REPO_ROOT / "docs" / "results"
    report = json.loads((stored / "reach_1xh200.json").read_text())
    assert bench.markdown(report) == (stored / "reach_1xh200.md").read_text()


def test_report_only_writes_the_report_and_its_tables(tmp_path, monkeypatch):
    bench = load_tool("benchmarks/bench_reach.py")
    for n in (131_072, 262_144):
        trial = _trial(bench, "plain", 8, n, 4 + n * 16384 / GiB)
        (tmp_path / f"{trial.name}.trial.json").write_text(json.dumps(bench.asdict(trial)))
    monkeypatch.setattr(bench, "device_total_gib", lambda: None)
    out, table = tmp_path / "report" / "reach.json", tmp_path / "report" / "reach.md"
    bench.main(["--results-dir", str(tmp_path), "--report-only", "--no-budget", "--out", str(out),
                "--markdown", str(table)])
    report = json.loads(out.read_text())
    entry = report["variants"]["plain/8L"]
    assert entry["bytes_per_token"] == 16384.0 and report["capacity_gib"] == 138.0
    assert out.read_text() == json.dumps(report, indent=1) + "\n"
    assert table.read_text() == bench.markdown(report)
    assert "| plain | 8 | 16,384 | 4.0 |" in table.read_text()
