"""The send plan of the static-capacity dispatcher: where every (token, expert) pair goes.

For a routing map ``routed[n, e]`` (N tokens, E experts, E_p ranks of El = E / E_p experts each,
top-k, slab of C rows per destination rank)::

    slot s of token n      e(n, s) = the s-th routed expert of n in ascending order
                           (valid[n, s] = n has more than s routed experts)
    count[e]               = Σ_n routed[n, e]
    start[e]               = Σ_{e' < e, e' on e's rank} count[e']        (block of e in its slab)
    position(n, e)         = start[e] + #{n' < n : routed[n', e]}
    row[n, s]              = rank(e)·C + position(n, e),   e = e(n, s)
    keep[n, s]             = valid[n, s] and position < C   (every valid slot when C ≥ N·k)
    send_counts[e]         = min(max(C − start[e], 0), count[e]),   overflow = any(valid & ~keep)
    row_pair[row[n, s]] = n·k + s,   row_token[...] = n,   row_valid[...] = True     (kept pairs)
    row_pair = 0, row_token = SKIP, row_valid = False                           (all other rows)

and the probabilities of the send rows, ``send_probs[r] = probs[row_token[r], e(row_pair[r])]``
on kept rows, 0 on the others, whose gradient is
``grad_probs[n, e(n, s)] = grad_send[row[n, s]]`` on kept slots, 0 elsewhere.

The eager reference (``plan_send`` + ``finalize_send_rows``, ``gather_send_probs_reference``;
also the dropless dispatcher's plan) computes the slots with a top-k over an integer score, the
positions with a cumsum over an ``[E, N]`` copy of the map, and the inverse tables with scatters:
44 tensor operations for the plan (57 where pairs can drop) and 14 for the probabilities,
forward and backward, per layer and micro-batch, whose host time dominates a launch-bound step.
On CUDA with Triton, ``plan_static_send`` runs two kernels: one program per expert counts the
expert's routed tokens in every block of tokens and writes their running sum (the position of
each block's first pair) and the total, and clears its share of the row tables (padding: no
token, pair 0, not valid) and the overflow flag, which saves three fill launches; one program
per block of tokens then takes each token's first k routed experts, adds the expert's start in its slab
(from the totals) and the token's rank in its block, and writes the slot tables, the rows of the
kept pairs in the inverse tables (distinct rows: plain stores), the overflow flag and, in its
first program, the send counts. ``gather_send_probs`` is one kernel forward (one program per
block of rows) and one backward (one program per block of tokens, writing each token's whole
gradient row). Integer results equal the reference's; the probabilities and their gradient are
copies of single values, bitwise the reference's.

One difference: for an unused slot (a token routed to fewer than k experts) ``slot_expert`` is
the first unrouted expert not taken by an earlier unused slot (ascending), while the reference's
top-k returns unrouted experts in an order torch does not specify (on CPU not the ascending
one). No consumer reads ``slot_expert`` where ``slot_valid`` is False except the reference's
``probs.gather``, whose values there are masked out (and whose adjoint adds zeros);
``gather_send_probs``'s kernels read it only on kept slots. A token routed to more than k
experts, which the top-k router never produces, has its first k as slots in both.

Memory: a ``[ceil(N / T), E]`` int32 table of block positions (T tokens per block, at least 16)
besides the plan itself; the reference holds ``[N, E]`` and ``[E, N]`` int32 temporaries and
int64 ``[N, k]`` ones. No temporaries for the probabilities.
Tests: ``tests/unit/moe/test_send_plan.py`` (the kernels in Triton's interpreter on CPU against the
reference, field by field, for balanced, skewed and partial routings, 1, 2 and 4 ranks,
capacities of 0 rows, that drop, fit exactly or hold N·k rows; the probabilities forward and
backward; the CUDA path on the GPU); ``tests/unit/moe/test_token_dispatcher.py`` checks the
reference against plain loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megatron.bounded.kernels.row_gather import SKIP
from megatron.bounded.kernels.triton_support import HAVE_TRITON, cached_launch

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "exclusive_cumsum",
    "routing_slots",
    "SendPlan",
    "plan_send",
    "finalize_send_rows",
    "plan_static_send",
    "plan_static_send_reference",
    "masked_rows",
    "gather_send_probs",
    "gather_send_probs_reference",
]

# Experts of the largest routing map the kernels take (a token block holds all of a token's
# experts); wider maps use the reference.
_MAX_FUSED_EXPERTS = 256
# Elements of a token block × expert tile of the plan kernel; its token block is 16 to 128 tokens.
_TILE_ELEMENTS = 4096
# Tokens per step of the per-expert count kernel.
_COUNT_STEP_TOKENS = 4096
# Send rows per program of the probability gather, and per step of a count program's share of
# the row tables' clearing.
_ROW_BLOCK = 1024


# --------------------------------------------------------------------------------------------
# The reference (eager torch; also the dropless dispatcher's plan)
# --------------------------------------------------------------------------------------------


def exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Start offsets of consecutive blocks of sizes ``x`` along ``dim``."""
    return torch.cumsum(x, dim=dim) - x


def _check_topk(topk: int, num_experts: int) -> None:
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds the number of experts {num_experts}")


def _routing_sizes(routing_map: torch.Tensor, topk: int, ep_size: int) -> Tuple[int, int, int]:
    """``(N, E, El)`` of a ``[N, E]`` bool routing map split over ``ep_size`` ranks (checked)."""
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError("routing_map must be a 2-D bool tensor [num_tokens, num_experts]")
    num_tokens, num_experts = routing_map.shape
    if num_experts % ep_size != 0:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} EP ranks")
    _check_topk(topk, num_experts)
    return num_tokens, num_experts, num_experts // ep_size


def routing_slots(routing_map: torch.Tensor, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k slots of each token from a boolean ``[N, E]`` routing map, on the device.

    Returns ``slot_expert`` ``[N, topk]`` (int64, the routed experts of each token in ascending
    expert order) and ``slot_valid`` ``[N, topk]`` (bool; False for the unused slots of tokens
    routed to fewer than ``topk`` experts, whose expert index is then meaningless).
    """
    num_tokens, num_experts = routing_map.shape
    _check_topk(topk, num_experts)
    # Routed experts score E - e (> 0, larger for lower e); unrouted experts score 0.  The top-k
    # of that score are the routed experts in ascending order, then unrouted ones (invalid).
    descending = torch.arange(
        num_experts, 0, -1, device=routing_map.device, dtype=torch.int32
    )
    score = routing_map.to(torch.int32) * descending
    top_score, slot_expert = torch.topk(score, topk, dim=1, sorted=True)
    return slot_expert, top_score > 0


@dataclass
class SendPlan:
    """Where every (token, slot) pair goes in the send buffer of one dispatch."""

    num_tokens: int
    topk: int
    ep_size: int
    num_local_experts: int
    # Rows per peer slab (static mode) or None (dropless mode, exact per-peer sizes).
    capacity: Optional[int]
    slot_expert: torch.Tensor  # [N, k] int64 global expert id (meaningless where not valid)
    slot_valid: torch.Tensor  # [N, k] bool: the slot holds a routed pair
    slot_keep: torch.Tensor  # [N, k] bool: routed and inside its slab (not dropped)
    slot_rows: torch.Tensor  # [N, k] int64 send-buffer row of each kept pair, 0 elsewhere
    send_counts: torch.Tensor  # [E_p, El] int64 kept pairs per destination rank / local expert
    overflow: torch.Tensor  # [1] bool: some routed pair was dropped
    routed_counts: torch.Tensor  # [E_p, El] int64 routed pairs (kept or not) per rank / expert
    # False when no pair can be dropped (dropless, or a slab of at least N·k rows): overflow is
    # then all False and nothing was computed for it
    can_drop: bool = True
    # Filled by ``finalize_send_rows`` once the number of send rows is known on the host.
    num_send_rows: Optional[int] = None
    row_token: Optional[torch.Tensor] = None  # [R_send] int64 source token of each row (SKIP pad)
    row_pair: Optional[torch.Tensor] = None  # [R_send] int64 n * k + slot of each row (0 pad)
    row_valid: Optional[torch.Tensor] = None  # [R_send] bool: the row carries a kept pair


def plan_send(
    routing_map: torch.Tensor,
    topk: int,
    ep_size: int,
    capacity: Optional[int],
    send_offsets: Optional[torch.Tensor] = None,
) -> SendPlan:
    """Positions of all routed pairs inside the per-destination slabs (device only, no sync).

    ``routing_map`` is ``[N, E]`` bool with experts ``[r * El, (r + 1) * El)`` on EP rank r.
    Within the slab for rank r, pairs are ordered by local expert, then by token index.

    Static mode (``capacity`` is an int): slab r occupies rows ``[r * C, (r + 1) * C)``; pairs at
    slab position ``>= C`` are dropped and raise ``overflow``. A token is routed to at most
    ``topk`` experts (as the top-k router does), so a slab of ``C >= N * topk`` rows holds every
    pair any rank can send: the drop arithmetic is then skipped (``can_drop`` False).

    Dropless mode (``capacity`` None): slab r starts at ``send_offsets[r]`` (a device tensor of
    exclusive prefix sums of the per-rank pair counts; computed here when not given) and holds
    all its pairs.
    """
    num_tokens, num_experts, num_local = _routing_sizes(routing_map, topk, ep_size)
    device = routing_map.device

    slot_expert, slot_valid = routing_slots(routing_map, topk)

    # Expert-major [E, N]: the scan over tokens below then runs along the contiguous dimension
    # (a scan along dim 0 of [N, E] is several times slower on a GPU).
    routed = routing_map.t().to(torch.int32).contiguous()
    counts = routed.sum(dim=1, dtype=torch.int64)  # [E] pairs per expert
    counts_2d = counts.view(ep_size, num_local)
    # Start of each expert's block inside its destination slab.
    expert_base = exclusive_cumsum(counts_2d, dim=1).view(num_experts)
    # Position of pair (n, e) inside its slab: rank of n among the tokens routed to e, plus the
    # start of e's block.  int32 keeps the [E, N] temporary as small as the routing probs.
    position = torch.cumsum(routed, dim=1, dtype=torch.int32)
    position.sub_(routed)
    position.add_(expert_base.to(torch.int32).unsqueeze(1))
    token = torch.arange(num_tokens, device=device, dtype=torch.int64).unsqueeze(1)
    slot_pos = position.view(-1)[slot_expert * num_tokens + token].to(torch.int64)
    del position, routed, token

    can_drop = capacity is not None and capacity < num_tokens * topk
    if capacity is None:
        if send_offsets is None:
            send_offsets = exclusive_cumsum(counts_2d.sum(dim=1))
        dest_rank = torch.div(slot_expert, num_local, rounding_mode="floor")
        slot_rows = send_offsets.to(device)[dest_rank] + slot_pos
    elif ep_size == 1:
        slot_rows = slot_pos  # the one slab is rows [0, C)
    else:
        slot_rows = torch.div(slot_expert, num_local, rounding_mode="floor") * capacity + slot_pos
    if can_drop:
        fits = slot_pos < capacity
        slot_keep = slot_valid & fits
        overflow = (slot_valid & ~fits).any().reshape(1)
        send_counts = torch.minimum(
            (capacity - exclusive_cumsum(counts_2d, dim=1)).clamp(min=0), counts_2d
        )
    else:  # dropless, or every pair fits its slab
        slot_keep = slot_valid
        overflow = torch.zeros(1, dtype=torch.bool, device=device)
        send_counts = counts_2d
    slot_rows = torch.where(slot_keep, slot_rows, torch.zeros_like(slot_rows))
    return SendPlan(
        num_tokens=num_tokens,
        topk=topk,
        ep_size=ep_size,
        num_local_experts=num_local,
        capacity=capacity,
        slot_expert=slot_expert,
        slot_valid=slot_valid,
        slot_keep=slot_keep,
        slot_rows=slot_rows,
        send_counts=send_counts,
        overflow=overflow,
        routed_counts=counts_2d,
        can_drop=can_drop,
    )


def finalize_send_rows(plan: SendPlan, num_send_rows: int) -> SendPlan:
    """Inverse tables of ``plan``: the source token / pair of every send row (device only)."""
    device = plan.slot_rows.device
    num_pairs = plan.num_tokens * plan.topk
    # Kept pairs write their own row; dropped and unused slots all write the dummy row R.
    target = torch.where(
        plan.slot_keep, plan.slot_rows, torch.full_like(plan.slot_rows, num_send_rows)
    ).reshape(-1)
    pair_ids = torch.arange(num_pairs, device=device, dtype=torch.int64)
    row_pair = torch.zeros(num_send_rows + 1, dtype=torch.int64, device=device)
    row_pair.scatter_(0, target, pair_ids)
    row_valid = torch.zeros(num_send_rows + 1, dtype=torch.bool, device=device)
    row_valid.scatter_(0, target, plan.slot_keep.reshape(-1))
    row_pair = row_pair[:num_send_rows]
    row_valid = row_valid[:num_send_rows]
    row_pair = torch.where(row_valid, row_pair, torch.zeros_like(row_pair))
    plan.num_send_rows = num_send_rows
    plan.row_pair = row_pair
    # padding rows read no token: row_gather moves no bytes for them
    row_token = torch.div(row_pair, plan.topk, rounding_mode="floor")
    plan.row_token = torch.where(row_valid, row_token, torch.full_like(row_token, SKIP))
    plan.row_valid = row_valid
    return plan


def plan_static_send_reference(
    routing_map: torch.Tensor, topk: int, ep_size: int, capacity: int
) -> SendPlan:
    """The static-capacity plan with its inverse tables, eager (``plan_send`` in static mode and
    ``finalize_send_rows`` for ``ep_size * capacity`` send rows)."""
    return finalize_send_rows(plan_send(routing_map, topk, ep_size, capacity), ep_size * capacity)


def masked_rows(
    source: torch.Tensor, row_token: torch.Tensor, row_valid: torch.Tensor
) -> torch.Tensor:
    """out[r] = source[row_token[r]] where row_valid[r], else 0."""
    picked = source.index_select(0, row_token)
    keep = row_valid.view((row_valid.shape[0],) + (1,) * (source.dim() - 1))
    return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def gather_send_probs_reference(probs: torch.Tensor, plan: SendPlan) -> torch.Tensor:
    """``[N, E]`` routing probs -> ``[R_send]`` prob of each send row (0 on padding rows)."""
    slot_probs = probs.gather(1, plan.slot_expert).reshape(-1)
    # The mask matters in backward: it zeroes the experts' unspecified probability gradient of
    # the padding rows, which index_select's adjoint would otherwise add into pair 0.
    return masked_rows(slot_probs, plan.row_pair, plan.row_valid)


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------


if HAVE_TRITON:

    @cached_launch
    @triton.jit
    def _block_starts_kernel(
        routing_ptr, block_start_ptr, counts_ptr, num_tokens, num_blocks,
        row_pair_ptr, row_token_ptr, row_valid_ptr, num_send_rows,
        NUM_EXPERTS: tl.constexpr, TOKEN_BLOCK: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr,
        NUM_STEPS: tl.constexpr, ROW_BLOCK: tl.constexpr, CLEAR_STEPS: tl.constexpr,
        PAD_TOKEN: tl.constexpr,
    ):
        # program e: per block of tokens, the tokens of earlier blocks routed to expert e; the total
        expert = tl.program_id(0)
        # and every NUM_EXPERTS-th block of the row tables cleared (row_valid holds one more
        # element, the overflow flag); the plan kernel, launched after this one, writes the rows
        # of the kept pairs
        for step in range(CLEAR_STEPS):
            first = (step * NUM_EXPERTS + expert).to(tl.int64) * ROW_BLOCK
            rows = first + tl.arange(0, ROW_BLOCK)
            tl.store(row_pair_ptr + rows, tl.zeros([ROW_BLOCK], dtype=tl.int64),
                     mask=rows < num_send_rows)
            tl.store(row_token_ptr + rows, tl.full([ROW_BLOCK], PAD_TOKEN, dtype=tl.int64),
                     mask=rows < num_send_rows)
            tl.store(row_valid_ptr + rows, tl.zeros([ROW_BLOCK], dtype=tl.int1),
                     mask=rows <= num_send_rows)
        blocks_of_step = tl.arange(0, BLOCKS_PER_STEP)
        in_block = tl.arange(0, TOKEN_BLOCK)
        before = tl.zeros([], dtype=tl.int32)
        # a constexpr trip count (it changes every BLOCKS_PER_STEP blocks only): Triton's
        # interpreter cannot take a runtime loop bound under NumPy 2.5
        for step in range(NUM_STEPS):
            blocks = step * BLOCKS_PER_STEP + blocks_of_step
            tokens = blocks[:, None].to(tl.int64) * TOKEN_BLOCK + in_block[None, :]
            routed = tl.load(
                routing_ptr + tokens * NUM_EXPERTS + expert, mask=tokens < num_tokens, other=0
            ).to(tl.int32)
            block_counts = tl.sum(routed, axis=1)
            starts = before + tl.cumsum(block_counts, axis=0) - block_counts
            tl.store(
                block_start_ptr + blocks * NUM_EXPERTS + expert, starts, mask=blocks < num_blocks
            )
            before += tl.sum(block_counts, axis=0)
        tl.store(counts_ptr + expert, before.to(tl.int64))

    @cached_launch
    @triton.jit
    def _send_plan_kernel(
        routing_ptr, block_start_ptr, counts_ptr,
        slot_expert_ptr, slot_valid_ptr, slot_keep_ptr, slot_rows_ptr, send_counts_ptr,
        row_pair_ptr, row_token_ptr, row_valid_ptr, overflow_ptr,
        num_tokens, capacity,
        NUM_EXPERTS: tl.constexpr, LOCAL_EXPERTS: tl.constexpr, TOPK: tl.constexpr,
        CAN_DROP: tl.constexpr, TOKEN_BLOCK: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
        RANK_BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        tokens = block.to(tl.int64) * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        experts = tl.arange(0, EXPERT_BLOCK)
        token_ok = tokens < num_tokens
        expert_ok = experts < NUM_EXPERTS
        routed = tl.load(
            routing_ptr + tokens[:, None] * NUM_EXPERTS + experts[None, :],
            mask=token_ok[:, None] & expert_ok[None, :], other=0,
        ).to(tl.int32)

        # Start of each expert's block in its rank's slab: the pairs of the rank's lower experts
        # (the pairs of all lower experts minus those of the lower ranks).
        counts = tl.load(counts_ptr + experts, mask=expert_ok, other=0).to(tl.int32)
        ranks = tl.arange(0, RANK_BLOCK)
        rank_start = tl.sum(
            tl.where(experts[None, :] < ranks[:, None] * LOCAL_EXPERTS, counts[None, :], 0), axis=1
        )
        own_rank = ranks[None, :] == (experts // LOCAL_EXPERTS)[:, None]
        own_rank_start = tl.sum(tl.where(own_rank, rank_start[None, :], 0), axis=1)
        expert_start = tl.cumsum(counts, axis=0) - counts - own_rank_start
        block_start = tl.load(
            block_start_ptr + block * NUM_EXPERTS + experts, mask=expert_ok, other=0
        )
        # Slab position of every (token, expert) of the block (meaningful where routed).
        position = (expert_start + block_start)[None, :] + tl.cumsum(routed, axis=0) - routed

        # Slot of each expert: the routed ones in ascending order, then the unrouted ones
        # (ascending; they fill the unused slots).
        routed_before = tl.cumsum(routed, axis=1) - routed
        num_routed = tl.sum(routed, axis=1)
        slot_of = tl.where(
            routed != 0, routed_before, num_routed[:, None] + experts[None, :] - routed_before
        )
        dropped = tl.zeros([TOKEN_BLOCK], dtype=tl.int32)
        for slot in tl.static_range(TOPK):
            chosen = slot_of == slot  # one expert per token
            expert = tl.sum(tl.where(chosen, experts[None, :], 0), axis=1)
            slab_position = tl.sum(tl.where(chosen, position, 0), axis=1)
            valid = num_routed > slot
            inside = slab_position < capacity
            if CAN_DROP:
                keep = valid & inside
                dropped += (valid & (slab_position >= capacity)).to(tl.int32)
            else:
                keep = valid
            row = (expert // LOCAL_EXPERTS).to(tl.int64) * capacity + slab_position
            row = tl.where(keep, row, 0)
            pair = tokens * TOPK + slot
            tl.store(slot_expert_ptr + pair, expert.to(tl.int64), mask=token_ok)
            tl.store(slot_valid_ptr + pair, valid, mask=token_ok)
            if CAN_DROP:  # otherwise slot_keep is slot_valid
                tl.store(slot_keep_ptr + pair, keep, mask=token_ok)
            tl.store(slot_rows_ptr + pair, row, mask=token_ok)
            # Kept pairs have distinct rows: plain stores. Inside the slab always with top-k
            # routing; a map routing a token to more than k experts could pass a slab of N·k
            # rows, and its pairs there must not write past the tables.
            written = keep & inside
            tl.store(row_pair_ptr + row, pair, mask=written)
            tl.store(row_token_ptr + row, tokens, mask=written)
            tl.store(row_valid_ptr + row, written, mask=written)
        if CAN_DROP:
            any_dropped = tl.max(dropped, axis=0) > 0
            tl.store(overflow_ptr, any_dropped, mask=any_dropped)  # every writer writes True
            send_counts = tl.minimum(tl.maximum(capacity - expert_start, 0), counts)
            tl.store(
                send_counts_ptr + experts, send_counts.to(tl.int64), mask=expert_ok & (block == 0)
            )

    @cached_launch
    @triton.jit
    def _send_probs_kernel(
        probs_ptr, slot_expert_ptr, row_pair_ptr, row_valid_ptr, out_ptr, num_rows,
        NUM_EXPERTS: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = rows < num_rows
        valid = tl.load(row_valid_ptr + rows, mask=in_range, other=0) != 0
        pair = tl.load(row_pair_ptr + rows, mask=valid, other=0)
        expert = tl.load(slot_expert_ptr + pair, mask=valid, other=0)
        prob = tl.load(probs_ptr + (pair // TOPK) * NUM_EXPERTS + expert, mask=valid, other=0.0)
        tl.store(out_ptr + rows, prob, mask=in_range)

    @cached_launch
    @triton.jit
    def _send_probs_grad_kernel(
        grad_send_ptr, slot_expert_ptr, slot_rows_ptr, slot_keep_ptr, grad_probs_ptr, num_tokens,
        NUM_EXPERTS: tl.constexpr, TOPK: tl.constexpr, TOKEN_BLOCK: tl.constexpr,
        EXPERT_BLOCK: tl.constexpr,
    ):
        tokens = tl.program_id(0).to(tl.int64) * TOKEN_BLOCK + tl.arange(0, TOKEN_BLOCK)
        experts = tl.arange(0, EXPERT_BLOCK)
        token_ok = tokens < num_tokens
        # 0 + the kept slot's gradient, as the reference's index_add and scatter_add into zeros
        # (a token's kept experts are distinct: one term at most per element)
        grad = tl.zeros([TOKEN_BLOCK, EXPERT_BLOCK], dtype=grad_probs_ptr.dtype.element_ty)
        for slot in tl.static_range(TOPK):
            pair = tokens * TOPK + slot
            keep = tl.load(slot_keep_ptr + pair, mask=token_ok, other=0) != 0
            expert = tl.load(slot_expert_ptr + pair, mask=keep, other=0)
            row = tl.load(slot_rows_ptr + pair, mask=keep, other=0)
            grad_row = tl.load(grad_send_ptr + row, mask=keep, other=0.0)
            hit = keep[:, None] & (experts[None, :] == expert[:, None])
            grad += tl.where(hit, grad_row[:, None], 0.0)
        tl.store(
            grad_probs_ptr + tokens[:, None] * NUM_EXPERTS + experts[None, :], grad,
            mask=token_ok[:, None] & (experts < NUM_EXPERTS)[None, :],
        )


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def plan_static_send(routing_map: torch.Tensor, topk: int, ep_size: int, capacity: int) -> SendPlan:
    """``plan_static_send_reference``'s plan (``capacity`` rows per slab, inverse tables for
    ``ep_size * capacity`` send rows); two Triton kernels on CUDA for up to
    ``_MAX_FUSED_EXPERTS`` experts, with ``slot_expert`` defined on unused slots too (the
    module's docstring says how)."""
    if capacity is None or capacity < 0:
        raise ValueError(f"a static send plan needs a capacity >= 0, got {capacity!r}")
    fused = (
        HAVE_TRITON and routing_map.is_cuda and routing_map.dim() == 2
        and routing_map.shape[0] > 0 and routing_map.shape[1] <= _MAX_FUSED_EXPERTS
        and routing_map.numel() < 2**31  # int32 slab positions
    )
    if not fused:
        return plan_static_send_reference(routing_map, topk, ep_size, capacity)
    return _launch_plan(routing_map, topk, ep_size, capacity)


def _tile(num_experts: int) -> Tuple[int, int]:
    """(expert block, token block) of the kernels that hold a token block's whole map rows."""
    expert_block = triton.next_power_of_2(num_experts)
    return expert_block, min(max(_TILE_ELEMENTS // expert_block, 16), 128)


def _launch_plan(routing_map: torch.Tensor, topk: int, ep_size: int, capacity: int) -> SendPlan:
    num_tokens, num_experts, num_local = _routing_sizes(routing_map, topk, ep_size)
    device = routing_map.device
    routing_map = routing_map.contiguous()
    expert_block, token_block = _tile(num_experts)
    num_blocks = triton.cdiv(num_tokens, token_block)
    can_drop = capacity < num_tokens * topk
    num_send_rows = ep_size * capacity

    block_start = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    routed_counts = torch.empty(ep_size, num_local, dtype=torch.int64, device=device)
    slot_expert = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    slot_rows = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    slot_valid = torch.empty(num_tokens, topk, dtype=torch.bool, device=device)
    # Without drops every valid slot is kept and sends: the reference returns the same tensors.
    slot_keep = torch.empty_like(slot_valid) if can_drop else slot_valid
    send_counts = torch.empty_like(routed_counts) if can_drop else routed_counts
    # The rows no kept pair writes are padding. The overflow flag is the element after the
    # row_valid table; the count kernel clears all three tables and the flag.
    row_valid_and_overflow = torch.empty(num_send_rows + 1, dtype=torch.bool, device=device)
    row_pair = torch.empty(num_send_rows, dtype=torch.int64, device=device)
    row_token = torch.empty(num_send_rows, dtype=torch.int64, device=device)
    row_valid = row_valid_and_overflow[:num_send_rows]
    overflow = row_valid_and_overflow[num_send_rows:]

    blocks_per_step = _COUNT_STEP_TOKENS // token_block
    _block_starts_kernel[(num_experts,)](
        routing_map, block_start, routed_counts, num_tokens, num_blocks,
        row_pair, row_token, row_valid_and_overflow, num_send_rows,
        NUM_EXPERTS=num_experts, TOKEN_BLOCK=token_block, BLOCKS_PER_STEP=blocks_per_step,
        NUM_STEPS=triton.cdiv(num_blocks, blocks_per_step), ROW_BLOCK=_ROW_BLOCK,
        CLEAR_STEPS=triton.cdiv(num_send_rows + 1, num_experts * _ROW_BLOCK), PAD_TOKEN=SKIP,
    )
    _send_plan_kernel[(num_blocks,)](
        routing_map, block_start, routed_counts,
        slot_expert, slot_valid, slot_keep, slot_rows, send_counts,
        row_pair, row_token, row_valid, overflow,
        num_tokens, capacity,
        NUM_EXPERTS=num_experts, LOCAL_EXPERTS=num_local, TOPK=topk, CAN_DROP=can_drop,
        TOKEN_BLOCK=token_block, EXPERT_BLOCK=expert_block,
        RANK_BLOCK=triton.next_power_of_2(ep_size), num_warps=8,
    )
    return SendPlan(
        num_tokens=num_tokens, topk=topk, ep_size=ep_size, num_local_experts=num_local,
        capacity=capacity, slot_expert=slot_expert, slot_valid=slot_valid, slot_keep=slot_keep,
        slot_rows=slot_rows, send_counts=send_counts, overflow=overflow,
        routed_counts=routed_counts, can_drop=can_drop, num_send_rows=num_send_rows,
        row_token=row_token, row_pair=row_pair, row_valid=row_valid,
    )


class _GatherSendProbs(torch.autograd.Function):
    """The send rows' probabilities; the backward puts each kept row's gradient back at its
    (token, expert)."""

    @staticmethod
    def forward(ctx, probs, slot_expert, slot_rows, slot_keep, row_pair, row_valid):
        ctx.save_for_backward(slot_expert, slot_rows, slot_keep)
        ctx.num_experts = probs.shape[1]
        return _launch_send_probs(probs, slot_expert, row_pair, row_valid)

    @staticmethod
    def backward(ctx, grad_send):
        slot_expert, slot_rows, slot_keep = ctx.saved_tensors
        grad_probs = _launch_send_probs_grad(
            grad_send, slot_expert, slot_rows, slot_keep, ctx.num_experts
        )
        return grad_probs, None, None, None, None, None


def gather_send_probs(probs: torch.Tensor, plan: SendPlan) -> torch.Tensor:
    """``gather_send_probs_reference``'s values and gradient; one Triton kernel each way for
    fp32/bf16/fp16 probabilities on CUDA."""
    fused = (
        HAVE_TRITON and probs.is_cuda and probs.dim() == 2 and plan.num_tokens > 0
        and plan.num_send_rows > 0 and probs.shape[1] <= _MAX_FUSED_EXPERTS
        and probs.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if not fused:
        return gather_send_probs_reference(probs, plan)
    return _GatherSendProbs.apply(
        probs, plan.slot_expert, plan.slot_rows, plan.slot_keep, plan.row_pair, plan.row_valid
    )


def _launch_send_probs(probs: torch.Tensor, slot_expert: torch.Tensor, row_pair: torch.Tensor,
                       row_valid: torch.Tensor) -> torch.Tensor:
    num_rows = row_pair.shape[0]
    out = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
    _send_probs_kernel[(triton.cdiv(num_rows, _ROW_BLOCK),)](
        probs.contiguous(), slot_expert, row_pair, row_valid, out, num_rows,
        NUM_EXPERTS=probs.shape[1], TOPK=slot_expert.shape[1], BLOCK=_ROW_BLOCK,
    )
    return out


def _launch_send_probs_grad(grad_send: torch.Tensor, slot_expert: torch.Tensor,
                            slot_rows: torch.Tensor, slot_keep: torch.Tensor,
                            num_experts: int) -> torch.Tensor:
    num_tokens, topk = slot_expert.shape
    grad_probs = torch.empty(
        num_tokens, num_experts, dtype=grad_send.dtype, device=grad_send.device
    )
    expert_block, token_block = _tile(num_experts)
    _send_probs_grad_kernel[(triton.cdiv(num_tokens, token_block),)](
        grad_send.contiguous(), slot_expert, slot_rows, slot_keep, grad_probs, num_tokens,
        NUM_EXPERTS=num_experts, TOPK=topk, TOKEN_BLOCK=token_block, EXPERT_BLOCK=expert_block,
        num_warps=8,
    )
    return grad_probs
