"""AdamW whose moments are stored in bf16: ``--exp-avg-dtype bf16`` / ``--exp-avg-sq-dtype bf16``
without Transformer Engine.

megatron-core keeps Adam's moments below fp32 only through Transformer Engine's FusedAdam
(``--use-precision-aware-optimizer``). :class:`MomentDtypeAdamW` is torch's AdamW with each moment
kept in its own dtype: every step reads the stored moments into fp32, updates them and the fp32
master weights with torch's AdamW arithmetic (decoupled weight decay, bias correction, the same
operation order as ``torch.optim.AdamW(foreach=False)``), and stores the new moments rounded to
nearest; the update itself uses the fp32 moments before rounding, as FusedAdam does. With fp32
moments it is bitwise torch's AdamW.

Memory: the moments take ``bytes(exp_avg_dtype) + bytes(exp_avg_sq_dtype)`` per master element
(4 instead of 8 with both in bf16); a step updates a shard in slices of at most
:data:`STEP_CHUNK_ELEMENTS` elements, so its fp32 temporaries (the denominator and a working copy
of each moment stored below fp32) are at most 3 x 4 B x that (:func:`step_transient_bytes`).

It runs inside megatron-core's distributed optimizer: :func:`use_moment_dtypes` turns the inner
torch AdamW that ``DistributedOptimizer`` built (its state already at step 0) into this class,
casting the moments; a checkpoint's moments are loaded in whatever dtype they were saved and kept
in the configured one from the next step on.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.bounded.object_changes import object_change

__all__ = ["MomentDtypeAdamW", "MOMENT_DTYPES", "STEP_CHUNK_ELEMENTS", "use_moment_dtypes",
           "moment_dtype", "step_transient_bytes"]

# The moment dtypes this optimizer keeps (fp16 and 8-bit moments need FusedAdam's scaling).
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Elements of a shard updated at once: bounds the fp32 working copies of the moments.
STEP_CHUNK_ELEMENTS = 1 << 26

_MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_dtype(value) -> Optional[torch.dtype]:
    """The torch dtype of a moment-dtype flag's value (``"bf16"``, ``torch.bfloat16``, …); None
    when this optimizer cannot keep it."""
    if isinstance(value, torch.dtype):
        return value if value in MOMENT_DTYPES.values() else None
    return MOMENT_DTYPES.get(str(value))


def step_transient_bytes(largest_shard_elements: int, moment_bytes: int) -> int:
    """Bytes of one step's fp32 temporaries (the denominator, and a working copy of each moment
    stored in bf16) with moments of ``moment_bytes`` per element in all (8, 6 or 4)."""
    copies = (8 - moment_bytes) // 2  # each bf16 moment saves 2 of fp32's 4 bytes
    return 4 * (1 + copies) * min(largest_shard_elements, STEP_CHUNK_ELEMENTS)


class MomentDtypeAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with ``exp_avg`` and ``exp_avg_sq`` stored in ``exp_avg_dtype`` and
    ``exp_avg_sq_dtype`` (fp32 or bf16), computed in fp32. Parameters (the master weights) and
    their gradients are fp32."""

    def __init__(self, params, *, exp_avg_dtype: torch.dtype = torch.bfloat16,
                 exp_avg_sq_dtype: torch.dtype = torch.bfloat16, **adamw_arguments):
        super().__init__(params, **adamw_arguments)
        self._configure(exp_avg_dtype, exp_avg_sq_dtype)

    def _configure(self, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> None:
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if moment_dtype(dtype) is None:
                raise ValueError(f"{type(self).__name__}: {name} must be one of "
                                 f"{sorted(MOMENT_DTYPES)}, got {dtype}")
        for group in self.param_groups:
            for option in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
                if group.get(option):
                    raise ValueError(f"{type(self).__name__} does not support {option}=True")
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        for state in self.state.values():
            self._keep_moment_dtypes(state)

    def _keep_moment_dtypes(self, state: dict) -> None:
        for name in _MOMENTS:
            moment = state.get(name)
            if moment is not None and moment.dtype != self.moment_dtypes[name]:
                state[name] = moment.to(self.moment_dtypes[name])

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for name in _MOMENTS:
                        state[name] = torch.zeros_like(param, dtype=self.moment_dtypes[name],
                                                       memory_format=torch.preserve_format)
                self._keep_moment_dtypes(state)  # a loaded checkpoint may assign other dtypes
                state["step"] += 1
                step = state["step"].item()
                self._update(param.view(-1), param.grad.view(-1), state["exp_avg"].view(-1),
                             state["exp_avg_sq"].view(-1), group, beta1, beta2, step)
        return loss

    @staticmethod
    def _update(param, grad, exp_avg, exp_avg_sq, group, beta1, beta2, step) -> None:
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        for start in range(0, param.numel(), STEP_CHUNK_ELEMENTS):
            piece = slice(start, start + STEP_CHUNK_ELEMENTS)
            p, g = param[piece], grad[piece]
            m = exp_avg[piece].float()  # a copy when stored below fp32, the storage itself if fp32
            v = exp_avg_sq[piece].float()
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
            if m.data_ptr() != exp_avg[piece].data_ptr():
                exp_avg[piece].copy_(m)  # rounded to nearest
            if v.data_ptr() != exp_avg_sq[piece].data_ptr():
                exp_avg_sq[piece].copy_(v)


def use_moment_dtypes(optimizer: torch.optim.AdamW, exp_avg_dtype: torch.dtype,
                      exp_avg_sq_dtype: torch.dtype) -> MomentDtypeAdamW:
    """Turn a torch AdamW (and its state) into a :class:`MomentDtypeAdamW` in place: the object
    megatron-core's distributed optimizer holds stays the same one."""
    if type(optimizer) is not torch.optim.AdamW and not isinstance(optimizer, MomentDtypeAdamW):
        raise TypeError(f"moment dtypes need torch's AdamW, got {type(optimizer).__name__}")
    object_change("moment-dtype-adamw").set(optimizer, __class__=MomentDtypeAdamW)
    optimizer._configure(exp_avg_dtype, exp_avg_sq_dtype)
    return optimizer

