"""The training loop: the progress log of each step, and the capacity factor a paged-stash rerun
needed."""

from __future__ import annotations

import functools
import math
from typing import Callable


def log_progress(original: Callable) -> Callable:
    """``megatron.training.training.train_step``: feeds the throughput meter of
    :mod:`megatron.bounded.training.progress`; arguments and results pass through unchanged."""

    from megatron.bounded.training.progress import record_train_step

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        outputs = original(*args, **kwargs)
        record_train_step(outputs, kwargs.get("iteration"))
        return outputs

    return train_step


def report_needed_capacity_factor(original: Callable) -> Callable:
    """``PagedStashRunner.prepare_for_rerun``: upstream logs that a step went over its dispatch
    budget but not by how much; before the rerun clears them, the largest ``slab_demand`` of our
    dispatchers over the layers and ranks is logged on rank 0 (the rerun itself is upstream's)."""

    import logging

    import torch

    from megatron.bounded.training.progress import count

    logger = logging.getLogger("megatron.bounded.moe")

    @functools.wraps(original)
    def prepare_for_rerun(self, *args, **kwargs):
        count("paged_stash_reruns")  # every rank reruns: the counter is the same on all
        demands = [
            layer.token_dispatcher.slab_demand
            for layer in getattr(self, "moe_layers", [])
            if getattr(getattr(layer, "token_dispatcher", None), "slab_demand", None) is not None
        ]
        if demands:
            # on the dispatchers' device, so the default group's backend (NCCL or gloo) takes it
            largest = torch.stack(demands).amax().reshape(1)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            # rounded up to the hundredth, so the factor printed really fits the slab
            needed = math.ceil(float(largest.item()) * 100 - 1e-6) / 100
            factor = self.config.moe_expert_rank_capacity_factor
            on_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
            # a rerun for a stash overflow alone has no drop to explain
            if on_rank_0 and factor is not None and needed > factor:
                logger.info(
                    "Paged stash: the fullest static dispatch slab held %.2fx its even share of "
                    "routed rows this step; --moe-expert-rank-capacity-factor %.2f or more "
                    "would have dropped nothing (it is %s)", needed, needed, factor,
                )
        return original(self, *args, **kwargs)

    return prepare_for_rerun
