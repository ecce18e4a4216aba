"""Triton in this package: whether it is importable, and a cheaper launch for its kernels.

The fused kernels of this package (``moe.weighted_swiglu``, ``moe.slot_sum``, ``moe.row_gather``,
``moe.zero_if_flag``, ``moe.send_plan``, ``loss.ring_dtp.kernels``, ``rotary``) run on CUDA with
Triton and fall back to their eager references otherwise.

Each of them is launched a few times per layer and micro-batch, and in a launch-bound step the
host time of a launch is what costs: Triton's ``kernel[grid](...)`` binds the arguments to the
signature, specializes every one of them and hashes the result before it finds the compiled
kernel, several times the time of the launch itself. :func:`cached_launch` wraps a kernel so that
the compiled kernel is looked up by a key computed directly from the arguments, and launched
directly. The key keeps everything Triton specializes on (and more), so it never maps two calls
that Triton would compile differently to one compiled kernel:

* a tensor: its dtype and whether its address is a multiple of 16 bytes;
* an integer: whether it is 1, whether it is a multiple of 16, and the width it is passed in
  (32-bit, 64-bit or unsigned 64-bit);
* a bool, a float, ``None``: the type;
* a constexpr parameter: its type and value;
* compile options (``num_warps``, ``enable_fp_fusion``, ...) and the current device.

The first call with a new key, a callable grid, an argument of any other kind, or launch hooks
(a profiler such as Proton) go through Triton's own launch. Triton versions without
``triton.knobs``, or whose compiled kernels lack the attributes used here (checked once per
kernel), always do.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401  (ships with torch on Linux)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False
try:
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one older than its knobs: Triton's own launch only
    _knobs = None

import torch

__all__ = ["HAVE_TRITON", "cached_launch", "specialization_key"]

# Compiled-kernel attributes the direct launch needs (Triton 3.x).
_LAUNCH_ATTRIBUTES = ("run", "function", "packed_metadata")
_INT32 = range(-(2**31), 2**31)
_INT64 = range(-(2**63), 2**63)


class _Uncached(Exception):
    """An argument the key does not describe: launch through Triton."""


def _argument_key(value, constexpr: bool):
    if constexpr:  # the type as well: True == 1 == 1.0 as values, but compile differently
        hash(value)  # raises TypeError for unhashable constexpr values
        return type(value), value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        width = "i32" if value in _INT32 else "i64" if value in _INT64 else "u64"
        return width, value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    if value is None:
        return None
    raise _Uncached


def specialization_key(values, constexprs, options: dict, device: int):
    """The cache key of one launch (see the module docstring); raises ``_Uncached`` for an
    argument it does not describe."""
    try:
        arguments = tuple(_argument_key(v, i in constexprs) for i, v in enumerate(values))
        return device, arguments, tuple(sorted(options.items()))
    except TypeError:
        raise _Uncached from None


class _CachedLaunchKernel:
    """A ``triton.jit`` kernel whose ``[grid](...)`` launches look up the compiled kernel by
    :func:`specialization_key`."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = list(kernel.arg_names)
        self._names = frozenset(self.arg_names)
        self._constexprs = frozenset(kernel.constexprs)
        self._compiled: dict = {}
        self._direct = _knobs is not None

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if not self._direct or callable(grid) or _launch_hooks_set():
            return self.kernel[grid](*args, **kwargs)
        try:
            values = list(args) + [kwargs[name] for name in self.arg_names[len(args):]]
        except KeyError:  # a parameter left to its default
            return self.kernel[grid](*args, **kwargs)
        options = {k: v for k, v in kwargs.items() if k not in self._names}
        device = torch.cuda.current_device()
        try:
            key = specialization_key(values, self._constexprs, options, device)
        except _Uncached:
            return self.kernel[grid](*args, **kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if all(hasattr(compiled, attr) for attr in _LAUNCH_ATTRIBUTES):
                self._compiled[key] = compiled
            else:
                self._direct = False
            return compiled
        grid = tuple(grid) + (1, 1)
        compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *values)
        return compiled


def _launch_hooks_set() -> bool:
    runtime = _knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def _hook_set(hook) -> bool:
    # Triton 3.6 keeps the hooks in a chain that is never None; older versions, a callable or None
    return hook is not None and bool(getattr(hook, "calls", True))


def cached_launch(kernel):
    """``kernel`` (a ``triton.jit`` function) with the cheaper launch of the module docstring;
    anything else (Triton's interpreter, say) is returned unchanged."""
    if not HAVE_TRITON:
        return kernel
    from triton.runtime.jit import JITFunction

    return _CachedLaunchKernel(kernel) if isinstance(kernel, JITFunction) else kernel
