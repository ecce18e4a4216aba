"""Chunked recompute lowers the layer's peak by what its formula releases (one GPU, marker ``gpu``).

The reach ladder's all-four-operators variant and the same with ``--chunked-recompute-tokens
16384`` (``tools/benchmarks/bench_reach.py``), one iteration at 262,144 tokens each: both train,
and the measured peak allocated falls by at least 90% of the drop the launch-time budget
predicts (which composes ``released_bytes_per_token`` with the layer's other terms). Trials go
to ``RESULTS_DIR/chunked_recompute``.
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

TOKENS = 262_144
GiB = 2**30


def test_chunked_recompute_lowers_the_peak_as_its_formula_says():
    import bench_reach

    runner = bench_reach.Runner(RESULTS_DIR / "chunked_recompute", num_gpus=1, timeout_s=600,
                                base_port=29950 + PORT_OFFSET)
    runner.results_dir.mkdir(parents=True, exist_ok=True)
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
