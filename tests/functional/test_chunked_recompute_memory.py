"""Chunked recompute lowers the layer's peak by what its formula releases (one GPU, marker ``gpu``).

The reach ladder's all-four-operators variant and the same with ``--chunked-recompute-tokens
16384`` (``tools/benchmarks/bench_reach.py``), one iteration at 262,144 tokens each: both train,
and the measured peak allocated falls by at least 90% of the drop the launch-time budget
predicts (which composes ``released_bytes_per_token`` with the layer's other terms). Trials go
to ``RESULTS_DIR/chunked_recompute``.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import reach_runner

pytestmark = [pytest.mark.gpu, requires_cuda]

TOKENS = 262_144


def test_chunked_recompute_lowers_the_peak_as_its_formula_says():
    bench_reach, runner = reach_runner("chunked_recompute", base_port=29950)
    trials = {variant: runner.run(variant, bench_reach.EXAMPLE_LAYERS, TOKENS, snapshot=False,
                                  concurrent=False)
              for variant in ("offload_stream", "chunked")}
    for trial in trials.values():
        assert trial.trained, f"{trial.name}: {trial.outcome}\n" + "\n".join(trial.last_lines)
    predicted = {variant: bench_reach.budget_peak_gib(trial) for variant, trial in trials.items()}
    predicted_drop = predicted["offload_stream"] - predicted["chunked"]
    measured_drop = trials["offload_stream"].peak_allocated_gib - trials["chunked"].peak_allocated_gib
    assert predicted_drop > 0
    assert measured_drop >= 0.9 * predicted_drop, (
        f"chunked recompute saved {measured_drop:.2f} GiB, the budget predicts {predicted_drop:.2f}"
    )
