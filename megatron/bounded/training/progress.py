"""Training progress and throughput log: tokens/s/GPU, TFLOP/s/GPU, peak memory, loss.

Upstream's training log reports the iteration time and, with ``--log-throughput``, TFLOP/s; it
does not report tokens per second per GPU or the peak memory after the first iterations, and it
prints the loss with six digits only. :class:`ThroughputMeter` fills that gap: every
``log_interval`` iterations it prints one line, and with ``--metrics-jsonl PATH`` it appends one
JSON record per iteration (the loss as an exact float), which the functional tests compare
between an uninterrupted and a resumed run.

The meter synchronizes the device once per log interval (to read a wall-clock interval that
includes all queued work) and reads the loss once per iteration only when a metrics file is set.

At each log interval the same figures, and the counters and figures other parts of this project
hand the meter (:func:`count`, :meth:`ThroughputMeter.add_figures`: SCO's offloaded boundaries,
steps rerun by paged stash), also go to upstream's TensorBoard writer when ``--tensorboard-dir`` made one, under
``bounded/``. When upstream's per-step NaN check is off (``--no-check-for-nan-in-loss-and-grad``,
which the whole-iteration CUDA graph needs), the loss and gradient norm are checked on the host
at each log interval instead, and a NaN or inf stops the job with :class:`NonFiniteLossError`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron.bounded.settings import BoundedArgumentError, Settings, knob
from megatron.bounded.units import GiB



@dataclass
class ThroughputMeter:
    """Accumulates per-iteration progress and formats the periodic log line.

    Args:
        tokens_per_iteration: global batch size × sequence length (tokens of one iteration).
        flops_per_iteration: model FLOPs of one iteration (all GPUs together), or 0 if unknown.
        world_size: number of GPUs sharing the work.
        log_interval: print a line every this many iterations.
        metrics_path: append one JSON record per iteration to this file (rank 0 writes).
        clock: time source, injectable for tests.
        peak_memory_bytes: returns this rank's peak allocated bytes (``None`` without CUDA).
    """

    tokens_per_iteration: int
    flops_per_iteration: float
    world_size: int
    log_interval: int
    metrics_path: Optional[str] = None
    clock: Callable[[], float] = time.perf_counter
    peak_memory_bytes: Optional[Callable[[], Optional[int]]] = None
    synchronize: Callable[[], None] = lambda: None
    check_finite: bool = False  # stop on a NaN/inf loss or gradient norm at each log interval
    last_stats: Optional[dict] = field(default=None, init=False)  # the last closed interval's
    counters: dict = field(default_factory=dict, init=False)  # by name, from count()
    figure_sources: list = field(default_factory=list, init=False)  # callables: {name: number}
    _interval_start: Optional[float] = field(default=None, init=False)
    _iterations_in_interval: int = field(default=0, init=False)

    def __post_init__(self):
        check_log_interval(self.log_interval)
        if self.peak_memory_bytes is None:
            self.peak_memory_bytes = _cuda_peak_memory_bytes

    def count(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the counter ``name``."""
        self.counters[name] = self.counters.get(name, 0) + amount

    def add_figures(self, source: Callable[[], dict]) -> None:
        """Register a callable returning ``{name: number}``, read at each log interval."""
        self.figure_sources.append(source)

    def figures(self) -> dict:
        """Every registered figure and counter, by name."""
        values = dict(self.counters)
        for source in self.figure_sources:
            values.update(source())
        return values

    def start(self) -> None:
        """Mark the beginning of an interval (call before the first measured iteration)."""
        self._interval_start = self.clock()
        self._iterations_in_interval = 0

    def record_iteration(
        self, iteration: int, loss: Optional[float], grad_norm: Optional[float], is_logging_rank: bool
    ) -> Optional[str]:
        """Account for one finished iteration; return the log line when an interval closes.

        The first recorded iteration only opens the first interval: it carries start-up work
        (allocator warm-up, kernel selection) that steady-state throughput must not include.
        """
        record = {"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm}
        line = None
        if self._interval_start is None:
            self.synchronize()
            # its peak too: a one-iteration job (a memory probe at a long sequence) has no interval
            record["peak_allocated_gib"] = self._peak_gib()
            record["peak_reserved_gib"] = _cuda_peak_reserved_gib()
            self.start()
        else:
            self._iterations_in_interval += 1
            if iteration % self.log_interval == 0:
                self.synchronize()
                stats = self.interval_stats(self.clock() - self._interval_start)
                self.last_stats = stats
                record.update(stats)
                line = format_line(iteration, stats, loss)
                self.start()
        if is_logging_rank and self.metrics_path is not None:
            with open(self.metrics_path, "a", encoding="utf-8") as metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
        return line

    def interval_stats(self, elapsed_s: float) -> dict:
        """Throughput of the current interval, which took ``elapsed_s`` seconds."""
        seconds_per_iteration = elapsed_s / max(self._iterations_in_interval, 1)
        stats = {
            "ms_per_iteration": seconds_per_iteration * 1e3,
            "tokens_per_s_per_gpu": self.tokens_per_iteration / seconds_per_iteration / self.world_size,
            "tflops_per_gpu": None,
        }
        if self.flops_per_iteration > 0:
            stats["tflops_per_gpu"] = (
                self.flops_per_iteration / seconds_per_iteration / self.world_size / 1e12
            )
        stats["peak_allocated_gib"] = self._peak_gib()
        stats["peak_reserved_gib"] = _cuda_peak_reserved_gib()
        return stats

    def _peak_gib(self) -> Optional[float]:
        peak = self.peak_memory_bytes()
        return None if peak is None else peak / GiB


def format_line(iteration: int, stats: dict, loss: Optional[float]) -> str:
    """One human-readable progress line from :meth:`ThroughputMeter.interval_stats`."""
    parts = [
        f"[bounded] iteration {iteration}",
        f"{stats['ms_per_iteration']:.1f} ms/iter",
        f"tokens/s/GPU {stats['tokens_per_s_per_gpu']:,.0f}",
    ]
    if stats["tflops_per_gpu"] is not None:
        parts.append(f"TFLOP/s/GPU {stats['tflops_per_gpu']:.1f}")
    if stats["peak_allocated_gib"] is not None:
        parts.append(f"peak allocated {stats['peak_allocated_gib']:.2f} GiB (max over ranks)")
    if loss is not None:
        parts.append(f"lm loss {loss:.6f}")
    return " | ".join(parts)


def _cuda_peak_reserved_gib() -> Optional[float]:
    """This rank's peak of memory held by the caching allocator (allocated + cached)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_reserved() / GiB


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm seen at a log interval is NaN or infinite."""


def non_finite_message(iteration: int, loss: Optional[float], grad_norm: Optional[float]) -> str:
    return (
        f"[bounded] iteration {iteration}: lm loss {loss}, grad norm {grad_norm}: not finite. "
        "Upstream's per-step NaN check is off (--no-check-for-nan-in-loss-and-grad, which the "
        "whole-iteration CUDA graph needs), so the loss is checked here every --log-interval "
        "iterations: stopping. Resume from the last checkpoint with a lower --lr or a smaller "
        "--clip-grad, or rerun without --cuda-graph-impl full_iteration and with "
        "--check-for-nan-in-loss-and-grad to find the first bad step."
    )


def _is_finite(value: Optional[float]) -> bool:
    return value is None or math.isfinite(value)


def _check_finite_on_all_ranks(iteration: int, loss: Optional[float], grad_norm: Optional[float]):
    """Raise :class:`NonFiniteLossError` on every rank when any rank saw a NaN/inf (ranks of
    earlier pipeline stages have no loss: one all-reduce lets all of them stop together)."""
    bad = not (_is_finite(loss) and _is_finite(grad_norm))
    if torch.distributed.is_initialized():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        bad = bool(flag.item())
    if bad:
        raise NonFiniteLossError(non_finite_message(iteration, loss, grad_norm))


def _tensorboard_writer():
    """Upstream's writer (the last rank's, with --tensorboard-dir), or None."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer
    except ImportError:  # pragma: no cover - part of megatron-core 0.19.2
        return None
    return get_tensorboard_writer()


def write_tensorboard(writer, iteration: int, values: dict) -> None:
    """Our interval figures and counters as scalars ``bounded/<name>`` at step ``iteration``."""
    for name, value in values.items():
        if value is not None:
            writer.add_scalar(f"bounded/{name}", value, iteration)


def _cuda_peak_memory_bytes() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated()


_meter: Optional[ThroughputMeter] = None


def count(name: str, amount: int = 1) -> None:
    """Add ``amount`` to the counter ``name`` of the installed meter (e.g. steps rerun dropless by
    paged stash); nothing without a meter, which alone writes them."""
    if _meter is not None:
        _meter.count(name, amount)


def configure(meter: Optional[ThroughputMeter]) -> None:
    """Install the meter that :func:`record_train_step` feeds (``None`` switches logging off)."""
    global _meter
    _meter = meter


def check_log_interval(log_interval, error_class=ValueError) -> None:
    """The meter prints every ``log_interval`` iterations: a positive count."""
    if log_interval is None or log_interval <= 0:
        raise error_class(
            f"--log-interval must be a positive number of iterations (the progress line is "
            f"printed every that many), got {log_interval}: use e.g. --log-interval 10."
        )


@dataclass(frozen=True)
class ProgressSettings(Settings):
    """The per-iteration record file."""

    metrics_jsonl: Optional[str] = knob(
        None, "Append one JSON record per iteration (iteration, exact lm loss, grad norm) to this "
        "file, written by the last rank.", metavar="PATH")

    def check(self, args) -> None:
        """A log interval the meter can use, and a --metrics-jsonl file it can append to."""
        check_log_interval(getattr(args, "log_interval", 1), BoundedArgumentError)
        path = self.metrics_jsonl
        if path is None:
            return
        if path.strip() == "":
            raise BoundedArgumentError("--metrics-jsonl needs a file path; omit the flag to disable it.")
        if os.path.isdir(path):
            raise BoundedArgumentError(
                f"--metrics-jsonl {path} is a directory; the records go to a file: name a file, "
                f"e.g. --metrics-jsonl {os.path.join(path, 'metrics.jsonl')}."
            )
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise BoundedArgumentError(
                f"--metrics-jsonl {path}: the directory {directory} does not exist (the first "
                f"record would fail after the model is built): create it (mkdir -p {directory}) "
                "or choose another path."
            )


def meter_from_args(args, settings: ProgressSettings) -> ThroughputMeter:
    """The meter for a Megatron run described by parsed ``args`` and ``settings``."""
    from megatron.training.training import num_floating_point_operations

    try:
        flops = float(num_floating_point_operations(args, args.global_batch_size))
    except Exception as error:  # an architecture the upstream FLOP formula does not know
        print(f"[bounded] TFLOP/s not reported: upstream FLOP count failed ({error})", flush=True)
        flops = 0.0
    return ThroughputMeter(
        tokens_per_iteration=args.global_batch_size * args.seq_length,
        flops_per_iteration=flops,
        world_size=args.world_size,
        log_interval=args.log_interval,
        metrics_path=settings.metrics_jsonl,
        peak_memory_bytes=_max_peak_memory_across_ranks,
        synchronize=_synchronize_cuda,
        check_finite=not args.check_for_nan_in_loss_and_grad,
    )


def record_train_step(train_step_outputs, iteration: Optional[int]) -> None:
    """Feed one upstream ``train_step`` result (its return tuple) to the configured meter."""
    if _meter is None or iteration is None:
        return
    loss_dict, grad_norm = train_step_outputs[0], train_step_outputs[5]
    # upstream's train loop increments `iteration` after train_step returns
    finished_iteration = iteration + 1
    loss = None
    wants_loss = _meter.metrics_path is not None or finished_iteration % _meter.log_interval == 0
    if wants_loss and "lm loss" in loss_dict:
        loss = float(loss_dict["lm loss"])
    line = _meter.record_iteration(
        finished_iteration,
        loss,
        None if grad_norm is None else float(grad_norm),
        is_logging_rank=_is_last_rank(),
    )
    if line is not None and _is_last_rank():
        print(line, flush=True)
    if line is not None:
        writer = _tensorboard_writer()
        if writer is not None:
            write_tensorboard(writer, finished_iteration, {**_meter.last_stats, **_meter.figures()})
        if _meter.check_finite:
            _check_finite_on_all_ranks(
                finished_iteration, loss, None if grad_norm is None else float(grad_norm)
            )


def _is_last_rank() -> bool:
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _synchronize_cuda() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_peak_memory_across_ranks() -> Optional[int]:
    peak = _cuda_peak_memory_bytes()
    if peak is None or not torch.distributed.is_initialized():
        return peak
    peak_tensor = torch.tensor([peak], dtype=torch.int64, device="cuda")
    torch.distributed.all_reduce(peak_tensor, op=torch.distributed.ReduceOp.MAX)
    return int(peak_tensor.item())
