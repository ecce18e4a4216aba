"""tools/summarize_metrics.py: per-run medians after the first interval, and ``--pool`` rows over
interleaved runs of one configuration (every figure by hand)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron.bounded.launch.commands import summarize_metrics as M
from tests.tool_modules import REPO_ROOT


def write_run(path, tflops, loss=1.0):
    """One record per log interval with the given TFLOP/s (ms and tokens/s derived from it)."""
    lines = [json.dumps({"iteration": 5 * (i + 1), "lm_loss": loss, "ms_per_iteration": 1e4 / t,
                         "tokens_per_s_per_gpu": 1000.0 * t, "tflops_per_gpu": t,
                         "peak_allocated_gib": 1.0 + i})
             for i, t in enumerate(tflops)]
    path.write_text("\n".join(lines) + "\n")


def test_run_median_leaves_the_first_interval_out(tmp_path):
    write_run(tmp_path / "a_1.jsonl", [10, 70, 80, 90])
    row = M.summarize(tmp_path / "a_1.jsonl")
    assert row["tflops_per_gpu"] == 80 and row["steady_intervals"] == 3
    assert row["peak_allocated_gib"] == 4.0 and row["iterations"] == "5-20"


def test_pool_takes_every_steady_interval_of_a_configurations_runs(tmp_path):
    write_run(tmp_path / "base_1.jsonl", [10, 60, 62])
    write_run(tmp_path / "base_2.jsonl", [10, 70, 90, 64])
    write_run(tmp_path / "new_1.jsonl", [10, 75])
    write_run(tmp_path / "other.jsonl", [10, 99])  # no round suffix: not pooled
    rows = {r["run"]: r for r in M.pooled(sorted(tmp_path.glob("*.jsonl")))}
    assert set(rows) == {"base (pooled, 2 runs)", "new (pooled, 1 runs)"}
    base = rows["base (pooled, 2 runs)"]
    assert base["tflops_per_gpu"] == 64  # median of 60, 62, 70, 90, 64
    assert base["iterations"] == "5 intervals" and base["first_loss"] is None
    assert rows["new (pooled, 1 runs)"]["tokens_per_s_per_gpu"] == pytest.approx(75000)


def test_pool_flag_adds_the_rows(tmp_path):
    write_run(tmp_path / "base_1.jsonl", [10, 60, 62])
    write_run(tmp_path / "base_2.jsonl", [10, 70])
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "summarize_metrics.py"),
                             *map(str, sorted(tmp_path.glob("*.jsonl"))), "--pool"],
                            capture_output=True, text=True, check=True)
    assert "| base (pooled, 2 runs) | 3 intervals | - → - |" in result.stdout
    assert "| 62.0 |" in result.stdout
