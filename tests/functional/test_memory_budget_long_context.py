"""The launch-time budget against the measured peak at long context (one GPU, marker ``gpu``).

Four points of the reach ladder of ``tools/benchmarks/bench_reach.py`` (one sequence, one
iteration, full recompute): the plain stack at 131,072 tokens, SCO at 262,144, all four
operators at 262,144, and all four with chunked recompute at 262,144. The budget's predicted
peak allocated must be within [0.95, 1.10] of ``torch.cuda.max_memory_allocated``. Trials go to ``RESULTS_DIR/reach_budget``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.functional.harness import PORT_OFFSET, REPO_ROOT, RESULTS_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU"),
]

for _path in (REPO_ROOT / "tools", REPO_ROOT / "tools" / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

POINTS = [("plain", 131_072), ("sco", 262_144), ("offload_stream", 262_144), ("chunked", 262_144)]


@pytest.mark.parametrize("variant, tokens", POINTS)
def test_budget_within_ten_percent_at_long_context(variant, tokens):
    import bench_reach

    runner = bench_reach.Runner(RESULTS_DIR / "reach_budget", num_gpus=1, timeout_s=600,
                                base_port=29900 + PORT_OFFSET)
    runner.results_dir.mkdir(parents=True, exist_ok=True)
    trial = runner.run(variant, bench_reach.EXAMPLE_LAYERS, tokens, snapshot=False,
                       concurrent=False)
    assert trial.trained, f"{trial.name}: {trial.outcome}\n" + "\n".join(trial.last_lines)
    ratio = bench_reach.budget_peak_gib(trial) / trial.peak_allocated_gib
    assert 0.95 <= ratio <= 1.10, f"{trial.name}: budget / measured = {ratio:.3f}"
