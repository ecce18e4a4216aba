"""A job that survives: faults and exits of real ``pretrain_gpt.py`` runs of the small MoE example
(on 2 GPUs with EP=2, or on the one GPU there is; marker ``gpu``; run through
``scripts/gpu_functional.sh``).

(a) SIGKILL of one rank (the last) after the first checkpoint: the job dies; a new job started with the same
    flags resumes from the last checkpoint (the tracker file) and trains to the end, and its
    losses and gradient norms equal an uninterrupted run's bit for bit.
(b) SIGTERM with ``--exit-signal-handler`` (sent to every rank, as a scheduler does): the job
    saves a checkpoint at the iteration it stopped at and exits 0; resuming from it reproduces
    the uninterrupted run bit for bit.
(c) ``--cuda-graph-impl full_iteration`` with ``--exit-interval``: the job leaves through
    upstream's sys.exit() and is gone within 60 s of its last iteration (a graph alive at NCCL's
    teardown used to hang the exit; pretrain_gpt.py releases it on every exit path).

Every run uses ``harness.DETERMINISTIC``; each saved checkpoint must also pass
``tools/verify_checkpoint.py`` (its integrity manifest was written before the job ended).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.functional.harness import (
    DETERMINISTIC, PORT_OFFSET, REPO_ROOT, RESULTS_DIR, TEST_ENV, resume_and_compare, run_example,
    scratch_checkpoints, stop_job,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU"),
]

WORLD = min(2, torch.cuda.device_count())  # ranks of every job: EP = WORLD
ITERATIONS = 30  # of the uninterrupted run; the interrupted jobs are stopped well before
SAVE_INTERVAL = 10
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST_DIR = "bounded_manifest"  # megatron.bounded.training.checkpoint_manifest.MANIFEST_DIR


# --------------------------------------------------------------------------------------------
# Jobs that are interrupted from outside: started here, not through harness.run_example
# --------------------------------------------------------------------------------------------


class Job:
    """examples/moe_small/train.sh started in its own session, with the environment
    harness.run_example gives it, and its per-iteration metrics."""

    def __init__(self, name: str, extra_args: list, port: int, env_overrides: dict):
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.metrics = RESULTS_DIR / f"{name}.metrics.jsonl"
        self.metrics.unlink(missing_ok=True)
        self.log_path = RESULTS_DIR / f"{name}.log"
        env = {**os.environ, **TEST_ENV, "NUM_GPUS": str(WORLD),
               "MASTER_PORT": str(port + PORT_OFFSET), "PYTHON": sys.executable,
               "TRAIN_ITERS": str(ITERATIONS), "LOG_INTERVAL": "1", **env_overrides}
        command = ["bash", str(REPO_ROOT / "examples/moe_small/train.sh"),
                   "--metrics-jsonl", str(self.metrics), *extra_args]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def records(self) -> list:
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip().endswith("}")]

    def last_iteration(self) -> int:
        records = self.records()
        return records[-1]["iteration"] if records else 0

    def wait_until(self, condition, timeout_s: float, what: str) -> float:
        """Poll ``condition()`` until true; returns the time it became true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return time.monotonic()
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} ended (exit {self.process.returncode}) before {what}:\n"
                            f"{self.log()[-4000:]}")
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"{self.name}: no {what} within {timeout_s:.0f} s:\n{self.log()[-4000:]}")

    def wait(self, timeout_s: float):
        """The exit status, or None when it did not end in time (then it is stopped)."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            return None
        finally:
            self._log.close()

    def stop(self) -> None:
        stop_job(self.process)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def workers(self) -> dict:
        """{global rank: pid} of the pretrain_gpt.py processes under this job (torchrun starts
        them in sessions of their own, but they stay its descendants). A worker's own children
        (data-loader workers, the checkpoint writer) share its command line and RANK: the tree
        is walked breadth first and each rank keeps the shallowest process, the worker."""
        children: dict = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        found, queue = {}, collections.deque([self.process.pid])
        while queue:
            pid = queue.popleft()
            queue.extend(sorted(children.get(pid, [])))
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = [item[5:] for item in environ if item.startswith(b"RANK=")]
            launcher = b"torch.distributed.run" in cmdline or b"torchrun" in cmdline
            if b"pretrain_gpt.py" in cmdline and rank and not launcher:
                found.setdefault(int(rank[0]), pid)
        return found


def tracker_iteration(checkpoint_dir: str) -> int:
    path = Path(checkpoint_dir) / TRACKER
    return int(path.read_text().strip()) if path.exists() else -1


def assert_checkpoint_verifies(checkpoint_dir: str, iteration: int) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools/verify_checkpoint.py"), checkpoint_dir,
         "--iteration", str(iteration)], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"checkpoint of iteration {iteration}: {result.stderr}"


@pytest.fixture(scope="module")
def uninterrupted():
    """The reference: ITERATIONS iterations without interruption (and without checkpoints)."""
    return run_example("fault_uninterrupted", WORLD, DETERMINISTIC, port=29560,
                       env_overrides={"TRAIN_ITERS": str(ITERATIONS), "LOG_INTERVAL": "1"})


@pytest.fixture
def checkpoints(tmp_path):
    with scratch_checkpoints(tmp_path, save_interval=SAVE_INTERVAL) as env:
        yield env


def test_sigkill_of_a_rank_then_restart_resumes_bitwise(uninterrupted, checkpoints):
    job = Job("fault_sigkill", DETERMINISTIC, port=29561, env_overrides=checkpoints)
    # the first checkpoint and every rank's part of its integrity manifest are on disk
    manifest = Path(checkpoints["CHECKPOINT_DIR"]) / f"iter_{SAVE_INTERVAL:07d}" / MANIFEST_DIR
    job.wait_until(lambda: all((manifest / f"part_{rank:05d}.json").exists()
                               for rank in range(WORLD)), 900, "the first checkpoint's manifest")
    job.wait_until(lambda: len(job.workers()) == WORLD, 60, "every worker")
    victim = WORLD - 1
    os.kill(job.workers()[victim], signal.SIGKILL)  # it dies without any chance to clean up
    status = job.wait(timeout_s=300)
    assert status not in (None, 0), f"the job survived the loss of rank {victim} (exit {status})"
    killed_at = job.last_iteration()
    assert killed_at < ITERATIONS, "the job finished before the kill landed: no fault tested"
    saved = tracker_iteration(checkpoints["CHECKPOINT_DIR"])
    assert SAVE_INTERVAL <= saved <= killed_at
    # (a later checkpoint's manifest may have been cut short by the kill: a load refuses it,
    # naming the missing part; the first one is complete and must match)
    assert_checkpoint_verifies(checkpoints["CHECKPOINT_DIR"], SAVE_INTERVAL)
    # the restart: the same flags, --load is the --save directory (the example passes both)
    restarted = run_example("fault_sigkill_restarted", WORLD, DETERMINISTIC, port=29562,
                            env_overrides={**checkpoints, "TRAIN_ITERS": str(ITERATIONS),
                                           "SAVE_INTERVAL": "1000", "LOG_INTERVAL": "1"})
    expected = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in uninterrupted.records}
    got = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in restarted.records}
    assert sorted(got) == list(range(saved + 1, ITERATIONS + 1)), sorted(got)
    mismatches = {i: (got[i], expected[i]) for i in got if got[i] != expected[i]}
    assert not mismatches, f"the restarted run differs from the uninterrupted one: {mismatches}"


def test_sigterm_with_exit_signal_handler_saves_and_resumes_bitwise(uninterrupted, checkpoints):
    env = {**checkpoints, "SAVE_INTERVAL": "1000"}  # the only checkpoint is the one on SIGTERM
    flags = DETERMINISTIC + ["--exit-signal-handler"]
    job = Job("fault_sigterm", flags, port=29563, env_overrides=env)
    job.wait_until(lambda: job.last_iteration() >= 5, 900, "iteration 5")
    job.wait_until(lambda: len(job.workers()) == WORLD, 60, "every worker")
    for pid in job.workers().values():  # a scheduler signals every process of the job
        os.kill(pid, signal.SIGTERM)
    status = job.wait(timeout_s=600)
    assert status == 0, f"exit {status} after SIGTERM:\n{job.log()[-4000:]}"
    stopped_at = job.last_iteration()
    assert 5 <= stopped_at < ITERATIONS
    assert tracker_iteration(checkpoints["CHECKPOINT_DIR"]) == stopped_at
    assert_checkpoint_verifies(checkpoints["CHECKPOINT_DIR"], stopped_at)
    # the same schedule length as the uninterrupted run (the learning rate depends on it)
    resume_and_compare("fault_sigterm_resumed", WORLD, DETERMINISTIC, 29564,
                       {**checkpoints, "TRAIN_ITERS": str(ITERATIONS)},
                       uninterrupted, from_iteration=stopped_at,
                       to_iteration=min(stopped_at + 10, ITERATIONS))


def test_whole_iteration_graph_job_exits_promptly_at_exit_interval():
    exit_at = 10
    job = Job("fault_graph_exit_interval", [
        "--moe-paged-stash", "--moe-expert-rank-capacity-factor", "2.0",
        "--moe-paged-stash-buffer-size-factor-cuda", "2.0", "--cuda-graph-impl", "full_iteration",
        "--no-check-for-nan-in-loss-and-grad", "--exit-interval", str(exit_at),
    ], port=29565, env_overrides={})
    last_iteration_at = job.wait_until(lambda: job.last_iteration() >= exit_at, 900,
                                       f"iteration {exit_at}")
    status = job.wait(timeout_s=60)
    exited_after = time.monotonic() - last_iteration_at
    assert status is not None, f"still running 60 s after iteration {exit_at}:\n{job.log()[-4000:]}"
    assert status == 0, f"exit {status}:\n{job.log()[-4000:]}"
    assert "CUDA graph capture done for training" in job.log()
    assert job.last_iteration() == exit_at
    assert exited_after <= 60, exited_after
