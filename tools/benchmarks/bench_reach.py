#!/usr/bin/env python3
"""Context reach of the small example, operator by operator: peak memory against length, bytes
per token, the longest length that trains, and the launch-time budget against each measurement.

    python tools/benchmarks/bench_reach.py --results-dir results/reach \\
        --out docs/results/reach_1xh200.json --markdown docs/results/reach_1xh200.md \\
        [--variants plain ring_dtp ...] [--lengths plain=131072,262144 ...] [--snapshot] \\
        [--confirm] [--layers plain=8 ...] [--jobs 2] [--report-only]

A cumulative ladder of variants of ``examples/moe_small/train.sh`` (one sequence per GPU, one
iteration, full recompute of every layer, cuDNN attention, expandable allocator segments):

* ``plain``: upstream's MoE dispatcher and experts (``--bounded-moe-backend upstream``) and
  upstream's output layer with its cross entropy;
* ``ring_dtp``: + Ring-DTP in 4,096-token chunks;
* ``pipelined_llep``: + PipelinedLLEP with a 16,384-token budget (torch-native experts);
* ``sco``: + SCO with a host budget that holds every checkpoint boundary of the length;
* ``offload_stream``: + OffloadStreamAdamW: all four operators;
* ``chunked``: + chunked recompute of each layer's MLP block in 16,384-token chunks;
* ``chunked_attention``: + the attention sublayer recomputed in the same chunks
  (``--chunked-recompute-attention``).

Each job's outcome (trained, out of memory, timeout, error), peak allocated and reserved memory
(``--metrics-jsonl``), and the iteration time upstream logs are kept in
``<results-dir>/<variant>_<layers>L_<length>.trial.json`` and reused by later invocations with the
same flags, so a ladder can be measured over several calls. With ``--snapshot`` a job records the
allocator's history (upstream's ``--record-memory-history``) and the trial keeps the live set at
its peak by owner (``megatron.bounded.budget.memory_snapshot``); the pickle itself is deleted.

The report fits peak allocated against length per variant and layer count (bytes per token and
intercept, least squares over the trained points), predicts the longest length whose peak fits
``--capacity-gib`` (default: the GPU's memory less 2 GiB of CUDA context and allocator slack,
rounded down to ``--granularity``), and compares every trained point with the launch-time budget
of the same flags (``megatron.bounded.budget``, evaluated when the report is written, so a
recalibrated budget is checked against the stored measurements). ``--confirm`` runs each
variant at its predicted longest length and one granule above; a variant given a smaller
``--confirm-layers`` count is confirmed with that many layers (attention's time grows with the
square of the length), and its slope is compared with the full model's. With
``--gpu-memory-gib G`` (or ``VARIANT=G``) each job's allocator may hold at most G GiB of each GPU
(``per_process_memory_fraction``; its trials are named ``..._GGiB``), and the prediction and
``--confirm`` are for that memory less the same slack: a predicted longest length is confirmed at
a size whose iteration fits a run, and held jobs can share one GPU (``--jobs``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]
# tools/ for its scripts, and this directory for bench_common also when the functional tests
# load this file as a module
for _path in (REPO_ROOT / "tools", Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_common import cell, markdown_table, write_json, write_text  # noqa: E402
from stop_job import run_logged  # noqa: E402

from megatron.bounded.budget.memory_snapshot import linear_fit  # noqa: E402
from megatron.bounded.units import GiB, ceil_div  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "moe_small" / "train.sh"
EXAMPLE_LAYERS = 8
VARIANTS = ("plain", "ring_dtp", "pipelined_llep", "sco", "offload_stream", "chunked",
            "chunked_attention")
COMMON_FLAGS = (
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--attention-backend", "fused",
    # one iteration: no warm-up schedule; the budget is what is measured, not what refuses
    "--lr-warmup-iters", "0", "--memory-budget-check", "off",
)
RING_DTP_FLAGS = ("--ring-dtp", "--ring-dtp-chunk-tokens", "4096")
PIPELINED_LLEP_FLAGS = ("--pipelined-llep", "--pipelined-llep-token-budget", "16384")
CHUNKED_RECOMPUTE_FLAGS = ("--chunked-recompute-tokens", "16384")
ALLOCATOR_CONF = "expandable_segments:True"
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
DEFAULT_GRANULARITY = 65536
SLACK_GIB = 2.0  # CUDA context and allocator slack left out of a GPU's memory for the prediction
HIDDEN_BYTES_PER_TOKEN = 1024 * 2  # the example's N·H·b per checkpoint boundary and token


def variant_flags(variant: str, seq_length: int, layers: int) -> List[str]:
    """pretrain_gpt.py flags of ``variant`` (cumulative ladder) at ``seq_length``."""
    rank = VARIANTS.index(variant)
    flags = [*COMMON_FLAGS, "--num-layers", str(layers)]
    flags += ["--bounded-moe-backend", "upstream" if rank < 2 else "auto"]
    if rank >= 1:
        flags += RING_DTP_FLAGS
    if rank >= 2:
        flags += PIPELINED_LLEP_FLAGS
    if rank >= 3:
        # every boundary of the length, rounded up to a GiB
        boundaries = layers * seq_length * HIDDEN_BYTES_PER_TOKEN
        flags += ["--sco-host-budget-gb", str(ceil_div(boundaries, GiB))]
    if rank >= 4:
        flags += ["--offload-stream-optimizer"]
    if rank >= 5:
        flags += CHUNKED_RECOMPUTE_FLAGS
    if rank >= 6:
        flags += ["--chunked-recompute-attention"]
    return flags


@dataclass
class Trial:
    variant: str
    layers: int
    seq_length: int
    num_gpus: int
    flags: List[str]
    outcome: str  # ok | oom | timeout | error
    wall_s: float
    peak_allocated_gib: Optional[float] = None
    peak_reserved_gib: Optional[float] = None
    iteration_s: Optional[float] = None
    concurrent: bool = False  # shared the GPU with another job: its time is not a step time
    last_lines: List[str] = field(default_factory=list)
    peak_owners: Dict[str, int] = field(default_factory=dict)  # bytes by owner (--snapshot)
    peak_reached_by: str = ""
    gpu_memory_gib: Optional[float] = None  # the job's allocator held to this many GiB per GPU

    @property
    def trained(self) -> bool:
        return self.outcome == "ok"

    @property
    def name(self) -> str:
        return trial_name(self.variant, self.layers, self.seq_length, self.gpu_memory_gib)


def trial_name(variant: str, layers: int, seq_length: int,
               gpu_memory_gib: Optional[float] = None) -> str:
    cap = f"_{gpu_memory_gib:g}GiB" if gpu_memory_gib else ""
    return f"{variant}_{layers}L_{seq_length}{cap}"


def _read_metrics(path: Path) -> List[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def classify(returncode: Optional[int], trained: bool, log_text: str) -> str:
    if trained and returncode in (0, None):
        return "ok"
    if any(marker in log_text for marker in OOM_MARKERS):
        return "oom"
    if returncode is None:
        return "timeout"
    return "error"


def allocator_conf(gpu_memory_gib: Optional[float], total_gib: Optional[float]) -> str:
    """The jobs' ``PYTORCH_CUDA_ALLOC_CONF``: expandable segments, and with ``gpu_memory_gib`` the
    allocator held to that many GiB of a ``total_gib`` GPU (what it asks beyond is an out of
    memory, as on a GPU of that size; the CUDA context is not counted)."""
    if not gpu_memory_gib:
        return ALLOCATOR_CONF
    if not total_gib or gpu_memory_gib > total_gib:
        raise SystemExit(f"bench_reach: --gpu-memory-gib {gpu_memory_gib:g} needs a GPU of at "
                         f"least that many GiB (found {total_gib or 0:.1f})")
    return f"{ALLOCATOR_CONF},per_process_memory_fraction:{gpu_memory_gib / total_gib:.6f}"


class Runner:
    def __init__(self, results_dir: Path, num_gpus: int, timeout_s: float, base_port: int,
                 total_gib: Optional[float] = None):
        self.results_dir = results_dir
        self.num_gpus = num_gpus
        self.timeout_s = timeout_s
        self.base_port = base_port
        self.total_gib = total_gib  # the GPU's memory, for jobs held to less
        self.ports = itertools.count()  # next() is atomic: concurrent jobs get distinct ports

    def trial_path(self, variant: str, layers: int, seq_length: int,
                   gpu_memory_gib: Optional[float] = None) -> Path:
        name = trial_name(variant, layers, seq_length, gpu_memory_gib)
        return self.results_dir / f"{name}.trial.json"

    def cached(self, variant: str, layers: int, seq_length: int,
               gpu_memory_gib: Optional[float] = None) -> Optional[Trial]:
        path = self.trial_path(variant, layers, seq_length, gpu_memory_gib)
        if not path.exists():
            return None
        trial = Trial(**json.loads(path.read_text()))
        same = trial.flags == variant_flags(variant, seq_length, layers)
        return trial if same and trial.num_gpus == self.num_gpus else None

    def run(self, variant: str, layers: int, seq_length: int, snapshot: bool,
            concurrent: bool, gpu_memory_gib: Optional[float] = None) -> Trial:
        found = self.cached(variant, layers, seq_length, gpu_memory_gib)
        if found is not None and (found.peak_owners or not snapshot):
            print(f"[reach] {found.name}: {found.outcome} (reused)", flush=True)
            return found
        name = trial_name(variant, layers, seq_length, gpu_memory_gib)
        metrics = self.results_dir / f"{name}.metrics.jsonl"
        log_path = self.results_dir / f"{name}.log"
        pickle_path = self.results_dir / f"{name}.snapshot.pickle"
        metrics.unlink(missing_ok=True)
        flags = variant_flags(variant, seq_length, layers)
        extra = ["--metrics-jsonl", str(metrics)]
        if snapshot:
            extra += ["--record-memory-history", "--memory-snapshot-path", str(pickle_path)]
        env = dict(
            os.environ, NUM_GPUS=str(self.num_gpus), SEQ_LENGTH=str(seq_length),
            MICRO_BATCH_SIZE="1", GLOBAL_BATCH_SIZE=str(self.num_gpus), TRAIN_ITERS="1",
            LOG_INTERVAL="1", DRY_RUN="0", CHECKPOINT_DIR="", PLAN="off", TENSORBOARD_DIR="",
            MASTER_PORT=str(self.base_port + next(self.ports) % 50),
            PYTORCH_CUDA_ALLOC_CONF=allocator_conf(gpu_memory_gib, self.total_gib),
        )
        print(f"[reach] {name}: running ...", flush=True)
        start = time.monotonic()
        returncode = run_logged(["bash", str(EXAMPLE), *flags, *extra], log_path, self.timeout_s,
                                cwd=REPO_ROOT, env=env)
        wall = time.monotonic() - start
        text = log_path.read_text(errors="replace")
        records = _read_metrics(metrics)
        peak_alloc = next((r["peak_allocated_gib"] for r in records
                           if r.get("peak_allocated_gib") is not None), None)
        peak_reserved = next((r["peak_reserved_gib"] for r in records
                              if r.get("peak_reserved_gib") is not None), None)
        times = _ITERATION_MS.findall(text)
        trained = bool(records) and all(r.get("lm_loss") is not None and
                                        math.isfinite(r["lm_loss"]) for r in records)
        trial = Trial(
            variant=variant, layers=layers, seq_length=seq_length, num_gpus=self.num_gpus,
            flags=flags, outcome=classify(returncode, trained, text), wall_s=round(wall, 1),
            peak_allocated_gib=peak_alloc, peak_reserved_gib=peak_reserved,
            iteration_s=float(times[-1]) / 1e3 if times else None, concurrent=concurrent,
            gpu_memory_gib=gpu_memory_gib,
        )
        if not trial.trained:
            trial.last_lines = text.splitlines()[-12:]
        if snapshot and pickle_path.exists():
            from megatron.bounded.budget.memory_snapshot import load_snapshot, peak_live_set

            live = peak_live_set(load_snapshot(pickle_path))
            trial.peak_owners = dict(sorted(live.by_owner.items(), key=lambda kv: -kv[1]))
            trial.peak_reached_by = live.peak_owner
            pickle_path.unlink()
        self.trial_path(variant, layers, seq_length, gpu_memory_gib).write_text(
            json.dumps(asdict(trial), indent=1) + "\n")
        print(f"[reach] {name}: {trial.outcome}, peak {peak_alloc} GiB, {wall:.0f} s", flush=True)
        return trial


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def usable_gib(gpu_memory_gib: Optional[float], capacity_gib: float) -> float:
    """The memory a prediction is for: the held memory less the slack, or the whole GPU's
    ``capacity_gib`` (already less the slack)."""
    return gpu_memory_gib - SLACK_GIB if gpu_memory_gib else capacity_gib


def load_trials(results_dir: Path) -> List[Trial]:
    return [Trial(**json.loads(p.read_text())) for p in sorted(results_dir.glob("*.trial.json"))]


def predicted_longest(fit: Tuple[float, float], capacity_bytes: float, granularity: int) -> int:
    slope, intercept = fit
    if slope <= 0:
        return 0
    return int((capacity_bytes - intercept) / slope) // granularity * granularity


def budget_peak_gib(trial: Trial) -> float:
    """The launch-time budget's predicted peak allocated for the trial's flags, GiB: its first
    iteration's, since a trial runs one."""
    budget = budget_of(trial)
    first = budget.details.get("first_iteration_peak")
    return (budget.peak_allocated if first is None else first) / GiB


def budget_of(trial: Trial):
    """The launch-time budget of the trial's flags (on the CPU)."""
    from example_argv import example_argv

    from megatron.bounded import budget as B
    from megatron.bounded.launch.commands.memory_budget import parse_training_args

    env = dict(os.environ, NUM_GPUS=str(trial.num_gpus), SEQ_LENGTH=str(trial.seq_length),
               MICRO_BATCH_SIZE="1", GLOBAL_BATCH_SIZE=str(trial.num_gpus), TRAIN_ITERS="1",
               LOG_INTERVAL="1", DRY_RUN="1", CHECKPOINT_DIR="", PLAN="off", TENSORBOARD_DIR="")
    argv = example_argv(EXAMPLE, env, trial.flags)
    rest = argv[next(i for i, a in enumerate(argv) if a.endswith("memory_budget.py")) + 1:]
    if rest[:1] == ["--world-size"]:
        rest = rest[2:]
    args, settings, _ = parse_training_args(rest, trial.num_gpus)
    return B.estimate(args, settings)


def build_report(trials: List[Trial], capacity_gib: float, granularity: Dict[str, int],
                 with_budget: bool) -> dict:
    """Per variant, layer count and GPU memory (whole, or held to ``gpu_memory_gib``): the fit of
    peak allocated against length over every trained point of the variant and layer count (the
    peak does not depend on the memory left free), the predicted longest length for that GPU
    memory (``capacity_gib``, or the held memory less the same slack) in the variant's
    ``granularity``, the points."""
    report = {"capacity_gib": capacity_gib, "variants": {}}
    groups: Dict[Tuple[str, int, float], List[Trial]] = {}
    for trial in trials:
        groups.setdefault((trial.variant, trial.layers, trial.gpu_memory_gib or 0.0),
                          []).append(trial)
    for (variant, layers, cap), group in sorted(
            groups.items(), key=lambda kv: (VARIANTS.index(kv[0][0]), -kv[0][1], kv[0][2])):
        group.sort(key=lambda t: t.seq_length)
        fit = linear_fit(trained_points(trials, variant, layers))
        rows = []
        for t in group:
            row = {"seq_length": t.seq_length, "outcome": t.outcome,
                   "peak_allocated_gib": t.peak_allocated_gib,
                   "peak_reserved_gib": t.peak_reserved_gib,
                   "iteration_s": None if t.concurrent else t.iteration_s}
            if with_budget and t.trained and t.peak_allocated_gib:
                predicted = budget_peak_gib(t)
                row["budget_peak_gib"] = round(predicted, 3)
                row["budget_ratio"] = round(predicted / t.peak_allocated_gib, 3)
            rows.append(row)
        entry = {"layers": layers, "gpu_memory_gib": cap or None,
                 "granularity": granularity[variant], "points": rows}
        if fit is not None:
            entry["bytes_per_token"] = round(fit[0], 1)
            entry["intercept_gib"] = round(fit[1] / GiB, 3)
            entry["predicted_longest"] = predicted_longest(
                fit, usable_gib(cap, capacity_gib) * GiB, granularity[variant])
        trained = [t.seq_length for t in group if t.trained]
        failed = [t.seq_length for t in group if t.outcome == "oom"]
        entry["longest_trained"] = max(trained) if trained else None
        entry["shortest_oom"] = min(failed) if failed else None
        report["variants"][report_key(variant, layers, cap)] = entry
    return report


def trained_points(trials: List[Trial], variant: str, layers: int) -> List[Tuple[int, float]]:
    """(length, peak allocated bytes) of the variant's trained trials with ``layers`` layers."""
    return [(t.seq_length, t.peak_allocated_gib * GiB) for t in trials
            if t.variant == variant and t.layers == layers and t.trained
            and t.peak_allocated_gib is not None]


def report_key(variant: str, layers: int, gpu_memory_gib: Optional[float] = None) -> str:
    return f"{variant}/{layers}L" + (f"/{gpu_memory_gib:g}GiB" if gpu_memory_gib else "")


def _layers_cell(entry: dict) -> str:
    cap = entry.get("gpu_memory_gib")
    return f"{entry['layers']}" + (f" ({cap:g} GiB GPU)" if cap else "")


FIT_HEADER = ("variant", "layers", "bytes/token", "intercept GiB", "predicted longest",
              "longest trained", "shortest OOM")
POINT_HEADER = ("variant", "layers", "tokens", "outcome", "peak allocated GiB",
                "peak reserved GiB", "budget GiB", "budget / measured", "iteration s")


def markdown(report: dict) -> str:
    """Two tables: the fit per variant and layer count, and every measured point."""
    fits, points = [], []
    for key, entry in report["variants"].items():
        variant, layers = key.split("/")[0], _layers_cell(entry)
        bpt = entry.get("bytes_per_token")
        fit = ([f"{bpt:,.0f}", entry.get("intercept_gib", "–"),
                f"{entry.get('predicted_longest', 0):,}"] if bpt is not None else ["–"] * 3)
        fits.append([variant, layers, *fit, entry["longest_trained"] or "–",
                     entry["shortest_oom"] or "–"])
        for row in entry["points"]:
            points.append([
                variant, layers, f"{row['seq_length']:,}", row["outcome"],
                cell(row["peak_allocated_gib"], ".2f", "–"), cell(row["peak_reserved_gib"], ".2f", "–"),
                cell(row.get("budget_peak_gib"), ".2f", "–"), cell(row.get("budget_ratio"), ".3f", "–"),
                cell(row["iteration_s"], ".1f", "–"),
            ])
    return markdown_table(FIT_HEADER, fits) + "\n\n" + markdown_table(POINT_HEADER, points) + "\n"


def _parse_map(items: List[str], cast) -> Dict[str, object]:
    out = {}
    for item in items or ():
        key, _, value = item.partition("=")
        if key not in VARIANTS:
            raise SystemExit(f"bench_reach: unknown variant {key!r} (choose from {VARIANTS})")
        out[key] = cast(value)
    return out


def _per_variant(items: List[str], cast, default) -> Dict[str, object]:
    """``V`` (every variant) or ``VARIANT=V`` entries, later ones winning, as a value per variant."""
    everyone = [item for item in items or () if "=" not in item]
    base = cast(everyone[-1]) if everyone else default
    return {**{v: base for v in VARIANTS},
            **_parse_map([item for item in items or () if "=" in item], cast)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None, help="report JSON")
    p.add_argument("--markdown", type=Path, default=None, help="report table")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--lengths", nargs="*", default=[],
                   help="VARIANT=L1,L2,... lengths to measure (tokens per GPU)")
    p.add_argument("--layers", nargs="*", default=[],
                   help=f"VARIANT=K: measure with K layers (default {EXAMPLE_LAYERS})")
    p.add_argument("--snapshot", action="store_true", help="record the live set at the peak")
    p.add_argument("--jobs", type=int, default=1,
                   help="jobs at once on the GPU(s): for memory only (times are then not kept)")
    p.add_argument("--confirm", action="store_true",
                   help="run each variant at its predicted longest length and one granule above")
    p.add_argument("--confirm-layers", nargs="*", default=[],
                   help="VARIANT=K: confirm with K layers")
    p.add_argument("--granularity", nargs="*", default=[],
                   help="N or VARIANT=N: predicted lengths are multiples of N tokens, and "
                   f"--confirm's step above is N more (default {DEFAULT_GRANULARITY})")
    p.add_argument("--capacity-gib", type=float, default=None)
    p.add_argument("--gpu-memory-gib", nargs="*", default=[],
                   help="G or VARIANT=G: hold each job's allocator to G GiB of each GPU, and "
                   "predict and --confirm for that memory less the slack: a predicted longest "
                   "length confirmed where the whole GPU's would take too long to run")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=540)
    p.add_argument("--base-port", type=int, default=29700)
    p.add_argument("--report-only", action="store_true", help="no jobs: report stored trials")
    p.add_argument("--no-budget", action="store_true", help="leave the budget comparison out")
    return p.parse_args(argv)


def device_total_gib() -> Optional[float]:
    """The first GPU's memory, GiB (None without a GPU)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GiB
    except Exception:
        pass
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    lengths = _parse_map(args.lengths, lambda v: [int(x) for x in v.split(",") if x])
    layers = _parse_map(args.layers, int)
    confirm_layers = _parse_map(args.confirm_layers, int)
    held = _per_variant(args.gpu_memory_gib, float, None)
    granularity = _per_variant(args.granularity, int, DEFAULT_GRANULARITY)
    total = device_total_gib()
    runner = Runner(args.results_dir, args.num_gpus, args.timeout_s, args.base_port, total)
    capacity = args.capacity_gib or (total - SLACK_GIB if total else 138.0)

    def run_all(work, snapshot: bool):
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(lambda w: runner.run(*w, snapshot=snapshot, concurrent=args.jobs > 1,
                                                gpu_memory_gib=held[w[0]]), work))

    if not args.report_only:
        # the longest first when sharing the GPU: the pair that fits memory is then decided early
        run_all([(v, layers.get(v, EXAMPLE_LAYERS), n) for v in args.variants
                 for n in lengths.get(v, [])], args.snapshot)
    trials = load_trials(args.results_dir)
    if args.confirm and not args.report_only:
        work = []
        for variant in args.variants:
            measured = layers.get(variant, EXAMPLE_LAYERS)
            fit = linear_fit(trained_points(trials, variant, measured))
            step = granularity[variant]
            usable = usable_gib(held[variant], capacity) * GiB
            target = predicted_longest(fit, usable, step) if fit else 0
            if target > 0:
                k = confirm_layers.get(variant, measured)
                work += [(variant, k, target), (variant, k, target + step)]
        run_all(work, snapshot=False)
        trials = load_trials(args.results_dir)
    report = build_report(trials, capacity, granularity, with_budget=not args.no_budget)
    text = markdown(report)
    print(text)
    if args.out:
        write_json(args.out, report, indent=1)
    if args.markdown:
        write_text(args.markdown, text)
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through Runner.run, which stops the job it runs


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
