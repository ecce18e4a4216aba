"""PipelinedLLEP: chunked expert-parallel MoE with a per-source token budget and LLEP balancing.

The routed batch of a rank (N tokens, top-k) is never materialized at once on any rank.  It is
cut into K chunks; every chunk goes through dispatch (all-to-all) -> grouped expert GEMM ->
combine (all-to-all), and the stages of consecutive chunks are pipelined.

How K is chosen (the paper's Eq. 1).  With the token budget c (``--pipelined-llep-token-budget``,
tokens per rank and chunk) and the cap K_max (``--pipelined-llep-max-chunks``, default
``PipelinedLLEPSettings``)::

    K = min(ceil(N / c), K_max)                       (num_chunks; at least 1)

Ranks may hold different N, so the group agrees on K and on the chunk size with one all-reduce
MAX (``agree_num_chunks``): K = num_chunks(N_max, c, K_max) and c_eff = ceil(N_max / K), the most
tokens any rank has in one chunk.  c_eff <= c while N_max <= K_max * c; when the cap binds,
c_eff = ceil(N_max / K_max) > c (the paper's c_eff).  Chunk i of a rank holds the strided
positions i, i+K, i+2K, ... (``strided_chunk``): every chunk samples the whole sequence, so a
run of consecutive tokens that go to one hot expert (or to one LLEP helper) is spread over all
chunks instead of filling one (``chunking="contiguous"`` is kept for comparison).

Exact sizes, and why the receive buffer is bounded whatever the routing.  Once per step every
rank counts, per chunk, destination rank and expert slot, the (token, expert) pairs it will send
(a [K, E_p, slots] tensor on the device), and one all-gather of these counts (with one host sync)
gives every rank the send and receive sizes of every chunk's all-to-all and the per-expert counts
of the rows it will receive, so the chunks exchange only rows.  Each chunk's rows are packed with
the slab machinery of ``token_dispatcher`` in its exact-size (dropless) mode: no pair is dropped
(``stats["dropped"]`` stays False) and no padding row is moved or computed
(``stats["pairs_sent"]`` equals the routed pairs).  A chunk has at most c_eff tokens, each routed
to at most k experts, so a source sends at most k * c_eff pairs per chunk *in total*, and a rank
receives at most ``E_p * k * c_eff`` rows per chunk however skewed the routing (the tests check
it for balanced, 80%-to-one-expert, Zipf and all-to-one-rank routings).  The pipeline keeps at
most two chunks dispatched at a time (chunk i+1 is dispatched while chunk i computes), so the
receive-side live set per rank is at most::

    M_dispatch = 2 * E_p * k * c_eff * H * b          (double-buffered receive)

(E_p ranks in the expert-parallel group, H hidden size, b bytes per element), fixed by the
launch configuration: routing skew can only lengthen the pipeline and fill more of the bound,
never pass it.  ``dispatch_live_bytes_bound`` gives this term and an upper bound of the whole
chunk working set (send, receive and expert-grouped rows, the expert activations, and the
gradient rows of the backward).

Exactness and recompute.  ``_PipelinedMoEFunction`` is a reentrant checkpoint at chunk
granularity: its forward runs the chunks without building an autograd graph and saves only its
inputs (token rows, probs, routing, weights); its backward re-runs each chunk's dispatch and
fc1 GEMM (``grouped_mlp_grads``: not the fc2 GEMM, whose output the gradients do not need),
sends the output gradient through the combine's adjoint, and returns the input gradient through
the dispatch's adjoint, with the same two-chunk window as the forward.  So the bound also holds
in backward after recompute, whether or not the layer sits inside an outer (full-recompute)
checkpoint.  (The paper
checkpoints only the expert GEMM and relies on the decoder layer's outer checkpoint; here the
dispatch is recomputed as well, at the price of one more dispatch all-to-all per chunk in
backward, because otherwise the received rows of all K chunks would be saved for backward.)
Expert weight gradients are summed over the chunks.  With K = 1 every row sees the operations
and reduction orders of the unchunked static-capacity dispatcher with a no-drop factor
(cf = E_p), whose padding rows reach no result, so outputs and all gradients are bitwise equal;
for K > 1 the weight-gradient sum over chunks is reassociated (outputs and input gradients keep
their per-token order).
``tests/unit/test_pipelined_llep.py::test_live_bytes_bounded_for_every_routing`` measures
the live set (every tensor the layer allocates, forward and backward, tracked through a
dispatch-mode meter on CPU) against ``dispatch_live_bytes_bound`` for three routings, and its
reduction against the unchunked path; ``test_received_rows_within_bound`` checks
the rows received per chunk; ``test_gpu_peak_memory_shrinks_with_chunks`` (GPU) checks
``torch.cuda.max_memory_allocated``.

Pipeline.  Per step i the schedule issues the dispatch of chunk i+1, then the grouped GEMM of
chunk i, then the combine of chunk i; so chunk i+1's dispatch and chunk i-1's combine are in
flight while chunk i computes.  On CUDA the all-to-alls and their packing run on a side stream
ordered by events (one NCCL group serializes its collectives; the overlap is communication
against the expert GEMM); on CPU (gloo) the same program runs sequentially with the same math.

LLEP (least-loaded expert parallelism).  Once per step the layer all-gathers the per-expert pair
counts of every rank (one small collective and one host sync, which also agrees K; the chunk
sizes above are exchanged after it, as they depend on the plan).  When the
most loaded rank carries more than ``threshold`` times the mean load, ``plan_llep`` (a pure
function of the global loads) moves the tail of the hottest experts' pairs to the least-loaded
ranks; such a helper rank receives a temporary copy of the expert's weights (an all-to-all with
autograd, so the copy's weight gradient flows back and is summed into the owner's gradient) and
runs the spilled pairs as an extra local expert.  Within every chunk the per-source budget still
bounds what any rank receives.  Results equal those without balancing up to fp32 reassociation
(a token's top-k outputs may be summed in another order).  Helpers hold the copies' weights for
the layer's forward and backward, and their local weights once more while the expert GEMM of a
chunk runs (``torch._grouped_mm`` takes one stacked weight).

Entry points: ``PipelinedLLEPMoE`` (reads the config, called by ``BoundedMoELayer``) and the
functional ``pipelined_moe``.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import utils as mcore_utils

from megatron.bounded.kernels.collectives import all_to_all_rows
from megatron.bounded.moe.experts import grouped_mlp, grouped_mlp_grads
from megatron.bounded.settings import BoundedArgumentError, Settings, knob
from megatron.bounded.moe.dispatch.token_dispatcher import (
    SendPlan,
    combine_slots,
    exclusive_cumsum,
    finalize_send_rows,
    masked_rows,
    plan_receive,
    plan_send,
    routing_slots,
)

__all__ = [
    "num_chunks",
    "agree_num_chunks",
    "strided_chunk",
    "contiguous_chunk",
    "dispatch_live_bytes_bound",
    "Spill",
    "LLEPPlan",
    "plan_llep",
    "pipelined_moe",
    "PipelinedLLEPMoE",
    "PipelinedLLEPSettings",
]

_CHUNKINGS = ("strided", "contiguous")


@dataclass
class PipelinedLLEPSettings(Settings):
    """PipelinedLLEP's flags. Not frozen: :class:`~megatron.bounded.model.config.BoundedTransformerConfig`
    inherits the fields, so the MoE layer reads them from its config."""

    SWITCH = "pipelined_llep"
    EARLY = False  # after the Transformer Engine substitutions of validate_bounded_args

    pipelined_llep: bool = knob(
        False, "PipelinedLLEP: dispatch each MoE layer in strided chunks of at most "
        "--pipelined-llep-token-budget tokens per source rank, pipelined and recomputed per chunk.")
    pipelined_llep_token_budget: Optional[int] = knob(
        None, "PipelinedLLEP: tokens per chunk and source rank (c); required.", metavar="C")
    pipelined_llep_max_chunks: int = knob(
        10, "PipelinedLLEP: most chunks per layer (K_max).", metavar="K")
    llep_imbalance_threshold: Optional[float] = knob(
        None, "PipelinedLLEP: spill overloaded experts to the least-loaded ranks when the hottest "
        "rank's load exceeds this multiple of the mean (>= 1.0). Default: off.")
    llep_min_spill_tokens: int = knob(
        1024, "PipelinedLLEP: smallest number of tokens worth moving to a helper rank.")

    def check(self, args) -> None:
        """Refuse settings PipelinedLLEP cannot run: no MoE model, a bad budget, cap, threshold or
        spill size, and the MoE options it replaces."""
        if not self.pipelined_llep:
            return
        if args.num_experts is None:
            raise BoundedArgumentError("--pipelined-llep needs an MoE model (--num-experts).")
        budget = self.pipelined_llep_token_budget
        if budget is None or budget <= 0:
            raise BoundedArgumentError(
                "--pipelined-llep needs --pipelined-llep-token-budget C > 0 (tokens per chunk and "
                f"source rank; e.g. ceil(N / 10)), got {budget}."
            )
        for flag, value in (("--pipelined-llep-max-chunks", self.pipelined_llep_max_chunks),
                            ("--llep-min-spill-tokens", self.llep_min_spill_tokens)):
            if value < 1:
                raise BoundedArgumentError(f"{flag} must be >= 1, got {value}.")
        threshold = self.llep_imbalance_threshold
        if threshold is not None and not threshold >= 1.0:
            raise BoundedArgumentError(
                f"--llep-imbalance-threshold is a ratio of the hottest rank's load to the mean and "
                f"must be >= 1.0 (e.g. 1.3), got {threshold}."
            )
        conflicts = [
            (args.bounded_moe_backend == "upstream", "--bounded-moe-backend upstream"),
            (args.moe_expert_rank_capacity_factor is not None,
             "--moe-expert-rank-capacity-factor (chunks already have a no-drop static size)"),
            (args.moe_paged_stash, "--moe-paged-stash"),
            ((args.expert_tensor_parallel_size or 1) > 1, "--expert-tensor-parallel-size > 1"),
            (bool(getattr(args, "moe_latent_size", None)), "--moe-latent-size"),
            (args.moe_shared_expert_overlap, "--moe-shared-expert-overlap"),
        ]
        for is_set, what in conflicts:
            if is_set:
                raise BoundedArgumentError(
                    f"--pipelined-llep cannot be combined with {what}: remove one of them."
                )


# --------------------------------------------------------------------------------------------
# Chunk count and membership
# --------------------------------------------------------------------------------------------


def _as_int(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def num_chunks(num_tokens: int, budget: int, max_chunks: int) -> int:
    """K = min(ceil(num_tokens / budget), max_chunks), at least 1 (Eq. 1 of the paper).

    ``budget`` is the per-rank token budget c of one chunk, ``max_chunks`` the cap K_max.
    """
    num_tokens = _as_int(num_tokens, "num_tokens")
    budget = _as_int(budget, "budget")
    max_chunks = _as_int(max_chunks, "max_chunks")
    if budget <= 0:
        raise ValueError(
            f"the PipelinedLLEP token budget must be a positive number of tokens per rank "
            f"(--pipelined-llep-token-budget), got {budget}"
        )
    if max_chunks < 1:
        raise ValueError(
            f"the PipelinedLLEP chunk cap must be at least 1 (--pipelined-llep-max-chunks), "
            f"got {max_chunks}"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return max(1, min(-(-num_tokens // budget), max_chunks))


def agree_num_chunks(
    num_tokens: int, budget: int, max_chunks: int, group=None, device=None
) -> Tuple[int, int]:
    """``(K, c_eff)`` agreed over ``group``: the chunk count of the largest rank and its chunk size.

    One all-reduce MAX of ``[K_local, N_local]`` (a host sync).  ``c_eff = ceil(N_max / K)`` is the
    most tokens any rank has in any chunk; it sets the receive bound, so it must agree too.
    ``device``: where the reduced tensor lives (CUDA for NCCL groups; CPU by default).
    """
    local_k = num_chunks(num_tokens, budget, max_chunks)
    values = [local_k, num_tokens]
    if group is not None and mcore_utils.get_pg_size(group) > 1:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        values = t.tolist()
    k, n_max = values
    return k, max(1, -(-n_max // k))


def _chunk_arguments(num_tokens, K, i) -> Tuple[int, int, int]:  # noqa: N803
    """Validated ``(num_tokens, K, i)`` of a chunk request."""
    num_tokens, K, i = _as_int(num_tokens, "num_tokens"), _as_int(K, "K"), _as_int(i, "i")
    if K < 1:
        raise ValueError(f"the number of chunks must be >= 1, got {K}")
    if not 0 <= i < K:
        raise ValueError(f"chunk index {i} outside [0, {K})")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens, K, i


def strided_chunk(num_tokens: int, K: int, i: int, device=None) -> torch.Tensor:  # noqa: N803
    """Positions i, i+K, i+2K, ... below ``num_tokens`` (int64); chunk sizes differ by <= 1."""
    num_tokens, K, i = _chunk_arguments(num_tokens, K, i)
    return torch.arange(min(i, num_tokens), num_tokens, K, dtype=torch.int64, device=device)


def contiguous_chunk(num_tokens: int, K: int, i: int, device=None) -> torch.Tensor:  # noqa: N803
    """Positions [i * s, (i + 1) * s) below ``num_tokens`` with s = ceil(num_tokens / K)."""
    num_tokens, K, i = _chunk_arguments(num_tokens, K, i)
    size = -(-num_tokens // K)
    return torch.arange(
        min(i * size, num_tokens), min((i + 1) * size, num_tokens), dtype=torch.int64, device=device
    )


def _chunk_index(
    num_tokens: int, K: int, i: int, chunking: str, device  # noqa: N803
) -> Optional[torch.Tensor]:
    """Token positions of chunk ``i`` (None when K = 1: the whole batch, no gather)."""
    if K == 1:
        return None
    fn = strided_chunk if chunking == "strided" else contiguous_chunk
    return fn(num_tokens, K, i, device=device)


def dispatch_live_bytes_bound(
    ep_size: int,
    topk: int,
    chunk_tokens: int,
    hidden_size: int,
    ffn_width: int,
    bytes_per_element: int,
) -> Dict[str, int]:
    """Closed-form sizes of the chunk buffers, in bytes, from the launch configuration alone.

    ``receive``: the double-buffered receive rows, 2 * E_p * k * c * H * b (the paper's bound).
    ``chunk_working_set``: everything the layer allocates for chunks in flight (send and receive
    slabs, the expert-grouped copies, the fc1 output ``ffn_width`` = 2F for gated units, the
    combine rows, and in backward the gradient rows); an upper bound of the measured live set
    beyond the layer's inputs, outputs, gradients and O(N * k) routing metadata.
    """
    rows = ep_size * topk * chunk_tokens
    row_bytes = hidden_size * bytes_per_element
    return {
        "receive": 2 * rows * row_bytes,
        # Two chunks' dispatch rows (send, receive, grouped) plus one chunk's expert working set
        # (grouped input, fc1, activation, output, their gradients) and its combine rows.
        "chunk_working_set": rows * (10 * row_bytes + 4 * ffn_width * bytes_per_element),
    }


# --------------------------------------------------------------------------------------------
# LLEP planner (pure)
# --------------------------------------------------------------------------------------------


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
    """
    loads = tuple(_as_int(x, "expert load") for x in loads)
    ep_size = _as_int(ep_size, "ep_size")
    min_spill_tokens = _as_int(min_spill_tokens, "min_spill_tokens")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if len(loads) == 0 or len(loads) % ep_size != 0:
        raise ValueError(f"{len(loads)} expert loads do not split over {ep_size} EP ranks")
    if any(x < 0 for x in loads):
        raise ValueError("expert loads must be non-negative")
    if threshold is None or not threshold >= 1.0:
        raise ValueError(
            f"the LLEP imbalance threshold (max rank load / mean) must be >= 1.0, got {threshold!r}"
        )
    if min_spill_tokens < 1:
        raise ValueError(f"min_spill_tokens must be >= 1, got {min_spill_tokens}")
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

    target = -(-total // ep_size)
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


# --------------------------------------------------------------------------------------------
# Per-step metadata (host side) and pair -> virtual expert mapping (device side)
# --------------------------------------------------------------------------------------------


@dataclass
class _Step:
    """Everything one forward (and its backward) needs that is fixed for the step."""

    group: object
    ep_size: int
    ep_rank: int
    topk: int
    num_tokens: int
    num_experts: int
    num_local: int
    num_chunks: int
    chunk_tokens: int  # c_eff
    # exact per-chunk sizes, from one all-gather of every rank's [K, E_p, slots] pair counts
    send_splits: List[List[int]]  # [K][E_p] rows this rank sends each peer in chunk i
    recv_splits: List[List[int]]  # [K][E_p] rows this rank receives from each peer in chunk i
    send_offsets: torch.Tensor  # [K, E_p] int64 (device) start of each peer's rows in chunk i
    # [K, E_p, slots] int64 (device): rows this rank receives per chunk, source and expert slot
    recv_counts: torch.Tensor
    chunking: str
    slots: int  # virtual experts per rank (local + hosted copies, padded to the max)
    local_slots: int  # slots with weights on this rank (local + this rank's copies)
    plan: Optional[LLEPPlan]
    slot_virtual: Optional[torch.Tensor]  # [N, k] virtual expert of each slot (sentinel if invalid)
    virtual_to_expert: Optional[torch.Tensor]  # [E_p * slots] original expert id
    overlap: bool
    apply_probs_on_input: bool
    activation: Callable
    stats: Optional[dict]

    def chunk_index(self, i: int, device) -> Optional[torch.Tensor]:
        return _chunk_index(self.num_tokens, self.num_chunks, i, self.chunking, device)


def _pair_virtual_experts(
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


def _chunk_pair_counts(routing_map: torch.Tensor, slot_virtual: Optional[torch.Tensor], slots: int,
                       ep_size: int, num_chunks: int, chunking: str) -> torch.Tensor:
    """[K, E_p, slots] int64 (device): the (token, expert) pairs this rank sends each EP rank's
    expert slots in each chunk: the owners' experts, or the LLEP virtual experts when
    ``slot_virtual`` is given. Summed over the slots: the sizes of each chunk's all-to-all."""
    num_tokens = routing_map.shape[0]
    device = routing_map.device
    width = ep_size * slots
    counts = []
    for i in range(num_chunks):
        idx = _chunk_index(num_tokens, num_chunks, i, chunking, device)
        if slot_virtual is None:  # a rank's experts are one contiguous block of the routing map
            rows = routing_map if idx is None else routing_map.index_select(0, idx)
            counts.append(rows.sum(dim=0, dtype=torch.int64))
        else:  # the sentinel of invalid slots (E_p * slots) lands in the dropped last bin
            virt = (slot_virtual if idx is None else slot_virtual.index_select(0, idx)).reshape(-1)
            bins = torch.zeros(width + 1, dtype=torch.int64, device=device)
            counts.append(bins.scatter_add_(0, virt, torch.ones_like(virt))[:width])
    return torch.stack(counts).view(num_chunks, ep_size, slots)


def _exchange_chunk_counts(counts: torch.Tensor, group, ep_rank: int, ep_size: int):
    """Every rank's [K, E_p, slots] pair counts, gathered (one collective and one host sync).

    Returns the exact send and receive sizes ``[K][E_p]`` of every chunk's all-to-all on this
    rank, and the rows it receives per chunk, source and expert slot ``[K, E_p, slots]`` (device),
    which group the received rows by expert: no chunk exchanges counts of its own.
    """
    if group is None:
        table = counts.unsqueeze(0)
    else:
        gathered = [torch.empty_like(counts) for _ in range(ep_size)]
        dist.all_gather(gathered, counts.contiguous(), group=group)
        table = torch.stack(gathered)  # [source, chunk, destination, slot]
    host = table.sum(dim=3).tolist()
    sends = [host[ep_rank][i] for i in range(counts.shape[0])]
    receives = [[host[source][i][ep_rank] for source in range(ep_size)] for i in range(counts.shape[0])]
    return sends, receives, table[:, :, ep_rank].transpose(0, 1)


# --------------------------------------------------------------------------------------------
# Streams (CUDA) / sequential (CPU)
# --------------------------------------------------------------------------------------------

_COMM_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


class _Schedule:
    """Runs dispatch / combine on a side stream and the expert GEMM on the current stream.

    Inactive (everything on the current stream, program order) on CPU or when overlap is off.
    """

    def __init__(self, device: torch.device, enabled: bool):
        self.active = bool(enabled) and device.type == "cuda"
        if self.active:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _COMM_STREAMS:
                _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
            self.comm = _COMM_STREAMS[index]
            self.compute = torch.cuda.current_stream(index)

    def begin(self) -> None:
        if self.active:
            self.comm.wait_stream(self.compute)

    def end(self) -> None:
        if self.active:
            self.compute.wait_stream(self.comm)

    def on_comm(self, fn, *args, wait=None):
        if not self.active:
            return fn(*args), None
        with torch.cuda.stream(self.comm):
            if wait is not None:
                self.comm.wait_event(wait)
            out = fn(*args)
            event = torch.cuda.Event()
            event.record(self.comm)
        return out, event

    def on_compute(self, fn, *args, wait=None):
        if not self.active:
            return fn(*args), None
        if wait is not None:
            self.compute.wait_event(wait)
        out = fn(*args)
        event = torch.cuda.Event()
        event.record(self.compute)
        return out, event

    def to_compute(self, *tensors) -> None:
        """Tensors made on the side stream and used on the compute stream."""
        if self.active:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.compute)

    def to_comm(self, *tensors) -> None:
        """Tensors made on the compute stream and used on the side stream."""
        if self.active:
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.comm)


def _pipeline(num_chunks: int, dispatch, compute, combine, schedule: _Schedule) -> None:
    """dispatch(i+1) | compute(i) | combine(i): at most two dispatched chunks alive at once."""
    schedule.begin()
    pending = schedule.on_comm(dispatch, 0)
    for i in range(num_chunks):
        ahead = schedule.on_comm(dispatch, i + 1) if i + 1 < num_chunks else None
        state, ready = pending
        result = schedule.on_compute(compute, i, state, wait=ready)
        schedule.on_comm(combine, i, state, result[0], wait=result[1])
        pending = ahead
        del state, result
    schedule.end()


# --------------------------------------------------------------------------------------------
# Chunk stages
# --------------------------------------------------------------------------------------------


def _chunk_plan(step: _Step, routing_map: torch.Tensor, i: int, idx: Optional[torch.Tensor]):
    """Send plan of chunk ``i`` (exact per-peer sizes) and the original expert of its slots."""
    if step.slot_virtual is None:
        chunk_map = routing_map if idx is None else routing_map.index_select(0, idx)
    else:
        virt = step.slot_virtual if idx is None else step.slot_virtual.index_select(0, idx)
        width = step.ep_size * step.slots
        chunk_map = torch.zeros(virt.shape[0], width + 1, dtype=torch.bool, device=virt.device)
        chunk_map.scatter_(1, virt, True)
        chunk_map = chunk_map[:, :width]
    plan = plan_send(chunk_map, step.topk, step.ep_size, None, send_offsets=step.send_offsets[i])
    finalize_send_rows(plan, sum(step.send_splits[i]))
    if step.virtual_to_expert is None:
        slot_expert = plan.slot_expert
    else:
        slot_expert = step.virtual_to_expert.index_select(0, plan.slot_expert.reshape(-1))
        slot_expert = slot_expert.view_as(plan.slot_expert)
    return plan, slot_expert


def _send_probs(probs_c: torch.Tensor, plan: SendPlan, slot_expert: torch.Tensor) -> torch.Tensor:
    slot_probs = probs_c.gather(1, slot_expert).reshape(-1)
    return masked_rows(slot_probs, plan.row_pair, plan.row_valid)


def _probs_on_rows(probs, rows):
    """``moe_apply_probs_on_input``: the probability scales the expert's input row."""
    return (probs.unsqueeze(-1) * rows).to(rows.dtype)


def _expert_fn(step: _Step, rows, tokens_per_expert, probs, weight1, weight2):
    if step.apply_probs_on_input:
        rows = _probs_on_rows(probs, rows)
        probs = torch.ones_like(probs)
    return grouped_mlp(rows, tokens_per_expert, probs, weight1, weight2, step.activation)


def _expert_grads(step: _Step, rows, tokens_per_expert, probs, weight1, weight2, grad_rows,
                  need_rows: bool, need_probs: bool, need_weights: bool):
    """(d rows, d probs, d weight1, d weight2) of ``_expert_fn`` for ``grad_rows`` (the
    backward's recompute: fc1 only, see ``grouped_mlp_grads``); None for the ones not needed."""
    if not step.apply_probs_on_input:
        return grouped_mlp_grads(rows, tokens_per_expert, probs, weight1, weight2, step.activation,
                                 grad_rows, need_rows, need_probs, need_weights)
    with torch.enable_grad():
        rows_leaf = rows.detach().requires_grad_(need_rows)
        probs_leaf = probs.detach().requires_grad_(need_probs)
        scaled_rows = _probs_on_rows(probs_leaf, rows_leaf)
    leaves = [t for t in (rows_leaf, probs_leaf) if t.requires_grad]
    grad_scaled_rows, _, grad_w1, grad_w2 = grouped_mlp_grads(
        scaled_rows.detach(), tokens_per_expert, torch.ones_like(probs), weight1, weight2,
        step.activation, grad_rows, bool(leaves), False, need_weights,
    )
    grads = list(torch.autograd.grad(scaled_rows, leaves, grad_scaled_rows)) if leaves else []
    grad_rows_in = grads.pop(0) if need_rows else None
    grad_probs = grads.pop(0) if need_probs else None
    return grad_rows_in, grad_probs, grad_w1, grad_w2


def _stack_weights(w: torch.Tensor, copies: Optional[torch.Tensor]) -> torch.Tensor:
    return w if copies is None or copies.shape[0] == 0 else torch.cat([w, copies], dim=0)


def _dispatch(step: _Step, x, probs, routing_map, i, grad_y=None):
    """Pack, exchange and group one chunk (and, in backward, its output gradient rows)."""
    device = x.device
    idx = step.chunk_index(i, device)
    plan, slot_expert = _chunk_plan(step, routing_map, i, idx)
    sends, receives = step.send_splits[i], step.recv_splits[i]
    x_c = x if idx is None else x.index_select(0, idx)
    probs_c = probs if idx is None else probs.index_select(0, idx)
    send_x = x_c.index_select(0, plan.row_token)
    send_p = _send_probs(probs_c, plan, slot_expert)
    recv_x = all_to_all_rows(send_x, step.group, receives, sends)
    del send_x
    recv_p = all_to_all_rows(send_p, step.group, receives, sends)
    layout = plan_receive(step.recv_counts[i], None, sum(receives))
    state = {
        "chunk": i,
        "idx": idx,
        "plan": plan,
        "slot_expert": slot_expert,
        "layout": layout,
        "rows": recv_x.index_select(0, layout.gather_index),
        "probs": recv_p.index_select(0, layout.gather_index),
        "tokens_per_expert": layout.tokens_per_expert[: step.local_slots],
    }
    del recv_x, recv_p
    if grad_y is not None:
        g_c = grad_y if idx is None else grad_y.index_select(0, idx)
        recv_g = all_to_all_rows(g_c.index_select(0, plan.row_token), step.group, receives, sends)
        state["grad_rows"] = recv_g.index_select(0, layout.gather_index)
    stats = step.stats
    if stats is not None and grad_y is None:  # the forward's chunks (the backward repeats them)
        received = layout.tokens_per_expert.sum().reshape(1)
        sent = plan.send_counts.sum(dim=1).max().reshape(1)
        # In place: the stats tensors live on the compute stream's side of the allocator.
        stats["max_recv_rows"].copy_(torch.maximum(stats["max_recv_rows"], received))
        stats["max_send_rows"].copy_(torch.maximum(stats["max_send_rows"], sent))
        stats["dropped"].logical_or_(plan.overflow)
    return state


def _return_rows(step: _Step, rows_grouped: torch.Tensor, state) -> torch.Tensor:
    """Expert-grouped rows back to the sending ranks, in their send-buffer order."""
    back = rows_grouped.index_select(0, state["layout"].dest_index)
    i = state["chunk"]
    return all_to_all_rows(back, step.group, step.send_splits[i], step.recv_splits[i])


# --------------------------------------------------------------------------------------------
# The autograd function
# --------------------------------------------------------------------------------------------


class _PipelinedMoEFunction(torch.autograd.Function):
    """Chunked dispatch -> experts -> combine; recomputes chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, x, probs, weight1, weight2, copies1, copies2, routing_map, step: _Step):
        w1 = _stack_weights(weight1, copies1)
        w2 = _stack_weights(weight2, copies2)
        schedule = _Schedule(x.device, step.overlap and step.ep_size > 1)
        out = x.new_zeros(x.shape) if step.num_chunks > 1 else None
        holder = {}

        def dispatch(i):
            state = _dispatch(step, x, probs, routing_map, i)
            schedule.to_compute(state["rows"], state["probs"], state["tokens_per_expert"])
            return state

        def compute(i, state):
            y = _expert_fn(step, state["rows"], state["tokens_per_expert"], state["probs"], w1, w2)
            schedule.to_comm(y)
            state["rows"] = state["probs"] = None  # the grouped rows are dead after the GEMM
            return y

        def combine(i, state, y):
            y_c = combine_slots(_return_rows(step, y, state), state["plan"])
            if out is None:
                schedule.to_compute(y_c)  # made on the side stream, returned to the caller
                holder["out"] = y_c
            else:
                out.index_copy_(0, state["idx"], y_c)

        _pipeline(step.num_chunks, dispatch, compute, combine, schedule)
        result = holder["out"] if out is None else out
        ctx.step = step
        ctx.has_copies = copies1 is not None
        ctx.save_for_backward(x, probs, weight1, weight2, copies1, copies2, routing_map)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, probs, weight1, weight2, copies1, copies2, routing_map = ctx.saved_tensors
        step: _Step = ctx.step
        need_x, need_p = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w = any(ctx.needs_input_grad[2:6])
        grad_out = grad_out.contiguous()
        w1 = _stack_weights(weight1, copies1)
        w2 = _stack_weights(weight2, copies2)
        schedule = _Schedule(x.device, step.overlap and step.ep_size > 1)
        single = step.num_chunks == 1
        grad_x = None if single or not need_x else torch.zeros_like(x)
        grad_p = None if single or not need_p else torch.zeros_like(probs)
        acc = {"w1": None, "w2": None, "x": None, "p": None}

        def dispatch(i):
            state = _dispatch(step, x, probs, routing_map, i, grad_y=grad_out)
            schedule.to_compute(state["rows"], state["probs"], state["tokens_per_expert"],
                                state["grad_rows"])
            return state

        def compute(i, state):
            g_rows, g_p, g1, g2 = _expert_grads(
                step, state["rows"], state["tokens_per_expert"], state["probs"], w1, w2,
                state["grad_rows"], need_x, need_p, need_w,
            )
            state["rows"] = state["probs"] = state["grad_rows"] = None
            if need_w:
                if acc["w1"] is None:
                    acc["w1"], acc["w2"] = g1, g2
                else:
                    acc["w1"].add_(g1)
                    acc["w2"].add_(g2)
            schedule.to_comm(g_rows, g_p)
            return g_rows, g_p

        def combine(i, state, grads):
            g_rows, g_p = grads
            plan, idx = state["plan"], state["idx"]
            if g_rows is not None:
                g_x = combine_slots(_return_rows(step, g_rows, state), plan)
                if single:
                    schedule.to_compute(g_x)
                    acc["x"] = g_x
                else:
                    grad_x.index_copy_(0, idx, g_x)
            if g_p is not None:
                g_send = _return_rows(step, g_p, state)
                num_tok = plan.num_tokens
                g_pc = torch.zeros(num_tok, probs.shape[1], dtype=g_send.dtype,
                                   device=g_send.device)
                if num_tok > 0:
                    # The adjoint of (gather the slot probs, pick the send rows), with the ops
                    # autograd uses for them: index_add into the pairs, scatter_add into [N, E].
                    keep = torch.where(plan.row_valid, g_send,
                                       torch.zeros((), dtype=g_send.dtype, device=g_send.device))
                    g_pairs = torch.zeros(num_tok * step.topk, dtype=g_send.dtype,
                                          device=g_send.device).index_add_(0, plan.row_pair, keep)
                    g_pc.scatter_add_(1, state["slot_expert"], g_pairs.view(num_tok, step.topk))
                if single:
                    schedule.to_compute(g_pc)
                    acc["p"] = g_pc
                else:
                    grad_p.index_copy_(0, idx, g_pc.to(grad_p.dtype))

        _pipeline(step.num_chunks, dispatch, compute, combine, schedule)
        if single:
            grad_x, grad_p = acc["x"], acc["p"]
            if grad_p is not None:
                grad_p = grad_p.to(probs.dtype)
        g1 = g2 = c1 = c2 = None
        if need_w:
            local = weight1.shape[0]
            g1, g2 = acc["w1"][:local], acc["w2"][:local]
            if ctx.has_copies:
                c1, c2 = acc["w1"][local:], acc["w2"][local:]
        return grad_x, grad_p, g1, g2, c1, c2, None, None


# --------------------------------------------------------------------------------------------
# Functional entry point
# --------------------------------------------------------------------------------------------


def _exchange_weight_copies(weight1, weight2, plan: LLEPPlan, ep_rank: int, group):
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


def pipelined_moe(
    hidden_states: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    topk: int,
    token_budget: int,
    max_chunks: int = PipelinedLLEPSettings.pipelined_llep_max_chunks,
    ep_group=None,
    imbalance_threshold: Optional[float] = None,
    min_spill_tokens: int = 1,
    chunking: str = "strided",
    overlap: bool = True,
    uniform_tokens: bool = False,
    apply_probs_on_input: bool = False,
    stats: Optional[dict] = None,
) -> torch.Tensor:
    """Routed-experts output of the MoE layer, chunked and pipelined (same shape as the input).

    ``hidden_states`` ``[..., H]`` (N rows after flattening), ``probs`` ``[N, E]`` routing
    probabilities, ``routing_map`` ``[N, E]`` bool with experts ``[r * El, (r + 1) * El)`` on EP
    rank r; ``weight1`` ``[El, H, F1]`` / ``weight2`` ``[El, F, H]`` and ``activation`` as
    ``GroupedExperts``.  ``imbalance_threshold`` None disables LLEP balancing.
    ``uniform_tokens=True`` promises that every EP rank has the same N (Megatron's fixed
    micro-batch shapes): without LLEP, K is then computed locally and the chunk-size exchange is
    the step's one collective and host sync; otherwise ``agree_num_chunks`` (or the LLEP count
    exchange) agrees it first.  ``stats`` (a dict)
    receives the step's chunk count, chunk size, slab sizes, the LLEP plan and, as device
    tensors, the most rows received / sent per chunk and whether any pair was dropped.
    """
    if chunking not in _CHUNKINGS:
        raise ValueError(f"chunking must be one of {_CHUNKINGS}, got {chunking!r}")
    hidden_shape = hidden_states.shape
    x = hidden_states.reshape(-1, hidden_shape[-1])
    num_tokens = x.shape[0]
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError("routing_map must be a 2-D bool tensor [num_tokens, num_experts]")
    num_experts = routing_map.shape[1]
    if routing_map.shape[0] != num_tokens or tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(
            f"routing_map {tuple(routing_map.shape)} / probs {tuple(probs.shape)} do not match "
            f"[{num_tokens}, {num_experts}]"
        )
    topk = _as_int(topk, "topk")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, {num_experts}]")
    ep_size = mcore_utils.get_pg_size(ep_group) if ep_group is not None else 1
    ep_rank = mcore_utils.get_pg_rank(ep_group) if ep_group is not None else 0
    if num_experts % ep_size != 0:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} EP ranks")
    local = num_experts // ep_size
    if weight1.shape[0] != local or weight2.shape[0] != local:
        raise ValueError(
            f"expert weights hold {weight1.shape[0]} / {weight2.shape[0]} experts, expected {local}"
        )
    num_chunks(num_tokens, token_budget, max_chunks)  # validates the knobs on every rank
    device = x.device
    group = ep_group if ep_size > 1 else None

    with torch.no_grad():
        counts = routing_map.sum(dim=0, dtype=torch.int64)
        plan = None
        source_counts = None
        if imbalance_threshold is not None:
            # One collective and one host sync: per-rank expert counts and token counts.
            meta = torch.cat([counts, torch.tensor([num_tokens], dtype=torch.int64, device=device)])
            if group is not None:
                gathered = [torch.empty_like(meta) for _ in range(ep_size)]
                dist.all_gather(gathered, meta, group=group)
                table = torch.stack(gathered)
            else:
                table = meta.unsqueeze(0)
            host = table.tolist()
            n_max = max(row[-1] for row in host)
            loads = [sum(row[e] for row in host) for e in range(num_experts)]
            plan = plan_llep(loads, ep_size, imbalance_threshold, min_spill_tokens)
            source_counts = table[:, :num_experts]
            k_chunks = num_chunks(n_max, token_budget, max_chunks)
            c_eff = max(1, -(-n_max // k_chunks))
        elif uniform_tokens:
            k_chunks = num_chunks(num_tokens, token_budget, max_chunks)
            c_eff = max(1, -(-num_tokens // k_chunks))
        else:
            k_chunks, c_eff = agree_num_chunks(
                num_tokens, token_budget, max_chunks, group, device=device
            )

        slots, local_slots = local, local
        slot_virtual = virtual_to_expert = None
        copies1 = copies2 = None
        if plan is not None and plan.active:
            slots = local + plan.max_hosted
            local_slots = local + len(plan.hosted(ep_rank))
            slot_expert, slot_valid = routing_slots(routing_map, topk)
            slot_virtual, virtual_to_expert = _pair_virtual_experts(
                slot_expert, slot_valid, source_counts, plan, ep_rank, slots
            )
            del slot_expert, slot_valid
        chunk_counts = _chunk_pair_counts(routing_map, slot_virtual, slots, ep_size, k_chunks, chunking)
        send_splits, recv_splits, recv_counts = _exchange_chunk_counts(
            chunk_counts, group, ep_rank, ep_size
        )
        send_offsets = exclusive_cumsum(chunk_counts.sum(dim=2), dim=1)
    if plan is not None and plan.active:
        copies1, copies2 = _exchange_weight_copies(weight1, weight2, plan, ep_rank, group)

    if stats is not None:
        stats.clear()
        stats.update(
            num_chunks=k_chunks,
            chunk_tokens=c_eff,
            send_rows_bound=topk * c_eff,
            recv_rows_bound=ep_size * topk * c_eff,
            pairs_sent=sum(map(sum, send_splits)),
            llep_plan=plan,
            hosted_experts=plan.hosted(ep_rank) if plan is not None else (),
            max_recv_rows=torch.zeros(1, dtype=torch.int64, device=device),
            max_send_rows=torch.zeros(1, dtype=torch.int64, device=device),
            dropped=torch.zeros(1, dtype=torch.bool, device=device),
        )
    step = _Step(
        group=group,
        ep_size=ep_size,
        ep_rank=ep_rank,
        topk=topk,
        num_tokens=num_tokens,
        num_experts=num_experts,
        num_local=local,
        num_chunks=k_chunks,
        chunk_tokens=c_eff,
        send_splits=send_splits,
        recv_splits=recv_splits,
        send_offsets=send_offsets,
        recv_counts=recv_counts,
        chunking=chunking,
        slots=slots,
        local_slots=local_slots,
        plan=plan,
        slot_virtual=slot_virtual,
        virtual_to_expert=virtual_to_expert,
        overlap=overlap,
        apply_probs_on_input=apply_probs_on_input,
        activation=activation,
        stats=stats,
    )
    out = _PipelinedMoEFunction.apply(
        x, probs, weight1, weight2, copies1, copies2, routing_map, step
    )
    return out.view(hidden_shape)


# --------------------------------------------------------------------------------------------
# Module used by BoundedMoELayer
# --------------------------------------------------------------------------------------------


class PipelinedLLEPMoE:
    """The routed-experts path of a MoE layer as PipelinedLLEP (replaces dispatch/experts/combine).

    ``PipelinedLLEPMoE(config, experts, ep_group=None)``; ``experts`` is the layer's
    ``GroupedExperts`` (its ``weight1``, ``weight2`` and activation are used; it is referenced,
    not registered, so the layer's state dict is unchanged); ``ep_group`` defaults to
    ``experts.ep_group``.  Call ``moe(hidden_states, probs, routing_map) -> output`` with the
    router's ``probs`` / ``routing_map`` ``[N, E]``; the output has the shape of
    ``hidden_states`` and holds the routed experts' sum (add shared experts outside).

    Config fields: ``pipelined_llep_token_budget`` (required, tokens per rank and chunk),
    ``pipelined_llep_max_chunks``, ``llep_imbalance_threshold`` (None: no
    balancing), ``llep_min_spill_tokens`` (optional, default 1), ``moe_router_topk``,
    ``num_moe_experts``, ``moe_apply_probs_on_input``.  ``last_stats`` describes the last call.

    Keyword options: ``chunking`` ("strided" or "contiguous"), ``overlap`` (side-stream schedule
    on CUDA), ``uniform_tokens`` (every EP rank has the same token count: K needs no
    collective when LLEP is off; see ``pipelined_moe``).
    """

    def __init__(self, config, experts, ep_group=None, *, chunking: str = "strided",
                 overlap: bool = True, uniform_tokens: bool = False):
        for name in ("weight1", "weight2", "activation"):
            if not hasattr(experts, name):
                raise TypeError(
                    f"PipelinedLLEP needs grouped experts (weight1, weight2, activation); "
                    f"{type(experts).__name__} has no {name!r}"
                )
        if chunking not in _CHUNKINGS:
            raise ValueError(f"chunking must be one of {_CHUNKINGS}, got {chunking!r}")
        self.config = config
        self.experts = experts
        self.ep_group = ep_group if ep_group is not None else getattr(experts, "ep_group", None)
        self.topk = _as_int(config.moe_router_topk, "moe_router_topk")
        self.num_experts = _as_int(config.num_moe_experts, "num_moe_experts")
        self.token_budget = getattr(config, "pipelined_llep_token_budget", None)
        if self.token_budget is None:
            raise ValueError(
                "PipelinedLLEP needs a token budget: set --pipelined-llep-token-budget "
                "(pipelined_llep_token_budget, tokens per rank and chunk)"
            )
        self.max_chunks = getattr(config, "pipelined_llep_max_chunks",
                                  PipelinedLLEPSettings.pipelined_llep_max_chunks)
        num_chunks(0, self.token_budget, self.max_chunks)  # validate both knobs now
        self.imbalance_threshold = getattr(config, "llep_imbalance_threshold", None)
        if self.imbalance_threshold is not None and not self.imbalance_threshold >= 1.0:
            raise ValueError(
                "llep_imbalance_threshold (max rank load / mean load) must be >= 1.0 or None, "
                f"got {self.imbalance_threshold!r}"
            )
        self.min_spill_tokens = getattr(config, "llep_min_spill_tokens", None) or 1
        self.apply_probs_on_input = bool(getattr(config, "moe_apply_probs_on_input", False))
        self.chunking = chunking
        self.overlap = overlap
        self.uniform_tokens = uniform_tokens
        self._stats: Optional[dict] = None

    @staticmethod
    def enabled(config) -> bool:
        return bool(getattr(config, "pipelined_llep", False))

    def __call__(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> torch.Tensor:
        stats: dict = {}
        out = pipelined_moe(
            hidden_states,
            probs,
            routing_map,
            self.experts.weight1,
            self.experts.weight2,
            self.experts.activation,
            topk=self.topk,
            token_budget=self.token_budget,
            max_chunks=self.max_chunks,
            ep_group=self.ep_group,
            imbalance_threshold=self.imbalance_threshold,
            min_spill_tokens=self.min_spill_tokens,
            chunking=self.chunking,
            overlap=self.overlap,
            uniform_tokens=self.uniform_tokens,
            apply_probs_on_input=self.apply_probs_on_input,
            stats=stats,
        )
        self._stats = stats
        return out

    forward = __call__

    @property
    def last_stats(self) -> Optional[dict]:
        """The last call's stats with device values read back (a host sync)."""
        if self._stats is None:
            return None
        out = dict(self._stats)
        for key in ("max_recv_rows", "max_send_rows"):
            out[key] = int(out[key].item())
        out["dropped"] = bool(out["dropped"].item())
        return out


def pipelined_llep_live_bytes(num_tokens: int, hidden: int, ffn: int, topk: int, ep_size: int,
                              local_experts: int, budget: int, max_chunks: int,
                              act_bytes: int = 2, gated: bool = True) -> dict:
    """Bytes one rank's MoE layer holds at its peak in backward (the recomputed chunks), by part.

    With K chunks of c_eff = ceil(N / K) tokens (:func:`agree_num_chunks` on one rank), a chunk sends at most
    S = k·c_eff rows and receives at most R = E_p·k·c_eff (every source sending its whole chunk
    here: the bound is independent of the routing). Live together:

    * ``dispatch``: the send and receive rows of the chunk in flight and of the next one,
      2·(S + R)·H·b (one chunk when K = 1);
    * ``expert_backward``: one chunk's expert backward, R·b·(2·fc1 + 2F + H) (fc1 output and its
      gradient, the scaled activation and its gradient, the rows' gradient);
    * ``weight_grads``: the local experts' weight gradients E_local·(fc1 + F)·H·b.

    fc1 = 2F with a gated activation, else F.
    """
    k_chunks, c_eff = agree_num_chunks(num_tokens, budget, max_chunks)
    send = topk * c_eff
    receive = ep_size * topk * c_eff
    fc1 = (2 if gated else 1) * ffn
    in_flight = 2 if k_chunks > 1 else 1
    return {
        "dispatch": in_flight * (send + receive) * hidden * act_bytes,
        "expert_backward": receive * act_bytes * (2 * fc1 + 2 * ffn + hidden),
        "weight_grads": local_experts * (fc1 + ffn) * hidden * act_bytes,
    }
