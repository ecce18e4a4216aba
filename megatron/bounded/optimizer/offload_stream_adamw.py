"""OffloadStreamAdamW: AdamW with host-resident fp32 state, updated on the GPU bucket by bucket.

The fp32 master weights and both Adam moments of every parameter live in host memory (page-locked
when the parameters are on a GPU). Each step streams that state through a fixed number of GPU
staging slots, so the GPU never holds more optimizer state than the slots, and the host link (not a
CPU Adam kernel) sets the step time. The update rule is not changed: every element goes through
``torch._fused_adamw_``, the kernel behind ``torch.optim.AdamW(fused=True)``, with the same
hyperparameters and step count, so results are bitwise equal to that optimizer run on the same
fp32 master weights.

Bucket plan. Parameters, in param-group order, are packed into buckets of at most ``bucket_numel``
elements. A parameter that fits in the room left in the current bucket joins it; one that does not
fit but is no larger than a bucket opens a new bucket; a parameter larger than a bucket is split
into consecutive pieces that fill the current bucket and then whole buckets. Split points inside a
parameter fall on multiples of ``SPLIT_ALIGN`` (16) elements: the CPU fused kernel computes the
last ``numel % vector_width`` elements of each tensor on a scalar path whose rounding can differ
from its vector path, and aligned pieces keep that tail where an unsplit update has it (the CUDA
kernel gives the same bits for any split). Host state is one flat fp32 tensor per kind (master,
exp_avg, exp_avg_sq) with the parameters laid end to end, so a bucket is one contiguous range of
each and ``state[p]`` holds views of the parameter's own range.

Per bucket on CUDA (Algorithm 4 of "Flattening Every Memory Peak in Long-Context MoE Training"):

1. copy stream: wait until the slot's previous write-back has finished (``slot.free``), then copy
   the bucket's master, exp_avg and exp_avg_sq from host into the slot; record ``slot.loaded``;
2. compute stream (the caller's current stream, so gradients from backward are ready and the
   refreshed weights are ready for the next forward): wait for ``slot.loaded``, cast the gradients
   into the slot's fp32 gradient area, run the fused AdamW kernel on the slot, copy the updated
   master into the working parameters (bf16 or fp32); record ``slot.updated``;
3. write-back stream: wait for ``slot.updated``, copy master and moments back to host; record
   ``slot.free``, which releases the slot to the bucket ``num_slots`` places later.

Only the span from a bucket's first to its last piece with a gradient is moved; buckets without
gradients are skipped. The host never blocks inside ``step``: the next step's copies wait on an
event recorded after the last write-back, and ``state_dict``, ``load_state_dict`` and
``synchronize`` wait for it before touching host state. Without CUDA (parameters on the CPU) the
same buckets are updated in place in host memory, synchronously, with the same kernel.

Memory bound, fixed by the launch configuration alone:

* GPU staging = S × L × 16 B, where S = min(num_slots, number of buckets), L = the largest bucket
  (≤ bucket_numel) and 16 B = fp32 master + exp_avg + exp_avg_sq + gradient per element; so at most
  num_slots × bucket_numel × 16 B. Allocated once, at the first CUDA step; nothing else is staged.
* Host = 12 B per parameter (fp32 master + exp_avg + exp_avg_sq), exactly: the buffers are
  page-locked with ``cudaHostRegister`` because the caching pinned allocator rounds every block up
  to a power of two (up to 2x). Gradients are read where autograd leaves them, on the parameter's
  device, so no host gradient buffer exists.

``staging_bytes()`` and ``host_state_bytes()`` report what is allocated. Tests:
``tests/unit/optimizer/test_offload_stream_adamw.py::test_gpu_staging_bytes_match_measured_allocation``
measures the staging with ``torch.cuda.memory_allocated`` (and the step's peak with
``max_memory_allocated``); ``test_host_state_is_twelve_bytes_per_parameter`` checks the host side.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.bounded.units import ceil_div

__all__ = [
    "OffloadStreamAdamW",
    "Bucket",
    "BucketSegment",
    "plan_buckets",
    "SPLIT_ALIGN",
    "STAGED_BYTES_PER_ELEMENT",
    "HOST_BYTES_PER_ELEMENT",
    "check_bucket_numel",
    "check_num_slots",
    "DEFAULT_BUCKET_NUMEL",
    "DEFAULT_NUM_SLOTS",
]

# Defaults of --offload-stream-bucket-numel and --offload-stream-slots (and of the constructor):
# GPU staging = DEFAULT_NUM_SLOTS x DEFAULT_BUCKET_NUMEL x 16 B per optimizer, 3.2 GB.
DEFAULT_BUCKET_NUMEL = 100_000_000
DEFAULT_NUM_SLOTS = 2

# Split points inside a parameter are multiples of this many elements: one 64-byte line of fp32,
# a multiple of every CPU vector width the fused kernel uses.
SPLIT_ALIGN = 16

# Bytes staged on the GPU per bucket element: fp32 master, exp_avg, exp_avg_sq and gradient.
STAGED_BYTES_PER_ELEMENT = 16

# Bytes of host state per parameter element: fp32 master, exp_avg and exp_avg_sq.
HOST_BYTES_PER_ELEMENT = 12

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_bucket_numel(bucket_numel) -> int:
    """Return ``bucket_numel`` if it is a valid bucket size (an int >= 16), else raise ValueError."""
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int):
        raise ValueError(f"bucket_numel must be an int, got {bucket_numel!r}")
    if bucket_numel < SPLIT_ALIGN:
        raise ValueError(
            f"Invalid bucket_numel: {bucket_numel} (must be >= {SPLIT_ALIGN}: parameters larger "
            f"than a bucket are split on {SPLIT_ALIGN}-element boundaries)"
        )
    return bucket_numel


def check_num_slots(num_slots) -> int:
    """Return ``num_slots`` if it is a valid number of staging slots (an int >= 1), else raise."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"Invalid num_slots: {num_slots!r} (must be an int >= 1)")
    return num_slots


@dataclass(frozen=True)
class BucketSegment:
    """One piece of one parameter inside a bucket."""

    param_index: int  # position of the parameter in param-group order
    param_offset: int  # first element of the piece inside the flattened parameter
    bucket_offset: int  # first element of the piece inside the bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous range ``[start, start + numel)`` of the flat host state."""

    start: int
    numel: int
    segments: tuple[BucketSegment, ...]


def plan_buckets(param_numels: Sequence[int], bucket_numel: int) -> list[Bucket]:
    """Pack parameters of the given sizes, in order, into buckets of at most ``bucket_numel``.

    Parameters no larger than a bucket are never split; larger ones are split on ``SPLIT_ALIGN``
    boundaries. Empty parameters get no segment. The buckets partition the flat state exactly.
    """
    if bucket_numel < SPLIT_ALIGN:
        raise ValueError(f"bucket_numel must be >= {SPLIT_ALIGN}, got {bucket_numel}")
    buckets: list[Bucket] = []
    segments: list[BucketSegment] = []
    bucket_start = 0
    used = 0

    def close_bucket() -> None:
        nonlocal segments, bucket_start, used
        if segments:
            buckets.append(Bucket(bucket_start, used, tuple(segments)))
            bucket_start += used
        segments, used = [], 0

    for param_index, numel in enumerate(param_numels):
        if numel <= bucket_numel and numel > bucket_numel - used:
            close_bucket()
        offset = 0
        while offset < numel:
            remaining = numel - offset
            room = bucket_numel - used
            piece = remaining if remaining <= room else room // SPLIT_ALIGN * SPLIT_ALIGN
            if piece == 0:
                close_bucket()
                continue
            segments.append(BucketSegment(param_index, offset, used, piece))
            used += piece
            offset += piece
    close_bucket()
    return buckets


@dataclass(frozen=True)
class _Layout:
    """Where each parameter's state lives in the flat host tensors, and the bucket plan."""

    params: tuple[torch.Tensor, ...]
    group_index: tuple[int, ...]
    offsets: tuple[int, ...]
    total_numel: int
    buckets: tuple[Bucket, ...]


def _build_layout(param_groups: list[dict], bucket_numel: int) -> _Layout:
    params, group_index, offsets = [], [], []
    total = 0
    for index, group in enumerate(param_groups):
        for param in group["params"]:
            params.append(param)
            group_index.append(index)
            offsets.append(total)
            total += param.numel()
    buckets = plan_buckets([p.numel() for p in params], bucket_numel)
    return _Layout(tuple(params), tuple(group_index), tuple(offsets), total, tuple(buckets))


def _cuda_check(error, what: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"{what} failed with CUDA error {error}")


def _unregister_host_memory(buffers: tuple[torch.Tensor, ...], device: torch.device) -> None:
    torch.cuda.synchronize(device)  # write-backs still in flight target these buffers
    cudart = torch.cuda.cudart()
    for buffer in buffers:
        _cuda_check(cudart.cudaHostUnregister(buffer.data_ptr()), "cudaHostUnregister")


class _HostState:
    """Flat fp32 master, exp_avg and exp_avg_sq for all parameters, in host memory."""

    def __init__(self, numel: int):
        self.master = torch.zeros(numel, dtype=torch.float32)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32)
        self.page_locked = False

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def page_lock(self, device: torch.device) -> None:
        """Pin the buffers in place so that copies to and from ``device`` are asynchronous DMA."""
        if self.page_locked or self.master.numel() == 0:
            return
        cudart = torch.cuda.cudart()
        for buffer in self.buffers():
            nbytes = buffer.numel() * buffer.element_size()
            _cuda_check(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0), "cudaHostRegister")
        # The finalizer holds the buffers, so they are unregistered before their memory is freed.
        finalizer = weakref.finalize(self, _unregister_host_memory, self.buffers(), device)
        finalizer.atexit = False  # the process teardown releases registrations by itself
        self.page_locked = True


class _StagingSlot:
    """GPU room for one bucket: fp32 master, exp_avg, exp_avg_sq and gradient, plus its events."""

    def __init__(self, numel: int, device: torch.device, side_streams: Sequence[torch.cuda.Stream]):
        self.buffer = torch.empty(4 * numel, dtype=torch.float32, device=device)
        self.master, self.exp_avg, self.exp_avg_sq, self.grad = self.buffer.view(4, numel).unbind(0)
        # The copy streams use the buffer too; if it is ever freed, the allocator waits for them.
        for stream in side_streams:
            self.buffer.record_stream(stream)
        self.loaded = torch.cuda.Event()
        self.updated = torch.cuda.Event()
        self.free = torch.cuda.Event()


class _Streamer:
    """Staging slots, copy streams and events of the CUDA path; created at the first CUDA step."""

    def __init__(self, device: torch.device, slot_numel: int, num_slots: int):
        self.device = device
        self.h2d_stream = torch.cuda.Stream(device=device)
        self.d2h_stream = torch.cuda.Stream(device=device)
        with torch.cuda.device(device):
            self.slots = [
                _StagingSlot(slot_numel, device, (self.h2d_stream, self.d2h_stream))
                for _ in range(num_slots)
            ]
            # The allocator may hand the slots memory that the allocating stream freed while
            # kernels queued on it still use it; the copy streams must not write it before those
            # kernels ran. (A first step after a checkpoint load has no host sync before its
            # copies: without this wait, late kernels overwrote the loaded state in a slot.)
            allocating = torch.cuda.current_stream(device)
            self.h2d_stream.wait_stream(allocating)
            self.d2h_stream.wait_stream(allocating)
        self.writeback_done = torch.cuda.Event()

    def nbytes(self) -> int:
        return sum(slot.buffer.numel() * slot.buffer.element_size() for slot in self.slots)


@dataclass
class _Piece:
    """Tensors the fused kernel updates for one bucket segment."""

    segment: BucketSegment
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor


def _check_hyperparameters(group: dict) -> None:
    lr, eps, weight_decay, betas = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon: {eps} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay: {weight_decay} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas} (must be a pair (beta1, beta2))")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta{index + 1}: {beta} (must be in [0, 1))")
    for flag in ("amsgrad", "maximize"):
        if group.get(flag, False):
            raise ValueError(f"OffloadStreamAdamW does not support {flag}=True")


def _check_param(param: torch.Tensor) -> None:
    if param.dtype not in _SUPPORTED_PARAM_DTYPES:
        raise ValueError(
            f"OffloadStreamAdamW keeps fp32 master weights; parameters must be float32, bfloat16 "
            f"or float16, got {param.dtype}"
        )
    if not param.is_contiguous():
        raise ValueError("OffloadStreamAdamW needs contiguous parameters (it updates flat views)")


class OffloadStreamAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in host memory; see the module docstring.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (decoupled weight decay).
        bucket_numel: most elements updated per bucket; bounds the GPU staging. At least 16.
        num_slots: GPU staging buffers the buckets rotate through (2 overlaps load, update and
            write-back of consecutive buckets).

    ``state[p]`` holds ``step`` (a 0-d float32 CPU tensor, as in ``torch.optim.AdamW``) and CPU
    fp32 ``exp_avg``, ``exp_avg_sq`` and ``master_param`` shaped like ``p``. On CUDA they are
    written back asynchronously: call ``synchronize()`` before reading them directly
    (``state_dict()`` does it).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        num_slots: int = DEFAULT_NUM_SLOTS,
    ):
        check_bucket_numel(bucket_numel)
        check_num_slots(num_slots)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_hyperparameters(defaults)
        self.bucket_numel = bucket_numel
        self.num_slots = num_slots
        self._layout: _Layout | None = None
        self._host: _HostState | None = None
        self._streamer: _Streamer | None = None
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------- setup

    def add_param_group(self, param_group: dict) -> None:
        if self._host is not None:
            raise RuntimeError(
                "OffloadStreamAdamW cannot add a param group after its host state was allocated "
                "(first step() or load_state_dict()): the flat host buffers are sized once"
            )
        super().add_param_group(param_group)
        try:
            _check_hyperparameters(self.param_groups[-1])
            for param in self.param_groups[-1]["params"]:
                _check_param(param)
        except ValueError:
            self.param_groups.pop()
            raise
        self._layout = _build_layout(self.param_groups, self.bucket_numel)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The bucket plan over all parameters in param-group order."""
        return self._layout.buckets

    def staging_bytes(self) -> int:
        """GPU staging bytes allocated: min(num_slots, buckets) × largest bucket × 16; 0 on CPU."""
        return 0 if self._streamer is None else self._streamer.nbytes()

    def host_state_bytes(self) -> int:
        """Host bytes of fp32 master + moments allocated: 12 per parameter element."""
        return 0 if self._host is None else self._host.nbytes()

    def synchronize(self) -> None:
        """Block until the last step's write-back of master weights and moments has reached host."""
        if self._streamer is not None:
            self._streamer.writeback_done.synchronize()

    def _params_device(self) -> torch.device:
        devices = {p.device for p in self._layout.params}
        if len(devices) != 1:
            raise RuntimeError(
                f"OffloadStreamAdamW needs all parameters on one device, found {sorted(map(str, devices))}"
            )
        device = devices.pop()
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"OffloadStreamAdamW supports cpu and cuda parameters, not {device}")
        return device

    def _ensure_host_state(self) -> _HostState:
        if self._host is None:
            self._host = _HostState(self._layout.total_numel)
        return self._host

    def _ensure_streamer(self, device: torch.device) -> _Streamer:
        self._ensure_host_state().page_lock(device)
        if self._streamer is None:
            largest = max((bucket.numel for bucket in self._layout.buckets), default=0)
            num_slots = min(self.num_slots, len(self._layout.buckets))
            self._streamer = _Streamer(device, largest, num_slots)
        elif self._streamer.device != device:
            raise RuntimeError(
                f"parameters moved from {self._streamer.device} to {device} after the first step"
            )
        return self._streamer

    def _host_views(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of parameter ``index``, shaped like the parameter."""
        param = self._layout.params[index]
        start = self._layout.offsets[index]
        stop = start + param.numel()
        return tuple(buffer[start:stop].view(param.shape) for buffer in self._host.buffers())

    def _create_state(self, index: int, step: float, master: torch.Tensor | None) -> None:
        """Set parameter ``index``'s master weights in host memory and point ``state[param]`` at its range.

        ``master`` None takes the master weights from the parameter, as torch's optimizers do on
        a parameter's first update.
        """
        param = self._layout.params[index]
        master_view, exp_avg_view, exp_avg_sq_view = self._host_views(index)
        if master is None:
            master = param.detach()
            if master.dtype != torch.float32:
                # A cross-device cast would go through a parameter-sized fp32 temporary on the
                # GPU; casting on the host keeps the first step within the staging bound.
                master = master.cpu()
        master_view.copy_(master.reshape(param.shape))
        self.state[param] = {
            "step": torch.tensor(step, dtype=torch.float32),
            "exp_avg": exp_avg_view,
            "exp_avg_sq": exp_avg_sq_view,
            "master_param": master_view,
        }

    # ----------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._layout.params
        active = [i for i, p in enumerate(params) if self.grad_of(p) is not None]
        if not active:
            return loss
        for index in active:
            if self.grad_of(params[index]).is_sparse:
                raise RuntimeError("OffloadStreamAdamW does not support sparse gradients")
        device = self._params_device()
        self._ensure_host_state()
        streamer = self._ensure_streamer(device) if device.type == "cuda" else None

        first_updates = [i for i in active if params[i] not in self.state]
        if first_updates:
            # An in-flight write-back may cover these ranges (it spans whole buckets).
            self.synchronize()
            for index in first_updates:
                self._create_state(index, step=0.0, master=None)
                for moment in self._host_views(index)[1:]:
                    moment.zero_()
        for index in active:
            self.state[params[index]]["step"] += 1

        if streamer is None:
            self._step_on_host(set(active))
        else:
            self._step_streamed(streamer, active)
        return loss

    def _fused_adamw(self, pieces: list[_Piece]) -> None:
        """One fused kernel call per parameter group present among ``pieces``."""
        by_group: dict[int, list[_Piece]] = defaultdict(list)
        for piece in pieces:
            by_group[self._layout.group_index[piece.segment.param_index]].append(piece)
        for group_index, group_pieces in by_group.items():
            group = self.param_groups[group_index]
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(
                [piece.master for piece in group_pieces],
                [piece.grad for piece in group_pieces],
                [piece.exp_avg for piece in group_pieces],
                [piece.exp_avg_sq for piece in group_pieces],
                [],
                [piece.step for piece in group_pieces],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
                amsgrad=False,
                maximize=False,
            )

    def _refresh_params(self, pieces: list[_Piece]) -> None:
        """Copy updated master pieces into the working parameters (rounding to their dtype)."""
        for piece in pieces:
            segment = piece.segment
            param = self._layout.params[segment.param_index].detach().view(-1)
            param[segment.param_offset : segment.param_offset + segment.numel].copy_(piece.master)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient ``step`` applies to ``param``: ``param.grad``.

        Subclasses that receive gradients elsewhere (e.g. a ``decoupled_grad`` attribute whose
        dtype differs from the parameter's) override this; it must return a tensor with the
        parameter's number of elements on the parameter's device, or None to skip the parameter.
        """
        return param.grad

    def _grad_piece(self, segment: BucketSegment) -> torch.Tensor:
        grad = self.grad_of(self._layout.params[segment.param_index]).reshape(-1)
        return grad[segment.param_offset : segment.param_offset + segment.numel]

    def _step_on_host(self, active: set[int]) -> None:
        """CPU parameters: update each bucket in place in host memory."""
        master, exp_avg, exp_avg_sq = self._host.buffers()
        params = self._layout.params
        for bucket in self._layout.buckets:
            pieces = []
            for segment in bucket.segments:
                if segment.param_index not in active:
                    continue
                start = bucket.start + segment.bucket_offset
                stop = start + segment.numel
                pieces.append(
                    _Piece(
                        segment,
                        master[start:stop],
                        self._grad_piece(segment).to(torch.float32),
                        exp_avg[start:stop],
                        exp_avg_sq[start:stop],
                        self.state[params[segment.param_index]]["step"],
                    )
                )
            if pieces:
                self._fused_adamw(pieces)
                self._refresh_params(pieces)

    def _step_streamed(self, streamer: _Streamer, active: list[int]) -> None:
        """CUDA parameters: rotate buckets through the staging slots on three streams."""
        params = self._layout.params
        device = streamer.device
        host_master, host_exp_avg, host_exp_avg_sq = self._host.buffers()
        with torch.cuda.device(device):
            compute = torch.cuda.current_stream(device)
            # The CUDA kernel reads step counts from device memory: one small copy per step, from
            # pinned memory so that it never waits for the compute stream (the caching host
            # allocator keeps the block until the copy is done).
            host_steps = torch.stack([self.state[params[i]]["step"] for i in active]).pin_memory()
            device_steps = host_steps.to(device, non_blocking=True)
            step_of = {index: device_steps[k] for k, index in enumerate(active)}
            # Host state read below must include the previous step's write-back.
            streamer.h2d_stream.wait_event(streamer.writeback_done)

            slot_turn = 0
            for bucket in self._layout.buckets:
                segments = [s for s in bucket.segments if s.param_index in step_of]
                if not segments:
                    continue
                slot = streamer.slots[slot_turn % len(streamer.slots)]
                slot_turn += 1
                # Move only the span that holds pieces with gradients.
                lo = segments[0].bucket_offset
                hi = segments[-1].bucket_offset + segments[-1].numel
                host_range = slice(bucket.start + lo, bucket.start + hi)
                staged = (slot.master[lo:hi], slot.exp_avg[lo:hi], slot.exp_avg_sq[lo:hi])
                on_host = (host_master[host_range], host_exp_avg[host_range], host_exp_avg_sq[host_range])

                with torch.cuda.stream(streamer.h2d_stream):
                    streamer.h2d_stream.wait_event(slot.free)
                    for device_view, host_view in zip(staged, on_host):
                        device_view.copy_(host_view, non_blocking=True)
                    slot.loaded.record(streamer.h2d_stream)

                compute.wait_event(slot.loaded)
                pieces = []
                for segment in segments:
                    piece = slice(segment.bucket_offset, segment.bucket_offset + segment.numel)
                    slot.grad[piece].copy_(self._grad_piece(segment))
                    pieces.append(
                        _Piece(
                            segment,
                            slot.master[piece],
                            slot.grad[piece],
                            slot.exp_avg[piece],
                            slot.exp_avg_sq[piece],
                            step_of[segment.param_index],
                        )
                    )
                self._fused_adamw(pieces)
                self._refresh_params(pieces)
                slot.updated.record(compute)

                with torch.cuda.stream(streamer.d2h_stream):
                    streamer.d2h_stream.wait_event(slot.updated)
                    for host_view, device_view in zip(on_host, staged):
                        host_view.copy_(device_view, non_blocking=True)
                    slot.free.record(streamer.d2h_stream)
            streamer.writeback_done.record(streamer.d2h_stream)

    # ----------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        self.synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW``.

        Values are copied into this optimizer's own host buffers (nothing is aliased). A state
        without ``master_param`` (torch's AdamW) takes the master weights from the parameters.
        """
        for group in state_dict["param_groups"]:
            _check_hyperparameters(group)
        self.synchronize()
        saved_state = state_dict["state"]
        # The base class restores the param groups (and validates their sizes); the state is
        # copied below, so that it lands in host buffers in fp32 whatever the parameter dtype.
        super().load_state_dict({**state_dict, "state": {}})
        self._ensure_host_state()
        saved_ids = [saved_id for group in state_dict["param_groups"] for saved_id in group["params"]]
        for index, saved_id in enumerate(saved_ids):
            param = self._layout.params[index]
            entry = saved_state.get(saved_id)
            if entry is None:
                for moment in self._host_views(index)[1:]:
                    moment.zero_()
                continue
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in entry and entry[key].numel() != param.numel():
                    raise ValueError(
                        f"state of parameter {saved_id}: {key} has {entry[key].numel()} elements, "
                        f"the parameter has {param.numel()}"
                    )
            self._create_state(index, step=float(entry["step"]), master=entry.get("master_param"))
            _, exp_avg_view, exp_avg_sq_view = self._host_views(index)
            exp_avg_view.copy_(entry["exp_avg"].reshape(param.shape))
            exp_avg_sq_view.copy_(entry["exp_avg_sq"].reshape(param.shape))


def staging_bound_bytes(num_params: int, bucket_numel: int, num_slots: int) -> int:
    """GPU staging of OffloadStreamAdamW over ``num_params`` parameters, from the settings alone:
    min(num_slots, buckets) × largest bucket × 16 B (fp32 master, two moments and the gradient
    of each element in a slot); what :meth:`OffloadStreamAdamW.staging_bytes` then allocates for
    one flat parameter group."""
    if num_params <= 0:
        return 0
    buckets = ceil_div(num_params, bucket_numel)
    return min(int(num_slots), buckets) * min(int(bucket_numel), int(num_params)) * STAGED_BYTES_PER_ELEMENT
