#!/usr/bin/env python3
"""This project's training path beside the tools a user would pick instead, on the same model,
weights, tokens, optimizer and precision: transformers' own Qwen3-MoE in a plain PyTorch loop
(short- and long-context settings), torchtitan's Qwen3 MoE, and ``pretrain_gpt.py`` through
``examples/moe_small/train.sh`` (docs/peers.md says what each runs).

    python tools/benchmarks/bench_peers.py make --preset small --work-dir W
    python tools/benchmarks/bench_peers.py run --system hf --seq-length 4096 --work-dir W/small \\
        --out R/records/small-hf-4096.json
    python tools/benchmarks/bench_peers.py grid --preset small --work-dir W --results-dir R \\
        --systems hf hf_long torchtitan ours --lengths 4096 32768 131072 longest
    python tools/benchmarks/bench_peers.py report --results-dir R --markdown R/summary.md \\
        --plot R/peers.svg --out R/summary.json

``make`` writes the preset's model, its import and the token stream (``peers.workload``);
``run`` trains one system at one length and writes its record (``--out``: system, settings, length,
micro-batch, tokens/s per GPU, peak allocated memory, per-step losses, versions, GPU, date,
commit, command); ``grid`` makes the workload and runs each system at each length in a process of
its own under a time limit (``longest``: the system's longest sequence to within 5%), keeping the
records so that a later call goes on where this one stopped; ``report`` writes the summary table
and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_common import REPO_ROOT, write_json

sys.path.insert(0, str(REPO_ROOT / "tools"))
from stop_job import run_logged  # noqa: E402

from peers import hf, longest, ours, report, titan, workload  # noqa: E402
from peers.training import record  # noqa: E402

SYSTEMS = (*hf.SYSTEMS, *titan.SYSTEMS, *ours.SYSTEMS)
DEFAULT_SYSTEMS = ("hf", "hf_long", "torchtitan", "ours")
DEFAULT_LENGTHS = ("4096", "32768", "131072", "longest")
ALLOCATOR = "expandable_segments:True"  # every system's allocator (the long-context recipes')
LEAST_RUN_S = 90  # a run is started only with this much of the time budget left
SEARCH_START = 4096  # where a longest-sequence search starts without a grid length to start from


def run_system(system: str, work: workload.Workload, seq_length: int, steps: int, warmup: int,
               device: str, scratch: Path) -> dict:
    """Train ``system`` at ``seq_length`` for ``steps`` steps; its record."""
    batch = workload.global_batch(seq_length)
    if system in ours.SYSTEMS:
        settings, measured = ours.run(work, seq_length, batch, steps, scratch)
    else:
        dataset = workload.training_dataset(work, seq_length, steps * batch)
        module = hf if system in hf.SYSTEMS else titan
        settings, measured = module.run(system, work, dataset, seq_length, batch, steps, device)
    settings["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return record(system, settings, work, seq_length, batch, steps, warmup, measured)


class Grid:
    """Runs of one preset, each in a process of its own, records kept in ``results_dir``."""

    def __init__(self, args, work: workload.Workload, deadline: float):
        self.args, self.work, self.deadline = args, work, deadline
        self.ports = iter(range(29600, 29900))

    def name(self, system: str, seq_length: int) -> str:
        return f"{self.args.preset}-{system}-{seq_length}"

    def probe(self, system: str, seq_length: int, steps: int):
        """The record of ``system`` at ``seq_length`` (run now unless kept); None when too little
        of the time budget is left to run it within the per-run limit."""
        path = self.args.results_dir / "records" / f"{self.name(system, seq_length)}.json"
        if path.exists():
            return json.loads(path.read_text())
        left = self.deadline - time.monotonic()
        if left < LEAST_RUN_S:
            return None
        limit = min(self.args.run_timeout_s, left)
        warmup = min(self.args.warmup, steps - 1)  # at least one step timed
        logs = self.args.results_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        script = Path(__file__).resolve().relative_to(REPO_ROOT)  # the run starts there
        command = [sys.executable, str(script), "run", "--system", system,
                   "--seq-length", str(seq_length), "--work-dir", str(self.work.directory),
                   "--steps", str(steps), "--warmup", str(warmup),
                   "--scratch", str(self.args.results_dir / "runs" / self.name(system, seq_length)),
                   "--out", str(path)]
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=ALLOCATOR, MASTER_PORT=str(next(self.ports)))
        print(f"[peers] {self.name(system, seq_length)}: running (limit {limit:.0f} s)", flush=True)
        log_path = logs / f"{self.name(system, seq_length)}.log"
        returncode = run_logged(command, log_path, limit, cwd=REPO_ROOT, env=env)
        if path.exists():
            found = json.loads(path.read_text())
        elif returncode is None and limit < self.args.run_timeout_s:
            return None  # cut by the budget, not by the run's limit: run again next call
        else:
            measured = {"outcome": "timeout" if returncode is None else "error",
                        "last_lines": log_path.read_text(errors="replace").splitlines()[-12:]}
            found = record(system, {}, self.work, seq_length, workload.global_batch(seq_length),
                           steps, warmup, measured)
            found["command"] = " ".join([Path(sys.executable).name, *command[1:]])
            write_json(path, found)
        print(f"[peers] {self.name(system, seq_length)}: {found['outcome']}", flush=True)
        return found

    def longest(self, system: str, lengths: list) -> dict:
        """The system's longest-sequence search, from the longest of ``lengths`` that trained."""
        path = self.args.results_dir / "longest" / f"{self.args.preset}-{system}.json"
        if path.exists() and json.loads(path.read_text())["finished"]:
            return json.loads(path.read_text())
        kept = [self.probe(system, n, self.args.steps) for n in lengths]
        trained = [n for n, r in zip(lengths, kept) if r is not None and r["outcome"] == "ok"]
        start = max(trained, default=min(lengths, default=SEARCH_START))
        found = longest.search(lambda n: self.probe(system, n, self.args.probe_steps), start)
        write_json(path, {"preset": self.args.preset, "system": system, **found})
        return found


def grid(args) -> int:
    deadline = time.monotonic() + args.time_budget_s
    work = workload.make(args.preset, args.work_dir / args.preset)
    runs = Grid(args, work, deadline)
    lengths = [int(n) for n in args.lengths if n != "longest"]
    for system in args.systems:
        for seq_length in lengths:
            if runs.probe(system, seq_length, args.steps) is None:
                print("[peers] time budget spent: call again to go on", flush=True)
                return 0
    if "longest" in args.lengths:
        for system in args.systems:
            if not runs.longest(system, lengths)["finished"]:
                print("[peers] time budget spent: call again to go on", flush=True)
                return 0
    print("[peers] grid complete", flush=True)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_peers.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="the preset's model, import and token stream")
    make.add_argument("--preset", choices=sorted(workload.PRESETS), default="small")
    make.add_argument("--work-dir", type=Path, required=True)
    one = commands.add_parser("run", help="one system at one length; its record to --out")
    one.add_argument("--system", choices=SYSTEMS, required=True)
    one.add_argument("--seq-length", type=int, required=True)
    one.add_argument("--work-dir", type=Path, required=True, help="a preset's directory (make)")
    one.add_argument("--steps", type=int, default=6)
    one.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    one.add_argument("--device", default=None, help="default: cuda when there is a GPU")
    one.add_argument("--scratch", type=Path, default=None, help="our run's log and metrics")
    one.add_argument("--out", type=Path, required=True)
    many = commands.add_parser("grid", help="every system at every length, under a time budget")
    many.add_argument("--preset", choices=sorted(workload.PRESETS), default="small")
    many.add_argument("--work-dir", type=Path, required=True)
    many.add_argument("--results-dir", type=Path, required=True)
    many.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS))
    many.add_argument("--lengths", nargs="+", default=list(DEFAULT_LENGTHS),
                      help="sequence lengths, and 'longest' for each system's longest")
    many.add_argument("--steps", type=int, default=6)
    many.add_argument("--warmup", type=int, default=2)
    many.add_argument("--probe-steps", type=int, default=2, help="steps of a longest-search run")
    many.add_argument("--run-timeout-s", type=float, default=420)
    many.add_argument("--time-budget-s", type=float, default=540,
                      help="start no run that the rest of this budget cannot hold")
    summary = commands.add_parser("report", help="the summary table and the plot")
    summary.add_argument("--results-dir", type=Path, required=True)
    summary.add_argument("--markdown", type=Path, default=None)
    summary.add_argument("--plot", type=Path, default=None, help="e.g. peers.svg (matplotlib)")
    summary.add_argument("--out", type=Path, default=None, help="every record and search as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "make":
        work = workload.make(args.preset, args.work_dir / args.preset)
        print(json.dumps(work.manifest, indent=1))
        return 0
    if args.command == "run":
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        found = run_system(args.system, workload.Workload(args.work_dir), args.seq_length,
                           args.steps, args.warmup, device, args.scratch or args.out.parent)
        write_json(args.out, found)
        return 0 if found["outcome"] in ("ok", "oom", "refused") else 1
    if args.command == "grid":
        return grid(args)
    report.write(args.results_dir, args.markdown, args.plot)
    if args.out:
        runs, searches = report.load(args.results_dir)
        write_json(args.out, {"runs": runs, "longest": searches})
    return 0


if __name__ == "__main__":
    sys.exit(main())
