"""What the benchmarks in this directory share: timing (CUDA events, or a wall clock between
device synchronizations), peak-memory measurement, reductions over ranks, the stamps of a
record (date, device, torch, commit, command), the record's JSON file (``--out``), markdown
tables, and :class:`Benchmark`, the runner of the operator benchmarks (their common flags,
timing, correctness checks, record and summary).

A benchmark run as a script has this directory on ``sys.path`` (Python puts the script's own
there); importing this module also puts the repository there, so that the benchmark imports
``megatron.bounded`` without PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ------------------------------------------------------------------------------------ timing


def on_cuda(device=None) -> bool:
    """Whether ``device`` (default: the current CUDA device, if there is one) is a CUDA device."""
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def synchronize(device=None) -> None:
    """Wait for the work queued on ``device``; nothing to wait for off CUDA."""
    if on_cuda(device):
        torch.cuda.synchronize(device)


def median_cuda_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median of ``repeats`` timings of ``fn()`` (CUDA events) after ``warmup`` untimed calls
    (Triton compiles on the first)."""
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_event_ms(fn) for _ in range(repeats))


def cuda_event_ms(fn) -> float:
    """GPU milliseconds from just before the work ``fn()`` queues to the end of it (CUDA
    events on the current stream)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


class Stopwatch:
    """Times a ``with`` block from a synchronized start: ``host_s`` until the host left the
    block (what issuing its work took) and ``wall_s`` until ``device`` finished that work.
    Every rank passes a barrier first when a process group is up, so ranks start together."""

    def __init__(self, device=None):
        self.device = device
        self.host_s = self.wall_s = None

    def __enter__(self):
        synchronize(self.device)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.host_s = time.perf_counter() - self._start
        synchronize(self.device)
        self.wall_s = time.perf_counter() - self._start
        return False


def wall_times_s(step, repeats: int, warmup: int = 0, device=None) -> list:
    """Seconds of each of ``repeats`` calls of ``step()`` (:class:`Stopwatch` ``wall_s``) after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(repeats):
        with Stopwatch(device) as clock:
            step()
        times.append(clock.wall_s)
    return times


class PeakMemory:
    """The peak of the CUDA memory allocated inside a ``with`` block (the allocator's peak
    statistics reset on entry): ``peak_bytes`` in all and ``extra_bytes`` above what was
    allocated on entry. Off CUDA both stay None."""

    def __init__(self, device=None):
        self.device = device
        self.cuda = on_cuda(device)
        self.base = 0
        self.peak_bytes = self.extra_bytes = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.extra_bytes = self.peak_bytes - self.base
        return False

    def phase_bytes(self):
        """Peak above the entry's allocation since the last reset, which starts the next phase
        of the block (None off CUDA)."""
        if not self.cuda:
            return None
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


def gb_per_s(nbytes: float, ms: float) -> float:
    """Bandwidth of moving ``nbytes`` in ``ms`` milliseconds, GB/s."""
    return nbytes / ms / 1e6


# ---------------------------------------------------------------------------------- accuracy


def max_relative_difference(ours: torch.Tensor, reference: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> float:
    """max |ours − reference| / max |reference|, computed in ``dtype`` (0 for empty tensors)."""
    if reference.numel() == 0:
        return 0.0
    ours, reference = ours.to(dtype), reference.to(dtype)
    return ((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def relative_norm_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖ (Frobenius norms, fp32)."""
    ours, reference = ours.float(), reference.float()
    return ((ours - reference).norm() / reference.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------- processes


def init_distributed(default_port: int):
    """(rank, world size, device) of this process in a process group: NCCL on its GPU with
    NVLink multicast off, or gloo on the CPU. A plain ``python`` run (no ``RANK`` from a launcher)
    is rank 0 of 1 on ``default_port``."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(default_port)))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def finish_distributed():
    """Tear the process group down once every rank has got here: a rank that tears its gloo
    group down while a peer is still writing its record can abort."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from megatron.core import parallel_state

    dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def max_over_ranks(values, device) -> list:
    """``values`` (numbers) with each replaced by its maximum over the ranks of the process
    group (as they are without one), reduced in float64 on ``device``."""
    if not (dist.is_available() and dist.is_initialized()):
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ------------------------------------------------------------------------------------ records


def device_name(device=None) -> str:
    """The GPU's name on CUDA, else ``cpu``."""
    return torch.cuda.get_device_name(device) if on_cuda(device) else "cpu"


def utc_date() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """This process's command: the interpreter's name, the script (relative to the repository
    when inside it) and its arguments."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(REPO_ROOT):
        script = script.relative_to(REPO_ROOT)
    return " ".join([Path(sys.executable).name, str(script), *sys.argv[1:]])


def commit() -> str:
    """The repository's commit: git's, else ``BENCH_COMMIT`` (a copy of the tree without its git
    directory), else ``unknown``."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BENCH_COMMIT", "unknown")


def stamps(device=None) -> dict:
    """What a record says about its run: date, device, torch, commit and command."""
    return {"date": utc_date(), "device": device_name(device), "torch": torch.__version__,
            "commit": commit(), "command": command_line()}


def write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` (its folders made as needed) and say so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")


def write_json(path, record, indent: int = 2) -> None:
    """Write ``record`` as JSON to ``path`` (:func:`write_text`)."""
    write_text(path, json.dumps(record, indent=indent) + "\n")


def report(result: dict, out) -> None:
    """Print ``result`` as JSON and write it to ``out`` when given."""
    print(json.dumps(result, indent=2))
    if out:
        write_json(out, result)


# ------------------------------------------------------------------------------------- tables


def cell(value, spec: str = "", missing: str = "-") -> str:
    """``value`` formatted with ``spec`` for a table cell, ``missing`` for None."""
    return missing if value is None else format(value, spec)


def markdown_table(header, rows) -> str:
    """A markdown table of ``header`` (column titles) and ``rows`` (cells, as text)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ runner


def add_flags(parser, flags: dict) -> None:
    """Add ``flags`` (``--name`` → default, or → argparse's keywords) to ``parser``: an int,
    float or str default gives its type, a list one or more values of its items' type, False
    a switch."""
    for flag, spec in flags.items():
        if isinstance(spec, dict):
            parser.add_argument(flag, **spec)
        elif spec is False:
            parser.add_argument(flag, action="store_true")
        elif isinstance(spec, list):
            parser.add_argument(flag, type=type(spec[0]), nargs="+", default=spec)
        else:
            parser.add_argument(flag, type=type(spec), default=spec)


class Run:
    """One run of a :class:`Benchmark`, what its ``measure`` gets: the parsed ``args``, the
    ``device``, the ``record`` being filled (its stamps and ``shape`` already there), the
    timers and the correctness checks."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.record = {**stamps(device),
                       "shape": {k: v for k, v in vars(args).items() if k != "out"}}
        self.failed_checks = []

    def median_ms(self, fn, warmup=None) -> float:
        """Median milliseconds of ``--repeats`` calls of ``fn()`` after ``warmup`` (default
        ``--warmup``, else none) untimed ones: CUDA events on a GPU, else a wall clock."""
        warmup = getattr(self.args, "warmup", 0) if warmup is None else warmup
        if on_cuda(self.device):
            return median_cuda_ms(fn, self.args.repeats, warmup)
        return 1e3 * statistics.median(wall_times_s(fn, self.args.repeats, warmup, self.device))

    def time_variants(self, variants: dict, key: str = "{}_ms") -> dict:
        """``key`` of each variant's name → :meth:`median_ms` of its work (``variants``: name →
        a callable of no arguments)."""
        return {key.format(name): self.median_ms(work) for name, work in variants.items()}

    def check(self, key: str, passed: bool, value=None) -> bool:
        """Record the correctness check ``key`` (``value``, else whether it passed); a check
        that did not pass fails the run."""
        self.record[key] = bool(passed) if value is None else value
        if not passed:
            self.failed_checks.append(key)
            print(f"check failed: {key}", file=sys.stderr, flush=True)
        return bool(passed)

    def add_row(self, row: dict) -> dict:
        """Append ``row`` to the record's ``rows`` and print it."""
        self.record.setdefault("rows", []).append(row)
        print(row, flush=True)
        return row


@dataclasses.dataclass
class Benchmark:
    """A benchmark declared for the runner: its ``name`` (the script's, for messages), ``doc``
    (the first line describes it in ``--help``), its own ``flags`` (:func:`add_flags`) and
    ``measure(run)``, which builds each case's inputs, times its variants
    (:meth:`Run.time_variants`), checks them against the reference (:meth:`Run.check`) and puts
    its metrics into ``run.record``. The runner adds ``--repeats``, ``--warmup`` (unless
    ``warmup`` is None: a benchmark that warms up its own way) and ``--out``,
    refuses to run without a GPU when ``needs_cuda``, seeds torch, stamps the record, prints it
    and its markdown summary, writes it to ``--out`` and fails the run (exit 1) when a check
    failed."""

    name: str
    doc: str
    flags: dict
    measure: Callable[[Run], None]
    repeats: int = 20
    warmup: Optional[int] = 2
    needs_cuda: bool = True

    def main(self, argv=None) -> int:
        parser = argparse.ArgumentParser(description=self.doc.strip().splitlines()[0])
        common = {"--repeats": self.repeats}
        if self.warmup is not None:
            common["--warmup"] = dict(type=int, default=self.warmup,
                                      help="untimed calls before the timed ones")
        add_flags(parser, {**self.flags, **common,
                           "--out": dict(default=None, help="write the record as JSON here")})
        args = parser.parse_args(argv)
        if self.needs_cuda and not torch.cuda.is_available():
            print(f"{self.name} needs a CUDA GPU", file=sys.stderr)
            return 2
        torch.manual_seed(0)
        run = Run(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.measure(run)
        if run.failed_checks:
            run.record["failed_checks"] = run.failed_checks
        report(run.record, args.out)
        print(summary_table(run.record))
        return 1 if run.failed_checks else 0


def summary_table(record: dict) -> str:
    """The markdown summary of a runner's record: its numbers and flags (name | value), then a
    table of each list of rows (columns: the rows' keys in order of appearance)."""
    def text(value):
        return format(value, ".4g") if isinstance(value, float) else str(value)

    scalars = [[k, text(v)] for k, v in record.items()
               if isinstance(v, (bool, int, float)) and k not in ("date", "device", "torch")]
    tables = [markdown_table(["metric", "value"], scalars)] if scalars else []
    for key, rows in record.items():
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            columns = list(dict.fromkeys(c for row in rows for c in row))
            tables.append(f"{key}:\n" + markdown_table(
                columns, [[text(row.get(c, "-")) for c in columns] for row in rows]))
    return "\n\n".join(tables)
