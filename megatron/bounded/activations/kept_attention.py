"""Attention kept from the forward for the recompute (``--chunked-recompute-keep-attention``).

Under full recompute each layer runs twice: without gradients in the forward and again with
gradients in its backward. With the attention sublayer in chunks
(:mod:`megatron.bounded.activations.chunked_attention`) the second run needs attention only for
what its backward reads: K, V, attention's output and its log-sum-exp. At long context attention
is nearly all of a layer's work, so running it again is most of the recompute's cost, while what
it produces is small (``saved_bytes_per_token`` per token and layer). With the flag the first
forward hands those four tensors to the process's :class:`KeptAttention` and the recompute takes
them back instead of running attention again: the same tensors the same kernels produced from the
same inputs, so the step is exact.

Where they wait:

* ``gpu``: on the device, from the layer's forward to its recompute (at the loss every layer's).
* ``host``: in pinned host memory. Each layer's copy runs on a side stream while the forward goes
  on (at most one copy in flight; the device blocks are freed once their copy is done); in
  backward, taking layer l's starts layer l-1's copy back, so it arrives while layer l is
  back-propagated (at most two layers' worth on the device).

The entries are keyed by the attention module and taken in backward order: one micro-batch's
forward and backward at a time (no pipeline parallelism, whose schedules interleave them). The
memory formula is :func:`megatron.bounded.activations.chunked_attention.kept_attention_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.bounded.activations.host_memory import copy_streams
from megatron.bounded.activations.sco import HostBufferPool

__all__ = ["KeptAttention", "kept_attention"]


class _Entry:
    """One layer's kept tensors: on the device (``tensors``), or in ``host`` buffers and, once
    a copy back has started, in ``restored``."""

    __slots__ = ("tensors", "kernel", "host", "shapes", "dtypes", "device", "d2h_event",
                 "h2d_event", "restored")

    def __init__(self, tensors: Sequence[torch.Tensor], kernel):
        self.tensors: Optional[List[torch.Tensor]] = list(tensors)
        self.kernel = kernel
        self.host = None
        self.shapes = [t.shape for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.device = tensors[0].device
        self.d2h_event = self.h2d_event = None
        self.restored: Optional[List[torch.Tensor]] = None


class KeptAttention:
    """The tensors attention's forward kept for each layer's recompute (see the module
    docstring). ``stats``: layers kept and taken back, copies back started ahead and on demand,
    bytes copied to the host."""

    def __init__(self):
        self._entries: "OrderedDict[object, _Entry]" = OrderedDict()
        # its own pool: SCO trims the pool it draws from at each step's start
        self.pool = HostBufferPool()
        self._offload_in_flight = None
        self.stats = {"kept": 0, "taken": 0, "prefetches": 0, "on_demand_restores": 0,
                      "offloaded_bytes": 0}

    def keep(self, owner, tensors: Sequence[torch.Tensor], kernel, on_host: bool) -> None:
        """Keep ``tensors`` (and the name of the kernel that made them) for ``owner``'s recompute;
        an entry ``owner`` left untaken (a forward without backward) is dropped."""
        self.drop(owner)
        entry = _Entry([t.detach() for t in tensors], kernel)
        if on_host:
            self._offload(entry)
        self._entries[owner] = entry
        self.stats["kept"] += 1

    def take(self, owner) -> Optional[Tuple[List[torch.Tensor], object]]:
        """``(tensors, kernel)`` kept for ``owner``, now usable on the current stream, or None;
        starts the copy back of the entry to be taken next."""
        entry = self._entries.pop(owner, None)
        if entry is None:
            return None
        if entry.host is not None:
            if entry.restored is None:
                self._restore(entry)
                self.stats["on_demand_restores"] += 1
            if entry.h2d_event is not None:
                torch.cuda.current_stream(entry.device).wait_event(entry.h2d_event)
            tensors = entry.restored
            self._release_host(entry)
        else:
            tensors = entry.tensors
        self.stats["taken"] += 1
        self._prefetch_next()
        return tensors, entry.kernel

    def drop(self, owner) -> None:
        """Forget what was kept for ``owner``."""
        entry = self._entries.pop(owner, None)
        if entry is not None and entry.host is not None:
            self._release_host(entry)

    def clear(self) -> None:
        for owner in list(self._entries):
            self.drop(owner)

    def device_bytes(self) -> int:
        """Bytes the kept tensors hold on their device now (in flight to the host included)."""
        total = 0
        for entry in self._entries.values():
            for tensors in (entry.tensors, entry.restored):
                total += sum(t.numel() * t.element_size() for t in tensors or ())
        return total

    def __len__(self) -> int:
        return len(self._entries)

    def _offload(self, entry: _Entry) -> None:
        tensors, cuda = entry.tensors, entry.device.type == "cuda"
        entry.host = [self.pool.acquire(t.numel(), t.dtype, pinned=cuda)[0] for t in tensors]
        if cuda:
            if self._offload_in_flight is not None:
                # one copy in flight: bounds the device blocks that wait for their copy
                self._offload_in_flight.synchronize()
            d2h, _ = copy_streams(entry.device)
            d2h.wait_stream(torch.cuda.current_stream(entry.device))
            for buf in entry.host:
                if buf.last_event is not None:  # a copy back may still read the buffer
                    d2h.wait_event(buf.last_event)
            with torch.cuda.stream(d2h):
                for buf, t in zip(entry.host, tensors):
                    buf.tensor.view(t.shape).copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(d2h)
            for buf, t in zip(entry.host, tensors):
                t.record_stream(d2h)  # the block is reused only once the copy has read it
                buf.last_event = event
            entry.d2h_event = self._offload_in_flight = event
        else:
            for buf, t in zip(entry.host, tensors):
                buf.tensor.view(t.shape).copy_(t)
        self.stats["offloaded_bytes"] += sum(buf.nbytes for buf in entry.host)
        entry.tensors = None

    def _restore(self, entry: _Entry) -> None:
        restored = [torch.empty(shape, dtype=dtype, device=entry.device)
                    for shape, dtype in zip(entry.shapes, entry.dtypes)]
        if entry.device.type == "cuda":
            _, h2d = copy_streams(entry.device)
            # the blocks come from the compute stream's pool; the host copy must be complete
            h2d.wait_stream(torch.cuda.current_stream(entry.device))
            if entry.d2h_event is not None:
                h2d.wait_event(entry.d2h_event)
            with torch.cuda.stream(h2d):
                for buf, t in zip(entry.host, restored):
                    t.copy_(buf.tensor.view(t.shape), non_blocking=True)
                event = torch.cuda.Event()
                event.record(h2d)
            for buf, t in zip(entry.host, restored):
                t.record_stream(h2d)
                buf.last_event = event
            entry.h2d_event = event
        else:
            for buf, t in zip(entry.host, restored):
                t.copy_(buf.tensor.view(t.shape))
        entry.restored = restored

    def _prefetch_next(self) -> None:
        if not self._entries:
            return
        entry = next(reversed(self._entries.values()))  # backward takes the last kept first
        if entry.host is not None and entry.restored is None:
            self._restore(entry)
            self.stats["prefetches"] += 1

    def _release_host(self, entry: _Entry) -> None:
        for buf in entry.host:
            self.pool.release(buf)
        entry.host = None


_KEPT = KeptAttention()


def kept_attention() -> KeptAttention:
    """The process's store of kept attention tensors."""
    return _KEPT
