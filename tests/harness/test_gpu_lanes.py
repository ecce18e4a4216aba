"""``scripts/gpu_lanes.sh suite`` runs every GPU test: its lanes collect exactly the GPU-marked
tests of tests/unit and tests/functional, each once; ``--part K/N`` splits the lanes in order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# One process collects every lane and the whole test tree (imports are paid once).
_COLLECT = """
import json, sys
import pytest

class Items:
    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

result = []
for paths in json.loads(sys.argv[1]):
    items = Items()
    pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *paths], plugins=[items])
    result.append(items.ids)
print("LANES=" + json.dumps(result))
"""


def test_suite_lanes_cover_every_gpu_test_once():
    listed = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/gpu_lanes.sh"), "suite", "--list"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert len(listed) == 11
    lanes = [lane.split("|")[0].split() for lane in listed]
    collected = subprocess.run(
        [sys.executable, "-c", _COLLECT, json.dumps(lanes + [["tests/unit", "tests/functional"]])],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout
    *per_lane, everything = json.loads(collected.split("LANES=")[-1])
    in_lanes = [test for lane in per_lane for test in lane]
    assert all(per_lane), "a lane collects no test"
    assert len(in_lanes) == len(set(in_lanes)), "a test runs in two lanes"
    assert everything and sorted(in_lanes) == sorted(everything)


def _suite(*options):
    return subprocess.run(["bash", str(REPO_ROOT / "scripts/gpu_lanes.sh"), "suite", *options],
                          capture_output=True, text=True)


def test_suite_parts_split_the_lanes_in_order():
    whole = _suite("--list").stdout.splitlines()
    for n in (1, 2, 3):
        parts = [_suite("--part", f"{k}/{n}", "--list").stdout.splitlines() for k in range(1, n + 1)]
        assert all(parts) and [lane for part in parts for lane in part] == whole


def test_suite_refuses_a_bad_part():
    for bad in ("3/2", "0/2", "x", "1/0", "2"):
        result = _suite("--part", bad, "--list")
        assert result.returncode == 2 and "--part" in result.stderr, (bad, result.stderr)
