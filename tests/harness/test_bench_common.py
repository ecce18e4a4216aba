"""tools/benchmarks/bench_common.py on the CPU: the timers (no device synchronization off CUDA,
the CUDA calls where a CUDA device is named), peak memory, the differences, the reductions over
ranks, the record's stamps and file, and the tables."""

from __future__ import annotations

import datetime
import json
import sys
import time

import pytest
import torch

from tests.harness.benchmark_modules import load_benchmark
from tests.tool_modules import REPO_ROOT
from tests.unit.distributed import run_on_ranks

C = load_benchmark("bench_common.py")


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda's synchronize and memory statistics recorded instead of run (no GPU here)."""
    calls = []
    allocated = {"now": 100, "peak": 350}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    return calls


def test_stopwatch_on_the_cpu_times_the_block_without_synchronizing(monkeypatch):
    def no_sync(device=None):
        raise AssertionError("synchronized off CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    with C.Stopwatch("cpu") as clock:
        time.sleep(0.02)
    assert clock.host_s >= 0.02
    assert clock.wall_s >= clock.host_s


def test_stopwatch_on_cuda_synchronizes_before_and_after(cuda_calls):
    with C.Stopwatch("cuda:0") as clock:
        cuda_calls.append("block")
    assert cuda_calls == [("sync", "cuda:0"), "block", ("sync", "cuda:0")]
    assert clock.wall_s >= clock.host_s >= 0


def test_wall_times_warm_up_then_time_each_repeat():
    calls = []

    def step():
        calls.append(len(calls))
        time.sleep(0.005)

    times = C.wall_times_s(step, repeats=3, warmup=2, device="cpu")
    assert len(calls) == 5 and len(times) == 3
    assert all(t >= 0.005 for t in times)


def test_median_cuda_ms_warms_up_and_takes_the_median(monkeypatch):
    calls, timings = [], iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(C, "cuda_event_ms", lambda fn: next(timings))
    assert C.median_cuda_ms(lambda: calls.append(1), repeats=3, warmup=2) == 2.0
    assert len(calls) == 2  # the warm-up calls; the timed ones go through cuda_event_ms


def test_peak_memory_is_none_off_cuda():
    with C.PeakMemory("cpu") as memory:
        torch.ones(1000)
    assert memory.peak_bytes is None and memory.extra_bytes is None
    assert memory.phase_bytes() is None


def test_peak_memory_on_cuda_is_the_peak_above_the_start(cuda_calls):
    with C.PeakMemory("cuda:0") as memory:
        assert memory.phase_bytes() == 250  # and the next phase starts from a reset
    assert (memory.peak_bytes, memory.extra_bytes) == (350, 250)
    assert cuda_calls == [("reset", "cuda:0"), ("reset", "cuda:0")]


def test_relative_differences():
    ours, reference = torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])
    assert C.max_relative_difference(ours, reference) == pytest.approx(0.25)
    assert C.max_relative_difference(ours.double(), reference, torch.float64) == 0.25
    assert C.max_relative_difference(torch.empty(0), torch.empty(0)) == 0.0
    assert C.relative_norm_difference(torch.tensor([3.0, 9.0]), torch.tensor([3.0, 4.0])) == 1.0


def test_gb_per_s():
    assert C.gb_per_s(2e9, 1000.0) == 2.0


def test_max_over_ranks_without_a_process_group_keeps_the_values():
    assert C.max_over_ranks([3, 1.5], "cpu") == [3.0, 1.5]


def _ranks_body(rank, world_size):
    common = load_benchmark("bench_common.py")
    with common.Stopwatch("cpu") as clock:  # passes the barrier with the other rank
        pass
    return common.max_over_ranks([rank, -rank, 0.5], "cpu"), clock.wall_s >= 0


def test_max_over_ranks_takes_each_value_s_maximum():
    assert run_on_ranks(_ranks_body, world_size=2) == [([1.0, 0.0, 0.5], True)] * 2


def test_stamps(monkeypatch):
    date = datetime.datetime.fromisoformat(C.utc_date())
    assert date.utcoffset() == datetime.timedelta(0)
    assert C.device_name("cpu") == "cpu"
    script = REPO_ROOT / "tools" / "benchmarks" / "bench_x.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--out", "r.json"])
    assert C.command_line().split()[1:] == ["tools/benchmarks/bench_x.py", "--out", "r.json"]
    monkeypatch.setattr(sys, "argv", ["/elsewhere/bench_x.py"])
    assert C.command_line().split()[1:] == ["/elsewhere/bench_x.py"]


def test_write_json_makes_the_folders_and_says_so(tmp_path, capsys):
    path = tmp_path / "a" / "b" / "r.json"
    C.write_json(path, {"x": [1, 2]}, indent=1)
    text = path.read_text()
    assert json.loads(text) == {"x": [1, 2]}
    assert text == json.dumps({"x": [1, 2]}, indent=1) + "\n"
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_report_prints_the_record_and_writes_it_only_when_asked(tmp_path, capsys):
    C.report({"ms": 1.5}, None)
    assert json.loads(capsys.readouterr().out) == {"ms": 1.5}
    C.report({"ms": 1.5}, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == {"ms": 1.5}


def test_markdown_table_and_cells():
    rows = [["a", C.cell(1.23456, ".2f"), C.cell(None)], ["b", C.cell(None, ".2f", "n/a"), 7]]
    assert C.markdown_table(["name", "ms", "n"], rows).splitlines() == [
        "| name | ms | n |", "|---|---|---|", "| a | 1.23 | - |", "| b | n/a | 7 |"]
