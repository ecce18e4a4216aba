"""SCO in real training (2 GPUs, EP=2, full recompute, marker ``gpu``).

The same deterministic run with and without ``--sco-host-budget-gb``: every iteration's loss is
bit-for-bit equal (so are the gradients that produced it), SCO reports its offloaded boundaries,
and the peak memory falls.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.functional.harness import losses_by_iteration, run_example

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

FLAGS = [
    "--deterministic-mode",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
]
ENV = {"TRAIN_ITERS": "10", "SEQ_LENGTH": "8192", "GLOBAL_BATCH_SIZE": "4"}


def test_sco_is_exact_and_lowers_the_peak():
    without = run_example("sco_off", 2, FLAGS, port=29530, env_overrides=ENV)
    with_sco = run_example("sco_on", 2, FLAGS + ["--sco-host-budget-gb", "2"], port=29531, env_overrides=ENV)
    assert losses_by_iteration(with_sco.records) == losses_by_iteration(without.records)
    report = re.search(r"SCO: (\d+) of (\d+) checkpoint boundaries .*at most (\d+) restored", with_sco.log)
    assert report, "SCO did not report"
    offloaded, seen, max_restored = (int(x) for x in report.groups())
    assert offloaded == seen == 8 and max_restored <= 2
    peak_without = max(r["peak_allocated_gib"] for r in without.records if r.get("peak_allocated_gib"))
    peak_with = max(r["peak_allocated_gib"] for r in with_sco.records if r.get("peak_allocated_gib"))
    # 8 boundaries of N×H bf16 = 8192 × 1024 × 2 B = 16 MiB each; at most 2 come back
    assert peak_with < peak_without
