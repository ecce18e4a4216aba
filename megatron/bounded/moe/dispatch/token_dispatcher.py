"""Static-capacity, sync-free token dispatcher for expert parallelism on stock PyTorch.

Every rank of the expert-parallel (EP) group sends every peer one slab of a fixed number of
rows, ``capacity_rows = ceil(cf * N * k / E_p)`` (N local tokens, top-k, E_p EP ranks, cf the
rank capacity factor), through one ``all_to_all_single`` with equal splits.  All routing
metadata (slot positions, drop decisions, receive layout, ``tokens_per_expert``) is computed
on the tokens' device with cumsum / gather / scatter arithmetic, so a forward and backward pass
contains no device-to-host synchronization and can be captured in a CUDA graph.

Layout (rows of the send buffer; one slab of ``capacity_rows`` rows per destination rank)::

    slab r = [ pairs for local expert 0 of rank r in token order | ... local expert El-1 | pad ]

A (token, expert) pair whose position inside its slab is ``>= capacity_rows`` is dropped: it
contributes zero to the output and sets a sticky boolean "over budget" flag on the device,
which ``check_over_budget()`` returns and only ``reset_over_budget()`` clears.  Upstream's
``PagedStashRunner`` reads that flag after each step and, on overflow, sets
``_comm_manager.moe_expert_rank_capacity_factor = None`` and reruns the step: with the factor
``None`` the dispatcher sends exact per-peer counts (one host sync to size the all-to-all) and
drops nothing.  The dispatcher also keeps, the same sticky way, the fullest slab's routed pairs over
the even share N·k/E_p (``slab_demand``, a device tensor: the smallest factor that would have
dropped nothing), and the rerun's log line (``megatron.bounded.upstream.training_loop``) names it.

After the exchange a rank holds ``E_p`` slabs.  Rows are regrouped by local expert (within an
expert: by source rank, then token order, i.e. the order upstream's alltoall dispatcher uses),
padding rows last, so the experts see ``[R, H]`` rows where the first
``tokens_per_expert.sum()`` rows are valid (with one EP rank the single slab is already in that
order, and the regrouping is skipped).  The combine path undoes the regrouping, sends the
rows back into the same slab positions with the reverse all-to-all, and sums each token's top-k
expert outputs in slot order (the experts already applied the routing probabilities, as
upstream's experts do).  Every gather used here has a gather as its adjoint (no atomics), so
forward and backward results are deterministic.

Padding rows are never read into a token's result, so the dispatcher does not fill them: the
six row gathers of a layer (tokens into slabs, slabs into expert order and back, forward and
backward) take ``SKIP`` for every padding row and move no bytes for it (``row_gather``; a third
of the rows at factor 1.5).  The experts leave their output and the gradients of their input rows
and probabilities unspecified on padding rows (NaN or Inf are possible).  The
combine and the dispatch's adjoint read a row only for a kept (token, slot) pair; the other slots
point at row 0, which may be another pair's row or padding, and the slot sum (``slot_sum``)
does not read them (a zero factor would keep NaN).  The probability gradient of the send rows is
masked the same way (an ``[R]`` vector) before its adjoint adds the padding rows into pair 0.

The helpers are plain torch functions that work on CPU tensors and on any process-group backend
that implements ``all_to_all_single`` (NCCL on GPU, gloo on CPU). The exchanges and row
permutations themselves (``all_to_all_rows``, ``permute_rows``) live in
:mod:`megatron.bounded.kernels.collectives`, shared with PipelinedLLEP and the context-parallel attention;
the send plan (slots, slab positions, drops, the send rows' sources) and the send rows'
probabilities in :mod:`megatron.bounded.moe.dispatch.send_plan` (Triton kernels for the static plan on
CUDA, the eager reference elsewhere and for the dropless plan). Both are re-exported here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Optional

import torch

from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron.bounded.kernels.collectives import all_to_all_blocking, all_to_all_rows, permute_rows
from megatron.bounded.kernels.row_gather import SKIP, gather_rows
from megatron.bounded.moe.dispatch.send_plan import (
    SendPlan,
    exclusive_cumsum,
    finalize_send_rows,
    gather_send_probs,
    masked_rows,
    plan_send,
    plan_static_send,
    routing_slots,
)
from megatron.bounded.moe.kernels.slot_sum import slot_sum
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap

logger = logging.getLogger(__name__)

__all__ = [
    "capacity_rows",
    "expert_capacity",
    "pads_to_expert_capacity",
    "routing_slots",
    "SendPlan",
    "plan_send",
    "ReceiveLayout",
    "plan_receive",
    "all_to_all_rows",
    "gather_send_rows",
    "combine_slots",
    "permute_rows",
    "gather_send_probs",
    "masked_rows",
    "exclusive_cumsum",
    "StaticCapacityTokenDispatcher",
]


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


# Smallest --moe-expert-rank-capacity-factor accepted. A factor f sizes each slab for f times a
# rank's even share of the routed rows, so even perfectly balanced routing keeps at most a
# fraction f of them: below 0.1 more than 90% of the token-expert pairs are dropped at every
# step, which trains the experts on almost nothing and is in practice a typo (0.015 for 1.5).
MIN_CAPACITY_FACTOR = 0.1
# Largest rank capacity factor taken. The expert-parallel size already drops nothing (a slab then
# holds every row a rank can send); a larger factor only grows every slab, and a factor above
# this is a typo that would ask for absurd buffers (or overflow their row count).
MAX_CAPACITY_FACTOR = 1024.0


def check_capacity_flags(args, error_class=ValueError) -> None:
    """Values of the static-capacity flags that cannot run: a rank capacity factor that is not
    finite or is below :data:`MIN_CAPACITY_FACTOR` or above :data:`MAX_CAPACITY_FACTOR`, and
    paged-stash buffer factors that are not finite (or 0 for the CUDA buffer, which would hold
    nothing). Signs and zero/positive checks are megatron.bounded.launch.arguments'; these run
    after them."""
    factor = getattr(args, "moe_expert_rank_capacity_factor", None)
    flag = "--moe-expert-rank-capacity-factor"
    if factor is not None and factor > 0 and not (
        math.isfinite(factor) and factor >= MIN_CAPACITY_FACTOR
    ):
        raise error_class(
            f"{flag} must be a finite factor >= {MIN_CAPACITY_FACTOR} (each slab holds that many "
            f"times a rank's even share of the routed rows; below {MIN_CAPACITY_FACTOR} nearly "
            f"every token is dropped), got {factor}. Use e.g. {flag} 1.5, the EP size to drop "
            "nothing, or omit it for dropless MoE."
        )
    if factor is not None and factor > MAX_CAPACITY_FACTOR:
        raise error_class(
            f"{flag} {factor:g} is above the largest factor taken, {MAX_CAPACITY_FACTOR:g}: the "
            f"expert-parallel size already drops no token (each slab then holds every row a rank "
            f"can send), so use at most {flag} EP, e.g. {flag} 1.5, or omit it for dropless MoE."
        )
    if not getattr(args, "moe_paged_stash", False):
        return
    for name, zero_ok in (("moe_paged_stash_buffer_size_factor_cuda", False),
                          ("moe_paged_stash_buffer_size_factor_cpu", True)):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or (value == 0 and not zero_ok):
            stash_flag = "--" + name.replace("_", "-")
            raise error_class(
                f"{stash_flag} must be a finite non-zero factor of the average routed rows "
                f"(positive: average-based, negative: from the actual maximum; upstream's "
                f"default is 1.1), got {value}."
                if not zero_ok else
                f"{stash_flag} must be a finite factor (0 turns the host buffer off), got {value}."
            )


def check_expert_tensor_parallel(size: int, error_class=ValueError) -> None:
    """The torch-native dispatcher's experts are whole on each rank: expert TP 1 only."""
    if size != 1:
        raise error_class(
            "the torch-native MoE backend (static-capacity dispatcher) supports "
            f"--expert-tensor-parallel-size 1 only (got {size}): set --expert-tensor-parallel-size "
            "1, or use --bounded-moe-backend upstream."
        )


def pads_to_expert_capacity(config) -> bool:
    """Upstream's drop-and-pad MoE: ``moe_expert_capacity_factor`` with
    ``moe_pad_expert_input_to_capacity`` (every expert's input sized to its capacity)."""
    return bool(getattr(config, "moe_pad_expert_input_to_capacity", False)) and getattr(
        config, "moe_expert_capacity_factor", None) is not None


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows one expert takes from ``num_tokens`` tokens of one rank under upstream's per-expert
    capacity (``--moe-expert-capacity-factor``; the router drops the pairs beyond it): upstream's
    ``get_capacity`` of the routed pairs, at most one row per token."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    return min(get_capacity(num_tokens * topk, num_experts, capacity_factor), num_tokens)


def capacity_rows(num_tokens: int, topk: int, ep_size: int, capacity_factor: float) -> int:
    """Rows of one per-peer slab: ``ceil(capacity_factor * num_tokens * topk / ep_size)``.

    The factor is turned into a fraction with a bounded denominator first, so decimal factors
    such as 1.1 give the mathematically exact ceiling instead of one row more from binary
    rounding (1.1 * 100 * 8 / 2 is 440.00000000000006 in floating point).
    """
    if capacity_factor is None or capacity_factor <= 0:
        raise ValueError(f"capacity factor must be a positive number, got {capacity_factor!r}")
    if ep_size < 1 or topk < 1 or num_tokens < 0:
        raise ValueError(f"bad sizes: num_tokens={num_tokens} topk={topk} ep_size={ep_size}")
    factor = Fraction(capacity_factor).limit_denominator(1 << 20)
    return math.ceil(factor * num_tokens * topk / ep_size)


# --------------------------------------------------------------------------------------------
# Receiver side: regroup the received slabs by local expert
# --------------------------------------------------------------------------------------------


@dataclass
class ReceiveLayout:
    """Permutation from the received slab order to the expert-grouped order."""

    num_rows: int
    # grouped[i] = received[gather_index[i]];  received[j] = grouped[dest_index[j]]
    gather_index: torch.Tensor
    dest_index: torch.Tensor
    tokens_per_expert: torch.Tensor  # [El] int64, on the device
    # The same two maps with SKIP where the row written is padding (row_gather moves no bytes)
    grouped_source: torch.Tensor
    received_source: torch.Tensor


def plan_receive(
    recv_counts: torch.Tensor, slab_rows: Optional[int], num_rows: Optional[int] = None
) -> ReceiveLayout:
    """Grouping of received rows by local expert (device only, no sync).

    ``recv_counts[s, j]`` is the number of kept pairs source rank s sent for local expert j.
    Static mode: every slab has ``slab_rows`` rows, the tail of each is padding.  Dropless mode
    (``slab_rows`` None): slab s has exactly ``recv_counts[s].sum()`` rows and ``num_rows`` (the
    host-side total) must be given.  The grouped order is expert-major, then source rank, then
    the sender's order; all padding rows come last.
    """
    ep_size, num_local = recv_counts.shape
    device = recv_counts.device
    recv_counts = recv_counts.to(torch.int64)
    if slab_rows is not None:
        num_rows = ep_size * slab_rows
        padding = slab_rows - recv_counts.sum(dim=1, keepdim=True)
    else:
        if num_rows is None:
            raise ValueError("dropless receive layout needs the total number of rows")
        padding = torch.zeros(ep_size, 1, dtype=torch.int64, device=device)
    # Blocks in received order: (source s, local expert j) for j < El, then (s, padding).
    blocks = torch.cat([recv_counts, padding], dim=1)  # [E_p, El + 1]
    block_start_recv = exclusive_cumsum(blocks.reshape(-1))
    block_start_grouped = exclusive_cumsum(blocks.t().reshape(-1)).view(num_local + 1, ep_size)
    block_start_grouped = block_start_grouped.t().reshape(-1)
    block_of_row = torch.repeat_interleave(
        torch.arange(blocks.numel(), device=device),
        blocks.reshape(-1),
        output_size=num_rows,
    )
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    dest_index = (block_start_grouped - block_start_recv)[block_of_row] + rows
    gather_index = torch.empty_like(dest_index).scatter_(0, dest_index, rows)
    tokens_per_expert = recv_counts.sum(dim=0)
    if slab_rows is None:  # no padding
        grouped_source, received_source = gather_index, dest_index
    else:
        skip = torch.full_like(rows, SKIP)
        # Grouped order: all padding after the valid rows.  Received order: block El of each
        # source slab is its padding.
        grouped_source = torch.where(rows < tokens_per_expert.sum(), gather_index, skip)
        received_is_data = torch.remainder(block_of_row, num_local + 1) != num_local
        received_source = torch.where(received_is_data, dest_index, skip)
    return ReceiveLayout(
        num_rows=num_rows,
        gather_index=gather_index,
        dest_index=dest_index,
        tokens_per_expert=tokens_per_expert,
        grouped_source=grouped_source,
        received_source=received_source,
    )


# --------------------------------------------------------------------------------------------
# Differentiable data movement
# --------------------------------------------------------------------------------------------


class _GatherSendRows(torch.autograd.Function):
    """Token rows into the send buffer; the backward sums each token's slot gradients."""

    @staticmethod
    def forward(ctx, hidden, row_token, slot_rows, slot_keep):
        ctx.save_for_backward(slot_rows, slot_keep)
        # Padding rows are not written (SKIP); receivers never treat them as valid.
        return gather_rows(hidden, row_token)

    @staticmethod
    def backward(ctx, grad_rows):
        slot_rows, slot_keep = ctx.saved_tensors
        return slot_sum(grad_rows, slot_rows, slot_keep), None, None, None


class _CombineSlots(torch.autograd.Function):
    """Send-buffer rows back into token order (sum over slots); adjoint of _GatherSendRows."""

    @staticmethod
    def forward(ctx, rows, slot_rows, slot_keep, row_token):
        ctx.save_for_backward(row_token)
        return slot_sum(rows, slot_rows, slot_keep)

    @staticmethod
    def backward(ctx, grad_tokens):
        (row_token,) = ctx.saved_tensors
        # The adjoint on kept rows; padding rows are not written, and the experts' backward
        # reads them into no result (no [R, H] mask needed).
        return gather_rows(grad_tokens, row_token), None, None, None


def gather_send_rows(hidden: torch.Tensor, plan: SendPlan) -> torch.Tensor:
    """``[N, H]`` token rows -> ``[R_send, H]`` send buffer (differentiable in ``hidden``)."""
    return _GatherSendRows.apply(hidden, plan.row_token, plan.slot_rows, plan.slot_keep)


def combine_slots(rows: torch.Tensor, plan: SendPlan) -> torch.Tensor:
    """``[R_send, H]`` rows returned by the combine all-to-all -> ``[N, H]`` token outputs."""
    return _CombineSlots.apply(rows, plan.slot_rows, plan.slot_keep, plan.row_token)


# --------------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------------


_FROM_CONFIG = object()


class StaticCapacityTokenDispatcher(MoETokenDispatcher):
    """Sync-free expert-parallel token dispatcher with fixed per-peer slabs.

    Drop-in for upstream's ``MoEAlltoAllTokenDispatcher`` inside ``MoELayer`` (same six-method
    protocol, same ``(tokens, tokens_per_expert, probs)`` contract towards the experts, with
    ``tokens_per_expert`` an int64 device tensor and padding rows after the valid ones), plus
    the duck-typed interface of upstream's ``PagedStashRunner``: ``check_over_budget()``,
    ``reset_over_budget()`` and ``_comm_manager.moe_expert_rank_capacity_factor``, re-read on
    every forward (``None`` = exact dropless sizes, used for the rerun after an overflow).

    Upstream's drop-and-pad MoE (``moe_pad_expert_input_to_capacity`` with
    ``moe_expert_capacity_factor``, no rank factor) is static too: the router drops each expert's
    pairs beyond its capacity C without padding, and every slab holds El·C rows (El local
    experts), the rows past each expert's pairs left as padding; upstream computes its padding
    rows with probability 0, which adds nothing to any token.

    Requirements: every rank of the EP group has the same number of tokens per micro-batch
    (static slab sizes must agree), expert tensor parallelism is 1, no token padding for
    quantization.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config,
        pg_collection=None,
        capacity_factor=_FROM_CONFIG,
    ) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        check_expert_tensor_parallel(self.tp_size)
        if getattr(config, "moe_router_padding_for_quantization", False):
            raise ValueError(
                "the static-capacity dispatcher does not support moe_router_padding_for_quantization"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        if self.num_experts != num_local_experts * self.ep_size:
            raise ValueError(
                f"{self.num_experts} experts != {num_local_experts} local x {self.ep_size} EP ranks"
            )
        if self.local_expert_indices != list(
            range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts)
        ):
            raise ValueError("local experts must be the contiguous block of this EP rank")
        self.topk = config.moe_router_topk
        # The runner toggles this attribute (None -> dropless rerun) and restores it from
        # ``self.config``; it is re-read at the start of every dispatch.
        if capacity_factor is _FROM_CONFIG:
            capacity_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
        self.moe_expert_rank_capacity_factor = capacity_factor
        # Upstream's drop-and-pad (moe_pad_expert_input_to_capacity): the router drops each
        # expert's pairs beyond its capacity (and pads nothing), and without a rank factor the
        # slabs hold every local expert's capacity, so the exchange has fixed sizes.
        self.expert_capacity_factor = (
            config.moe_expert_capacity_factor if pads_to_expert_capacity(config) else None)
        self._comm_manager = self
        self.over_budget: Optional[torch.Tensor] = None
        # [1] fp32, sticky max like the flag: the fullest slab's routed pairs over the even share
        # N·k/E_p, i.e. the smallest factor that would have dropped nothing
        self.slab_demand: Optional[torch.Tensor] = None
        self._state = None
        self.cudagraph_attrs = []
        # Set by BoundedMoELayer when its experts are GroupedExperts: their fc1 weight gradient
        # then runs during the backward's dispatch all-to-all (wgrad_handoff).
        self.wgrad_overlap: Optional[ExpertWeightGradOverlap] = None

    # ---------------------------------------------------------------- over-budget interface

    def check_over_budget(self) -> Optional[torch.Tensor]:
        """Sticky ``[1]`` bool device tensor: True once any dispatch dropped a pair."""
        return self.over_budget

    def reset_over_budget(self) -> None:
        """Clear the sticky over-budget flag and slab demand (in place, so CUDA graphs keep their
        pointers)."""
        if self.over_budget is not None:
            self.over_budget.zero_()
        if self.slab_demand is not None:
            self.slab_demand.zero_()

    def _record_overflow(self, plan: SendPlan) -> None:
        overflow = plan.overflow
        if self.over_budget is None or self.over_budget.device != overflow.device:
            self.over_budget = torch.zeros(1, dtype=torch.bool, device=overflow.device)
            self.slab_demand = torch.zeros(1, dtype=torch.float32, device=overflow.device)
        if not plan.can_drop:
            # nothing to flag; the slab demand (<= EP <= the factor) is read only on a rerun,
            # to name a factor above the current one
            return
        self.over_budget.logical_or_(overflow)
        if plan.capacity is not None and plan.num_tokens > 0:
            fullest = plan.routed_counts.sum(dim=1).amax().reshape(1).to(torch.float32)
            even_share = plan.num_tokens * plan.topk / plan.ep_size
            torch.maximum(self.slab_demand, fullest.div_(even_share), out=self.slab_demand)

    # ---------------------------------------------------------------- static sizes

    def capacity_for(self, num_tokens: int) -> Optional[int]:
        """Slab rows for ``num_tokens`` local tokens under the current factor: the rank capacity
        factor's, else every local expert's capacity (padded to it), else None (dropless)."""
        factor = self._comm_manager.moe_expert_rank_capacity_factor
        if factor is not None:
            return capacity_rows(num_tokens, self.topk, self.ep_size, factor)
        if self.expert_capacity_factor is not None:
            return self.num_local_experts * expert_capacity(
                num_tokens, self.topk, self.num_experts, self.expert_capacity_factor)
        return None

    # ---------------------------------------------------------------- dispatch

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """Compute slot positions and pack the send slabs (no communication, no sync)."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        num_tokens = hidden.shape[0]
        if routing_map.shape != (num_tokens, self.num_experts) or probs.shape != routing_map.shape:
            raise ValueError(
                f"routing_map {tuple(routing_map.shape)} / probs {tuple(probs.shape)} do not "
                f"match [{num_tokens}, {self.num_experts}]"
            )
        capacity = self.capacity_for(num_tokens)
        if capacity is not None:
            plan = plan_static_send(routing_map, self.topk, self.ep_size, capacity)
            self._record_overflow(plan)
            state = {"plan": plan, "send_splits": None, "recv_splits": None, "recv_counts": None}
        else:
            state = self._dropless_metadata(routing_map)
            plan = state["plan"]
            self._record_overflow(plan)  # all False: keeps the flag allocated
        self._state = state
        send_hidden = gather_send_rows(hidden, plan)
        send_probs = gather_send_probs(probs, plan)
        return send_hidden, send_probs

    def _dropless_metadata(self, routing_map: torch.Tensor) -> dict:
        """Exact per-peer sizes: exchange counts and bring the splits to the host (one sync)."""
        plan = plan_send(routing_map, self.topk, self.ep_size, capacity=None)
        send_counts = plan.send_counts
        recv_counts = self._exchange_counts(send_counts)
        sizes = torch.cat([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).cpu().tolist()
        send_splits = sizes[: self.ep_size]
        recv_splits = sizes[self.ep_size :]
        finalize_send_rows(plan, int(sum(send_splits)))
        return {
            "plan": plan,
            "send_splits": send_splits,
            "recv_splits": recv_splits,
            "recv_counts": recv_counts,
        }

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """[E_p, El] counts per destination -> [E_p, El] counts per source (no grad, no sync)."""
        if self.ep_size == 1:
            return send_counts
        return all_to_all_blocking(send_counts.contiguous(), self.ep_group, None, None)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Exchange the slabs (equal splits in static mode) and the per-expert counts."""
        state = self._state
        if state["recv_counts"] is None:
            state["recv_counts"] = self._exchange_counts(state["plan"].send_counts)
        handoff = None
        if self.wgrad_overlap is not None and self.ep_size > 1 and hidden_states.requires_grad:
            handoff = self.wgrad_overlap.open()
        recv_hidden = all_to_all_rows(
            hidden_states, self.ep_group, state["recv_splits"], state["send_splits"], handoff
        )
        recv_probs = all_to_all_rows(probs, self.ep_group, state["recv_splits"], state["send_splits"])
        return recv_hidden, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Group the received rows by local expert; padding rows go last."""
        state = self._state
        plan = state["plan"]
        if self.ep_size == 1:
            # One slab from one source: its rows are already expert-major with the padding last,
            # so the grouping is the identity (no layout, no row permutation either way).
            state["layout"] = None
            return hidden_states, state["recv_counts"].sum(dim=0), probs
        if plan.capacity is not None:
            layout = plan_receive(state["recv_counts"], plan.capacity)
        else:
            layout = plan_receive(state["recv_counts"], None, int(sum(state["recv_splits"])))
        state["layout"] = layout
        grouped_hidden = permute_rows(hidden_states, layout.grouped_source, layout.received_source)
        grouped_probs = permute_rows(probs, layout.grouped_source, layout.received_source)
        return grouped_hidden, layout.tokens_per_expert, grouped_probs

    # ---------------------------------------------------------------- combine

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Back from expert-grouped order to received slab order."""
        layout = self._state["layout"]
        if layout is None:  # EP = 1: the expert-grouped order is the slab order
            return hidden_states
        return permute_rows(hidden_states, layout.received_source, layout.grouped_source)

    def token_combine(self, hidden_states: torch.Tensor):
        """Reverse all-to-all: every row returns to its slab position on the sending rank."""
        state = self._state
        return all_to_all_rows(
            hidden_states, self.ep_group, state["send_splits"], state["recv_splits"]
        )

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Sum each token's top-k expert outputs (in slot order) and restore the input shape."""
        plan = self._state["plan"]
        self._state = None
        output = combine_slots(hidden_states, plan)
        return output.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts):
        raise NotImplementedError(
            "shared-expert overlap is not supported by the static-capacity dispatcher; "
            "disable moe_shared_expert_overlap"
        )
