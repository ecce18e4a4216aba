#!/usr/bin/env python3
"""Longest sequence the small example trains at with and without SCO, and SCO's step time there.

    python tools/benchmarks/bench_sco_longest_sequence.py --results-dir results/sco_longest \\
        --out results/sco_longest_sequence.json

Two variants of ``examples/moe_small/train.sh`` on NUM_GPUS GPUs (default 2) at a fixed global
batch (default 2, micro-batch 1, so one sequence per GPU and iteration):

* ``without_sco``: full recompute (``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1``), the only setting under which SCO can run;
* ``with_sco``: the same plus ``--sco-host-budget-gb G``. By default G is chosen per sequence
  length so that every checkpoint boundary can be offloaded: the boundaries that
  ``megatron.bounded.budget`` counts for the configuration (one per layer with uniform recompute
  of one layer) times N·H·b bytes each, rounded up to a MiB. SCO allocates its pinned buffers
  only as boundaries arrive, so a G that covers them all costs no more host memory than the
  boundaries themselves.

For each variant the budget's predicted longest length (``megatron.bounded.budget.max_seq_length``
on the exact flags the example passes, captured from a ``DRY_RUN=1`` launch; with
``--start-routing-skew S`` the budget assumes routing skew S instead of the flags' value, 2.0 by
default, which at EP = 2 puts every routed row on one rank: the example's random router spreads
them evenly, so 1.1 starts much closer to the real limit) starts the search;
real jobs then gallop up or down from it until one length trains and one fails, and bisect between
the two (``longest_training_length``). A length "trains" when the job exits 0 after ``--iterations``
iterations with a finite loss in every one of them; any other end is a failure: ``oom`` (the log
mentions CUDA running out of memory), ``timeout`` (the job outlived ``--timeout-s``; recorded
separately because it says nothing about memory) or ``error``. Each failure keeps the last lines of
its log. At the longest length both variants train, each runs ``--timing-iterations`` iterations
and the report gives the median ms/iteration after the first log interval (``LOG_INTERVAL=1``: every
iteration is an interval; the first carries warm-up), their ratio and each run's peak allocated
memory (max over ranks).

Default common flags (both variants): ``--ring-dtp --ring-dtp-chunk-tokens 4096``. Without them the
vocabulary projection limits the plain example: at the budget's longest length with full recompute
(about 200K tokens) its three fp32 N×V logit tensors take 72 of 131 GiB, the boundaries 3 GiB, and
offloading the boundaries cannot move the limit. Ring-DTP (exact: same loss) shards the vocabulary
over the two GPUs in 4,096-token strips, which shrinks that term to about 4.5 GiB; the limit then
moves to about 540K tokens, where the 8 boundaries take 8.4 GiB (6% of HBM) and the budget
predicts 540,672 tokens without SCO and 573,440 with it. The layers' recompute working set (one
layer's attention and routed rows) dominates there and SCO cannot shrink it. Adding PipelinedLLEP
(``--pipelined-llep``) would make the boundaries a larger share (31 GiB at about 2M tokens), but
attention cost grows with the square of the length, so one iteration there takes over ten times as
long as at 540K; pass it through ``--common-flags`` to measure that regime. The model itself
(layers, widths, experts) stays the example's.

Every run also gets ``--lr-warmup-iters 0``: the example's 5 warm-up iterations must be shorter
than the run (the decay length), and the learning-rate schedule changes neither memory nor time.

Every job runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``--allocator-conf``;
an outer value never leaks in). SCO frees each boundary's block in the middle of the forward, and
with PyTorch's fixed-size segments those holes cannot hold the recompute's larger blocks: at
1,179,648 tokens a with-SCO job stopped with 10.2 GiB reserved but unallocated when a 13.4 GiB
block failed. The setting is the same for both variants and is recorded with each job.

Each finished job is recorded in the results directory (``<variant>_<length>_<n>it.trial.json``);
a later invocation with the same results directory, flags and allocator setting reuses those
records instead of running the jobs again, so a search cut off by a time limit continues where it
stopped.

The search assumes that a length that trains implies that every shorter one does (memory grows
with the length); if a failure is not monotone (a flake), the result is still a length that
trained next to one that failed, and every trial is in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]
for _path in (REPO_ROOT, REPO_ROOT / "tools"):  # the package, and the scripts of tools/
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from example_argv import example_argv  # noqa: E402
from stop_job import stop_job  # noqa: E402
from summarize_metrics import summarize_records  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "moe_small" / "train.sh"

RECOMPUTE_FLAGS = (
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
)
# The example warms the learning rate up over 5 iterations, which must be fewer than the run's.
SHORT_RUN_FLAGS = ("--lr-warmup-iters", "0")
DEFAULT_COMMON_FLAGS = "--ring-dtp --ring-dtp-chunk-tokens 4096"
VARIANTS = ("without_sco", "with_sco")
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
# SCO frees each boundary's block (N·H·b) in the middle of the forward; with the caching
# allocator's fixed segments those holes cannot serve the recompute's larger MoE blocks (at
# 1,179,648 tokens: 10.2 GiB reserved but unallocated when a 13.4 GiB block failed)
DEFAULT_ALLOCATOR_CONF = "expandable_segments:True"
# How torch reports an allocation the GPU cannot satisfy (torch.OutOfMemoryError and its text).
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
MiB = 2**20
GiB = 2**30
# PyTorch's CUDA OOM message: "Tried to allocate 14.11 GiB. ... Of the allocated memory 124.78 GiB
# is allocated by PyTorch"
_OOM_SIZES = re.compile(
    r"Tried to allocate ([\d.]+) ([KMG]i?B).*?Of the allocated memory ([\d.]+) ([KMG]i?B) is allocated"
)
_UNIT_GIB = {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "KB": 2**-20, "MB": 2**-10, "GB": 1.0}
# A host budget no configuration reaches: asks the budget to offload every boundary.
UNLIMITED_HOST_BYTES = 1 << 62
# A job that has logged every iteration gets this long to exit by itself before it is stopped:
# a 1,081,344-token job was still in teardown 12 s after its last iteration (why was not
# measured), and a search is after the length, not the exit.
TRAINED_EXIT_GRACE_S = 10.0
# How often a running job's metrics are read.
POLL_S = 2.0
# Each run gets the next of this many rendezvous ports, so a port the previous job left in
# TIME_WAIT is not reused at once.
PORTS_PER_SEARCH = 10


# ------------------------------------------------------------------------------------------------
# Pure logic: the search over lengths and the metrics summary (unit-tested on CPU)
# ------------------------------------------------------------------------------------------------


@dataclass
class SearchResult:
    """Outcome of :func:`longest_training_length`.

    ``longest``: the longest length that trained (0: not even one granule trained);
    ``shortest_failure``: the shortest length that failed (None when ``capped``);
    ``capped``: the maximum length trained, so the real limit may be higher;
    ``trials``: (length, trained) in the order they ran.
    """

    longest: int
    shortest_failure: Optional[int]
    capped: bool
    trials: List[Tuple[int, bool]] = field(default_factory=list)


def longest_training_length(
    trains: Callable[[int], bool],
    predicted: int,
    granularity: int,
    max_length: int,
    first_step_fraction: float = 0.125,
) -> SearchResult:
    """Largest multiple of ``granularity`` (at most ``max_length``) for which ``trains`` is true.

    Starts at ``predicted`` (rounded down to the granularity, at least one granule), then gallops:
    while lengths train it steps up, and while they fail it steps down, the step starting at
    ``first_step_fraction`` of the prediction and doubling every time, so a prediction that is off
    by any factor costs a logarithmic number of runs. Once one length trains and a longer one
    fails, bisection closes the gap. Each length is tried at most once.
    """
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    top = max_length // granularity
    if top < 1:
        raise ValueError(f"max_length {max_length} is shorter than one granule of {granularity}")
    trials: List[Tuple[int, bool]] = []

    def trains_at(index: int) -> bool:
        length = index * granularity
        trained = bool(trains(length))
        trials.append((length, trained))
        return trained

    start = min(max(1, predicted // granularity), top)
    step = max(1, int(start * first_step_fraction))
    if trains_at(start):
        trained, failed = start, None
        while failed is None:
            if trained == top:
                return SearchResult(top * granularity, None, True, trials)
            candidate = min(trained + step, top)
            if trains_at(candidate):
                trained = candidate
                step *= 2
            else:
                failed = candidate
    else:
        trained, failed = None, start
        while trained is None:
            if failed == 1:
                return SearchResult(0, granularity, False, trials)
            candidate = max(failed - step, 1)
            if trains_at(candidate):
                trained = candidate
            else:
                failed = candidate
                step *= 2
    while failed - trained > 1:
        middle = (trained + failed) // 2
        if trains_at(middle):
            trained = middle
        else:
            failed = middle
    return SearchResult(trained * granularity, failed * granularity, False, trials)


def read_metrics(path: Path) -> List[dict]:
    """The records of a ``--metrics-jsonl`` file (empty when the job wrote none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completed_training(records: List[dict], iterations: int) -> bool:
    """The run recorded ``iterations`` iterations, each with a finite loss."""
    if len(records) < iterations or records[-1].get("iteration") != iterations:
        return False
    losses = [record.get("lm_loss") for record in records]
    return all(loss is not None and math.isfinite(loss) for loss in losses)


def step_time_summary(records: List[dict]) -> dict:
    """Median ms/iteration over the log intervals after the first (the first carries warm-up;
    None when there is no other), the number of intervals it is taken over, and the peak
    allocated GiB over all intervals (``tools/summarize_metrics.summarize_records``)."""
    summary = summarize_records(records)
    steady = summary["steady_intervals"]
    return {
        "ms_per_iteration_median": summary["ms_per_iteration"] if steady else None,
        "intervals_in_median": steady,
        "peak_allocated_gib": summary["peak_allocated_gib"],
        "iterations": summary["last_iteration"] or 0,
    }


def classify_outcome(returncode: Optional[int], timed_out: bool, trained: bool, log_text: str) -> str:
    """``ok``, ``timeout``, ``oom`` or ``error`` for one finished (or stopped) job."""
    if timed_out:
        return "timeout"
    if returncode == 0 and trained:
        return "ok"
    if any(marker in log_text for marker in OOM_MARKERS):
        return "oom"
    return "error"


def oom_demand_gib(log_text: str) -> Optional[float]:
    """What the job asked for when it ran out of memory, at least: the largest (allocated +
    requested) GiB over the ranks' CUDA OOM messages in its log; None without one. A failed trial
    then still says how far over the GPU it was, which places the next trial."""
    demands = [
        float(requested) * _UNIT_GIB[requested_unit] + float(allocated) * _UNIT_GIB[allocated_unit]
        for requested, requested_unit, allocated, allocated_unit in _OOM_SIZES.findall(log_text)
    ]
    return round(max(demands), 2) if demands else None


def sco_budget_gb(boundary_bytes: int) -> float:
    """``--sco-host-budget-gb`` value (GiB) that holds ``boundary_bytes``: rounded up to a MiB, so
    the value is exact in binary and pretrain_gpt.py's int(G × 2³⁰) gives back at least that."""
    return math.ceil(boundary_bytes / MiB) * MiB / GiB


def step_time_comparison(without: dict, with_sco: dict) -> dict:
    """Ratios of the two timing runs' medians (None unless both trained and have one).

    ``step_time_ratio``: ms with SCO / ms without; ``throughput_ratio``: its inverse, the speed
    with SCO as a fraction of the speed without.
    """
    ms_without = without.get("ms_per_iteration_median")
    ms_with = with_sco.get("ms_per_iteration_median")
    both_trained = without.get("outcome") == "ok" and with_sco.get("outcome") == "ok"
    if not (both_trained and ms_without and ms_with):
        return {"step_time_ratio": None, "throughput_ratio": None}
    return {"step_time_ratio": ms_with / ms_without, "throughput_ratio": ms_without / ms_with}


def markdown_report(report: dict) -> str:
    """The search and timing results as two markdown tables and the ratio."""

    def fmt(value, spec=","):
        return "-" if value is None else format(value, spec)

    lines = [
        "| variant | budget's longest | longest that trained | shortest that failed (how) | runs |",
        "|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        variant = report["variants"].get(name)
        if variant is None:
            continue
        failure = variant["shortest_failure"]
        if variant["capped"]:
            failed = "none up to --max-seq-length"
        else:
            trial = next((t for t in variant["trials"] if t["seq_length"] == failure), {})
            how = trial.get("outcome", "?")
            if trial.get("oom_demand_gib") is not None:
                how += f", asked for ≥ {trial['oom_demand_gib']:.1f} GiB"
            failed = f"{fmt(failure)} ({how})"
        lines.append(
            f"| {name} | {fmt(variant['predicted_longest'])} | {fmt(variant['longest'])} | "
            f"{failed} | {len(variant['trials'])} |"
        )
    timing = report.get("timing")
    if timing:
        lines += [
            "",
            f"At {fmt(timing['seq_length'])} tokens, {timing['iterations']} iterations:",
            "",
            "| variant | outcome | ms/iteration (median) | peak allocated GiB |",
            "|---|---|---|---|",
        ]
        for name in VARIANTS:
            run = timing[name]
            lines.append(
                f"| {name} | {run['outcome']} | {fmt(run['ms_per_iteration_median'], ',.1f')} | "
                f"{fmt(run['peak_allocated_gib'], '.2f')} |"
            )
        lines += [
            "",
            f"step time with / without SCO: {fmt(timing['step_time_ratio'], '.3f')}; "
            f"throughput with / without: {fmt(timing['throughput_ratio'], '.3f')}",
        ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The budget's prediction, on the flags the example really passes
# ------------------------------------------------------------------------------------------------


def capture_example_argv(env: dict, flags: List[str]) -> List[str]:
    """The command line a ``DRY_RUN=1`` launch of the example hands to tools/memory_budget.py
    (``tools/memory_budget.py --world-size N <pretrain_gpt.py flags>``), so the budget sees
    exactly the flags the real runs get."""
    return example_argv(EXAMPLE, dict(env, DRY_RUN="1"), flags)


@contextlib.contextmanager
def _environment_restored(*names):
    """Upstream's argument validation reads the job's size from WORLD_SIZE/RANK, which the
    budget tool sets; put them back so later launches and callers do not inherit them."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def budget_config(budget_argv: List[str]):
    """``megatron.bounded.budget.BudgetConfig`` of a captured memory_budget.py command line."""
    import memory_budget  # tools/memory_budget.py (imports upstream's argument code)

    from megatron.bounded import budget

    options, training_flags = memory_budget.split_argv(budget_argv[1:])
    with _environment_restored("WORLD_SIZE", "RANK"):
        args = memory_budget.parse_training_args(training_flags, options.world_size)
    return budget.BudgetConfig.from_args(args)


def boundary_bytes(config, seq_length: int) -> int:
    """Bytes of all checkpoint boundaries of one micro-batch at ``seq_length``, as the budget
    sizes them: what it would put on the host if the host budget were unlimited."""
    from megatron.bounded import budget

    at = config.replace(seq_length=seq_length, sco_host_bytes=UNLIMITED_HOST_BYTES)
    return budget.estimate_config(at).host_terms.get("SCO boundaries", 0)


def predicted_longest(config, granularity: int, max_length: int, sco_host_bytes: int) -> int:
    """The budget's longest multiple of ``granularity`` that fits, with this SCO host budget."""
    from megatron.bounded import budget

    return budget.max_seq_length(
        config.replace(sco_host_bytes=sco_host_bytes), granularity=granularity, upper=max_length
    )


# ------------------------------------------------------------------------------------------------
# Real runs of the example
# ------------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One job of the example: its outcome, time, metrics summary and, if it failed, its log's end."""

    variant: str
    seq_length: int
    iterations: int
    outcome: str
    wall_s: float
    flags: List[str]
    summary: dict
    log_path: str
    last_lines: List[str] = field(default_factory=list)
    # the jobs' PYTORCH_CUDA_ALLOC_CONF ("": PyTorch's default; records made before this field
    # existed ran with the default)
    allocator_conf: str = ""
    # out of memory: allocated + requested GiB at the failure (the most over the ranks), at least
    oom_demand_gib: Optional[float] = None

    @property
    def trained(self) -> bool:
        return self.outcome == "ok"


class ExampleRunner:
    """Runs examples/moe_small/train.sh as subprocesses, one at a time."""

    def __init__(self, env: dict, results_dir: Path, num_gpus: int, global_batch: int,
                 master_port: int, tail_lines: int, allocator_conf: str = ""):
        self.env = {k: v for k, v in env.items() if k != ALLOC_CONF_VAR}
        if allocator_conf:
            self.env[ALLOC_CONF_VAR] = allocator_conf
        self.allocator_conf = allocator_conf
        self.results_dir = results_dir
        self.num_gpus = num_gpus
        self.global_batch = global_batch
        self.master_port = master_port
        self.tail_lines = tail_lines
        self.runs_started = 0

    def launch_env(self, seq_length: int, iterations: int) -> dict:
        return dict(
            self.env,
            NUM_GPUS=str(self.num_gpus), SEQ_LENGTH=str(seq_length), MICRO_BATCH_SIZE="1",
            GLOBAL_BATCH_SIZE=str(self.global_batch), TRAIN_ITERS=str(iterations),
            # the variants' flags as given: no fast path, no TensorBoard probe or logs
            FAST_PATH="0", TENSORBOARD_DIR="",
            # every iteration is its own interval: per-iteration times and peaks in the metrics
            LOG_INTERVAL="1",
            MASTER_PORT=str(self.master_port + self.runs_started % PORTS_PER_SEARCH),
            # a real launch, without checkpoints (saving would add time and disk to every trial)
            DRY_RUN="0", CHECKPOINT_DIR="",
        )

    def run(self, variant: str, seq_length: int, flags: List[str], iterations: int,
            timeout_s: float) -> RunRecord:
        name = f"{variant}_{seq_length}_{iterations}it"
        trial_path = self.results_dir / f"{name}.trial.json"
        if trial_path.exists():  # finished by an earlier invocation with these flags: reuse it
            saved = RunRecord(**json.loads(trial_path.read_text()))
            if saved.flags == flags and saved.allocator_conf == self.allocator_conf:
                print(f"[sco-longest] {variant}: seq {seq_length:,}: {saved.outcome} "
                      f"(reused {trial_path.name})", flush=True)
                return saved
        metrics = self.results_dir / f"{name}.metrics.jsonl"
        log_path = self.results_dir / f"{name}.log"
        metrics.unlink(missing_ok=True)  # the job appends to it
        env = self.launch_env(seq_length, iterations)
        self.runs_started += 1
        command = ["bash", str(EXAMPLE), *flags, "--metrics-jsonl", str(metrics)]
        print(f"[sco-longest] {variant}: seq {seq_length:,}, {iterations} iterations ...", flush=True)
        started = time.monotonic()
        timed_out = False
        with open(log_path, "w") as log:
            # its own session: on timeout the whole launcher (bash, torchrun) gets the signal
            job = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
            try:
                timed_out, stopped_after_training = _wait_for_job(job, metrics, iterations,
                                                                  started + timeout_s)
            except BaseException:  # Ctrl-C, or an outer time limit's SIGTERM (see main)
                stop_job(job)  # the job is in its own session: nothing else would stop it
                raise
        wall_s = time.monotonic() - started
        text = log_path.read_text(errors="replace")
        records = read_metrics(metrics)
        returncode = 0 if stopped_after_training else job.returncode
        outcome = classify_outcome(returncode, timed_out, completed_training(records, iterations), text)
        record = RunRecord(
            variant=variant, seq_length=seq_length, iterations=iterations, outcome=outcome,
            wall_s=round(wall_s, 1), flags=flags, summary=step_time_summary(records),
            log_path=str(log_path), allocator_conf=self.allocator_conf,
        )
        if not record.trained:
            record.last_lines = text.splitlines()[-self.tail_lines:]
            record.oom_demand_gib = oom_demand_gib(text)
        trial_path.write_text(json.dumps(asdict(record), indent=1) + "\n")
        print(f"[sco-longest] {variant}: seq {seq_length:,}: {outcome} ({wall_s:.0f} s)", flush=True)
        return record


def _wait_for_job(job: subprocess.Popen, metrics: Path, iterations: int,
                  deadline: float) -> Tuple[bool, bool]:
    """Waits for ``job`` to exit; (timed out, stopped after training).

    A job past ``deadline`` is stopped and timed out. A job whose metrics show every iteration
    trained gets TRAINED_EXIT_GRACE_S to exit, then is stopped: it has trained at its length."""
    trained_at = None
    while True:
        try:
            job.wait(timeout=POLL_S)
            return False, False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if trained_at is None and _trained_so_far(metrics, iterations):
            trained_at = now
        if trained_at is not None and now - trained_at >= TRAINED_EXIT_GRACE_S:
            stop_job(job)
            return False, True
        if now >= deadline:
            stop_job(job)
            return trained_at is None, trained_at is not None


def _trained_so_far(metrics: Path, iterations: int) -> bool:
    """completed_training on a file the job may be writing (a half-written line: not yet)."""
    try:
        return completed_training(read_metrics(metrics), iterations)
    except json.JSONDecodeError:
        return False


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------


def variant_flags(common: List[str], sco_gb: Optional[float]) -> List[str]:
    """pretrain_gpt.py flags of one variant (``sco_gb`` None: without SCO)."""
    flags = [*SHORT_RUN_FLAGS, *common, *RECOMPUTE_FLAGS]
    if sco_gb is not None:
        flags += ["--sco-host-budget-gb", repr(sco_gb)]
    return flags


def search_variant(runner: ExampleRunner, variant: str, flags_at: Callable[[int], List[str]],
                   prediction: int, args: argparse.Namespace) -> dict:
    """Real jobs of one variant, searched from the budget's prediction; its report entry."""
    runs: List[RunRecord] = []

    def trains(seq_length: int) -> bool:
        record = runner.run(variant, seq_length, flags_at(seq_length), args.iterations,
                            args.timeout_s)
        runs.append(record)
        return record.trained

    start = args.start_length or prediction
    search = longest_training_length(trains, start, args.granularity, args.max_seq_length,
                                     args.first_step_fraction)
    return {
        "predicted_longest": prediction,
        "search_start": start,
        "longest": search.longest,
        "shortest_failure": search.shortest_failure,
        "capped": search.capped,
        "trials": [_trial(record) for record in runs],
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="--common-flags takes one string; a single flag needs the '=' form "
        "(--common-flags=--ring-dtp), and --common-flags= runs the example's flags alone.",
    )
    parser.add_argument("--results-dir", type=Path, default=REPO_ROOT / "results" / "sco_longest_sequence",
                        help="folder for every run's log and metrics JSONL")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the JSON report here (default: <results-dir>/report.json)")
    parser.add_argument("--num-gpus", type=int, default=2, help="GPUs of the example (NUM_GPUS)")
    parser.add_argument("--global-batch-size", type=int, default=2,
                        help="fixed global batch (micro-batch 1), the same at every length")
    parser.add_argument("--granularity", type=int, default=4096,
                        help="lengths tried are multiples of this many tokens")
    parser.add_argument("--max-seq-length", type=int, default=2_097_152,
                        help="longest length the search may try")
    parser.add_argument("--iterations", type=int, default=3,
                        help="iterations a length must train to count as training")
    parser.add_argument("--timing-iterations", type=int, default=8,
                        help="iterations of each timing run at the longest length both variants "
                        "train (0: no timing runs)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="a search run still going after this many seconds counts as failed "
                        "(outcome 'timeout')")
    parser.add_argument("--timing-timeout-s", type=float, default=3600.0,
                        help="time limit of each timing run")
    parser.add_argument("--common-flags", default=DEFAULT_COMMON_FLAGS,
                        help="extra pretrain_gpt.py flags of both variants, one shell-quoted string "
                        f"(default: {DEFAULT_COMMON_FLAGS!r}; see the module docstring for why)")
    parser.add_argument("--sco-host-budget-gb", type=float, default=None,
                        help="fixed --sco-host-budget-gb (GiB) of the SCO variant; default: at "
                        "each length, enough for every checkpoint boundary the budget counts")
    parser.add_argument("--master-port", type=int, default=29820,
                        help=f"first rendezvous port; run i uses this + i mod {PORTS_PER_SEARCH}")
    parser.add_argument("--python", default=os.environ.get("PYTHON", sys.executable),
                        help="interpreter the example launches (its PYTHON; default: $PYTHON or "
                        "this one)")
    parser.add_argument("--tail-lines", type=int, default=30,
                        help="last lines of a failed run's log kept in the report")
    parser.add_argument("--start-routing-skew", type=float, default=None,
                        help="routing skew the budget assumes for the prediction that starts "
                        "the search (default: the flags' --budget-routing-skew, 2.0: with EP = 2 "
                        "every routed row on one rank). The jobs' flags do not change, so their "
                        "records are reused")
    parser.add_argument("--start-length", type=int, default=None,
                        help="start both searches at this length instead of at the budget's "
                        "prediction (e.g. next to the longest length recorded so far, when a "
                        "search continues from earlier records)")
    parser.add_argument("--allocator-conf", default=DEFAULT_ALLOCATOR_CONF,
                        help=f"{ALLOC_CONF_VAR} of every job, recorded with it (default: "
                        f"{DEFAULT_ALLOCATOR_CONF!r}; '' runs PyTorch's default allocator)")
    parser.add_argument("--first-step-fraction", type=float, default=0.125,
                        help="first gallop step as a fraction of the start length, doubling after; "
                        "0 steps one granule (when --start-length is already next to the limit, "
                        "each trial then moves by one granule)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="variants to search (default: both; the timing runs need both), "
                        "e.g. one per invocation when each has a time limit")
    parser.add_argument("--predict-only", action="store_true",
                        help="print the budget's predicted longest lengths and each variant's "
                        "flags, run nothing (works without GPUs)")
    return parser.parse_args(argv)


def _exit_on_sigterm(signum, frame):
    """SIGTERM (an outer ``timeout``) as an exception, so a running trial is stopped on the way
    out instead of being left holding the GPUs."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.start_length is not None and args.start_length < args.granularity:
        raise SystemExit(f"--start-length {args.start_length} is shorter than one granule "
                         f"(--granularity {args.granularity})")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    common = shlex.split(args.common_flags)
    base_env = dict(os.environ, PYTHON=args.python, FAST_PATH="0", TENSORBOARD_DIR="")
    # the budget is read from the example's flags at one granule; it varies the length itself
    budget_env = dict(base_env, NUM_GPUS=str(args.num_gpus), SEQ_LENGTH=str(args.granularity),
                      MICRO_BATCH_SIZE="1", GLOBAL_BATCH_SIZE=str(args.global_batch_size),
                      TRAIN_ITERS=str(args.iterations))
    config = budget_config(capture_example_argv(budget_env, variant_flags(common, None)))
    if args.start_routing_skew is not None:
        config = config.replace(routing_skew=args.start_routing_skew)

    def sco_gb_at(seq_length: int) -> float:
        if args.sco_host_budget_gb is not None:
            return args.sco_host_budget_gb
        return sco_budget_gb(boundary_bytes(config, seq_length))

    # with the default G every boundary is offloaded at any length: the budget's unlimited host
    sco_host_bytes = (UNLIMITED_HOST_BYTES if args.sco_host_budget_gb is None
                      else int(args.sco_host_budget_gb * GiB))
    predictions = {
        "without_sco": predicted_longest(config, args.granularity, args.max_seq_length, 0),
        "with_sco": predicted_longest(config, args.granularity, args.max_seq_length, sco_host_bytes),
    }

    def flags_of(variant: str, seq_length: int) -> List[str]:
        return variant_flags(common, sco_gb_at(seq_length) if variant == "with_sco" else None)

    if args.predict_only:
        for variant in VARIANTS:
            length = predictions[variant]
            print(f"{variant}: budget's longest {length:,} tokens; flags at that length: "
                  f"{shlex.join(flags_of(variant, max(length, args.granularity)))}")
        return 0

    args.results_dir.mkdir(parents=True, exist_ok=True)
    runner = ExampleRunner(base_env, args.results_dir, args.num_gpus, args.global_batch_size,
                           args.master_port, args.tail_lines, args.allocator_conf)
    report = {
        "settings": {
            "num_gpus": args.num_gpus, "global_batch_size": args.global_batch_size,
            "micro_batch_size": 1, "granularity": args.granularity,
            "max_seq_length": args.max_seq_length, "iterations": args.iterations,
            "timing_iterations": args.timing_iterations, "timeout_s": args.timeout_s,
            "timing_timeout_s": args.timing_timeout_s, "allocator_conf": args.allocator_conf,
            "common_flags": common, "recompute_flags": list(RECOMPUTE_FLAGS),
            "start_routing_skew": config.routing_skew,
            "sco_host_budget_gb": (
                "every boundary, per length" if args.sco_host_budget_gb is None
                else args.sco_host_budget_gb
            ),
        },
        "variants": {},
    }
    for variant in args.variants:
        report["variants"][variant] = search_variant(
            runner, variant, functools.partial(flags_of, variant), predictions[variant], args,
        )
    longest_both = min(report["variants"][v]["longest"] for v in args.variants)
    if longest_both and args.timing_iterations > 0 and len(args.variants) == len(VARIANTS):
        timing = {"seq_length": longest_both, "iterations": args.timing_iterations}
        for variant in VARIANTS:
            record = runner.run(variant, longest_both, flags_of(variant, longest_both),
                                args.timing_iterations, args.timing_timeout_s)
            timing[variant] = _trial(record)
        timing.update(step_time_comparison(timing["without_sco"], timing["with_sco"]))
        report["timing"] = timing
    out = args.out or args.results_dir / "report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_report(report))
    print(f"\nreport: {out}")
    return 0 if longest_both else 1


def _trial(record: RunRecord) -> dict:
    """The JSON form of one run."""
    trial = asdict(record)
    summary = trial.pop("summary")
    trial.update(summary)
    return trial


if __name__ == "__main__":
    sys.exit(main())
