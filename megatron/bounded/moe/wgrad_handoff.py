"""The experts' fc1 weight gradient, computed while the dispatch's backward all-to-all is in flight.

In a MoE layer's backward the static dispatcher's dispatch all-to-all (the experts' input
gradient going back to the ranks that sent the rows) can start only once the experts' input
gradient exists, and computed in order the GPU does nothing else while its bytes cross the link.
The largest GEMM of the experts' backward, the fc1 weight gradient ``x^T · d fc1`` per expert, is
needed by nothing of the layer's backward, so it is handed over to run alongside:

1. the dispatcher's ``token_dispatch`` opens a ``WeightGradHandoff`` for the experts' ``weight1``
   (``ExpertWeightGradOverlap.open``) and passes ``weight1`` into its all-to-all as an extra input
   that the forward does not use;
2. the grouped experts take the handoff at their forward (``ExpertWeightGradOverlap.take``); their
   backward computes d W2, d fc1 and the input gradient, returns no gradient for ``weight1`` and
   leaves its GEMM in the handoff (``defer``);
3. the all-to-all's backward starts its exchange asynchronously on the process group's stream,
   runs the pending GEMM on the current stream meanwhile (``run``), waits for the exchange, and
   returns the GEMM's result as the gradient of its ``weight1`` input.

Autograd then accumulates ``weight1``'s gradient from that one producer, after both nodes have
run, so it, and the hooks of Megatron's DDP, see the same tensor the experts' backward would have
returned: the values are bitwise unchanged (``tests/unit/moe/test_wgrad_handoff.py``).

The gain is bounded by how much the GEMM and the exchange can share the GPU: NCCL's intra-node
all-to-all runs on the same SMs and HBM that the GEMM fills, so the overlapped GEMM runs slower
than alone. ``tools/benchmarks/bench_moe_dispatch.py`` times the layer with and without the
handoff (variant ``static_cf<cf>_serial_wgrad``); the measured figures are in
``docs/operators/static_capacity_dispatch.md``.

Memory bound: the pending GEMM holds exactly the experts' input rows ``x`` ``[R, H]`` (saved for
backward anyway) and ``d fc1`` ``[R, fc1]``, b·R·(H + fc1) bytes, until the exchange is issued
(``test_pending_gradient_holds_only_the_input_rows_and_fc1_gradient``). Besides the exchange's
own send and receive buffers (the budget's dispatch term) that is d fc1, fewer bytes per row than
the b·(H + 2·fc1 + 2F) the experts' backward holds at once (the budget's ``row_grad``,
``megatron.bounded.budget``), so the layer's bound does not grow. With expert parallelism 1 there
is no exchange and nothing is handed over.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

__all__ = ["WeightGradHandoff", "ExpertWeightGradOverlap"]


class WeightGradHandoff:
    """One layer's pending weight gradients for ``params``, from the experts' backward to the
    dispatch all-to-all's backward (one forward, one backward)."""

    def __init__(self, params: Tuple[torch.nn.Parameter, ...]):
        self.params = tuple(params)
        self._pending: Optional[Callable[[], Tuple[torch.Tensor, ...]]] = None

    def defer(self, compute: Callable[[], Tuple[torch.Tensor, ...]]) -> None:
        """Leave ``compute() -> one gradient per param`` to run later."""
        if self._pending is not None:
            raise RuntimeError("a weight-gradient handoff takes one pending computation")
        self._pending = compute

    def run(self) -> Tuple[Optional[torch.Tensor], ...]:
        """Run the pending computation (None per param when nothing was deferred, e.g. frozen
        weights) and drop it, so its tensors are freed."""
        compute, self._pending = self._pending, None
        if compute is None:
            return (None,) * len(self.params)
        grads = tuple(compute())
        if len(grads) != len(self.params):
            raise RuntimeError(f"{len(grads)} gradients for {len(self.params)} parameters")
        return grads


class ExpertWeightGradOverlap:
    """Connects one MoE layer's static dispatcher and grouped experts (``BoundedMoELayer`` sets it
    on both): the dispatcher opens a handoff per forward, the experts take it."""

    def __init__(self, experts: torch.nn.Module):
        self._experts = experts
        self._open: Optional[WeightGradHandoff] = None

    def open(self) -> WeightGradHandoff:
        """A new handoff for the experts' ``weight1`` (replaces one the experts did not take)."""
        self._open = WeightGradHandoff((self._experts.weight1,))
        return self._open

    def take(self) -> Optional[WeightGradHandoff]:
        """The handoff opened by this forward's dispatch, once (None when none is open)."""
        handoff, self._open = self._open, None
        return handoff
