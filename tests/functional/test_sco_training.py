"""SCO in real training (2 GPUs with EP=2, or the one GPU there is; full recompute, marker ``gpu``).

The same deterministic run with and without ``--sco-host-budget-gb``, at a shape where the
checkpoint boundaries matter: 16 layers, one sequence of 32,768 tokens per GPU. Checked:
- every iteration's loss is bit-for-bit equal (so are the gradients that produced it);
- SCO reports all 16 boundaries offloaded and at most 2 restored at once in backward;
- the peak falls by (offloaded boundaries − 2) × N·H·b within 10% (SCO's saving formula): the peak
  is at the start of backward, when without SCO all boundaries are still on the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import requires_cuda
from tests.functional.harness import DETERMINISTIC, losses_by_iteration, run_example
from megatron.bounded.units import GiB

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
]

WORLD = min(2, torch.cuda.device_count())  # GPUs of every job (one sequence each)

LAYERS, SEQ, HIDDEN, BF16_BYTES = 16, 32768, 1024, 2
FLAGS = [
    *DETERMINISTIC, "--num-layers", str(LAYERS),
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
]
ENV = {"TRAIN_ITERS": "6", "SEQ_LENGTH": str(SEQ), "GLOBAL_BATCH_SIZE": str(max(WORLD, 1))}
BOUNDARY_GIB = SEQ * HIDDEN * BF16_BYTES / GiB  # N·H·b of one micro-batch (64 MiB)


def _peak(run) -> float:
    return max(r["peak_allocated_gib"] for r in run.records if r.get("peak_allocated_gib"))


def test_sco_is_exact_and_lowers_the_peak_by_the_offloaded_boundaries():
    without = run_example("sco_off", WORLD, FLAGS, port=29530, env_overrides=ENV)
    with_sco = run_example("sco_on", WORLD, FLAGS + ["--sco-host-budget-gb", "2"], port=29531, env_overrides=ENV)
    assert losses_by_iteration(with_sco.records) == losses_by_iteration(without.records)
    report = re.search(r"SCO: (\d+) of (\d+) checkpoint boundaries .*at most (\d+) restored", with_sco.log)
    assert report, "SCO did not report"
    offloaded, seen, max_restored = (int(x) for x in report.groups())
    assert offloaded == seen == LAYERS and max_restored <= 2
    expected_saving = (offloaded - 2) * BOUNDARY_GIB
    saving = _peak(without) - _peak(with_sco)
    assert abs(saving - expected_saving) <= 0.1 * expected_saving, (saving, expected_saving)
