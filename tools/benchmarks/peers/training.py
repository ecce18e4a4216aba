"""The training loop the peers share (transformers' model, torchtitan's): the same batches in the
same order, AdamW as pretrain_gpt.py runs it, the step timed from a synchronized start to the end
of its work, the largest micro-batch that fits, and the record every system writes.

Precision, per system (``precision``):

* ``bf16_master``: the model's weights in bf16, an fp32 master copy of each in the optimizer, the
  gradients accumulated in fp32 on the master (each weight's gradient is moved there as soon as
  backward has produced it) and clipped and stepped there; what pretrain_gpt.py's ``--bf16``
  does with megatron-core's distributed optimizer;
* ``autocast``: fp32 weights (the master copy itself), the forward under ``torch.autocast``
  in bf16;
* ``fp32``: fp32 throughout (the CPU tests).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import statistics
from typing import Callable, List

import torch

from bench_common import Stopwatch, command_line, commit, device_name, utc_date
from megatron.bounded.units import GiB
from peers.workload import OPTIMIZER, Optimizer, micro_batch

PRECISIONS = ("bf16_master", "autocast", "fp32")
OOM_MARKERS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
VERSIONED = ("transformers", "megatron-core", "liger-kernel", "torchtitan", "triton")


def model_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16_master" else torch.float32


def adamw(params, optimizer: Optimizer, device) -> torch.optim.AdamW:
    """megatron-core's parameter groups (no weight decay on 1-D parameters; these models have no
    biases) under torch's AdamW, fused on CUDA."""
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim > 1]},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                             weight_decay=optimizer.weight_decay,
                             fused=torch.device(device).type == "cuda")


class Update:
    """The forward's precision context and the optimizer step of one model in ``precision``."""

    def __init__(self, model: torch.nn.Module, precision: str, device,
                 optimizer: Optimizer = OPTIMIZER):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision, self.device, self.clip = precision, torch.device(device), optimizer.clip_grad
        params = [p for p in model.parameters() if p.requires_grad]
        if precision == "bf16_master":
            self.masters = [p.detach().float() for p in params]
            for param, master in zip(params, self.masters):
                param.register_post_accumulate_grad_hook(_move_grad_to(master))
            self.pairs = list(zip(params, self.masters))
        else:
            self.masters, self.pairs = params, []
        self.optimizer = adamw(self.masters, optimizer, device)

    def context(self):
        if self.precision == "autocast":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.optimizer.step()
        self.zero_grad()
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None
        for param, _ in self.pairs:
            param.grad = None


def _move_grad_to(master: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    return hook


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or any(
        marker in str(error) for marker in OOM_MARKERS)


def micro_batch_sizes(global_batch: int, seq_length: int, max_tokens: int) -> List[int]:
    """The divisors of ``global_batch`` with at most ``max_tokens`` tokens (at least 1), largest
    first: the micro-batches a run tries until one fits."""
    sizes = [m for m in range(global_batch, 0, -1)
             if global_batch % m == 0 and m * seq_length <= max_tokens]
    return sizes or [1]


def run_steps(loss_of: Callable, update: Update, dataset, steps: int, global_batch: int,
              micro: int, device, losses: list, seconds: list) -> None:
    """``steps`` optimizer steps of ``global_batch`` sequences in micro-batches of ``micro``,
    appending each step's loss (the mean over its tokens, as pretrain_gpt.py reports it) and
    seconds. ``loss_of(tokens, labels)`` is a micro-batch's mean loss."""
    count = global_batch // micro
    for step in range(steps):
        batches = [micro_batch(dataset, step * global_batch + j * micro, micro, device)
                   for j in range(count)]
        with Stopwatch(device) as clock:
            total = torch.zeros((), device=device)
            for tokens, labels in batches:
                with update.context():
                    loss = loss_of(tokens, labels)
                (loss / count).backward()
                total += loss.detach().float()
            update.step()
            value = (total / count).item()
        losses.append(value)
        seconds.append(clock.wall_s)


def train(loss_of: Callable, update: Update, dataset, steps: int, global_batch: int,
          seq_length: int, max_micro_tokens: int, device) -> dict:
    """Train with the largest micro-batch (:func:`micro_batch_sizes`) whose first step fits;
    what was measured (losses, step seconds, micro-batch, peak allocated bytes, outcome)."""
    cuda = torch.device(device).type == "cuda"
    losses, seconds = [], []
    for micro in micro_batch_sizes(global_batch, seq_length, max_micro_tokens):
        losses.clear()
        seconds.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        try:
            run_steps(loss_of, update, dataset, steps, global_batch, micro, device, losses, seconds)
            outcome = "ok"
        except Exception as error:  # noqa: BLE001 - an out-of-memory is a result, not a failure
            if not is_out_of_memory(error):
                raise
            outcome = "oom"
        if outcome == "ok" or losses:  # a later step ran out: the next size would not help
            break
        update.zero_grad()  # the failed step's gradients and activations go, then a smaller try
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"outcome": outcome, "micro_batch": micro, "losses": losses, "step_s": seconds,
            "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def record(system: str, settings: dict, workload, seq_length: int, global_batch: int,
           steps: int, warmup: int, measured: dict) -> dict:
    """The JSON record of one run: what ran, on what, and what it measured; tokens/s per GPU is
    the median over the steps after ``warmup``."""
    timed = [s for s in measured.get("step_s", [])[warmup:] if s is not None]
    rate = global_batch * seq_length / statistics.median(timed) if timed else None
    peak = measured.get("peak_bytes")
    return {
        "system": system, "settings": settings, "preset": workload.manifest["preset"],
        "seq_length": seq_length, "global_batch": global_batch,
        "micro_batch": measured.get("micro_batch"), "steps": steps, "warmup_steps": warmup,
        "outcome": measured["outcome"],
        "tokens_per_s_per_gpu": round(rate, 1) if rate else None,
        "peak_gib": round(peak / GiB, 3) if peak is not None else None,
        "losses": measured.get("losses", []), "step_s": [round(s, 4) for s in timed],
        "weights_sha256": workload.manifest["weights_sha256"],
        "tokens_sha256": workload.manifest["tokens_sha256"],
        "versions": versions(), "gpu": device_name(), "date": utc_date(), "commit": commit(),
        "command": command_line(),
        **{key: measured[key] for key in ("longest_hint", "last_lines") if key in measured},
    }


def versions() -> dict:
    """torch's version (with its CUDA build) and the installed packages' (None: not installed)."""
    found = {"torch": torch.__version__}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found
