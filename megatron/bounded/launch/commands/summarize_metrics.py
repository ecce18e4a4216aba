"""Summarize ``--metrics-jsonl`` files of training runs as a markdown table.

    bounded-summarize-metrics results/*.metrics.jsonl [--json summary.json] [--pool]
    python tools/summarize_metrics.py ...   (the same, from a clone without installing it)

Per run: iterations, first and last loss, and the steady-state throughput — the median over the
logged intervals after the first one (the first interval includes warm-up) of ms/iteration,
tokens/s/GPU and TFLOP/s/GPU — and the largest peak allocated memory (max over ranks).

``--pool`` adds one row per configuration run in interleaved rounds (runs named ``NAME_1``,
``NAME_2``, ...): the medians over the steady intervals of all its runs. Where the host's speed
drifts within a call, only configurations alternated in one call and pooled compare fairly.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize_records(records: list[dict], warm_up_intervals: int = 1) -> dict:
    """Throughput medians over the logged intervals after the first ``warm_up_intervals`` (only
    over those when there is no other: ``steady_intervals`` says how many the medians are over,
    0 then), the largest peak allocated memory over all intervals, first and last loss and
    iteration."""
    intervals = [r for r in records if r.get("ms_per_iteration") is not None]
    steady = intervals[warm_up_intervals:]

    def median(key):
        values = [r[key] for r in (steady or intervals) if r.get(key) is not None]
        return statistics.median(values) if values else None

    peaks = [r["peak_allocated_gib"] for r in records if r.get("peak_allocated_gib") is not None]
    return {
        "first_iteration": records[0]["iteration"] if records else None,
        "last_iteration": records[-1]["iteration"] if records else None,
        "first_loss": records[0]["lm_loss"] if records else None,
        "last_loss": records[-1]["lm_loss"] if records else None,
        "ms_per_iteration": median("ms_per_iteration"),
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
        "tflops_per_gpu": median("tflops_per_gpu"),
        "steady_intervals": len(steady),
        "peak_allocated_gib": max(peaks) if peaks else None,
    }


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pooled(paths: list[Path]) -> list[dict]:
    """One row per ``NAME`` of runs ``NAME_<round>``: throughput medians over the steady
    intervals of all its runs (each run's first interval left out), the largest peak."""
    groups: dict = {}
    for path in paths:
        name = path.name.removesuffix(".metrics.jsonl").removesuffix(".jsonl")
        prefix, _, round_ = name.rpartition("_")
        if prefix and round_.isdigit():
            groups.setdefault(prefix, []).append(path)
    rows = []
    for prefix, members in sorted(groups.items()):
        steady = []
        for path in members:
            intervals = [r for r in read_records(path) if r.get("ms_per_iteration") is not None]
            steady += intervals[1:]
        summary = summarize_records(steady, warm_up_intervals=0)
        rows.append({"run": f"{prefix} (pooled, {len(members)} runs)",
                     "iterations": f"{summary['steady_intervals']} intervals",
                     **{k: v for k, v in summary.items()
                        if k not in ("first_iteration", "last_iteration")},
                     "first_loss": None, "last_loss": None})
    return rows


def summarize(path: Path) -> dict:
    records = read_records(path)
    summary = summarize_records(records)
    first, last = summary.pop("first_iteration"), summary.pop("last_iteration")
    return {
        "run": path.name.removesuffix(".metrics.jsonl"),
        "iterations": f"{first}-{last}" if records else "-",
        **summary,
    }


def markdown_table(rows: list[dict]) -> str:
    header = "| run | iterations | loss first → last | ms/iter | tokens/s/GPU | TFLOP/s/GPU | peak GiB |"
    lines = [header, "|---|---|---|---|---|---|---|"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    for row in rows:
        lines.append(
            f"| {row['run']} | {row['iterations']} | {fmt(row['first_loss'], '.3f')} → "
            f"{fmt(row['last_loss'], '.3f')} | {fmt(row['ms_per_iteration'], '.1f')} | "
            f"{fmt(row['tokens_per_s_per_gpu'], ',.0f')} | {fmt(row['tflops_per_gpu'], '.1f')} | "
            f"{fmt(row['peak_allocated_gib'], '.2f')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--pool", action="store_true",
                        help="add a row per NAME pooling the runs NAME_1, NAME_2, ...")
    args = parser.parse_args(argv)
    rows = [summarize(path) for path in sorted(args.metrics)]
    if args.pool:
        rows += pooled(sorted(args.metrics))
    print(markdown_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
