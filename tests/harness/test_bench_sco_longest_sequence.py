"""tools/benchmarks/bench_sco_longest_sequence.py on CPU.

The search over lengths runs against fake ``trains`` callables with a known threshold; the metrics
summary against hand-written records; the whole tool against a stand-in for the example's
interpreter that "runs out of memory" above a length, hangs above another, and otherwise writes
the metrics a real job writes.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from pathlib import Path

from megatron.bounded import budget as B
from tests.tool_modules import load_tool

tool = load_tool("benchmarks/bench_sco_longest_sequence.py")
G = 4096


def threshold_trains(limit: int, calls: list):
    """trains(length) is true up to ``limit`` tokens; every call is recorded."""

    def trains(length: int) -> bool:
        calls.append(length)
        return length <= limit

    return trains


def run_bound(top: int) -> int:
    """Trials the search may use over ``top`` granules: two gallops and a bisection, each
    logarithmic, plus the start."""
    return 3 * math.ceil(math.log2(top + 1)) + 2


# ------------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limit, predicted",
    [
        (540_000, 540_672),  # budget a little too high
        (700_000, 540_672),  # budget too low (a conservative estimate)
        (3 * G, 1024 * G),  # budget far too high
        (1000 * G + 5, 4 * G),  # budget far too low
        (123_456, 0),  # budget says nothing fits
        (G, 77 * G),  # only one granule trains
        (100 * G, 100 * G + 100),  # exact, up to rounding
    ],
)
def test_search_finds_the_largest_multiple_below_the_threshold(limit, predicted):
    max_length = 2048 * G
    calls = []
    result = tool.longest_training_length(threshold_trains(limit, calls), predicted, G, max_length)
    assert result.longest == limit // G * G
    assert result.shortest_failure == result.longest + G
    assert not result.capped
    assert [length for length, _ in result.trials] == calls
    assert all(trained == (length <= limit) for length, trained in result.trials)
    assert len(set(calls)) == len(calls), "a length was tried twice"
    assert all(length % G == 0 and G <= length <= max_length for length in calls)
    assert len(calls) <= run_bound(max_length // G)


def test_accurate_prediction_costs_few_runs():
    calls = []
    result = tool.longest_training_length(threshold_trains(540_672, calls), 540_672, G, 2048 * G)
    assert result.longest == 540_672
    # the start trains, the first step up fails, then bisection over 16 granules
    assert len(calls) == 2 + 4


def test_a_variant_that_never_trains():
    calls = []
    result = tool.longest_training_length(lambda length: calls.append(length) or False,
                                          540_672, G, 2048 * G)
    assert result.longest == 0 and result.shortest_failure == G and not result.capped
    assert calls[0] == 540_672 and calls[-1] == G
    assert calls == sorted(calls, reverse=True)
    assert len(calls) <= run_bound(2048)


def test_training_at_the_maximum_is_capped():
    calls = []
    result = tool.longest_training_length(threshold_trains(10**9, calls), 100 * G, G, 1000 * G + 7)
    assert result.longest == 1000 * G and result.capped and result.shortest_failure is None
    assert calls[-1] == 1000 * G and len(calls) <= run_bound(1000)


def test_prediction_beyond_the_maximum_starts_at_the_maximum():
    calls = []
    result = tool.longest_training_length(threshold_trains(5 * G, calls), 10**9, G, 16 * G)
    assert calls[0] == 16 * G and result.longest == 5 * G


@pytest.mark.parametrize("granularity, max_length", [(0, 10), (G, G - 1)])
def test_search_refuses_an_empty_range(granularity, max_length):
    with pytest.raises(ValueError):
        tool.longest_training_length(lambda length: True, G, granularity, max_length)


# ------------------------------------------------------------------------------------------------
# Metrics and outcomes
# ------------------------------------------------------------------------------------------------


def metrics_records(ms, peaks, losses=None):
    """Records as --metrics-jsonl writes them with LOG_INTERVAL=1: iteration 1 opens the first
    interval and has no time; iteration i > 1 has ms[i - 2] and peaks[i - 2]."""
    count = len(ms) + 1
    losses = losses or [10.0] * count
    records = [{"iteration": 1, "lm_loss": losses[0], "grad_norm": 1.0}]
    for i, (time_ms, peak) in enumerate(zip(ms, peaks), start=2):
        records.append({"iteration": i, "lm_loss": losses[i - 1], "grad_norm": 1.0,
                        "ms_per_iteration": time_ms, "tokens_per_s_per_gpu": 1.0,
                        "tflops_per_gpu": None, "peak_allocated_gib": peak})
    return records


def test_step_time_summary_skips_the_first_interval():
    records = metrics_records([900.0, 100.0, 104.0, 98.0, 102.0, 101.0, 99.0],
                              [80.5, 80.5, 81.0, 80.9, 80.5, 80.5, 80.5])
    summary = tool.step_time_summary(records)
    assert summary["ms_per_iteration_median"] == 100.5  # median of the six after the 900 ms one
    assert summary["intervals_in_median"] == 6
    assert summary["peak_allocated_gib"] == 81.0
    assert summary["iterations"] == 8


def test_step_time_summary_of_short_and_empty_runs():
    one_interval = tool.step_time_summary(metrics_records([900.0], [5.0]))
    assert one_interval["ms_per_iteration_median"] is None
    assert one_interval["intervals_in_median"] == 0 and one_interval["peak_allocated_gib"] == 5.0
    one_iteration = tool.step_time_summary(
        [{"iteration": 1, "lm_loss": 10.5, "grad_norm": 2.0, "peak_allocated_gib": 97.25}])
    assert one_iteration["peak_allocated_gib"] == 97.25 and one_iteration["iterations"] == 1
    empty = tool.step_time_summary([])
    assert empty == {"ms_per_iteration_median": None, "intervals_in_median": 0,
                     "peak_allocated_gib": None, "iterations": 0}


def test_completed_training_needs_every_iteration_with_a_finite_loss():
    records = metrics_records([1.0, 1.0], [1.0, 1.0])
    assert tool.completed_training(records, 3)
    assert not tool.completed_training(records, 4)
    assert not tool.completed_training(records[:2], 3)
    assert not tool.completed_training(metrics_records([1.0, 1.0], [1.0, 1.0], [10.0, float("nan"), 9.0]), 3)
    assert not tool.completed_training(metrics_records([1.0, 1.0], [1.0, 1.0], [10.0, None, 9.0]), 3)


@pytest.mark.parametrize(
    "returncode, timed_out, trained, log, outcome",
    [
        (0, False, True, "", "ok"),
        (None, True, False, "torch.OutOfMemoryError: CUDA out of memory.", "timeout"),
        (1, False, False, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "oom"),
        (1, False, False, "AssertionError: bad flag", "error"),
        (0, False, False, "", "error"),  # exited 0 without the iterations
    ],
)
def test_classify_outcome(returncode, timed_out, trained, log, outcome):
    assert tool.classify_outcome(returncode, timed_out, trained, log) == outcome


def test_step_time_comparison():
    ok = lambda ms: {"outcome": "ok", "ms_per_iteration_median": ms}  # noqa: E731
    ratios = tool.step_time_comparison(ok(100.0), ok(102.0))
    assert ratios["step_time_ratio"] == pytest.approx(1.02)
    assert ratios["throughput_ratio"] == pytest.approx(100 / 102)
    failed = {"outcome": "oom", "ms_per_iteration_median": 100.0}
    assert tool.step_time_comparison(ok(100.0), failed) == {"step_time_ratio": None,
                                                            "throughput_ratio": None}


@pytest.mark.parametrize("nbytes", [1, 2**20, 8 * 540_672 * 1024 * 2, 8 * 573_441 * 1024 * 2 + 3])
def test_sco_budget_gb_holds_the_boundaries(nbytes):
    value = tool.sco_budget_gb(nbytes)
    held = int(float(repr(value)) * 2**30)  # as pretrain_gpt.py reads the flag
    assert nbytes <= held < nbytes + 2**20


# ------------------------------------------------------------------------------------------------
# The budget on the example's flags, and the tool end to end with a stand-in for the jobs
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_config():
    env = dict(os.environ, NUM_GPUS="2", SEQ_LENGTH=str(G), GLOBAL_BATCH_SIZE="2",
               TRAIN_ITERS="3", PYTHON=sys.executable)
    flags = tool.variant_flags(shlex.split(tool.DEFAULT_COMMON_FLAGS), None)
    argv = tool.capture_example_argv(env, flags)
    assert argv[:3] == ["tools/memory_budget.py", "--world-size", "2"]
    before = {name: os.environ.get(name) for name in ("WORLD_SIZE", "RANK")}
    config = tool.budget_config(argv)
    assert {name: os.environ.get(name) for name in before} == before
    return config


def test_budget_config_is_the_example_with_the_common_flags(example_config):
    assert (example_config.layers, example_config.hidden, example_config.world) == (8, 1024, 2)
    assert example_config.recompute == "full" and example_config.ring_dtp
    assert example_config.ring_chunk == 4096 and example_config.sco_host_bytes == 0


def test_default_sco_budget_offloads_every_boundary(example_config):
    seq = 540_672
    nbytes = tool.boundary_bytes(example_config, seq)
    assert nbytes == 8 * seq * 1024 * 2  # one boundary per layer, N·H·b each
    at = example_config.replace(seq_length=seq, sco_host_bytes=int(tool.sco_budget_gb(nbytes) * 2**30))
    plan = B.estimate_config(at)
    assert plan.host_terms["SCO boundaries"] == nbytes
    assert plan.terms["checkpoint_boundaries"] < 3 * seq * 1024 * 2  # two restored + rotary table


def test_predictions_bracket_the_search(example_config):
    without = tool.predicted_longest(example_config, G, 2**21, 0)
    with_sco = tool.predicted_longest(example_config, G, 2**21, tool.UNLIMITED_HOST_BYTES)
    assert without % G == 0 and with_sco % G == 0
    assert G <= without < with_sco <= 2**21  # offloading the boundaries lets a longer one fit


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for: python -m torch.distributed.run ... pretrain_gpt.py FLAGS --metrics-jsonl PATH
metrics="${@: -1}"
printf '%s\\n' "$*" >> "$FAKE_CALLS"
printf '%s\\n' "${PYTORCH_CUDA_ALLOC_CONF-unset}" >> "$FAKE_CALLS.alloc"
if [ "$SEQ_LENGTH" -gt "$FAKE_HANG_ABOVE" ]; then echo $$ >> "$FAKE_CALLS.hung"; sleep 60; fi
if [ "$SEQ_LENGTH" -gt "$FAKE_OOM_ABOVE" ]; then
    echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. Of the allocated memory 120.00 GiB is allocated by PyTorch" >&2
    exit 1
fi
ms=100
case " $* " in *" --sco-host-budget-gb "*) ms=102 ;; esac
echo "{\\"iteration\\": 1, \\"lm_loss\\": 10.5}" >> "$metrics"
for i in $(seq 2 "$TRAIN_ITERS"); do
    echo "{\\"iteration\\": $i, \\"lm_loss\\": 10.0, \\"ms_per_iteration\\": $ms, \\"peak_allocated_gib\\": 90.0}" >> "$metrics"
done
if [ -n "${FAKE_LINGER_S:-}" ]; then sleep "$FAKE_LINGER_S"; fi  # a slow teardown after training
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """(the stand-in python, the file it appends each job's command line to)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_CALLS", str(calls))
    return fake, calls


def test_tool_end_to_end_with_a_stand_in_for_the_jobs(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", "40000")
    monkeypatch.setenv("FAKE_HANG_ABOVE", "60000")
    out = tmp_path / "report.json"
    status = tool.main([
        "--python", str(fake), "--results-dir", str(tmp_path / "runs"), "--out", str(out),
        "--max-seq-length", str(16 * G), "--timeout-s", "2", "--master-port", "29900",
    ])
    assert status == 0
    report = json.loads(out.read_text())
    for name in tool.VARIANTS:
        variant = report["variants"][name]
        # the budget predicts far more than 16 granules: the search starts at the maximum
        assert variant["predicted_longest"] == 16 * G
        assert variant["longest"] == 9 * G and variant["shortest_failure"] == 10 * G
        outcomes = {t["seq_length"]: t["outcome"] for t in variant["trials"]}
        assert outcomes[16 * G] == "timeout" and outcomes[10 * G] == "oom"
        assert all(outcome == "ok" for length, outcome in outcomes.items() if length <= 9 * G)
        oom = next(t for t in variant["trials"] if t["seq_length"] == 10 * G)
        assert any("OutOfMemoryError" in line for line in oom["last_lines"])
        assert oom["oom_demand_gib"] == 122.0
    sco_trial = next(t for t in report["variants"]["with_sco"]["trials"] if t["seq_length"] == 9 * G)
    gb = float(sco_trial["flags"][sco_trial["flags"].index("--sco-host-budget-gb") + 1])
    assert int(gb * 2**30) >= 8 * 9 * G * 1024 * 2
    assert "--sco-host-budget-gb" not in report["variants"]["without_sco"]["trials"][0]["flags"]
    timing = report["timing"]
    assert timing["seq_length"] == 9 * G and timing["iterations"] == 8
    assert timing["without_sco"]["ms_per_iteration_median"] == 100
    assert timing["with_sco"]["intervals_in_median"] == 6
    assert timing["throughput_ratio"] == pytest.approx(100 / 102)
    # every job got the variant's flags, the fixed batch and the example's launcher
    lines = calls.read_text().splitlines()
    assert all("pretrain_gpt.py" in line and "--recompute-granularity full" in line
               and "--ring-dtp --ring-dtp-chunk-tokens 4096" in line
               and "--global-batch-size 2" in line and "--micro-batch-size 1" in line
               for line in lines)
    assert len(lines) == sum(len(report["variants"][name]["trials"]) for name in tool.VARIANTS) + 2


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) is not running
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_sigterm_stops_the_running_job_too(tmp_path, monkeypatch, stand_in):
    """An outer time limit's SIGTERM must not leave the trial (its own session) on the GPUs."""
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", "999999999")
    monkeypatch.setenv("FAKE_HANG_ABOVE", "0")
    hung = tmp_path / "calls.hung"
    command = [sys.executable, str(tool.__file__), "--python", str(fake),
               "--results-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "report.json"),
               "--max-seq-length", str(4 * G), "--timeout-s", "120", "--master-port", "29950"]
    search = subprocess.Popen(command, cwd=tool.REPO_ROOT, env=os.environ.copy())
    try:
        assert _wait_for(lambda: hung.exists() and hung.read_text().strip(), 120), "no job started"
        job_pid = int(hung.read_text().split()[0])
        assert _running(job_pid)
        search.send_signal(signal.SIGTERM)
        assert search.wait(timeout=60) == 128 + signal.SIGTERM
        assert _wait_for(lambda: not _running(job_pid), 30), "the job outlived the search"
    finally:
        search.kill()


def test_a_second_invocation_reuses_the_finished_jobs(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", str(5 * G))
    monkeypatch.setenv("FAKE_HANG_ABOVE", str(16 * G))
    argv = ["--python", str(fake), "--results-dir", str(tmp_path / "runs"),
            "--max-seq-length", str(8 * G), "--timeout-s", "20", "--master-port", "29910"]
    first = tmp_path / "first.json"
    assert tool.main(argv + ["--out", str(first)]) == 0
    jobs = len(calls.read_text().splitlines())
    second = tmp_path / "second.json"
    assert tool.main(argv + ["--out", str(second)]) == 0
    assert len(calls.read_text().splitlines()) == jobs  # nothing ran again
    strip = lambda report: {name: report["variants"][name]["longest"] for name in tool.VARIANTS}  # noqa: E731
    assert strip(json.loads(second.read_text())) == strip(json.loads(first.read_text())) == {
        name: 5 * G for name in tool.VARIANTS}


def _search_only(tmp_path, monkeypatch, fake, oom_above: int, max_length: int, port: int, *extra):
    """The tool against the stand-in without timing runs; its report."""
    monkeypatch.setenv("FAKE_OOM_ABOVE", str(oom_above))
    monkeypatch.setenv("FAKE_HANG_ABOVE", str(64 * G))
    out = tmp_path / "report.json"
    assert tool.main(["--python", str(fake), "--results-dir", str(tmp_path / "runs"), "--out", str(out),
                      "--max-seq-length", str(max_length), "--timeout-s", "20", "--master-port",
                      str(port), "--timing-iterations", "0", *extra]) == 0
    return json.loads(out.read_text())


def test_zero_timing_iterations_runs_only_the_search(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    report = _search_only(tmp_path, monkeypatch, fake, 5 * G, 8 * G, 29920)
    assert "timing" not in report
    assert {name: report["variants"][name]["longest"] for name in tool.VARIANTS} == {
        name: 5 * G for name in tool.VARIANTS}
    assert len(calls.read_text().splitlines()) == sum(
        len(report["variants"][name]["trials"]) for name in tool.VARIANTS)


def test_start_length_replaces_the_prediction_as_the_first_trial(tmp_path, monkeypatch, stand_in):
    fake, _ = stand_in
    report = _search_only(tmp_path, monkeypatch, fake, 13 * G, 32 * G, 29930,
                          "--start-length", str(12 * G))
    for name in tool.VARIANTS:
        variant = report["variants"][name]
        assert variant["search_start"] == 12 * G and variant["predicted_longest"] == 32 * G
        assert variant["trials"][0]["seq_length"] == 12 * G
        assert variant["longest"] == 13 * G and variant["shortest_failure"] == 14 * G
    with pytest.raises(SystemExit, match="shorter than one granule"):
        tool.main(["--python", str(fake), "--start-length", str(G - 1)])


def test_variants_limits_the_search_and_skips_the_timing(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", str(5 * G))
    monkeypatch.setenv("FAKE_HANG_ABOVE", str(64 * G))
    out = tmp_path / "report.json"
    # timing iterations stay at their default: one variant alone cannot be timed against the other
    assert tool.main(["--python", str(fake), "--results-dir", str(tmp_path / "runs"), "--out", str(out),
                      "--max-seq-length", str(8 * G), "--timeout-s", "20", "--master-port", "29940",
                      "--variants", "with_sco"]) == 0
    report = json.loads(out.read_text())
    assert list(report["variants"]) == ["with_sco"] and "timing" not in report
    assert report["variants"]["with_sco"]["longest"] == 5 * G
    lines = calls.read_text().splitlines()
    assert len(lines) == len(report["variants"]["with_sco"]["trials"])
    assert all("--sco-host-budget-gb" in line for line in lines)


def test_allocator_conf_reaches_the_jobs_and_is_part_of_a_record(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "from:outside")  # never leaks into the jobs
    alloc = Path(str(calls) + ".alloc")
    first = _search_only(tmp_path, monkeypatch, fake, 5 * G, 8 * G, 29945, "--variants", "with_sco")
    jobs = len(first["variants"]["with_sco"]["trials"])
    assert alloc.read_text().split() == [tool.DEFAULT_ALLOCATOR_CONF] * jobs
    assert first["settings"]["allocator_conf"] == "expandable_segments:True"
    assert all(t["allocator_conf"] == tool.DEFAULT_ALLOCATOR_CONF
               for t in first["variants"]["with_sco"]["trials"])
    # PyTorch's default allocator is another configuration: its jobs run again, without the variable
    second = _search_only(tmp_path, monkeypatch, fake, 5 * G, 8 * G, 29946, "--variants", "with_sco",
                          "--allocator-conf", "")
    assert len(alloc.read_text().split()) == 2 * jobs
    assert alloc.read_text().split()[jobs:] == ["unset"] * jobs
    assert second["variants"]["with_sco"]["longest"] == 5 * G


def test_first_step_of_one_granule_brackets_a_close_start_in_two_jobs(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    report = _search_only(tmp_path, monkeypatch, fake, 13 * G, 32 * G, 29947, "--variants", "with_sco",
                          "--start-length", str(14 * G), "--first-step-fraction", "0")
    trials = [(t["seq_length"], t["outcome"]) for t in report["variants"]["with_sco"]["trials"]]
    assert trials == [(14 * G, "oom"), (13 * G, "ok")]
    assert report["variants"]["with_sco"]["longest"] == 13 * G


def test_oom_demand_is_the_largest_allocated_plus_requested():
    log = (
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has "
        "a total capacity of 139.80 GiB of which 0.2 GiB is free. Of the allocated memory 130.00 GiB "
        "is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.\n"
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 14.11 GiB. GPU 1 has a "
        "total capacity of 139.80 GiB of which 11.37 GiB is free. Including non-PyTorch memory, this "
        "process has 128.36 GiB memory in use. Of the allocated memory 124.78 GiB is allocated by "
        "PyTorch, and 63.70 MiB is reserved by PyTorch but unallocated.\n"
    )
    assert tool.oom_demand_gib(log) == pytest.approx(138.89)
    assert tool.oom_demand_gib("RuntimeError: NCCL error") is None


def test_predict_only_runs_nothing(tmp_path, capsys):
    assert tool.main(["--predict-only", "--python", str(tmp_path / "absent"),
                      "--results-dir", str(tmp_path / "runs")]) == 0
    printed = capsys.readouterr().out
    assert "without_sco: budget's longest" in printed and "--sco-host-budget-gb" in printed
    assert not (tmp_path / "runs").exists()


def _predicted(printed: str, variant: str) -> int:
    line = next(line for line in printed.splitlines() if line.startswith(f"{variant}:"))
    return int(line.split("budget's longest ")[1].split(" tokens")[0].replace(",", ""))


def test_start_routing_skew_moves_only_the_prediction(tmp_path, capsys):
    common = ["--predict-only", "--python", str(tmp_path / "absent"), "--granularity", "16384"]
    assert tool.main(common) == 0
    default = capsys.readouterr().out
    assert tool.main(common + ["--start-routing-skew", "1.1"]) == 0
    even = capsys.readouterr().out
    for variant in tool.VARIANTS:
        # fewer rows assumed on the hottest rank: a longer sequence is predicted to fit
        assert _predicted(even, variant) > _predicted(default, variant)
    assert "--budget-routing-skew" not in even  # the jobs' flags are unchanged


def test_a_job_lingering_after_its_iterations_is_stopped_and_counts_as_trained(
        tmp_path, monkeypatch, stand_in):
    """At 1M tokens a job's teardown outlasted a time limit after its iteration had trained."""
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", "999999999")
    monkeypatch.setenv("FAKE_HANG_ABOVE", "999999999")
    monkeypatch.setenv("FAKE_LINGER_S", "60")
    monkeypatch.setattr(tool, "TRAINED_EXIT_GRACE_S", 0.5)
    monkeypatch.setattr(tool, "POLL_S", 0.1)
    out = tmp_path / "report.json"
    started = time.monotonic()
    tool.main(["--python", str(fake), "--results-dir", str(tmp_path / "runs"), "--out", str(out),
               "--variants", "with_sco", "--start-length", str(G), "--max-seq-length", str(G),
               "--granularity", str(G), "--iterations", "2", "--timeout-s", "50",
               "--master-port", "29960"])
    assert time.monotonic() - started < 40  # not the job's 60 s linger nor the 50 s limit
    (trial,) = json.loads(out.read_text())["variants"]["with_sco"]["trials"]
    assert trial["outcome"] == "ok" and trial["iterations"] == 2


def test_a_job_still_training_at_its_time_limit_times_out(tmp_path, monkeypatch, stand_in):
    fake, calls = stand_in
    monkeypatch.setenv("FAKE_OOM_ABOVE", "999999999")
    monkeypatch.setenv("FAKE_HANG_ABOVE", "0")
    monkeypatch.setattr(tool, "POLL_S", 0.1)
    out = tmp_path / "report.json"
    tool.main(["--python", str(fake), "--results-dir", str(tmp_path / "runs"), "--out", str(out),
               "--variants", "with_sco", "--start-length", str(G), "--max-seq-length", str(G),
               "--granularity", str(G), "--iterations", "2", "--timeout-s", "1",
               "--master-port", "29970"])
    (trial,) = json.loads(out.read_text())["variants"]["with_sco"]["trials"]
    assert trial["outcome"] == "timeout"
