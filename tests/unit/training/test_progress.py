"""The throughput meter behind the progress log and ``--metrics-jsonl``."""

from __future__ import annotations

import json

import pytest

from megatron.bounded.training import progress
from megatron.bounded.training.progress import ThroughputMeter, format_line
from megatron.bounded.units import GiB


def _meter(tmp_path, log_interval=2, peak=3 * GiB):
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
    meter, clock = _meter(tmp_path, peak=5 * GiB)
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
    with pytest.raises(ValueError, match="--log-interval"):
        ThroughputMeter(tokens_per_iteration=1, flops_per_iteration=0, world_size=1, log_interval=0)


class _FakeWriter:
    """Stands in for upstream's TensorBoard SummaryWriter: records add_scalar calls."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def _train_step_outputs(loss, grad_norm):
    # upstream's train_step tuple: (loss dict, skipped iter, should checkpoint, should exit,
    # exit code, grad norm, number of zeros in grad)
    return ({"lm loss": loss}, 0, False, False, 0, grad_norm, None)


def _configured(monkeypatch, tmp_path, check_finite=False, writer=None):
    meter, clock = _meter(tmp_path, log_interval=2)
    meter.check_finite = check_finite
    monkeypatch.setattr(progress, "_meter", meter)
    monkeypatch.setattr(progress, "_tensorboard_writer", lambda: writer)
    return meter, clock


def test_figures_and_counters_go_to_the_tensorboard_writer(monkeypatch, tmp_path, capsys):
    writer = _FakeWriter()
    meter, clock = _configured(monkeypatch, tmp_path, writer=writer)
    meter.add_figures(lambda: {"sco_offloaded_boundaries": 3, "sco_offloaded_gib": 0.5})
    for iteration in range(4):  # upstream passes the iteration before it increments it
        clock["now"] += 0.25
        if iteration == 2:
            progress.count("paged_stash_reruns")
        progress.record_train_step(_train_step_outputs(2.0, 1.0), iteration)
    logged = {(tag, step): value for tag, value, step in writer.scalars}
    steps = sorted({step for _, _, step in writer.scalars})
    assert steps == [2, 4]  # log intervals only, at upstream's iteration numbers
    assert logged[("bounded/tokens_per_s_per_gpu", 4)] == pytest.approx(8 * 4096 / 0.25 / 2)
    assert logged[("bounded/peak_allocated_gib", 4)] == pytest.approx(3.0)
    assert logged[("bounded/sco_offloaded_boundaries", 2)] == 3
    assert ("bounded/paged_stash_reruns", 2) not in logged and logged[("bounded/paged_stash_reruns", 4)] == 1
    assert all(value is not None for value in logged.values())
    assert "[bounded] iteration 4" in capsys.readouterr().out


def test_without_a_writer_nothing_is_written(monkeypatch, tmp_path):
    _, clock = _configured(monkeypatch, tmp_path, writer=None)
    for iteration in range(2):
        clock["now"] += 1.0
        progress.record_train_step(_train_step_outputs(2.0, 1.0), iteration)  # no error


@pytest.mark.parametrize("loss,grad_norm", [(float("nan"), 1.0), (2.0, float("inf")), (float("-inf"), None)])
def test_non_finite_loss_stops_the_job_at_the_log_interval(monkeypatch, tmp_path, loss, grad_norm):
    _, clock = _configured(monkeypatch, tmp_path, check_finite=True)
    clock["now"] += 1.0
    progress.record_train_step(_train_step_outputs(loss, grad_norm), 0)  # not a log iteration
    clock["now"] += 1.0
    with pytest.raises(progress.NonFiniteLossError, match="iteration 2.*not finite.*--no-check-for-nan"):
        progress.record_train_step(_train_step_outputs(loss, grad_norm), 1)


def test_finite_loss_or_check_off_trains_on(monkeypatch, tmp_path):
    _, clock = _configured(monkeypatch, tmp_path, check_finite=True)
    for iteration in range(4):
        clock["now"] += 1.0
        progress.record_train_step(_train_step_outputs(2.0, 1.0), iteration)
    _, clock = _configured(monkeypatch, tmp_path, check_finite=False)  # upstream checks each step
    for iteration in range(4):
        clock["now"] += 1.0
        progress.record_train_step(_train_step_outputs(float("nan"), 1.0), iteration)


@pytest.mark.parametrize("upstream_check", [True, False])
def test_host_check_is_on_exactly_when_upstreams_per_step_check_is_off(upstream_check, capsys):
    from types import SimpleNamespace

    args = SimpleNamespace(global_batch_size=2, seq_length=16, world_size=1, log_interval=1,
                           check_for_nan_in_loss_and_grad=upstream_check)
    meter = progress.meter_from_args(args, progress.ProgressSettings())
    assert meter.check_finite is (not upstream_check)


def test_counters_belong_to_the_installed_meter(monkeypatch, tmp_path):
    """count() adds to the meter configure() installed, not to a store the next run inherits."""
    first, _ = _meter(tmp_path)
    second, _ = _meter(tmp_path)
    monkeypatch.setattr(progress, "_meter", None)
    progress.count("paged_stash_reruns")  # no meter: logging is off, nothing to count into
    monkeypatch.setattr(progress, "_meter", first)
    progress.count("paged_stash_reruns", 2)
    monkeypatch.setattr(progress, "_meter", second)
    progress.count("paged_stash_reruns")
    second.add_figures(lambda: {"sco_offloaded_boundaries": 5})
    assert first.figures() == {"paged_stash_reruns": 2}
    assert second.figures() == {"paged_stash_reruns": 1, "sco_offloaded_boundaries": 5}
