"""The launch-time budget against the measured peak at long context (one GPU, marker ``gpu``).

Four points of the reach ladder of ``tools/benchmarks/bench_reach.py`` (one sequence, one
iteration, full recompute): the plain stack at 131,072 tokens, SCO at 262,144, all four
operators at 262,144, and all four with chunked recompute at 262,144. The budget's predicted
peak allocated must be within [0.95, 1.10] of ``torch.cuda.max_memory_allocated``. Trials go to ``RESULTS_DIR/reach_budget``.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import reach_runner

pytestmark = [pytest.mark.gpu, requires_cuda]

POINTS = [("plain", 131_072), ("sco", 262_144), ("offload_stream", 262_144), ("chunked", 262_144)]


@pytest.mark.parametrize("variant, tokens", POINTS)
def test_budget_within_ten_percent_at_long_context(variant, tokens):
    bench_reach, runner = reach_runner("reach_budget", base_port=29900)
    trial = runner.run(variant, bench_reach.EXAMPLE_LAYERS, tokens, snapshot=False,
                       concurrent=False)
    assert trial.trained, f"{trial.name}: {trial.outcome}\n" + "\n".join(trial.last_lines)
    ratio = bench_reach.budget_peak_gib(trial) / trial.peak_allocated_gib
    assert 0.95 <= ratio <= 1.10, f"{trial.name}: budget / measured = {ratio:.3f}"
