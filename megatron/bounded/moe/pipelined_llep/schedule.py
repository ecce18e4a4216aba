"""The chunk pipeline: dispatch(i+1) | compute(i) | combine(i), with the all-to-alls on a side
stream ordered by events on CUDA and in program order on CPU."""

from __future__ import annotations

from typing import Dict

import torch

_COMM_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


class Schedule:
    """Runs dispatch / combine on a side stream and the expert GEMM on the current stream.

    Inactive (everything on the current stream, program order) on CPU or when overlap is off.
    """

    def __init__(self, device: torch.device, enabled: bool):
        self.active = bool(enabled) and device.type == "cuda"
        if self.active:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _COMM_STREAMS:
                _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
            self.comm = _COMM_STREAMS[index]
            self.compute = torch.cuda.current_stream(index)

    def begin(self) -> None:
        if self.active:
            self.comm.wait_stream(self.compute)

    def end(self) -> None:
        if self.active:
            self.compute.wait_stream(self.comm)

    def on_comm(self, fn, *args, wait=None):
        if not self.active:
            return fn(*args), None
        with torch.cuda.stream(self.comm):
            if wait is not None:
                self.comm.wait_event(wait)
            out = fn(*args)
            event = torch.cuda.Event()
            event.record(self.comm)
        return out, event

    def on_compute(self, fn, *args, wait=None):
        if not self.active:
            return fn(*args), None
        if wait is not None:
            self.compute.wait_event(wait)
        out = fn(*args)
        event = torch.cuda.Event()
        event.record(self.compute)
        return out, event

    def to_compute(self, *tensors) -> None:
        """Tensors made on the side stream and used on the compute stream."""
        if self.active:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.compute)

    def to_comm(self, *tensors) -> None:
        """Tensors made on the compute stream and used on the side stream."""
        if self.active:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.comm)


def pipeline(num_chunks: int, dispatch, compute, combine, schedule: Schedule) -> None:
    """dispatch(i+1) | compute(i) | combine(i): at most two dispatched chunks alive at once."""
    schedule.begin()
    pending = schedule.on_comm(dispatch, 0)
    for i in range(num_chunks):
        ahead = schedule.on_comm(dispatch, i + 1) if i + 1 < num_chunks else None
        state, ready = pending
        result = schedule.on_compute(compute, i, state, wait=ready)
        schedule.on_comm(combine, i, state, result[0], wait=result[1])
        pending = ahead
        del state, result
    schedule.end()

