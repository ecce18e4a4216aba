"""SCO: checkpoint-boundary offload to (pinned) host memory, with one-layer-ahead prefetch.

Under full recompute the activations kept between forward and backward are the checkpoint
boundaries (each checkpointed chunk's input, N·H·b bytes). :class:`CheckpointOffload` moves the
first ones in forward order that fit its host budget to host memory through a
``saved_tensors_hooks`` pack hook (copies on a side stream, the device block freed as soon as the
copy is done), and in backward restores each one when its checkpoint unpacks it, prefetching the
previous one, so at most two restored boundaries are on the device at once. Host buffers come
from the instance's :class:`HostBufferPool` and are reused across steps. The bound, the rules that recognise a
boundary and the limitations: ``docs/operators/sco.md``. :class:`SCOSettings` holds the flag.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron.bounded.activations.host_memory import check_pinned_host_memory, copy_streams
from megatron.bounded.settings import BoundedArgumentError, Settings, knob
from megatron.bounded.units import GiB

__all__ = ["CheckpointOffload", "HostBufferPool", "allocator_advice"]


def allocator_advice(alloc_conf: Optional[str]) -> Optional[str]:
    """What to tell a CUDA user of SCO whose ``PYTORCH_CUDA_ALLOC_CONF`` is ``alloc_conf``;
    None when expandable segments are on.

    SCO frees each offloaded boundary's block in the middle of the forward. With PyTorch's
    fixed-size segments those holes cannot serve the larger blocks that come later (a layer's
    recompute); expandable segments can merge them. The measured effect at a million tokens is
    in ``docs/operators/sco.md``."""
    settings = [item.strip().replace(" ", "") for item in (alloc_conf or "").split(",")]
    if "expandable_segments:True" in settings:
        return None
    return (
        "SCO frees each offloaded boundary's GPU block during the forward, which fragments "
        "PyTorch's default cache at long context: set PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True before the launch (it is "
        + (repr(alloc_conf) if alloc_conf else "unset") + ")"
    )

# (module, qualified name) of the reentrant checkpoint functions recognised out of the box.
_KNOWN_CHECKPOINT_FUNCTIONS = frozenset(
    {
        ("torch.utils.checkpoint", "CheckpointFunction"),
        ("megatron.core.tensor_parallel.random", "CheckpointFunction"),
        ("transformer_engine.pytorch.distributed", "_CheckpointFunction"),
    }
)

# The most restored boundaries a prefetch may bring the device to (the one in use plus one).
_MAX_RESTORED = 2


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# Host buffer pool
# --------------------------------------------------------------------------------------------


class _HostBuffer:
    """A flat host tensor owned by a pool; ``last_event`` is the last CUDA event that touched it."""

    __slots__ = ("tensor", "key", "nbytes", "last_event")

    def __init__(self, tensor: torch.Tensor, key):
        self.tensor = tensor
        self.key = key
        self.nbytes = _nbytes(tensor)
        self.last_event = None


class HostBufferPool:
    """Host buffers keyed by ``(numel, dtype, pinned)``, reused across steps.

    ``allocated_bytes`` is what the pool holds (idle + in use), ``in_use_bytes`` what is handed out;
    ``num_allocations`` counts every host allocation ever made, so a step that allocates nothing
    leaves it unchanged.
    """

    def __init__(self):
        # Re-entrant: buffers come back from finalizers, which may run inside a locked section.
        self._lock = threading.RLock()
        self._idle: Dict[tuple, List[_HostBuffer]] = defaultdict(list)
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_allocated_bytes = 0
        self.num_allocations = 0

    def acquire(
        self, numel: int, dtype: torch.dtype, pinned: bool, cap_bytes: Optional[int] = None
    ) -> Tuple[_HostBuffer, bool]:
        """Return ``(buffer, newly_allocated)``. Before a new allocation, idle buffers of other
        keys are released until the pool would hold at most ``cap_bytes`` (when given)."""
        key = (int(numel), dtype, bool(pinned))
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                buf = idle.pop()
                self.in_use_bytes += buf.nbytes
                return buf, False
            if cap_bytes is not None:
                self._trim_locked(max(0, cap_bytes - nbytes))
        tensor = torch.empty(int(numel), dtype=dtype, pin_memory=bool(pinned))
        buf = _HostBuffer(tensor, key)
        with self._lock:
            self.allocated_bytes += buf.nbytes
            self.in_use_bytes += buf.nbytes
            self.num_allocations += 1
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return buf, True

    def release(self, buf: _HostBuffer) -> None:
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            self._idle[buf.key].append(buf)

    def _trim_locked(self, max_bytes: int) -> None:
        dropped = []  # the buffers are freed once the bookkeeping is consistent
        for key in list(self._idle):
            bufs = self._idle.get(key, [])
            while bufs and self.allocated_bytes > max_bytes:
                buf = bufs.pop()
                self.allocated_bytes -= buf.nbytes
                dropped.append(buf)
            if self.allocated_bytes <= max_bytes:
                break
        for key in [k for k, v in self._idle.items() if not v]:
            del self._idle[key]
        del dropped

    def trim(self, max_bytes: int = 0) -> None:
        """Release idle buffers until the pool holds at most ``max_bytes`` (buffers in use stay)."""
        with self._lock:
            self._trim_locked(max_bytes)

    def idle_bytes(self) -> int:
        with self._lock:
            return self.allocated_bytes - self.in_use_bytes


# --------------------------------------------------------------------------------------------
# Per-step state
# --------------------------------------------------------------------------------------------


class _Record:
    """One recognised boundary of one forward pass (kept or offloaded)."""

    __slots__ = (
        "index",
        "shape",
        "dtype",
        "device",
        "nbytes",
        "offloaded",
        "host",
        "d2h_event",
        "h2d_event",
        "pending",
        "last_restored",
        "restored_storage",
        "restored_finalizer",
        "consumed",
        "released",
    )

    def __init__(self, index, t: torch.Tensor, offloaded: bool):
        self.index = index
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = _nbytes(t)
        self.offloaded = offloaded
        self.host: Optional[_HostBuffer] = None
        self.d2h_event = None
        self.h2d_event = None
        self.pending: Optional[torch.Tensor] = None  # restored, not yet handed out
        self.last_restored = None  # weakref to the last tensor handed out
        self.restored_storage = None  # weakref to the restored copy's storage (any alias keeps it)
        self.restored_finalizer = None  # counts the restored copy as freed (once)
        self.consumed = False
        self.released = False


class _Handle:
    """What the pack hook returns for a boundary; autograd keeps it until the node is freed."""

    __slots__ = ("rec", "tensor", "__weakref__")

    def __init__(self, rec: _Record, tensor: Optional[torch.Tensor]):
        self.rec = rec
        self.tensor = tensor  # the tensor itself for kept boundaries, None when offloaded


def _new_stats() -> dict:
    return {
        "offloaded_boundaries": 0,
        "offloaded_bytes": 0,
        "max_restored_on_device": 0,
        "boundaries_seen": 0,
        "kept_boundaries": 0,
        "kept_bytes": 0,
        "other_saved_tensors": 0,
        "restored_on_device": 0,
        "restores": 0,
        "restored_freed_early": 0,
        "prefetches": 0,
        "on_demand_restores": 0,
        "prefetches_skipped": 0,
        "host_new_allocations": 0,
        "host_pool_bytes": 0,
    }


class _Step:
    def __init__(self, owner: "CheckpointOffload"):
        self.owner = owner
        self.records: List[_Record] = []
        self.stats = _new_stats()
        self.lock = threading.RLock()
        self.exhausted = False
        self.alive_restored = 0
        self.inflight = deque()  # D2H events of offloads not yet known to be complete

    # ---------------------------------------------------------------- recognition

    def _is_boundary(self, t: torch.Tensor, caller) -> bool:
        if caller.f_code.co_name != "apply":
            return False
        cls = caller.f_locals.get("cls")
        if not isinstance(cls, type) or not issubclass(cls, torch.autograd.Function):
            return False
        if not self.owner._is_checkpoint_function(cls):
            return False
        if not (t.is_floating_point() and t.requires_grad):
            return False
        return _nbytes(t) >= self.owner.min_boundary_bytes

    # ---------------------------------------------------------------- forward

    def pack(self, t: torch.Tensor):
        if not self._is_boundary(t, sys._getframe(1)):
            self.stats["other_saved_tensors"] += 1
            return t
        owner = self.owner
        nbytes = _nbytes(t)
        with self.lock:
            index = len(self.records)
            fits = (
                not self.exhausted
                and self.stats["offloaded_bytes"] + nbytes <= owner.host_budget_bytes
            )
            if not fits:
                self.exhausted = True
            rec = _Record(index, t, offloaded=fits)
            self.records.append(rec)
            self.stats["boundaries_seen"] += 1
            if not fits:
                self.stats["kept_boundaries"] += 1
                self.stats["kept_bytes"] += nbytes
                return _Handle(rec, t)
            self.stats["offloaded_boundaries"] += 1
            self.stats["offloaded_bytes"] += nbytes

        pinned = owner._pinned_for(t)
        buf, new = owner.pool.acquire(t.numel(), t.dtype, pinned, cap_bytes=owner.host_budget_bytes)
        rec.host = buf
        host_view = buf.tensor.view(rec.shape)
        if t.is_cuda and owner.use_streams:
            self._bound_inflight()
            d2h, _ = copy_streams(t.device)
            d2h.wait_stream(torch.cuda.current_stream(t.device))
            if buf.last_event is not None:
                d2h.wait_event(buf.last_event)
            with torch.cuda.stream(d2h):
                host_view.copy_(t, non_blocking=pinned)
                ev = torch.cuda.Event()
                ev.record(d2h)
            # The block of ``t`` may not be reused before the copy stream has read it.
            t.record_stream(d2h)
            rec.d2h_event = ev
            buf.last_event = ev
            self.inflight.append(ev)
        else:
            host_view.copy_(t)
        with self.lock:
            if new:
                self.stats["host_new_allocations"] += 1
            self.stats["host_pool_bytes"] = owner.pool.allocated_bytes
        handle = _Handle(rec, None)
        fin = weakref.finalize(handle, _Step._release_host, self, rec)
        fin.atexit = False
        return handle

    def _bound_inflight(self) -> None:
        """Keep at most ``max_inflight_offloads`` offload copies pending.

        A source block handed to the copy stream is only reusable once its copy is done, so the
        host thread, which otherwise runs ahead of the device, waits for the oldest copy here.
        """
        inflight = self.inflight
        while inflight and inflight[0].query():
            inflight.popleft()
        while len(inflight) >= self.owner.max_inflight_offloads:
            inflight.popleft().synchronize()

    # ---------------------------------------------------------------- backward

    def unpack(self, handle):
        if not isinstance(handle, _Handle):
            return handle
        rec = handle.rec
        if handle.tensor is not None:
            rec.consumed = True
            self._prefetch_before(rec.index)
            return handle.tensor
        with self.lock:
            t = rec.pending
            if t is not None:
                rec.pending = None
            else:
                t = rec.last_restored() if rec.last_restored is not None else None
                if t is None or t.untyped_storage().size() == 0:  # freed early: restore again
                    t = self._start_restore(rec)
                    self.stats["on_demand_restores"] += 1
            rec.consumed = True
            rec.last_restored = weakref.ref(t)
            self._free_restored_after(rec.index)
        if rec.h2d_event is not None:
            torch.cuda.current_stream(t.device).wait_event(rec.h2d_event)
        self._prefetch_before(rec.index)
        return t

    def _start_restore(self, rec: _Record) -> torch.Tensor:
        """Allocate the restored tensor on the current stream and start its copy (lock held)."""
        host_view = rec.host.tensor.view(rec.shape)
        dst = torch.empty(rec.shape, dtype=rec.dtype, device=rec.device)
        if rec.device.type == "cuda" and self.owner.use_streams:
            _, h2d = copy_streams(rec.device)
            # ``dst`` comes from the compute stream's pool: wait until earlier work on that stream
            # is done with the block, and until the offload copy has filled the host buffer.
            h2d.wait_stream(torch.cuda.current_stream(rec.device))
            if rec.d2h_event is not None:
                h2d.wait_event(rec.d2h_event)
            with torch.cuda.stream(h2d):
                dst.copy_(host_view, non_blocking=rec.host.key[2])
                ev = torch.cuda.Event()
                ev.record(h2d)
            dst.record_stream(h2d)
            rec.h2d_event = ev
            rec.host.last_event = ev
        else:
            dst.copy_(host_view)
        self.alive_restored += 1
        self.stats["restores"] += 1
        self.stats["restored_on_device"] = self.alive_restored
        if self.alive_restored > self.stats["max_restored_on_device"]:
            self.stats["max_restored_on_device"] = self.alive_restored
        # Count the restored boundary as alive until its storage is freed, whoever holds it.
        storage = dst.untyped_storage()
        fin = weakref.finalize(storage, _Step._restored_freed, self)
        fin.atexit = False
        rec.restored_storage = weakref.ref(storage)
        rec.restored_finalizer = fin
        return dst

    def _free_restored_after(self, index: int) -> None:
        """Free the restored copies of the boundaries after ``index`` (lock held).

        Backward visits boundaries from the last to the first, so when boundary ``index`` is
        asked for, the recompute and backward of every later one are finished. Their restored
        copies are dead, but something in a real model's recompute graph keeps them reachable
        (not identified; measured in training of the small MoE example: all 16 restored
        boundaries stayed on the GPU until the end of backward). Emptying the storage returns
        the memory now. Reading an emptied boundary afterwards is invalid (it reads freed
        memory and can crash the process), so a boundary may be read only by its own chunk's
        recompute and backward.
        """
        for later in self.records[index + 1:]:
            fin = later.restored_finalizer
            storage = later.restored_storage() if later.restored_storage is not None else None
            if storage is None or fin is None or not fin.alive:
                continue
            storage.resize_(0)
            fin()  # counts it freed now; the finalizer will not run again
            self.stats["restored_freed_early"] += 1

    def _prefetch_before(self, index: int) -> None:
        if not self.owner.prefetch:
            return
        with self.lock:
            for j in range(index - 1, -1, -1):
                rec = self.records[j]
                if not rec.offloaded or rec.released or rec.consumed:
                    continue
                if rec.pending is not None:
                    return
                if self.alive_restored >= _MAX_RESTORED:
                    self.stats["prefetches_skipped"] += 1
                    return
                rec.pending = self._start_restore(rec)
                self.stats["prefetches"] += 1
                return

    def _restored_freed(self) -> None:
        with self.lock:
            self.alive_restored -= 1
            self.stats["restored_on_device"] = self.alive_restored

    def _release_host(self, rec: _Record) -> None:
        with self.lock:
            rec.released = True
            rec.pending = None
            buf, rec.host = rec.host, None
        if buf is not None:
            self.owner.pool.release(buf)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


class CheckpointOffload:
    """Offload full-recompute checkpoint boundaries to host memory within ``host_budget_bytes``.

    Use around the forward of a model that checkpoints its layers with a reentrant checkpoint
    (upstream ``megatron.core.tensor_parallel.checkpoint`` or
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``)::

        with CheckpointOffload(budget) as sco:
            loss = model(x).sum()
        loss.backward()          # restores (and prefetches) boundaries as the recompute needs them
        sco.stats["offloaded_boundaries"], sco.stats["max_restored_on_device"]

    Args:
        host_budget_bytes: host bytes the boundaries of one forward may occupy (0 offloads nothing).
        min_boundary_bytes: smaller checkpoint inputs are left on the device.
        checkpoint_functions: further ``torch.autograd.Function`` classes whose saved inputs count
            as boundaries (subclasses are included).
        pin_memory: use pinned host buffers for CUDA boundaries (default: True).
        pool: the :class:`HostBufferPool` to draw from (default: a pool of this instance's own,
            kept while it serves step after step).
        prefetch: start restoring boundary l-1 when boundary l is unpacked (default: True).
        use_streams: run the copies on side streams on CUDA (default: True); False copies
            synchronously on the current stream.
        max_inflight_offloads: offload copies allowed to be pending at once on CUDA; the forward
            waits for the oldest one beyond that (default: 2).

    The instance may be re-entered for the next step; ``stats`` and ``plan`` then describe the
    latest forward, and keep being updated by its backward after the ``with`` block has exited.
    """

    def __init__(
        self,
        host_budget_bytes,
        *,
        min_boundary_bytes: int = 0,
        checkpoint_functions: Iterable[type] = (),
        pin_memory: bool = True,
        pool: Optional[HostBufferPool] = None,
        prefetch: bool = True,
        use_streams: bool = True,
        max_inflight_offloads: int = 2,
    ):
        budget = int(host_budget_bytes)
        if budget < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        if int(min_boundary_bytes) < 0:
            raise ValueError(f"min_boundary_bytes must be >= 0, got {min_boundary_bytes}")
        self.host_budget_bytes = budget
        self.min_boundary_bytes = int(min_boundary_bytes)
        self.pin_memory = bool(pin_memory)
        self.pool = pool if pool is not None else HostBufferPool()
        self.prefetch = bool(prefetch)
        self.use_streams = bool(use_streams)
        if int(max_inflight_offloads) < 1:
            raise ValueError(f"max_inflight_offloads must be >= 1, got {max_inflight_offloads}")
        self.max_inflight_offloads = int(max_inflight_offloads)
        self._extra_functions = tuple(checkpoint_functions)
        for cls in self._extra_functions:
            if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
                raise TypeError(f"checkpoint_functions must be autograd.Function classes: {cls!r}")
        self._known_cache: Dict[type, bool] = {}
        self._step: Optional[_Step] = None
        self._hooks = None

    # ---------------------------------------------------------------- helpers

    def _is_checkpoint_function(self, cls: type) -> bool:
        hit = self._known_cache.get(cls)
        if hit is None:
            hit = issubclass(cls, self._extra_functions) if self._extra_functions else False
            if not hit:
                hit = any(
                    (getattr(c, "__module__", None), getattr(c, "__qualname__", None))
                    in _KNOWN_CHECKPOINT_FUNCTIONS
                    for c in cls.__mro__
                )
            self._known_cache[cls] = hit
        return hit

    def _pinned_for(self, t: torch.Tensor) -> bool:
        return self.pin_memory and t.is_cuda

    # ---------------------------------------------------------------- context manager

    def __enter__(self) -> "CheckpointOffload":
        if self._hooks is not None:
            raise RuntimeError("CheckpointOffload is already active")
        # Idle buffers beyond this budget (left by a context with a larger one) are given back.
        self.pool.trim(self.host_budget_bytes)
        step = _Step(self)
        hooks = torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack)
        hooks.__enter__()
        self._step, self._hooks = step, hooks
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(exc_type, exc, tb)
        return False

    # ---------------------------------------------------------------- reporting

    @property
    def stats(self) -> dict:
        """Live counters of the latest forward (and its backward)."""
        if self._step is None:
            return _new_stats()
        return self._step.stats

    @property
    def plan(self) -> List[Tuple[Tuple[int, ...], str, bool]]:
        """``(shape, dtype, offloaded)`` of every recognised boundary, in forward order."""
        if self._step is None:
            return []
        with self._step.lock:
            return [(r.shape, str(r.dtype), r.offloaded) for r in self._step.records]


@dataclass(frozen=True)
class SCOSettings(Settings):
    """SCO's flag; :attr:`host_budget_bytes` is the one rule from GiB to bytes."""

    sco_host_budget_gb: float = knob(
        0.0, "SCO: GiB of pinned host memory per GPU for full-recompute checkpoint boundaries, "
        "offloaded in forward order and prefetched one layer ahead in backward (0: off).",
        metavar="GIB")

    @property
    def enabled(self) -> bool:
        return self.sco_host_budget_gb > 0

    @property
    def host_budget_bytes(self) -> int:
        """Bytes of ``--sco-host-budget-gb`` (GiB), truncated, as :class:`CheckpointOffload` gets them."""
        return int(self.sco_host_budget_gb * GiB)

    @classmethod
    def holding(cls, nbytes: int) -> "SCOSettings":
        """The settings with the smallest ``--sco-host-budget-gb`` of 3 decimals whose bytes
        hold ``nbytes``."""
        value = math.ceil(nbytes * 1000 / GiB) / 1000
        while cls(sco_host_budget_gb=value).host_budget_bytes < nbytes:
            value = round(value + 0.001, 3)
        return cls(sco_host_budget_gb=value)

    def check(self, args) -> None:
        """Refuse a budget SCO cannot run (before any GPU allocation): not a finite number of GiB
        >= 0, less than a byte, no full recompute (or none of its layers), upstream's CPU
        offloading, pipeline parallelism, more pinned memory than the host can give."""
        flag, budget_gb = "--sco-host-budget-gb", self.sco_host_budget_gb
        if not math.isfinite(budget_gb) or budget_gb < 0:
            raise BoundedArgumentError(
                f"{flag} must be >= 0 and finite (GiB of pinned host memory per GPU; 0 turns SCO "
                f"off), got {budget_gb}."
            )
        if budget_gb == 0:
            return
        # before any byte count: an absurd budget is refused here rather than overflowing an int
        check_pinned_host_memory({flag: budget_gb}, BoundedArgumentError, fix=f"lower {flag}")
        if budget_gb * GiB < 1:
            raise BoundedArgumentError(
                f"{flag} {budget_gb} is less than one byte ({budget_gb} GiB rounds to 0 bytes), "
                f"which would turn SCO off: give the budget in GiB (e.g. {flag} 4), or 0 to turn "
                "SCO off."
            )
        self._check_recompute(args, flag)
        if args.pipeline_model_parallel_size > 1:
            raise BoundedArgumentError(
                f"{flag} is not supported with --pipeline-model-parallel-size > 1 yet (several "
                "micro-batches' forwards would hold host budget at once): use "
                f"--pipeline-model-parallel-size 1 or {flag} 0."
            )

    @staticmethod
    def _check_recompute(args, flag: str) -> None:
        """SCO offloads the boundaries of full recompute's checkpointed chunks."""
        if args.recompute_granularity != "full":
            raise BoundedArgumentError(
                f"{flag} offloads the checkpoint boundaries of full recompute: add "
                "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1, "
                f"or set {flag} 0."
            )
        if args.recompute_num_layers is not None and args.recompute_num_layers < 1:
            raise BoundedArgumentError(
                f"--recompute-num-layers {args.recompute_num_layers} checkpoints no layer, so "
                f"{flag} would offload nothing: use --recompute-num-layers 1 (or more), or set "
                f"{flag} 0."
            )
        if getattr(args, "cpu_offloading_num_layers", 0):
            # upstream's layer offloading refuses any activation recompute (in the model config)
            raise BoundedArgumentError(
                f"--cpu-offloading-num-layers cannot run with {flag} (upstream's CPU offloading "
                "does not work with the full recompute SCO needs): remove "
                f"--cpu-offloading-num-layers, or set {flag} 0."
            )


def boundaries_on_device(boundaries: int, boundary_bytes: int, host_budget: int,
                         restored_together: int = 1) -> tuple:
    """(offloaded, on the GPU at once) for ``boundaries`` checkpoint boundaries of
    ``boundary_bytes`` each under a host budget of ``host_budget`` bytes: boundaries are offloaded
    in forward order while the budget lasts, and in backward at most ``restored_together`` + 1
    offloaded ones are back on the GPU (the checkpoint in use and the one prefetched; a
    checkpoint of several boundaries, a multi-token-prediction layer's two, brings them back
    together)."""
    offloaded = min(int(boundaries), int(host_budget) // int(boundary_bytes)) if host_budget > 0 else 0
    return offloaded, (int(boundaries) - offloaded) + min(offloaded, restored_together + 1)
