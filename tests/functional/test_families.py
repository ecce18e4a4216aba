"""Each MoE family of tests/families.py trains 20 iterations on one GPU with its published flags
(scaled as the table says, mock data, sequence 4096), marker ``gpu``: the loss stays finite and
does not diverge. The families run as parallel jobs on the one GPU (start-up dominates); their
peak memory, iteration time and losses go to ``RESULTS_DIR/families.json``.

``--log-interval 5`` is added to every command line so that each job logs its iteration time
(the architecture-only sources set none; upstream's default, 100, is past the run's end).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import requires_cuda
from tests.families import FAMILIES
from tests.functional.harness import RESULTS_DIR, run_pretrain_jobs

pytestmark = [pytest.mark.gpu, requires_cuda]

SEQ_LENGTH = 4096
ITERATIONS = 20
BASE_PORT = 29700
TIMEOUT_S = 270  # the whole file within 5 minutes on one H200


def _command_line(family) -> list:
    # every family trains ITERATIONS: --train-iters, or as many --train-samples of batch 1
    return family.command_line(SEQ_LENGTH) + ["--log-interval", "5"]


def _record(run) -> dict:
    losses = [record["lm_loss"] for record in run.records]
    peaks = [record["peak_allocated_gib"] for record in run.records if "peak_allocated_gib" in record]
    times = [record["ms_per_iteration"] for record in run.records if "ms_per_iteration" in record]
    return {"exit": run.returncode, "iterations": len(run.records), "losses": losses,
            "peak_allocated_gib": max(peaks) if peaks else None,
            "ms_per_iteration": times[-1] if times else None}


@pytest.fixture(scope="module")
def runs():
    jobs = {f"family_{family.name}": _command_line(family) for family in FAMILIES}
    results = run_pretrain_jobs(jobs, BASE_PORT, TIMEOUT_S)
    by_family = {family.name: results[f"family_{family.name}"] for family in FAMILIES}
    records = {name: {**_record(run), "source": family.source}
               for family, (name, run) in zip(FAMILIES, by_family.items())}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "families.json").write_text(json.dumps(records, indent=2))
    return by_family


@pytest.mark.parametrize("name", [family.name for family in FAMILIES])
def test_family_trains_20_iterations_without_diverging(runs, name):
    run = runs[name]
    assert run.returncode == 0, f"{name} failed (exit {run.returncode}):\n{run.log[-4000:]}"
    assert [record["iteration"] for record in run.records] == list(range(1, ITERATIONS + 1))
    losses = [record["lm_loss"] for record in run.records]
    assert all(loss is not None and math.isfinite(loss) for loss in losses), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= first + 0.1, f"{name}: the loss grew ({first:.3f} -> {last:.3f}): {losses}"
    assert "[bounded] run:" in run.log  # the start-up line, with what was substituted
