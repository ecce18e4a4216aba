"""Pinned host memory: the host's RAM, the one check of what the GPU processes of a node pin, and
the copy streams its users share.

Every pinned user (SCO's checkpoint boundaries, the attention kept on the host, OffloadStreamAdamW's
fp32 state, upstream's host optimizer) states its bytes per GPU; :func:`check_pinned_host_memory` adds them, multiplies by the
GPU processes of this host and refuses a total above :data:`PINNED_HOST_FRACTION` of the RAM:
pinned pages cannot be swapped, and the host keeps the rest for the data loaders, the Python
processes and the page cache (a node whose pinned memory fills its RAM is killed by the kernel's
out-of-memory handler in the middle of training).
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Optional, Tuple

import torch

from megatron.bounded.units import GiB

# Largest share of the host's RAM the pinned buffers of all its GPU processes may take.
PINNED_HOST_FRACTION = 0.8

# Host memory per GPU process of the machine a plan is for, when that is not this one
# (tools/memory_budget.py with --budget-host-gb); None: this host's RAM and GPU processes.
_planned_bytes_per_gpu: Optional[int] = None


def plan_for_host(bytes_per_gpu: Optional[int]) -> None:
    """Check against ``bytes_per_gpu`` of host memory per GPU process (a plan made on another
    machine) instead of this host's RAM; None: this host's again."""
    global _planned_bytes_per_gpu
    _planned_bytes_per_gpu = bytes_per_gpu


def host_memory_bytes() -> int:
    """Physical memory of this host (MemTotal); 0 if it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def local_ranks() -> int:
    """GPU processes on this host (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def _host() -> Tuple[bool, float, int]:
    """(whether a planned host stands in for this one, its GiB, the GPU processes sharing it)."""
    planned = _planned_bytes_per_gpu is not None
    host_gib = (_planned_bytes_per_gpu if planned else host_memory_bytes()) / GiB
    return planned, host_gib, 1 if planned else local_ranks()


def pinned_limit_per_gpu() -> Tuple[float, str]:
    """(GiB one GPU process may pin, where that figure comes from); 0 where the RAM is unknown."""
    planned, host_gib, ranks = _host()
    where = ("the planned host's memory per GPU (--budget-host-gb)" if planned
             else f"this host's {host_gib:.1f} GiB over {ranks} GPU process(es)")
    return PINNED_HOST_FRACTION * host_gib / ranks, f"{PINNED_HOST_FRACTION:.0%} of {where}"


def check_pinned_host_memory(pinned_gib_per_gpu: Dict[str, float], error_class,
                             fix: str = "") -> None:
    """Refuse when ``pinned_gib_per_gpu`` (``{flag: GiB one GPU process pins}``, in GiB floats so
    that an absurd value cannot overflow) times the GPU processes of this host exceeds
    :data:`PINNED_HOST_FRACTION` of its RAM. Nothing is refused where the RAM cannot be read.
    ``fix``: how to lower each flag (appended to the message)."""
    users = {flag: float(gib) for flag, gib in pinned_gib_per_gpu.items() if gib > 0}
    planned, host_gib, ranks = _host()
    if not users or not host_gib:
        return
    per_gpu = sum(users.values())
    limit = PINNED_HOST_FRACTION * host_gib / ranks
    if per_gpu <= limit:
        return
    parts = " + ".join(f"{flag} {gib:.4g} GiB" for flag, gib in users.items())
    host = (f"the planned host has {host_gib:.1f} GiB per GPU (--budget-host-gb)" if planned
            else f"this host has {host_gib:.1f} GiB")
    raise error_class(
        f"pinned host memory per GPU ({parts}) × {ranks} GPU process(es) needs "
        f"{per_gpu * ranks:.4g} GiB but {host}, of which at most "
        f"{PINNED_HOST_FRACTION:.0%} may be pinned: lower the pinned memory per GPU to at most "
        f"{limit:.1f} GiB{' (' + fix + ')' if fix else ''}"
        + ("" if planned else "; planning on another machine than the one that trains, state "
           "its host memory per GPU with --budget-host-gb") + "."
    )


# One (device-to-host, host-to-device) pair of copy streams per CUDA device, made once and shared
# by the users of pinned memory, so that their copies queue behind each other instead of
# competing for the link.
_STREAMS: Dict[int, Tuple["torch.cuda.Stream", "torch.cuda.Stream"]] = {}
_STREAMS_LOCK = threading.Lock()


def copy_streams(device: torch.device) -> Tuple["torch.cuda.Stream", "torch.cuda.Stream"]:
    """The (device-to-host, host-to-device) copy streams of CUDA ``device``."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        pair = _STREAMS.get(idx)
        if pair is None:
            pair = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
            _STREAMS[idx] = pair
    return pair
