"""The throughput meter behind the progress log and ``--metrics-jsonl``."""

from __future__ import annotations

import json

import pytest

from megatron.bounded.progress import ThroughputMeter, format_line


def _meter(tmp_path, log_interval=2, peak=3 * 1024**3):
    clock = {"now": 0.0}
    meter = ThroughputMeter(
        tokens_per_iteration=8 * 4096,
        flops_per_iteration=4e15,
        world_size=2,
        log_interval=log_interval,
        metrics_path=str(tmp_path / "metrics.jsonl"),
        clock=lambda: clock["now"],
        peak_memory_bytes=lambda: peak,
    )
    return meter, clock


def test_first_iteration_is_excluded_and_rates_are_per_gpu(tmp_path):
    meter, clock = _meter(tmp_path)
    lines = []
    for iteration, seconds in zip(range(1, 6), [9.0, 0.5, 0.5, 0.25, 0.25]):
        clock["now"] += seconds  # iteration 1 is slow (warm-up): it must not count
        lines.append(meter.record_iteration(iteration, 10.0 / iteration, 1.5, True))
    assert lines[0] is None and lines[2] is None and lines[4] is None
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["lm_loss"] == 10.0 / 3  # exact float, not a rounded print
    # iteration 2 alone: 0.5 s; iterations 3-4: 0.75 s for 2
    assert records[1]["ms_per_iteration"] == pytest.approx(500.0)
    assert records[3]["ms_per_iteration"] == pytest.approx(375.0)
    assert records[3]["tokens_per_s_per_gpu"] == pytest.approx(8 * 4096 / 0.375 / 2)
    assert records[3]["tflops_per_gpu"] == pytest.approx(4e15 / 0.375 / 2 / 1e12)
    assert records[3]["peak_allocated_gib"] == pytest.approx(3.0)
    assert "tokens/s/GPU 43,691" in lines[3] and "lm loss 2.500000" in lines[3]


def test_a_one_iteration_job_still_reports_its_peak(tmp_path):
    """A memory probe at a long sequence runs one iteration, which opens no interval."""
    meter, clock = _meter(tmp_path, peak=5 * 1024**3)
    clock["now"] += 100.0
    assert meter.record_iteration(1, 10.5, 2.0, True) is None
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["peak_allocated_gib"] == pytest.approx(5.0)
    assert "ms_per_iteration" not in record  # the warm-up iteration's time is still left out


def test_non_logging_rank_writes_no_metrics(tmp_path):
    meter, clock = _meter(tmp_path)
    for iteration in range(1, 4):
        clock["now"] += 1.0
        meter.record_iteration(iteration, 1.0, None, is_logging_rank=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_flops_and_memory_are_left_out_of_the_line():
    stats = {"ms_per_iteration": 100.0, "tokens_per_s_per_gpu": 5.0, "tflops_per_gpu": None,
             "peak_allocated_gib": None}
    line = format_line(7, stats, None)
    assert "TFLOP" not in line and "peak" not in line and "loss" not in line


def test_log_interval_must_be_positive():
    with pytest.raises(ValueError, match="log_interval"):
        ThroughputMeter(tokens_per_iteration=1, flops_per_iteration=0, world_size=1, log_interval=0)
