"""The dataset index helpers: upstream's start-up compile step replaced by the wheel's prebuilt
extension."""

from __future__ import annotations

import functools
import importlib
from typing import Callable


def use_prebuilt_dataset_helpers(original: Callable) -> Callable:
    """``megatron.core.datasets.utils.compile_helpers``: upstream runs ``make`` on rank 0, but the
    wheel ships the compiled ``helpers_cpp`` and no Makefile; the replacement only checks that the
    prebuilt extension imports (the caller's barrier is kept)."""

    @functools.wraps(original)
    def compile_helpers() -> None:
        # Importing proves the wheel's compiled extension loads; a broken install fails here with
        # the real ImportError instead of a confusing `make` error.
        importlib.import_module("megatron.core.datasets.helpers_cpp")

    return compile_helpers
