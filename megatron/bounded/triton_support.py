"""Whether Triton is importable here: the fused kernels of this package (``moe.weighted_swiglu``,
``moe.slot_sum``, ``moe.row_gather``, ``moe.zero_if_flag``, ``moe.send_plan``,
``loss.strip_softmax``, ``rotary``) run on CUDA with Triton and fall back to their eager
references otherwise."""

try:
    import triton  # noqa: F401  (ships with torch on Linux)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON"]
