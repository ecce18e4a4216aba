"""This project's training path as a user runs it: ``examples/moe_small/train.sh`` with
``SEQ_LENGTH=L`` (pretrain_gpt.py's planner chooses the micro-batch, recompute, the operators and
the dispatch), started from the workload's import (``tools/convert_hf.py import``: its
``pretrain_args.txt`` gives the architecture, ``--load ... --finetune`` the weights), on the
workload's indexed dataset, with the optimizer of :data:`peers.workload.OPTIMIZER`. Its
``--metrics-jsonl`` records give the losses, step times and peak allocated memory
(``torch.cuda.max_memory_allocated``, as the peers measure it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from megatron.bounded.units import GiB
from peers.workload import DATA_SEED, OPTIMIZER, REPO_ROOT, SPLIT

EXAMPLE = REPO_ROOT / "examples" / "moe_small" / "train.sh"
SYSTEMS = ("ours",)
REFUSAL = "[bounded] error:"
LAUNCH_VARIABLES = ("NUM_GPUS", "SEQ_LENGTH", "TRAIN_ITERS", "GLOBAL_BATCH_SIZE", "LOG_INTERVAL",
                    "DATA_PATH", "TOKENIZER_TYPE", "VOCAB_SIZE", "CHECKPOINT_DIR", "TENSORBOARD_DIR")
_LONGEST = re.compile(r"The longest --seq-length that fits is ([\d,]+)")
_MICRO_BATCH = re.compile(r"^\s*micro_batch_size \.+ (\d+)\s*$", re.MULTILINE)
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def environment(workload, seq_length: int, steps: int, global_batch: int, base: dict) -> dict:
    """The example's environment: one GPU, ``steps`` iterations of ``global_batch`` sequences,
    a record per iteration, the workload's data read with the null tokenizer of its vocabulary,
    no checkpoints or TensorBoard files; the planner on (``PLAN=auto``)."""
    return dict(base, NUM_GPUS="1", SEQ_LENGTH=str(seq_length), TRAIN_ITERS=str(steps),
                GLOBAL_BATCH_SIZE=str(global_batch), LOG_INTERVAL="1", PLAN="auto",
                DATA_PATH=str(workload.data_prefix), TOKENIZER_TYPE="NullTokenizer",
                VOCAB_SIZE=str(workload.vocab_size), CHECKPOINT_DIR="", TENSORBOARD_DIR="")


def flags(workload, seq_length: int, metrics: Path) -> list:
    """The example's extra flags: the import's architecture and weights, the length, the data's
    split and seed (the shuffles the peers reproduce), the shared optimizer, the records."""
    architecture = (workload.checkpoint / "pretrain_args.txt").read_text().split()
    return [*architecture, "--load", str(workload.checkpoint), "--finetune",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--split", SPLIT, "--seed", str(DATA_SEED), *OPTIMIZER.flags(),
            "--metrics-jsonl", str(metrics)]


def run(workload, seq_length: int, global_batch: int, steps: int, scratch: Path) -> tuple:
    """Run the example; (settings as recorded: the planner's and the run's start-up lines and
    the launch command, measurements). Its log and metrics stay in ``scratch``."""
    scratch.mkdir(parents=True, exist_ok=True)
    metrics, log_path = scratch / "ours.metrics.jsonl", scratch / "ours.log"
    metrics.unlink(missing_ok=True)
    env = environment(workload, seq_length, steps, global_batch, os.environ)
    command = ["bash", str(EXAMPLE.relative_to(REPO_ROOT)), *flags(workload, seq_length, metrics)]
    with open(log_path, "w") as log:
        returncode = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT).returncode
    settings, measured = measurements(log_path.read_text(errors="replace"), returncode, metrics)
    # what a user types to run the same: the example's variables set here, then its command
    settings["launch"] = " ".join([*(f"{key}={env[key]}" for key in LAUNCH_VARIABLES), *command])
    return settings, measured


def measurements(log: str, returncode: int, metrics: Path) -> tuple:
    """(settings, measurements) of a finished run from its log and ``--metrics-jsonl`` file."""
    records = ([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
               if metrics.exists() else [])
    settings = {"example": str(EXAMPLE.relative_to(REPO_ROOT)), "plan": None, "run": None}
    for line in log.splitlines():
        for key in ("plan", "run"):
            if line.startswith(f"[bounded] {key}:"):
                settings[key] = line
    micro = _MICRO_BATCH.findall(log)
    peaks = [r["peak_allocated_gib"] for r in records if r.get("peak_allocated_gib") is not None]
    measured = {
        "outcome": outcome(returncode, log, records),
        "micro_batch": int(micro[-1]) if micro else None,
        "losses": [r["lm_loss"] for r in records],
        # each iteration's time from the end of the one before: the first has none
        "step_s": [r["ms_per_iteration"] / 1e3 if r.get("ms_per_iteration") is not None else None
                   for r in records],
        "peak_bytes": max(peaks) * GiB if peaks else None,
    }
    longest = _LONGEST.search(log)
    if longest:
        measured["longest_hint"] = int(longest.group(1).replace(",", ""))
    if measured["outcome"] != "ok":
        # torchrun's closing report ends the log: the worker's own error lines say what failed
        errors = [line for line in log.splitlines() if "Error" in line or "error:" in line]
        measured["last_lines"] = errors[-8:] or log.splitlines()[-12:]
    return settings, measured


def outcome(returncode: int, log: str, records: list) -> str:
    """ok, refused (the planner or a check: nothing was built), oom, or error."""
    if returncode == 0 and records:
        return "ok"
    if REFUSAL in log and returncode == 2:
        return "refused"
    if any(marker in log for marker in _OOM_MARKERS):
        return "oom"
    return "error"
