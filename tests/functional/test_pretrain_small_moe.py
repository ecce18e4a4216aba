"""Real ``pretrain_gpt.py`` runs of the small MoE example on 1–2 GPUs (marker ``gpu``).

Run through ``scripts/gpu_functional.sh`` (it installs the wheelhouse and sets RESULTS_DIR), or
directly: ``RESULTS_DIR=results python -m pytest -m gpu tests/functional``.

(a) 2 GPUs, EP=2, 50 iterations, saving a checkpoint every 20: the loss falls.
(b) Resume: a new job loads the checkpoint of iteration 20 and trains iterations 21–30; their
    losses and gradient norms must equal the uninterrupted run's bit for bit. (a) and (b) run with
    ``harness.DETERMINISTIC`` (upstream's ``--deterministic-mode``, eager SwiGLU): bitwise
    equality is asserted, no tolerance.
(c) 1 GPU, 20 iterations: trains and the loss falls.
Each run's per-iteration metrics (exact loss, throughput, peak memory) are kept in RESULTS_DIR.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_cuda
from tests.functional.harness import (
    DETERMINISTIC, TRAIN_ITERS, assert_loss_falls, resume_and_compare, run_example, scratch_checkpoints,
)

pytestmark = [
    pytest.mark.gpu,
    requires_cuda,
]


@pytest.fixture(scope="module")
def checkpointed_env(tmp_path_factory):
    with scratch_checkpoints(tmp_path_factory.mktemp("small_moe"), save_interval=20) as env:
        yield env


@pytest.fixture(scope="module")
def uninterrupted_two_gpu_run(checkpointed_env):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return run_example("small_moe_2gpu_deterministic", 2, DETERMINISTIC, port=29510, env_overrides=checkpointed_env)


def test_two_gpu_ep2_loss_decreases(uninterrupted_two_gpu_run):
    records = uninterrupted_two_gpu_run.records
    assert [r["iteration"] for r in records] == list(range(1, TRAIN_ITERS + 1))
    assert_loss_falls(records, "2 GPUs, EP=2")


def test_resume_reproduces_losses_bitwise(uninterrupted_two_gpu_run, checkpointed_env):
    resume_and_compare("small_moe_2gpu_resumed", 2, DETERMINISTIC, 29511, checkpointed_env,
                       uninterrupted_two_gpu_run, from_iteration=20, to_iteration=30)


def test_one_gpu_trains():
    records = run_example("small_moe_1gpu", 1, [], port=29513, env_overrides={"TRAIN_ITERS": "20"}).records
    assert_loss_falls(records, "1 GPU")
