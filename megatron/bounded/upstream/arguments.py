"""Upstream's argument handling: flag validation without a GPU, and ``--help`` texts with a bare
``%``."""

from __future__ import annotations

import functools
from typing import Callable


# Compute-capability major version assumed when validating flags without a GPU (H200: 9).
PLANNING_DEVICE_ARCH = 9


def device_arch_without_a_gpu(original: Callable) -> Callable:
    """``megatron.training.arguments.get_device_arch_version``: upstream asks the GPU whenever
    tensor or context parallelism is on; without CUDA the answer is :data:`PLANNING_DEVICE_ARCH`,
    so the budget and ``DRY_RUN=1`` check such plans on a machine without a GPU."""

    import torch

    @functools.wraps(original)
    def get_device_arch_version() -> int:
        return original() if torch.cuda.is_available() else PLANNING_DEVICE_ARCH

    return get_device_arch_version


def escape_help_percent_signs(original: Callable) -> Callable:
    """``ArgumentGroupFactory._get_field_docstrings``: upstream's field docstrings become ``--help``
    texts that argparse %-formats, and a bare "10%)" made ``--help`` fail; every ``%`` that is not
    ``%%`` or a ``%(name)s`` field is doubled (the text shown is unchanged)."""

    import re

    # a "%%" pair or a "%(name)s" field stays as it is; any other "%" is doubled
    pattern = re.compile(r"%%|%\([^)]*\)[a-zA-Z]|%")

    def escape(text):
        if not isinstance(text, str):
            return text
        return pattern.sub(lambda match: match.group(0) if len(match.group(0)) > 1 else "%%", text)

    @functools.wraps(original)
    def _get_field_docstrings(self, *args, **kwargs):
        docstrings = original(self, *args, **kwargs)
        return {name: escape(text) for name, text in docstrings.items()}

    return _get_field_docstrings


def validate_grouped_gemm_without_a_gpu(original: Callable) -> Callable:
    """``megatron.training.arguments.validate_args``: with ``--moe-grouped-gemm`` upstream reads the
    GPU's compute capability; without CUDA it reads :data:`PLANNING_DEVICE_ARCH` for the duration of
    upstream's validation, with CUDA the call is upstream's unchanged."""

    import torch

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if torch.cuda.is_available() or not getattr(args, "moe_grouped_gemm", False):
            return original(args, *rest, **kwargs)
        asked = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: (PLANNING_DEVICE_ARCH, 0)
        try:
            return original(args, *rest, **kwargs)
        finally:
            torch.cuda.get_device_capability = asked

    return validate_args
