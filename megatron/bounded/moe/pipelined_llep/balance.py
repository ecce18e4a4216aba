"""LLEP balancing: the least-loaded spill plan (pure), the virtual expert of every routed pair
under it, and the weight copies the helper ranks receive."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import torch

from megatron.bounded.kernels.collectives import all_to_all_rows
from megatron.bounded.moe.dispatch.token_dispatcher import exclusive_cumsum
from megatron.bounded.moe.pipelined_llep.chunks import as_int
from megatron.bounded.units import ceil_div


@dataclass(frozen=True)
class Spill:
    """Pairs ``[start, start + count)`` of ``expert``'s global order run on ``helper``."""

    expert: int
    owner: int
    helper: int
    start: int
    count: int


@dataclass(frozen=True)
class LLEPPlan:
    """Which pairs of which experts run on which rank for one step.

    The pairs of expert e are ordered globally by (source rank, token order); the owner keeps
    the first ``kept(e)`` of them and each ``Spill`` of e hands a further range to a helper.
    """

    ep_size: int
    num_experts: int
    threshold: float
    loads: Tuple[int, ...]
    rank_loads: Tuple[int, ...]
    balanced_rank_loads: Tuple[int, ...]
    imbalance: float
    spills: Tuple[Spill, ...] = field(default_factory=tuple)

    @property
    def active(self) -> bool:
        return len(self.spills) > 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def hosted(self, rank: int) -> Tuple[int, ...]:
        """Experts of other ranks that ``rank`` runs a copy of, ascending."""
        return tuple(sorted(s.expert for s in self.spills if s.helper == rank))

    @property
    def max_hosted(self) -> int:
        return max((len(self.hosted(r)) for r in range(self.ep_size)), default=0)

    def kept(self, expert: int) -> int:
        return self.loads[expert] - sum(s.count for s in self.spills if s.expert == expert)


def plan_llep(
    loads: Sequence[int], ep_size: int, threshold: float, min_spill_tokens: int = 1
) -> LLEPPlan:
    """Least-loaded spill plan from the global per-expert pair counts (deterministic, no comm).

    Experts ``[r * El, (r + 1) * El)`` live on rank r.  When ``max(rank load) / mean`` exceeds
    ``threshold``, every rank above the target ``ceil(total / E_p)`` hands pairs of its heaviest
    experts to the currently least-loaded rank (ties: lower rank) until it is at the target,
    never filling a helper beyond the target; a hand-over smaller than ``min_spill_tokens`` is
    not made (a weight copy for a handful of pairs costs more than it saves).

    ``threshold`` (>= 1.0) and ``min_spill_tokens`` (>= 1) are values
    ``PipelinedLLEPSettings.check_values`` accepts (``pipelined_moe`` checks them).
    """
    loads = tuple(as_int(x, "expert load") for x in loads)
    ep_size = as_int(ep_size, "ep_size")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if len(loads) == 0 or len(loads) % ep_size != 0:
        raise ValueError(f"{len(loads)} expert loads do not split over {ep_size} EP ranks")
    if any(x < 0 for x in loads):
        raise ValueError("expert loads must be non-negative")
    local = len(loads) // ep_size
    rank_loads = [sum(loads[r * local : (r + 1) * local]) for r in range(ep_size)]
    total = sum(rank_loads)
    imbalance = max(rank_loads) * ep_size / total if total else 1.0
    plan_args = dict(
        ep_size=ep_size,
        num_experts=len(loads),
        threshold=float(threshold),
        loads=loads,
        rank_loads=tuple(rank_loads),
        imbalance=imbalance,
    )
    if ep_size == 1 or total == 0 or imbalance <= threshold:
        return LLEPPlan(balanced_rank_loads=tuple(rank_loads), **plan_args)

    target = ceil_div(total, ep_size)
    assigned = list(rank_loads)
    helpers = [(assigned[r], r) for r in range(ep_size) if assigned[r] < target]
    heapq.heapify(helpers)
    moves: List[Tuple[int, int, int]] = []  # (expert, helper, count) in decision order
    for r in sorted(range(ep_size), key=lambda q: (-rank_loads[q], q)):
        experts = sorted(range(r * local, (r + 1) * local), key=lambda e: (-loads[e], e))
        for e in experts:
            left = loads[e]
            while assigned[r] > target and left > 0 and helpers:
                _, h = heapq.heappop(helpers)
                count = min(assigned[r] - target, left, target - assigned[h])
                if count < min_spill_tokens:
                    heapq.heappush(helpers, (assigned[h], h))
                    break
                moves.append((e, h, count))
                left -= count
                assigned[r] -= count
                assigned[h] += count
                if assigned[h] < target:
                    heapq.heappush(helpers, (assigned[h], h))
            if assigned[r] <= target or not helpers:
                break
    # The owner keeps the head of each expert's order; helpers take consecutive tail ranges.
    spills = []
    for e in sorted({m[0] for m in moves}):
        mine = [(h, c) for (x, h, c) in moves if x == e]
        start = loads[e] - sum(c for _, c in mine)
        for h, c in mine:
            spills.append(Spill(expert=e, owner=e // local, helper=h, start=start, count=c))
            start += c
    return LLEPPlan(balanced_rank_loads=tuple(assigned), spills=tuple(spills), **plan_args)



def pair_virtual_experts(
    slot_expert: torch.Tensor,
    slot_valid: torch.Tensor,
    source_counts: torch.Tensor,
    plan: LLEPPlan,
    ep_rank: int,
    slots: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Virtual expert (rank * slots + slot) of every routed slot under ``plan`` (device only).

    A pair's global position in its expert's order is the number of pairs of that expert on
    lower source ranks (``source_counts`` ``[E_p, E]``) plus its rank among this source's pairs
    of the expert in token order; ``plan`` maps position ranges to the owner or to helpers.
    Returns ``(slot_virtual [N, k], virtual_to_expert [E_p * slots])``; invalid slots get the
    sentinel ``E_p * slots``.
    """
    device = slot_expert.device
    num_experts = plan.num_experts
    local = plan.num_local_experts
    flat_valid = slot_valid.reshape(-1)
    flat_expert = torch.where(flat_valid, slot_expert.reshape(-1), torch.full_like(
        slot_expert.reshape(-1), num_experts))
    # Rank of each pair among this source's pairs of the same expert (token order kept: the
    # flat order is token-major and the sort is stable).
    order = torch.sort(flat_expert, stable=True).indices
    # (scatter_add, not bincount: bincount reads its maximum back to the host on CUDA)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, flat_expert, torch.ones_like(flat_expert))
    starts = exclusive_cumsum(per_expert, 0)
    sorted_expert = flat_expert.index_select(0, order)
    rank_sorted = torch.arange(order.numel(), device=device) - starts.index_select(0, sorted_expert)
    local_pos = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    lower = source_counts[:ep_rank].sum(dim=0) if ep_rank > 0 else torch.zeros(
        num_experts, dtype=torch.int64, device=device)
    lower = torch.cat([lower.to(device=device, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64, device=device)])
    global_pos = lower.index_select(0, flat_expert) + local_pos

    # Segment table: (expert, start) -> virtual id, sorted by expert * span + start.
    span = max(max(plan.loads), 1) + 1
    keys, virt = [], []
    slot_of = {r: {e: local + j for j, e in enumerate(plan.hosted(r))} for r in range(plan.ep_size)}
    for e in range(num_experts):
        owner = e // local
        mine = sorted((s for s in plan.spills if s.expert == e), key=lambda s: s.start)
        if plan.kept(e) > 0 or not mine:
            keys.append(e * span)
            virt.append(owner * slots + (e - owner * local))
        for s in mine:
            keys.append(e * span + s.start)
            virt.append(s.helper * slots + slot_of[s.helper][e])
    seg_keys = torch.tensor(keys, dtype=torch.int64, device=device)
    seg_virt = torch.tensor(virt, dtype=torch.int64, device=device)
    pair_key = flat_expert.clamp(max=num_experts - 1) * span + global_pos
    seg = torch.searchsorted(seg_keys, pair_key, right=True) - 1
    sentinel = plan.ep_size * slots
    slot_virtual = torch.where(flat_valid, seg_virt.index_select(0, seg.clamp(min=0)),
                               torch.full_like(seg, sentinel)).view_as(slot_expert)

    table = []
    for r in range(plan.ep_size):
        row = [r * local + j for j in range(local)] + list(plan.hosted(r))
        table.extend(row + [0] * (slots - len(row)))
    return slot_virtual, torch.tensor(table, dtype=torch.int64, device=device)



def exchange_weight_copies(weight1, weight2, plan: LLEPPlan, ep_rank: int, group):
    """Owners send the spilled experts' weights to their helpers (differentiable)."""
    local = plan.num_local_experts
    send_ids, in_splits, out_splits = [], [], []
    for h in range(plan.ep_size):
        mine = [e for e in plan.hosted(h) if e // local == ep_rank]
        send_ids.extend(e - ep_rank * local for e in mine)
        in_splits.append(len(mine))
        out_splits.append(sum(1 for e in plan.hosted(ep_rank) if e // local == h))
    index = torch.tensor(send_ids, dtype=torch.int64, device=weight1.device)
    copies = []
    for w in (weight1, weight2):
        width = math.prod(w.shape[1:])
        rows = w.index_select(0, index).reshape(len(send_ids), width)
        received = all_to_all_rows(rows, group, out_splits, in_splits)
        copies.append(received.view((sum(out_splits),) + tuple(w.shape[1:])))
    return copies

