"""The distributed optimizer over torch's AdamW (its state at step 0, one step counter per
parameter, a fully-reshardable load), and the multi-tensor norm and scale without Apex or
Transformer Engine."""

from __future__ import annotations

import functools
from typing import Callable


def _give_fresh_torch_adam_state(optimizer) -> None:
    """Give a distributed optimizer over torch's Adam the state it has at step 0 (zero moments
    via upstream's own ``init_state_fn``, ``step`` 0 placed as torch places it) unless it has
    state already or runs Apex/TE's optimizer."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    inner = optimizer.optimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or optimizer.init_state_fn is None:
        return
    if not isinstance(inner, torch.optim.Adam) and not isinstance(inner, torch.optim.AdamW):
        return
    if any("step" in state for state in inner.state.values()):
        return
    optimizer.init_state_fn(inner, optimizer.config)
    for group in inner.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            inner.state[param]["step"] = torch.tensor(
                0.0, dtype=torch.float32, device=param.device if on_device else "cpu"
            )


def initialize_torch_adam_state_before_first_step(original: Callable) -> Callable:
    """``DistributedOptimizer.state_dict``: a fresh torch AdamW has no ``step`` yet, and upstream
    asserts on it while building a checkpoint's template, so no run could resume; the state of
    step 0 is given first (the loaded checkpoint then overwrites all of it)."""

    @functools.wraps(original)
    def state_dict(self):
        _give_fresh_torch_adam_state(self)
        return original(self)

    return state_dict


# The moment dtypes of this run's AdamW (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` below
# fp32, bound at launch by :func:`keep_adam_moments_in`); None: torch's AdamW as built.
_adam_moment_dtypes = None


def keep_adam_moments_in(exp_avg_dtype, exp_avg_sq_dtype) -> None:
    """Every distributed optimizer built from now on turns its torch AdamW into
    ``MomentDtypeAdamW`` with these moment dtypes."""
    global _adam_moment_dtypes
    _adam_moment_dtypes = (exp_avg_dtype, exp_avg_sq_dtype)


def allocate_torch_adam_state_at_construction(original: Callable) -> Callable:
    """``DistributedOptimizer.__init__``: the same step-0 state at construction, so the moments
    exist from the first iteration on and its peak is the steady state's (torch's Adam creates
    exactly this state lazily: training is bitwise unchanged). OffloadStreamAdamW's inner
    optimizer allocates and page-locks its host state here too (``allocate_host_state``), so
    the first step does not spend seconds on it."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _give_fresh_torch_adam_state(self)
        if _adam_moment_dtypes is not None and getattr(self, "optimizer", None) is not None:
            from megatron.bounded.optimizer.moment_dtype_adamw import use_moment_dtypes

            use_moment_dtypes(self.optimizer, *_adam_moment_dtypes)
        from megatron.bounded.optimizer.distributed import OffloadStreamHybridOptimizer

        inner = getattr(self, "optimizer", None)
        if isinstance(inner, OffloadStreamHybridOptimizer):
            inner.allocate_host_state()

    return __init__


def separate_adam_step_counters_after_load(original: Callable) -> Callable:
    """``DistributedOptimizer.load_state_dict``: upstream gives every parameter the same ``step``
    tensor, which torch increments in place once per parameter, so the bias corrections went
    wrong after a resume; each parameter gets its own counter holding the loaded step."""

    import torch
    from megatron.core.optimizer import distrib_optimizer

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if distrib_optimizer.HAVE_APEX_OR_TE:
            return result
        # The loaded step lives in the param groups (distrib_optimizer.py:1026); the parameter
        # state may also have been handed back a step tensor captured earlier (the dp_reshardable
        # template), so every parameter gets a fresh counter holding the loaded value.
        steps = {group["step"] for group in state_dict["optimizer"]["param_groups"] if "step" in group}
        if len(steps) != 1:
            return result
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32, device=state["step"].device)
        return result

    return load_state_dict


class _AbsentIsNothing(dict):
    """Saved tensors of one parameter in which an absent key reads as None (not a tensor)."""

    def __missing__(self, key):
        return None


def skip_unsaved_optimizer_states(original: Callable) -> Callable:
    """``DistributedOptimizer._set_main_param_and_optimizer_states``: a fully-reshardable
    checkpoint leaves ``step`` out of each parameter's saved tensors (it is restored from the param
    groups), but the method reads it and raises ``KeyError``; an absent key reads as "nothing
    saved", which the method already skips."""

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, _AbsentIsNothing(tensors))

    return _set_main_param_and_optimizer_states


def multi_tensor_fallback(ours_name: str) -> Callable[[Callable], Callable]:
    """Replace upstream's local multi-tensor fallback by ``multi_tensor.<ours_name>``; leave
    Apex's or Transformer Engine's kernel (any other original) in place."""

    def make_replacement(original: Callable) -> Callable:
        from megatron.core import utils as upstream_utils

        from megatron.bounded.optimizer import multi_tensor

        fallbacks = (upstream_utils.local_multi_tensor_l2_norm,
                     upstream_utils.local_multi_tensor_scale)
        chosen = getattr(multi_tensor, ours_name) if original in fallbacks else original

        def replacement(*args):
            return chosen(*args)

        return replacement

    return make_replacement
