"""``scripts/gpu_lanes.sh suite`` runs every GPU test: its lanes collect exactly the GPU-marked
tests of tests/unit and tests/functional, each once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _collected(paths: list[str]) -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *paths],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )
    return [line for line in completed.stdout.splitlines() if "::" in line]


def test_suite_lanes_cover_every_gpu_test_once():
    listed = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/gpu_lanes.sh"), "suite", "--list"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert len(listed) == 8
    per_lane = [_collected(lane.split("|")[0].split()) for lane in listed]
    in_lanes = [test for lane in per_lane for test in lane]
    assert all(per_lane), "a lane collects no test"
    assert len(in_lanes) == len(set(in_lanes)), "a test runs in two lanes"
    assert sorted(in_lanes) == sorted(_collected(["tests/unit", "tests/functional"]))
