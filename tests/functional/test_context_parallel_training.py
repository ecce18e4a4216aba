"""Context parallelism without Transformer Engine (2 GPUs, marker ``gpu``).

The small MoE example with ``--context-parallel-size 2 --cp-comm-type a2a`` (each GPU keeps its
zigzag half of every sequence; the SDPA attention exchanges heads for tokens with
``megatron.bounded.attention.context_parallel``; EP = 2, DP = 1) trains the same 8 sequences per step as the same
example with DP = 2 and no context parallelism, so its per-step losses must match within bf16
reassociation (the reductions run in other orders): 20 steps at lr 1e-4 (warm-up 10), ≤ 1e-3
relative per step, like the Ring-DTP comparison. A third run adds ``--ring-dtp``, whose ring then
spans the context-parallel ranks (DP × CP = 2): same bound.
"""

from __future__ import annotations

import pytest

from tests.conftest import requires_two_gpus
from tests.functional.harness import DETERMINISTIC, losses_by_iteration, run_example

pytestmark = [
    pytest.mark.gpu,
    requires_two_gpus,
]

FLAGS = [*DETERMINISTIC, "--lr", "1e-4", "--lr-warmup-iters", "10"]
CONTEXT_PARALLEL = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
ENV = {"TRAIN_ITERS": "20"}


def _relative_differences(losses, reference):
    assert sorted(losses) == sorted(reference) == list(range(1, 21))
    return {i: abs(losses[i] - reference[i]) / abs(reference[i]) for i in reference}


def test_context_parallel_matches_data_parallel_losses():
    reference = losses_by_iteration(run_example("cp_off", 2, FLAGS, port=29580, env_overrides=ENV).records)
    cp_run = run_example("cp2", 2, FLAGS + CONTEXT_PARALLEL, port=29581, env_overrides=ENV)
    assert "context-parallel size: 2" in cp_run.log
    relative = _relative_differences(losses_by_iteration(cp_run.records), reference)
    assert max(relative.values()) <= 1e-3, f"CP=2 loss deviates: {relative}"
    ring_run = run_example("cp2_ring_dtp", 2, FLAGS + CONTEXT_PARALLEL + ["--ring-dtp"], port=29582,
                           env_overrides=ENV)
    relative = _relative_differences(losses_by_iteration(ring_run.records), reference)
    assert max(relative.values()) <= 1e-3, f"CP=2 with Ring-DTP deviates: {relative}"
