"""Upstream's output-discarding checkpoint without Transformer Engine.

megatron-core 0.19.2's ``CheckpointWithoutOutput`` (``tensor_parallel/random.py``), which the
selective recompute of ``layernorm`` and ``moe_act`` runs, stores ``self.fp8 = fp8 is not None``:
the default ``fp8=False`` reads as on, and its forward then asks Transformer Engine's
``FP8GlobalStateManager`` for the fp8 state, a name that module defines only when TE imports. So
``--recompute-modules layernorm`` raised ``NameError`` at the first forward without TE.
"""

from __future__ import annotations

import functools
from typing import Callable


def fp8_off_without_transformer_engine(original: Callable) -> Callable:
    """``CheckpointWithoutOutput.__init__``: without Transformer Engine there is no fp8 (the
    argument layer replaces ``--fp8-format`` by the model's precision), so the checkpoint runs
    its plain path; with TE upstream's choice stands."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not tensor_parallel_random.HAVE_TE:
            self.fp8 = False

    return __init__
