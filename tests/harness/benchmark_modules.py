"""A benchmark of tools/benchmarks as a module, for the tests of the benchmarks: that folder goes
on sys.path first, as it is when a benchmark runs as a script (they import bench_common from
there)."""

from __future__ import annotations

import sys

from tests.tool_modules import REPO_ROOT, load_tool

BENCHMARKS = REPO_ROOT / "tools" / "benchmarks"


def load_benchmark(file_name: str):
    """``tools/benchmarks/<file_name>`` as a module (``bench_common.py`` is the one the
    benchmarks import)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if file_name == "bench_common.py":
        import bench_common

        return bench_common
    return load_tool(f"benchmarks/{file_name}")
