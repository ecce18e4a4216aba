"""Chunked recompute lowers the layer's peak by what its formulas say (one GPU, marker ``gpu``).

The reach ladder's all-four-operators variant, the same with ``--chunked-recompute-tokens
16384``, and with ``--chunked-recompute-attention`` too (``tools/benchmarks/bench_reach.py``), one
iteration at 262,144 tokens each: all train, each step's measured peak allocated falls by at
least 90% of the drop the launch-time budget predicts (which composes
``released_bytes_per_token``, and the attention node's ``saved_bytes_per_token``,
``backward_bytes_per_token`` and ``chunk_backward_bytes_per_token``, with the layer's other
terms), and the budget is within [0.95, 1.10] of each peak. Trials go to
``RESULTS_DIR/chunked_recompute``.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import reach_runner

pytestmark = [pytest.mark.gpu, requires_cuda]

TOKENS = 262_144


VARIANTS = ("offload_stream", "chunked", "chunked_attention")


def test_chunked_recompute_lowers_the_peak_as_its_formulas_say():
    bench_reach, runner = reach_runner("chunked_recompute", base_port=29950)
    trials = {variant: runner.run(variant, bench_reach.EXAMPLE_LAYERS, TOKENS, snapshot=False,
                                  concurrent=False)
              for variant in VARIANTS}
    for trial in trials.values():
        assert trial.trained, f"{trial.name}: {trial.outcome}\n" + "\n".join(trial.last_lines)
    predicted = {variant: bench_reach.budget_peak_gib(trial) for variant, trial in trials.items()}
    for variant, trial in trials.items():
        ratio = predicted[variant] / trial.peak_allocated_gib
        assert 0.95 <= ratio <= 1.10, f"{variant}: budget / measured = {ratio:.3f}"
    for before, after in zip(VARIANTS, VARIANTS[1:]):
        predicted_drop = predicted[before] - predicted[after]
        measured_drop = trials[before].peak_allocated_gib - trials[after].peak_allocated_gib
        assert predicted_drop > 0, (before, after)
        assert measured_drop >= 0.9 * predicted_drop, (
            f"{after} saved {measured_drop:.2f} GiB against {before}, the budget predicts "
            f"{predicted_drop:.2f}"
        )
