"""OffloadStreamAdamW as the inner optimizer of megatron-core's ``DistributedOptimizer``.

megatron-core 0.19.2 already has a host-state path through its distributed optimizer: with
``--optimizer-cpu-offload`` it builds a ``HybridDeviceOptimizer`` (HDO), and ``DistributedOptimizer``
then keeps no fp32 main parameters on the GPU, hands the inner optimizer the bf16/fp32 *shard views
of the model parameter buffer* of this data-parallel rank, attaches each shard's gradient as
``param.decoupled_grad`` (a view of the fp32/bf16 grad buffer), and checkpoints the inner state
``state[shard] = {master_param, exp_avg, exp_avg_sq, step}`` through its HDO branches
(``isinstance(optimizer, HybridDeviceOptimizer)``). :class:`OffloadStreamHybridOptimizer` is an HDO
subclass whose work is done by :class:`OffloadStreamAdamW`: every rank streams only its own shard
through the GPU staging slots, so the GPU holds no fp32 master weight or moment, and the
distributed checkpoints (``dp_reshardable``, ``fully_reshardable`` and the legacy ``dp_zero``
file; ``fully_sharded_model_space`` cannot be built by megatron-core 0.19.2 at all) save and
restore the host state.

What ``DistributedOptimizer`` does with the inner optimizer, and how this class answers:

* It is constructed twice: by ``_get_megatron_optimizer_based_on_param_groups`` with the model's
  parameters and HDO's keyword arguments, then rebuilt over the shard views with
  ``HybridDeviceOptimizer(params=groups, **old.defaults)``. ``HybridDeviceOptimizer.__init__`` is
  not called (it would clone parameters to the host and build CPU sub-optimizers); ``defaults``
  holds exactly the keyword arguments the rebuild must pass back, bucket plan included. Host state
  is allocated lazily (first step, ``dummy_step`` or ``state_dict``), so the discarded first
  instance costs nothing; the run-time change to ``DistributedOptimizer.__init__`` then calls
  :meth:`OffloadStreamHybridOptimizer.allocate_host_state` on the rebuilt one.
* Gradients: ``param.decoupled_grad`` when set, else ``param.grad`` (:meth:`grad_of`).
* ``sub_optimizers`` is empty (there are none). ``DistributedOptimizer.state_dict`` looks for the
  common ``step`` in torch Adam sub-optimizers when Apex or Transformer Engine is installed; this
  class writes that step into every param group of its own ``state_dict`` instead, which is where
  ``DistributedOptimizer.load_state_dict`` reads it back, with or without Apex/TE.
* ``dummy_step()`` gives every parameter its state at step 0 (master = parameter, zero moments)
  without changing anything; ``state_dict()`` does the same first, so a fresh optimizer can build
  the template a checkpoint is loaded into (upstream asserts on a missing ``step`` otherwise).
* Loading assigns tensors into ``state[p][k]`` directly (``_set_main_param_and_optimizer_states``)
  instead of copying into them. Such tensors are *adopted*: copied into this optimizer's host
  buffers and ``state[p]`` pointed back at them, by ``_sync_hdo_state_to_sub_optimizers()`` (which
  upstream calls after two of the load paths) and, for the others, at the start of ``step()``,
  ``state_dict()`` and ``update_fp32_param_by_new_param()``.
* ``step`` is owned by this optimizer: every parameter keeps one step tensor for its lifetime,
  changed only by ``step()`` and ``load_state_dict()``; a step tensor that other code puts into
  ``state[p]`` is discarded. Upstream's checkpoint formats never carry ``step`` in the parameter
  state (it travels in the param groups, into ``load_state_dict``), but the ``dp_reshardable`` load
  assigns back the step tensor captured when the load template was built. That is this class's
  own counter, which the load has updated, unless other code replaced the step tensors in between
  (this project's run-time patch for torch AdamW clones them after every load): then it is a
  copy that still holds the template's step 0.
* ``update_fp32_param_by_new_param()`` (``reload_model_params``) copies the parameters into the
  master weights of every parameter that has state.
* Reading ``state`` waits for the last step's asynchronous write-back, so upstream code that reads
  the host tensors directly (``save_parameter_state`` of the legacy format does, without calling
  ``state_dict`` first) never sees a partly written step.

Binding: megatron-core refers to the class by name in two modules, and both must name the
configured subclass (:data:`HYBRID_DEVICE_OPTIMIZER_BINDINGS`); build it with
:func:`offload_stream_hybrid_optimizer_class`. Configuration required of the run: distributed
optimizer, adam with decoupled weight decay, ``optimizer_cpu_offload`` and
``use_precision_aware_optimizer`` (selects the HDO path and the shard views / ``decoupled_grad``),
``optimizer_offload_fraction`` 1.0, fp32 main parameters and moments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from megatron.bounded.settings import BoundedArgumentError, Settings, knob

from megatron.bounded.optimizer.offload_stream_adamw import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_NUM_SLOTS,
    OffloadStreamAdamW,
    check_bucket_numel,
    check_num_slots,
)

__all__ = [
    "OffloadStreamSettings",
    "OffloadStreamHybridOptimizer",
    "offload_stream_hybrid_optimizer_class",
    "check_bucket_numel",
    "check_num_slots",
    "HYBRID_DEVICE_OPTIMIZER_BINDINGS",
]

# (module, attribute) pairs through which megatron-core constructs its HybridDeviceOptimizer:
# the first build in get_megatron_optimizer, and DistributedOptimizer's rebuild over the shards.
HYBRID_DEVICE_OPTIMIZER_BINDINGS = (
    ("megatron.core.optimizer", "HybridDeviceOptimizer"),
    ("megatron.core.optimizer.distrib_optimizer", "HybridDeviceOptimizer"),
)

# Per-parameter state tensors other than ``step``, in the order of OffloadStreamAdamW's host views.
_TENSOR_KEYS = ("master_param", "exp_avg", "exp_avg_sq")

# torch AdamW keyword arguments accepted only at the value that matches this optimizer.
_FIXED_TORCH_ARGUMENTS = {
    "amsgrad": False,
    "maximize": False,
    "differentiable": False,
    "capturable": False,
    "foreach": None,
}


def _same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``tensor`` is exactly ``view``'s host memory (a different object over the same data)."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype == view.dtype
        and tensor.numel() == view.numel()
        and tensor.is_contiguous()
        and tensor.data_ptr() == view.data_ptr()
    )


def _check_hybrid_arguments(name: str, offload_fraction, cpu_optimizer_cls, param_update_in_fp32,
                            bias_correction, torch_arguments: dict) -> None:
    """Refuse HybridDeviceOptimizer arguments this optimizer does not implement (it is AdamW with
    bias correction, fp32 master weights and all state in host memory)."""
    unknown = sorted(set(torch_arguments) - set(_FIXED_TORCH_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"{name} is AdamW only; unsupported arguments {unknown} (megatron-core passes "
            f"these for --optimizer sgd, which offload streaming does not support)"
        )
    for key, value in torch_arguments.items():
        if value != _FIXED_TORCH_ARGUMENTS[key]:
            raise ValueError(f"{name} does not support {key}={value!r}")
    if offload_fraction != 1.0:
        raise ValueError(
            f"{name} keeps all optimizer state in host memory: offload_fraction must be 1.0, "
            f"got {offload_fraction}"
        )
    if not param_update_in_fp32:
        raise ValueError(f"{name} always keeps fp32 master weights: param_update_in_fp32 must be True")
    if not bias_correction:
        raise ValueError(f"{name} implements AdamW with bias correction: bias_correction must be True")
    if cpu_optimizer_cls is not None and not (
        isinstance(cpu_optimizer_cls, type) and issubclass(cpu_optimizer_cls, torch.optim.Adam)
    ):
        raise ValueError(
            f"{name} implements AdamW, but the optimizer requested is {cpu_optimizer_cls!r}"
        )


class OffloadStreamHybridOptimizer(HybridDeviceOptimizer, OffloadStreamAdamW):
    """A ``HybridDeviceOptimizer`` for ``DistributedOptimizer`` whose update is OffloadStreamAdamW.

    The constructor takes HybridDeviceOptimizer's arguments (as megatron-core passes them) and
    OffloadStreamAdamW's bucket plan. ``bucket_numel`` and ``num_slots`` default to the class
    attributes ``default_bucket_numel`` / ``default_num_slots``, which
    :func:`offload_stream_hybrid_optimizer_class` sets, because megatron-core constructs the class
    without them.

    Args:
        params: parameters or param groups (megatron-core's groups carry ``wd_mult`` etc.).
        offload_fraction: must be 1.0: all optimizer state is in host memory.
        cpu_optimizer_cls: the algorithm megatron-core asked for; must be Adam/AdamW or None.
        gpu_optimizer_cls, pin_cpu_grads, pin_cpu_params, overlap_cpu_optimizer_d2h_h2d: accepted
            and kept in ``defaults`` for the rebuild; unused (there are no sub-optimizers and no
            host gradient copies; host state is page-locked in place).
        param_update_in_fp32: must be True (master weights are fp32).
        lr, betas, eps, weight_decay: AdamW hyperparameters (decoupled weight decay).
        bias_correction: must be True.
        fused: accepted and ignored (the update is always torch's fused AdamW kernel).
        bucket_numel, num_slots: OffloadStreamAdamW's bucket plan.
    """

    default_bucket_numel: int | None = None
    default_num_slots: int | None = None

    def __init__(
        self,
        params,
        offload_fraction: float = 1.0,
        cpu_optimizer_cls=None,
        gpu_optimizer_cls=None,
        param_update_in_fp32: bool = True,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = False,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        bias_correction: bool = True,
        fused=None,
        bucket_numel: int | None = None,
        num_slots: int | None = None,
        **torch_arguments,
    ):
        name = type(self).__name__
        _check_hybrid_arguments(name, offload_fraction, cpu_optimizer_cls, param_update_in_fp32,
                                bias_correction, torch_arguments)
        bucket_numel, num_slots = self._bucket_plan(name, bucket_numel, num_slots)

        # Set before the base constructor: the `state` property reads it.
        self._writeback_in_flight = False
        # One step tensor per parameter index for the optimizer's lifetime (see the module docstring).
        self._step_counters: dict[int, torch.Tensor] = {}
        # The host views state[p] holds when it is this optimizer's own, per parameter index.
        self._own_views: dict[int, tuple[torch.Tensor, ...]] = {}
        OffloadStreamAdamW.__init__(
            self,
            params,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bucket_numel=bucket_numel,
            num_slots=num_slots,
        )
        if self._layout.params:
            self._params_device()  # all parameters on one cpu or cuda device, or a clear error

        # DistributedOptimizer rebuilds the optimizer as cls(params=..., **self.defaults).
        self.defaults = dict(
            offload_fraction=offload_fraction,
            cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls,
            param_update_in_fp32=param_update_in_fp32,
            pin_cpu_grads=pin_cpu_grads,
            pin_cpu_params=pin_cpu_params,
            overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            fused=fused,
            bucket_numel=bucket_numel,
            num_slots=num_slots,
        )
        # HybridDeviceOptimizer's configuration attributes, for code that inspects them.
        self.offload_fraction = offload_fraction
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.sub_optimizer_kwargs = {}
        self.cpu_optimizers = []
        self.gpu_optimizer = None

    def _bucket_plan(self, name: str, bucket_numel, num_slots) -> tuple[int, int]:
        """The bucket plan given, else the class's defaults (megatron-core passes none), checked."""
        if bucket_numel is None:
            bucket_numel = self.default_bucket_numel
        if num_slots is None:
            num_slots = self.default_num_slots
        if bucket_numel is None or num_slots is None:
            raise ValueError(
                f"{name}: bucket_numel and num_slots are not configured; pass them or build the class "
                f"with offload_stream_hybrid_optimizer_class(bucket_numel, num_slots)"
            )
        check_bucket_numel(bucket_numel)
        check_num_slots(num_slots)
        return bucket_numel, num_slots

    def add_param_group(self, param_group: dict) -> None:
        """OffloadStreamAdamW.add_param_group, accepting parameters that are not autograd leaves.

        DistributedOptimizer hands fp32 parameters over as plain views of the model parameters
        (``model_param.view(-1)[range]``, not detached), which torch refuses to optimize unless
        the optimizer is differentiable. This optimizer reads gradients from ``decoupled_grad``
        and writes parameters through ``detach()``, so such views are updated correctly.
        """
        had_key = "differentiable" in param_group
        previous = self.defaults.get("differentiable")
        self.defaults["differentiable"] = True  # torch skips its leaf check for these only
        try:
            OffloadStreamAdamW.add_param_group(self, param_group)
        finally:
            self.defaults["differentiable"] = previous
            if previous is None:
                del self.defaults["differentiable"]
        if not had_key:
            self.param_groups[-1].pop("differentiable", None)

    # ------------------------------------------------------------------------- state access

    @property
    def state(self):
        """Per-parameter state; reading it first waits for the last step's write-back to host."""
        if self.__dict__.get("_writeback_in_flight"):
            self.__dict__["_writeback_in_flight"] = False
            self.synchronize()
        return self.__dict__["state"]

    @state.setter
    def state(self, value) -> None:
        self.__dict__["state"] = value

    @property
    def sub_optimizers(self) -> list:
        """No sub-optimizers: the update runs in this object (see the module docstring on ``step``)."""
        return []

    # ------------------------------------------------------------------------- gradients, step

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param.decoupled_grad`` when set (DistributedOptimizer's precision-aware path), else ``param.grad``."""
        grad = getattr(param, "decoupled_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            if grad.numel() != param.numel():
                raise ValueError(
                    f"gradient has {grad.numel()} elements, its parameter has {param.numel()}"
                )
            if grad.device != param.device:
                raise RuntimeError(f"gradient is on {grad.device}, its parameter on {param.device}")
        return grad

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient (OffloadStreamAdamW.step)."""
        self._adopt_assigned_state()
        loss = OffloadStreamAdamW.step(self, closure)
        if self._streamer is not None:
            self._writeback_in_flight = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``grad`` and ``decoupled_grad`` of every parameter."""
        for group in self.param_groups:
            for param in group["params"]:
                decoupled = getattr(param, "decoupled_grad", None)
                if decoupled is not None:
                    if set_to_none:
                        param.decoupled_grad = None
                    else:
                        decoupled.zero_()
        torch.optim.Optimizer.zero_grad(self, set_to_none)

    def dummy_step(self) -> None:
        """Give every parameter without state its state at step 0; change nothing else.

        DistributedOptimizer calls this before loading a checkpoint into a fresh optimizer.
        """
        self._materialize_state()

    def allocate_host_state(self) -> None:
        """Give every parameter without state its step-0 state and page-lock the host buffers
        now: what the first ``step()`` would do first (allocating, zeroing and pinning 12 bytes
        per parameter element takes seconds), done when ``DistributedOptimizer`` is built, so
        that the first iteration costs what the others do and a host that cannot hold the state
        fails at setup. The GPU staging is still allocated by the first step."""
        self._materialize_state()
        if self._host is not None and self._layout.params:
            device = self._params_device()
            if device.type == "cuda":
                self._host.page_lock(device)

    # ------------------------------------------------------------------------- HDO hooks

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Called by DistributedOptimizer after assigning loaded tensors into ``state``: adopt them."""
        self._adopt_assigned_state()

    def _sync_hdo_param_groups_to_sub_optimizers(self) -> None:
        """Nothing to do: the param groups are read directly at every step."""

    def update_fp32_param_by_new_param(self) -> None:
        """Copy the current parameters into the fp32 master weights of all parameters with state."""
        self._adopt_assigned_state()
        self.synchronize()
        with torch.no_grad():
            for index, param in enumerate(self._layout.params):
                if param not in self.state:
                    continue
                self._own_views[index][0].view(-1).copy_(self._param_as_master_source(param))

    # ------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """The state of every parameter (created at step 0 if missing), with the common ``step``
        also written into each param group, where DistributedOptimizer's load reads it."""
        self._materialize_state()
        state_dict = OffloadStreamAdamW.state_dict(self)
        steps = {float(entry["step"]) for entry in state_dict["state"].values()}
        if len(steps) == 1:
            step = steps.pop()
            for group in state_dict["param_groups"]:
                group["step"] = int(step) if step.is_integer() else step
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer's parameter layout (OffloadStreamAdamW.load_state_dict).

        A state dict of another layout (group count, parameters per group, or a state tensor size
        that differs) is refused before anything changes.
        """
        self._check_layout_of(state_dict)
        self._own_views.clear()
        OffloadStreamAdamW.load_state_dict(self, state_dict)
        for group in self.param_groups:
            group.pop("step", None)  # the step lives in the per-parameter state

    def _check_layout_of(self, state_dict: dict) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}: it is the state of another parameter layout"
            )
        for group_index, (saved, own) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(own["params"]):
                raise ValueError(
                    f"param group {group_index} of the state dict has {len(saved['params'])} "
                    f"parameters, this optimizer's has {len(own['params'])}: it is the state of "
                    f"another parameter layout"
                )
        saved_ids = [saved_id for group in saved_groups for saved_id in group["params"]]
        for index, saved_id in enumerate(saved_ids):
            entry = state_dict["state"].get(saved_id)
            if entry is None:
                continue
            numel = self._layout.params[index].numel()
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in entry:
                    raise ValueError(f"state of parameter {saved_id} has no {key!r}")
            for key in _TENSOR_KEYS:
                value = entry.get(key)
                if value is not None and value.numel() != numel:
                    raise ValueError(
                        f"state of parameter {saved_id}: {key} has {value.numel()} elements, the "
                        f"parameter has {numel}: it is the state of another parameter layout"
                    )

    # ------------------------------------------------------------------------- internals

    @staticmethod
    def _param_as_master_source(param: torch.Tensor) -> torch.Tensor:
        source = param.detach()
        if source.dtype != torch.float32:
            source = source.cpu()  # cast on the host: no parameter-sized fp32 temporary on the GPU
        return source.reshape(-1)

    def _create_state(self, index: int, step: float, master: torch.Tensor | None) -> None:
        OffloadStreamAdamW._create_state(self, index, step, master)
        entry = self.state[self._layout.params[index]]
        counter = self._step_counters.get(index)
        if counter is None:
            self._step_counters[index] = entry["step"]
        else:
            counter.fill_(step)
            entry["step"] = counter
        self._own_views[index] = tuple(entry[key] for key in _TENSOR_KEYS)

    def _is_own(self, index: int, entry: dict) -> bool:
        own = self._own_views.get(index)
        if own is None or entry.get("step") is not self._step_counters.get(index):
            return False
        return all(entry.get(key) is view for key, view in zip(_TENSOR_KEYS, own))

    def _materialize_state(self) -> None:
        self._adopt_assigned_state()
        state = self.state
        missing = [i for i, p in enumerate(self._layout.params) if p not in state]
        if not missing:
            return
        self.synchronize()  # a write-back in flight spans whole buckets, these ranges included
        self._ensure_host_state()
        with torch.no_grad():
            for index in missing:
                self._create_state(index, step=0.0, master=None)
                for moment in self._host_views(index)[1:]:
                    moment.zero_()

    @torch.no_grad()
    def _adopt_assigned_state(self) -> None:
        """Copy tensors that other code assigned into ``state[p]`` into the host buffers."""
        state = self.state
        foreign = [
            index
            for index, param in enumerate(self._layout.params)
            if param in state and not self._is_own(index, state[param])
        ]
        if not foreign:
            return
        self.synchronize()
        self._ensure_host_state()
        for index in foreign:
            param = self._layout.params[index]
            entry = state[param]
            views = tuple(view.view(-1) for view in self._host_views(index))
            known = index in self._own_views
            for key, view in zip(_TENSOR_KEYS, views):
                value = entry.get(key)
                if value is None:
                    if not known:  # a state this optimizer never had: start as at step 0
                        if key == "master_param":
                            view.copy_(self._param_as_master_source(param))
                        else:
                            view.zero_()
                    continue
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"state[{key!r}] of parameter {index} is a {type(value).__name__}, not a tensor")
                if value.numel() != param.numel():
                    raise ValueError(
                        f"state[{key!r}] of parameter {index} has {value.numel()} elements, the "
                        f"parameter has {param.numel()}: it is the state of another parameter layout"
                    )
                if not _same_memory(value, view):
                    view.copy_(value.detach().reshape(-1))
            counter = self._step_counters.get(index)
            if counter is None:
                step = entry.get("step")
                counter = torch.tensor(0.0 if step is None else float(step), dtype=torch.float32)
                self._step_counters[index] = counter
            shaped = tuple(view.view(param.shape) for view in views)
            state[param] = {
                "step": counter,
                "exp_avg": shaped[1],
                "exp_avg_sq": shaped[2],
                "master_param": shaped[0],
            }
            self._own_views[index] = shaped


@functools.lru_cache(maxsize=None)
def _configured_class(bucket_numel: int, num_slots: int) -> type:
    return type(
        "OffloadStreamHybridOptimizer",
        (OffloadStreamHybridOptimizer,),
        {
            "__module__": __name__,
            "__doc__": (
                f"OffloadStreamHybridOptimizer with buckets of {bucket_numel} elements and "
                f"{num_slots} staging slots."
            ),
            "default_bucket_numel": bucket_numel,
            "default_num_slots": num_slots,
        },
    )


def offload_stream_hybrid_optimizer_class(bucket_numel: int, num_slots: int) -> type:
    """The :class:`OffloadStreamHybridOptimizer` subclass to bind at
    :data:`HYBRID_DEVICE_OPTIMIZER_BINDINGS`, with this bucket plan as its default.

    The same arguments give the same class. Raises ValueError for ``bucket_numel < 16`` or
    ``num_slots < 1`` (or non-integers).
    """
    return _configured_class(check_bucket_numel(bucket_numel), check_num_slots(num_slots))


@dataclass(frozen=True)
class OffloadStreamSettings(Settings):
    """OffloadStreamAdamW's flags (handed to upstream's optimizer build through
    :meth:`upstream_optimizer_flags` and the class binding of ``megatron.bounded.upstream``)."""

    SWITCH = "offload_stream_optimizer"
    EARLY = False  # reads the optimizer dtypes as upstream's validation leaves them

    offload_stream_optimizer: bool = knob(
        False, "OffloadStreamAdamW inside the distributed optimizer: fp32 master weights and Adam "
        "moments in pinned host memory, streamed through the GPU bucket by bucket (exact).")
    offload_stream_bucket_numel: int = knob(
        DEFAULT_BUCKET_NUMEL, "OffloadStreamAdamW: elements per streamed bucket (>= 16).",
        metavar="NUMEL")
    offload_stream_slots: int = knob(
        DEFAULT_NUM_SLOTS, "OffloadStreamAdamW: GPU staging slots (buckets in flight).")

    # upstream's host-optimizer path: --optimizer-cpu-offload selects the HybridDeviceOptimizer
    # slot (bound to ours) and the precision-aware mode hands over the bf16 shards without fp32
    # copies on the GPU
    UPSTREAM_OPTIMIZER_FLAGS = {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True}

    def check(self, args) -> None:
        """Refuse what the streamed optimizer cannot run: a bad bucket or slot count, no
        distributed optimizer, another optimizer, a partial offload, non-fp32 optimizer dtypes,
        and the upstream options it replaces."""
        if not self.offload_stream_optimizer:
            return
        for check, flag, value in (
            (check_bucket_numel, "--offload-stream-bucket-numel", self.offload_stream_bucket_numel),
            (check_num_slots, "--offload-stream-slots", self.offload_stream_slots),
        ):
            try:
                check(value)
            except ValueError as error:
                raise BoundedArgumentError(f"{flag}: {error}") from None
        if not args.use_distributed_optimizer:
            raise BoundedArgumentError(
                "--offload-stream-optimizer is the inner optimizer of the distributed optimizer (each "
                "data-parallel rank streams its own shard): add --use-distributed-optimizer."
            )
        if args.optimizer != "adam":
            raise BoundedArgumentError(
                f"--offload-stream-optimizer implements AdamW: use --optimizer adam (got {args.optimizer})."
            )
        if args.optimizer_offload_fraction != 1.0:
            raise BoundedArgumentError(
                "--offload-stream-optimizer keeps all optimizer state in host memory: "
                f"--optimizer-offload-fraction must be 1.0 (got {args.optimizer_offload_fraction})."
            )
        for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(args, name, torch.float32) not in (torch.float32, "fp32"):
                raise BoundedArgumentError(
                    "--offload-stream-optimizer keeps fp32 master weights and moments: remove "
                    f"--{name.replace('_', '-')}."
                )
        unsupported = [
            ("overlap_cpu_optimizer_d2h_h2d", "--overlap-cpu-optimizer-d2h-h2d (the update runs on "
             "the GPU bucket by bucket)"),
            ("fp8_param_gather", "--fp8-param-gather"),
            ("fp4_param_gather", "--fp4-param-gather"),
            ("use_megatron_fsdp", "--use-megatron-fsdp"),
            ("use_torch_fsdp2", "--use-torch-fsdp2"),
            ("optimizer_cuda_graph", "--optimizer-cuda-graph"),
        ]
        for name, flag in unsupported:
            if getattr(args, name, False):
                raise BoundedArgumentError(f"{flag} is not supported with --offload-stream-optimizer: remove it.")
