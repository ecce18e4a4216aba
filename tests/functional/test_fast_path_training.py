"""The small example as users run it (``bash scripts/train.sh``: its default ``--bounded-fast-path``),
marker ``gpu``: the torch-native static path (with paged stash on 2 GPUs), captured whole by
upstream's whole-iteration CUDA graph, on 1 GPU (factor 1.0) and on 2 GPUs (factor 2.0 = EP): the start-up
lines say so, the graph is captured, no step is rerun, the loss falls and the job exits. With
``--bounded-moe-backend upstream`` the same script runs upstream's path, eager; on one GPU the fast
path trains at least ten times as many tokens per second (same call, median of the logged
windows after the first). A loss driven to NaN (a learning rate of 1e30 overflows bf16 within a
step) still stops the graph-captured job, with the message that says what to do.
"""

from __future__ import annotations

import pytest

from megatron.bounded.launch.commands.summarize_metrics import summarize_records
from tests.conftest import requires_cuda, requires_two_gpus
from tests.functional.harness import assert_loss_falls, run_example

pytestmark = [pytest.mark.gpu]

FAST = {"PLAN": "auto", "TRAIN_ITERS": "30"}
RERUN_LINE = "Paged stash: rerunning forward-backward"


def _check_fast_path(run, gpus):
    factor = str(gpus)
    # one GPU: the experts' rows are exactly the routed ones, nothing to page
    stash = f" --moe-paged-stash --moe-paged-stash-buffer-size-factor-cuda {factor}" if gpus > 1 else ""
    # the planner at 2,048 tokens (8 sequences per step): one micro-batch per rank and step
    assert (f"[bounded] plan: added --micro-batch-size {8 // gpus} --bounded-moe-backend torch "
            f"--moe-expert-rank-capacity-factor {factor}{stash} --cuda-graph-impl full_iteration "
            "--no-check-for-nan-in-loss-and-grad --no-bias-dropout-fusion --manual-gc "
            "--manual-gc-interval 100") in run.log
    assert (f"[bounded] run: MoE torch-native all-to-all dispatcher (static, rank capacity factor "
            f"{factor}, EP={gpus}) + GroupedExperts (torch._grouped_mm) |") in run.log
    assert ("| operators paged stash" in run.log) == (gpus > 1)
    assert "CUDA graph whole iteration (NaN/inf checked on the host every 5 iterations)" in run.log
    assert "CUDA graph capture done for training" in run.log
    assert RERUN_LINE not in run.log and "over budget" not in run.log
    assert [record["iteration"] for record in run.records] == list(range(1, 31))
    assert_loss_falls(run.records, f"fast path, {gpus} GPU(s)")


def _tokens_per_s(run) -> float:
    """Median of the logged windows' tokens per second per GPU, the first (capture, warm-up) left
    out (``tools/summarize_metrics.py``'s steady-state figure)."""
    summary = summarize_records(run.records)
    assert summary["steady_intervals"] > 0, "one logged window only: no steady-state throughput"
    return summary["tokens_per_s_per_gpu"]


@pytest.fixture(scope="module")
def fast_one_gpu():
    return run_example("fast_path_1gpu", 1, [], port=29591, env_overrides=FAST, timeout_s=600)


@pytest.fixture(scope="module")
def upstream_one_gpu():
    return run_example("upstream_on_request_1gpu", 1, ["--bounded-moe-backend", "upstream"],
                       port=29593, env_overrides=FAST, timeout_s=600)


@requires_cuda
def test_fast_path_one_gpu(fast_one_gpu):
    _check_fast_path(fast_one_gpu, 1)


@requires_two_gpus
def test_fast_path_two_gpus():
    _check_fast_path(run_example("fast_path_2gpu", 2, [], port=29592, env_overrides=FAST, timeout_s=600), 2)


@requires_cuda
def test_upstream_path_on_request(upstream_one_gpu):
    run = upstream_one_gpu
    assert "upstream's MoE path kept: --bounded-moe-backend upstream" in run.log
    assert "[bounded] run: MoE upstream MoEAlltoAllTokenDispatcher (EP=1) + SequentialMLP" in run.log
    # upstream's line after a capture (PyTorch's own warnings may name "CUDA graph capture")
    assert "CUDA graph capture done" not in run.log
    assert_loss_falls(run.records, "upstream path on request")


@requires_cuda
def test_fast_path_trains_ten_times_as_fast_as_upstream(fast_one_gpu, upstream_one_gpu):
    fast, upstream = _tokens_per_s(fast_one_gpu), _tokens_per_s(upstream_one_gpu)
    assert fast >= 10 * upstream, f"tokens/s per GPU: fast path {fast:.0f}, upstream {upstream:.0f}"


@requires_cuda
def test_a_nan_loss_stops_the_graph_captured_job():
    run = run_example("fast_path_nan_1gpu", 1, ["--lr", "1e30", "--min-lr", "1e30",
                                                "--lr-warmup-iters", "0"],
                      port=29595, env_overrides=FAST, timeout_s=600, must_succeed=False)
    assert run.returncode != 0, "the job trained on through a NaN loss"
    assert "CUDA graph capture done for training" in run.log
    assert "not finite" in run.log and "Resume from the last checkpoint with a lower --lr" in run.log
    assert run.records[-1]["iteration"] < 30
