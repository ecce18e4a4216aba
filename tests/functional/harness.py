"""Shared helpers of the GPU functional tests: run the small MoE example, read its metrics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.tool_modules import load_tool
from megatron.bounded.units import GiB

REPO_ROOT = Path(__file__).resolve().parents[2]
stop_job = load_tool("stop_job.py").stop_job
RESULTS_DIR = Path(os.environ.get("RESULTS_DIR", REPO_ROOT / "results"))
# Shorter than the example's default sequence so the suite stays within minutes.
# PLAN=off: these tests measure the configurations they name (upstream's MoE path unless they
# pass other flags); test_fast_path_training.py runs the example's default, the planner's choice.
TEST_ENV = {"SEQ_LENGTH": "2048", "GLOBAL_BATCH_SIZE": "8", "LOG_INTERVAL": "5", "PLAN": "off"}
TRAIN_ITERS = 50  # the small example's uninterrupted 2-GPU run: long enough for the loss to fall
# Bitwise reproducibility across processes: upstream's --deterministic-mode (its token
# unpermutation otherwise scatter-adds with atomics: even iteration 1 differs at ~1e-5) and the
# eager SwiGLU (the compiled weighted one's reduction order depends on the compile history;
# megatron.bounded.launch.arguments refuses the pair).
DETERMINISTIC = ["--deterministic-mode", "--no-bias-swiglu-fusion"]
# Added to every rendezvous port, so that lanes of the suite can share one host
# (scripts/gpu_lanes.sh gives each lane its own GPUs and offset).
PORT_OFFSET = int(os.environ.get("PORT_OFFSET", "0"))


def reach_runner(subdirectory: str, base_port: int):
    """(``tools/benchmarks/bench_reach.py`` as a module, its ``Runner`` on one GPU writing trials to
    ``RESULTS_DIR/<subdirectory>``)."""
    bench_reach = load_tool("benchmarks/bench_reach.py")
    runner = bench_reach.Runner(RESULTS_DIR / subdirectory, num_gpus=1, timeout_s=600,
                                base_port=base_port + PORT_OFFSET)
    runner.results_dir.mkdir(parents=True, exist_ok=True)
    return bench_reach, runner


@dataclass
class Run:
    records: list  # one dict per iteration from --metrics-jsonl
    log: str  # everything the job printed
    returncode: int = 0


def run_example(name: str, num_gpus: int, extra_args: list[str], port: int, env_overrides=None,
                timeout_s: float = 900, must_succeed: bool = True) -> Run:
    """Run examples/moe_small/train.sh; fail with the log's tail if it does not finish (exit
    included) within ``timeout_s``, or (``must_succeed``) exits non-zero."""
    env = dict(TEST_ENV, NUM_GPUS=str(num_gpus), TRAIN_ITERS=str(TRAIN_ITERS))
    return run_script(name, "examples/moe_small/train.sh", extra_args, port,
                      {**env, **(env_overrides or {})}, timeout_s, must_succeed)


def run_script(name: str, script: str, extra_args: list[str], port: int, env_overrides=None,
               timeout_s: float = 900, must_succeed: bool = True) -> Run:
    """Run the example launch script ``script`` (a path from the repository root) with
    ``extra_args``; the same checks as :func:`run_example`."""
    env = dict(os.environ, MASTER_PORT=str(port + PORT_OFFSET), PYTHON=sys.executable)
    env.update(env_overrides or {})
    return _run_job(name, ["bash", str(REPO_ROOT / script)], extra_args, env, timeout_s,
                    must_succeed)


def run_pretrain(name: str, num_gpus: int, flags: list[str], port: int, timeout_s: float = 900) -> Run:
    """Run ``pretrain_gpt.py FLAGS`` under torchrun on ``num_gpus`` GPUs (a user's own command
    line rather than an example script); same checks as :func:`run_example`."""
    command, env = _pretrain_command(num_gpus, port)
    return _run_job(name, command, flags, env, timeout_s)


def run_pretrain_jobs(jobs: dict, port: int, timeout_s: float) -> dict:
    """Run ``pretrain_gpt.py`` once per ``{name: flags}`` of ``jobs``, all at once on one GPU
    (rendezvous ports from ``port`` on); ``{name: Run}`` (a job that exits non-zero has its exit
    status and whatever metrics it wrote; one still running after ``timeout_s`` fails)."""
    started = {}
    for index, (name, flags) in enumerate(jobs.items()):
        command, env = _pretrain_command(1, port + index)
        started[name] = _start_job(name, command, flags, env)
    deadline = time.monotonic() + timeout_s
    return {name: _finish_job(name, job, max(deadline - time.monotonic(), 1), must_succeed=False,
                              require_metrics=False)
            for name, job in started.items()}


def _pretrain_command(num_gpus: int, port: int):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_gpus),
               "--master_addr", "127.0.0.1", "--master_port", str(port + PORT_OFFSET),
               str(REPO_ROOT / "pretrain_gpt.py")]
    # what examples/common/launch.sh exports (NVLink multicast off, one CUDA connection)
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return command, env


def _run_job(name: str, command: list[str], flags: list[str], env: dict, timeout_s: float,
             must_succeed: bool = True) -> Run:
    """``command + flags + --metrics-jsonl``; its log and metrics are kept in RESULTS_DIR."""
    return _finish_job(name, _start_job(name, command, flags, env), timeout_s, must_succeed)


@dataclass
class _Job:
    process: subprocess.Popen
    log_path: Path
    metrics: Path


def _start_job(name: str, command: list[str], flags: list[str], env: dict) -> _Job:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    metrics = RESULTS_DIR / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log_path = RESULTS_DIR / f"{name}.log"
    with open(log_path, "w") as log:
        # its own session, so that a job past its time is stopped with its workers and does not
        # hold the GPUs for the next test
        process = subprocess.Popen(command + ["--metrics-jsonl", str(metrics)] + list(flags),
                                   cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return _Job(process, log_path, metrics)


def _finish_job(name: str, job: _Job, timeout_s: float, must_succeed: bool,
                require_metrics: bool = True) -> Run:
    try:
        returncode = job.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
        stop_job(job.process)
    text = job.log_path.read_text()
    assert returncode is not None, f"{name} did not finish within {timeout_s:.0f} s:\n{text[-4000:]}"
    assert returncode == 0 or not must_succeed, f"{name} failed (exit {returncode}):\n{text[-4000:]}"
    lines = job.metrics.read_text().splitlines() if job.metrics.exists() else []
    records = [json.loads(line) for line in lines]
    assert records or not require_metrics, f"{name} wrote no metrics:\n{text[-4000:]}"
    return Run(records, text, returncode)


# Checkpoints go to host memory when it has room: a torch_dist save of the small example took
# 13-27 s on the GPU machine's disk, most of a resume test's time.
RAM_DISK = Path("/dev/shm")
RAM_DISK_MIN_FREE_BYTES = 64 * GiB


def _checkpoint_root(fallback: Path) -> Path:
    try:
        if shutil.disk_usage(RAM_DISK).free >= RAM_DISK_MIN_FREE_BYTES:
            return Path(tempfile.mkdtemp(prefix="bounded-checkpoints-", dir=RAM_DISK))
    except OSError:
        pass
    return Path(fallback)


@contextmanager
def scratch_directory(fallback_root: Path):
    """A directory for checkpoints and models (in ``/dev/shm`` when it has 64 GiB free, else
    ``fallback_root``), deleted afterwards: a GPU machine's disk holds only a few checkpoints (it
    filled once with three files' worth)."""
    root = _checkpoint_root(fallback_root)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def scratch_checkpoints(fallback_root: Path, save_interval: int):
    """Environment of a run that saves torch_dist checkpoints every ``save_interval`` iterations
    into a :func:`scratch_directory` (a fixture's teardown deletes it): one checkpoint of the
    small example holds ~0.9e9 parameters × 14 B (bf16 weights, fp32 master and moments), about
    12 GB."""
    with scratch_directory(fallback_root) as root:
        yield {"CHECKPOINT_DIR": str(root / "checkpoint"), "SAVE_INTERVAL": str(save_interval)}


def resume_and_compare(name, num_gpus, flags, port, env, uninterrupted: Run, from_iteration: int,
                       to_iteration: int) -> Run:
    """Start a new job from the checkpoint the uninterrupted run saved at ``from_iteration``
    (``--ckpt-step``), train to ``to_iteration`` and require its losses and gradient norms to equal
    the uninterrupted run's bit for bit. The resumed job loads but saves nothing (no ``--save``:
    upstream would otherwise save again on exit)."""
    resumed = run_example(
        name, num_gpus,
        list(flags) + ["--load", env["CHECKPOINT_DIR"], "--ckpt-format", "torch_dist",
                       "--ckpt-step", str(from_iteration), "--exit-interval", str(to_iteration)],
        # every iteration in the log: a failed resume shows where it left the uninterrupted run
        port=port, env_overrides={**env, "CHECKPOINT_DIR": "", "LOG_INTERVAL": "1"},
    )
    expected = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in uninterrupted.records}
    got = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in resumed.records}
    assert sorted(got) == list(range(from_iteration + 1, to_iteration + 1)), (
        f"{name}: the resumed run must train iterations {from_iteration + 1}..{to_iteration}, got {sorted(got)}"
    )
    mismatches = {i: (got[i], expected[i]) for i in got if got[i] != expected[i]}
    assert not mismatches, f"{name}: (loss, grad norm) differ from the uninterrupted run: {mismatches}"
    return resumed


def write_documents(prefix: str, count: int, length: int, vocab: int,
                    ids: int | None = None) -> None:
    """An indexed dataset (``prefix``.bin/.idx) of ``count`` documents of ``length`` token ids
    drawn uniformly from the first ``ids`` (default: all but the last) of ``vocab``, each ending in
    the end-of-document id ``vocab - 1`` (NullTokenizer's with ``--vocab-size vocab``)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(count):
        document = numpy.append(rng.integers(0, ids or vocab - 1, length - 1), vocab - 1)
        builder.add_document(document.astype(numpy.int32), [length])
    builder.finalize(prefix + ".idx")


def record_figures(file_name: str, name: str, figures: dict) -> None:
    """Set ``name``'s entry of the JSON file ``RESULTS_DIR/file_name`` to ``figures`` (the other
    entries kept: the parametrized cases of one test share the file)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / file_name
    records = json.loads(path.read_text()) if path.exists() else {}
    records[name] = figures
    path.write_text(json.dumps(records, indent=1) + "\n")


def losses_by_iteration(records) -> dict[int, float]:
    return {record["iteration"]: record["lm_loss"] for record in records}


def assert_loss_falls(records, name: str, by: float = 0.5):
    losses = [record["lm_loss"] for record in records]
    assert all(loss is not None and loss == loss for loss in losses), f"{name}: NaN/None loss"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - by, f"{name}: loss did not fall enough ({first:.3f} -> {last:.3f})"
