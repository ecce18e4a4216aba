"""The summary of a results directory: one markdown table of every run (the columns of
docs/peers.md's results table, with the outcome and the first and last loss), the longest
sequence of each system, how far each system's losses are from ours on the same steps, and a plot
of tokens/s and peak memory against sequence length, one line per system (matplotlib; skipped,
saying so, where it is not installed)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_common import cell, markdown_table, write_text

RUN_HEADER = ("preset", "system", "seq", "outcome", "micro-batch", "tokens/s per GPU", "peak GiB",
              "first loss", "last loss", "date", "commit", "GPU", "command")
LONGEST_HEADER = ("preset", "system", "longest trained", "shortest not trained", "why",
                  "probes", "search")


def load(results_dir: Path) -> tuple:
    """(run records, longest-search results) stored under ``results_dir``."""
    runs = [json.loads(p.read_text()) for p in sorted((results_dir / "records").glob("*.json"))]
    longest = [json.loads(p.read_text()) for p in sorted((results_dir / "longest").glob("*.json"))]
    runs.sort(key=lambda r: (r["preset"], r["system"], r["seq_length"]))
    return runs, longest


def loss_gaps(runs: list) -> dict:
    """Per (preset, length, system): the largest |loss − ours| over the steps both ran, where
    ours ran at that length."""
    ours = {(r["preset"], r["seq_length"]): r["losses"] for r in runs
            if r["system"] == "ours" and r["losses"]}
    gaps = {}
    for r in runs:
        reference = ours.get((r["preset"], r["seq_length"]))
        if r["system"] != "ours" and reference and r["losses"]:
            gaps[(r["preset"], r["seq_length"], r["system"])] = max(
                abs(a - b) for a, b in zip(r["losses"], reference))
    return gaps


def markdown(runs: list, longest: list) -> str:
    rows = [[r["preset"], r["system"], f"{r['seq_length']:,}", r["outcome"],
             cell(r.get("micro_batch")), cell(r.get("tokens_per_s_per_gpu"), ",.0f"),
             cell(r.get("peak_gib"), ".2f"), cell((r["losses"] or [None])[0], ".4f"),
             cell((r["losses"] or [None])[-1], ".4f"), r["date"], r["commit"][:10], r["gpu"],
             f"`{r['command']}`"] for r in runs]
    text = markdown_table(RUN_HEADER, rows) + "\n"
    if longest:
        rows = [[s["preset"], s["system"], cell(s["longest"], ","), cell(s["shortest_failing"], ","),
                 cell(s["failing_outcome"]),
                 ", ".join(f"{p['seq_length']:,} {p['outcome']}" for p in s["probes"]),
                 "finished" if s["finished"] else "unfinished"] for s in longest]
        text += "\n" + markdown_table(LONGEST_HEADER, rows) + "\n"
    gaps = loss_gaps(runs)
    if gaps:
        rows = [[preset, f"{length:,}", system, f"{gap:.4f}"]
                for (preset, length, system), gap in sorted(gaps.items())]
        text += "\n" + markdown_table(("preset", "seq", "system", "largest |loss − ours|"),
                                      rows) + "\n"
    return text


def plot(runs: list, path: Path) -> bool:
    """Tokens/s per GPU and peak GiB against sequence length, one line per preset and system
    (trained runs); False (after saying so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report: matplotlib is not installed; no plot")
        return False
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = sorted({(r["preset"], r["system"]) for r in runs if r["outcome"] == "ok"})
    for preset, system in lines:
        points = [r for r in runs if (r["preset"], r["system"]) == (preset, system)
                  and r["outcome"] == "ok" and r["tokens_per_s_per_gpu"] is not None]
        lengths = [r["seq_length"] for r in points]
        label = f"{system} ({preset})"
        speed.plot(lengths, [r["tokens_per_s_per_gpu"] for r in points], marker="o", label=label)
        memory.plot(lengths, [r["peak_gib"] for r in points], marker="o", label=label)
    for axes, title in ((speed, "tokens/s per GPU"), (memory, "peak allocated GiB")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("sequence length (tokens)")
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
    speed.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    print(f"wrote {path}")
    return True


def write(results_dir: Path, markdown_path: Path = None, plot_path: Path = None) -> str:
    """Print the summary; write it and the plot where asked."""
    runs, longest = load(results_dir)
    text = markdown(runs, longest)
    print(text)
    if markdown_path:
        write_text(markdown_path, text)
    if plot_path:
        plot(runs, plot_path)
    return text
