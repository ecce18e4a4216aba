"""The small MoE example with the torch-native static-capacity backend and upstream's paged stash
(2 GPUs, EP=2, marker ``gpu``): it trains, and every overflow path reruns the step and goes on.

- factor 1.5 + paged stash: trains, loss falls, the torch-native backend is what runs. At this
  model's initialisation the router sends most tokens to a few experts (load-balancing loss
  about 1.8, 1.0 when balanced), so early steps can go over this budget and be rerun; how many
  did is printed;
- factor 2.0 = E_p (EP=2: a slab holds every pair a rank can send, nothing can drop) with a CUDA
  stash of 2.0 × the average routed rows (a rank receives at most E_p × the average; upstream's
  default 1.1 overflows, and reruns, whenever one rank receives more than 1.1 × its share, which
  this model's imbalanced early routing does): the steady state of paged stash, every step runs
  with static buffers and pages, none is rerun;
- the same under upstream's whole-iteration CUDA graph (``--cuda-graph-impl full_iteration``):
  the step is captured, replays train, and the job exits;
- factor 0.5: tokens go over budget, upstream's runner logs it (suggesting a larger factor),
  our rerun report names the factor that would have dropped nothing, the step is rerun dropless,
  and training continues to the end;
- a tiny CUDA stash (buffer factor 0.01, factor 2.0): the stash overflows and the step is rerun;
- the same tiny CUDA stash with a host buffer (CPU factor 2.0): pages spill to pinned host
  memory, which upstream's runner reports, without a rerun.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import requires_two_gpus
from tests.functional.harness import assert_loss_falls, run_example

pytestmark = [
    pytest.mark.gpu,
    requires_two_gpus,
]

PAGED_STASH = ["--moe-paged-stash"]
ITERS = {"TRAIN_ITERS": "15"}
TORCH_BACKEND_LINE = "MoE backend: torch-native all-to-all dispatcher"
RERUN_LINE = "Paged stash: rerunning forward-backward"
NO_DROP_FACTOR = ["--moe-expert-rank-capacity-factor", "2.0"]  # = E_p at EP=2


def _run(name, port, *flags):
    return run_example(name, 2, PAGED_STASH + list(flags), port=port, env_overrides=ITERS)


def test_paged_stash_with_capacity_factor_trains():
    run = _run("paged_stash_cf1.5", 29520, "--moe-expert-rank-capacity-factor", "1.5")
    assert TORCH_BACKEND_LINE in run.log and "rank capacity factor 1.5" in run.log
    assert len(run.records) == 15
    assert_loss_falls(run.records, "paged stash, cf 1.5")
    print(f"factor 1.5: {run.log.count(RERUN_LINE)} of 15 steps rerun dropless")


def test_paged_stash_steady_state_runs_without_rerun():
    run = _run("paged_stash_cf2.0", 29524, *NO_DROP_FACTOR, "--moe-paged-stash-buffer-size-factor-cuda", "2.0")
    assert TORCH_BACKEND_LINE in run.log
    assert RERUN_LINE not in run.log and "over budget" not in run.log
    assert len(run.records) == 15
    assert_loss_falls(run.records, "paged stash, cf 2.0")


def test_whole_iteration_graph_trains_and_exits():
    """The steady state under upstream's whole-iteration CUDA graph: it captures (nothing syncs
    with the host), trains, and the job exits (a graph alive at NCCL's teardown hung the exit)."""
    run = run_example("paged_stash_graph", 2, PAGED_STASH + NO_DROP_FACTOR + [
        "--moe-paged-stash-buffer-size-factor-cuda", "2.0", "--cuda-graph-impl", "full_iteration",
        "--no-check-for-nan-in-loss-and-grad"], port=29525, env_overrides=ITERS, timeout_s=300)
    assert "CUDA graph capture done for training" in run.log
    assert RERUN_LINE not in run.log
    assert len(run.records) == 15
    assert_loss_falls(run.records, "paged stash, cf 2.0, whole-iteration graph")


def test_over_budget_step_is_rerun_and_training_continues():
    run = _run("paged_stash_cf0.5", 29521, "--moe-expert-rank-capacity-factor", "0.5")
    assert "over budget" in run.log and "Consider increasing moe_expert_rank_capacity_factor" in run.log
    assert RERUN_LINE in run.log
    # and our dispatcher says which factor would have fitted (above the 0.5 that did not)
    needed = [float(m) for m in re.findall(r"capacity-factor ([\d.]+) or more would have dropped", run.log)]
    assert needed and all(value > 0.5 for value in needed), needed
    assert len(run.records) == 15
    assert_loss_falls(run.records, "paged stash, cf 0.5 (reruns)")


def test_stash_overflow_is_rerun():
    run = _run(
        "paged_stash_tiny_cuda", 29522, *NO_DROP_FACTOR,
        "--moe-paged-stash-buffer-size-factor-cuda", "0.01",
    )
    assert "stashing buffer overflow" in run.log and RERUN_LINE in run.log
    assert len(run.records) == 15


def test_host_spill_is_reported():
    run = _run(
        "paged_stash_host_spill", 29523, *NO_DROP_FACTOR,
        "--moe-paged-stash-buffer-size-factor-cuda", "0.01",
        "--moe-paged-stash-buffer-size-factor-cpu", "2.0",
    )
    assert "spilled activations to pinned host" in run.log and RERUN_LINE not in run.log
    assert len(run.records) == 15
