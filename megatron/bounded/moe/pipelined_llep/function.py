"""The step's state, the chunk stages, the autograd function that runs and recomputes them, and
the functional entry point ``pipelined_moe``.

The autograd function is a reentrant checkpoint at chunk granularity: its forward saves only its
inputs and its backward re-runs each chunk's dispatch and fc1 GEMM within the same two-chunk
window (docs/operators/pipelined_llep.md, "How it works").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import utils as mcore_utils

from megatron.bounded.kernels.collectives import all_to_all_rows
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
from megatron.bounded.moe.experts import grouped_mlp, grouped_mlp_grads
from megatron.bounded.moe.pipelined_llep.balance import (
    LLEPPlan,
    exchange_weight_copies,
    pair_virtual_experts,
    plan_llep,
)
from megatron.bounded.moe.pipelined_llep.chunks import (
    CHUNKINGS,
    agree_num_chunks,
    as_int,
    chunk_index,
    chunk_pair_counts,
    exchange_chunk_counts,
    num_chunks,
)
from megatron.bounded.moe.pipelined_llep.schedule import Schedule, pipeline
from megatron.bounded.moe.pipelined_llep.settings import PipelinedLLEPSettings
from megatron.bounded.units import ceil_div


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
        return chunk_index(self.num_tokens, self.num_chunks, i, self.chunking, device)



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



class _PipelinedMoEFunction(torch.autograd.Function):
    """Chunked dispatch -> experts -> combine; recomputes chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, x, probs, weight1, weight2, copies1, copies2, routing_map, step: _Step):
        w1 = _stack_weights(weight1, copies1)
        w2 = _stack_weights(weight2, copies2)
        schedule = Schedule(x.device, step.overlap and step.ep_size > 1)
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

        pipeline(step.num_chunks, dispatch, compute, combine, schedule)
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
        schedule = Schedule(x.device, step.overlap and step.ep_size > 1)
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

        pipeline(step.num_chunks, dispatch, compute, combine, schedule)
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


def _check_inputs(x, probs, routing_map, weight1, weight2, topk, ep_group) -> Tuple[int, int, int]:
    """Validated ``(topk, ep_size, ep_rank)``: the routing matches the ``[N, H]`` rows ``x``, the
    experts split over the EP group and the weights hold this rank's experts."""
    num_tokens = x.shape[0]
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError("routing_map must be a 2-D bool tensor [num_tokens, num_experts]")
    num_experts = routing_map.shape[1]
    if routing_map.shape[0] != num_tokens or tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(
            f"routing_map {tuple(routing_map.shape)} / probs {tuple(probs.shape)} do not match "
            f"[{num_tokens}, {num_experts}]"
        )
    topk = as_int(topk, "topk")
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
    return topk, ep_size, ep_rank


def _agree_chunks(routing_map, device, group, ep_size, token_budget, max_chunks,
                  imbalance_threshold, min_spill_tokens, uniform_tokens):
    """``(K, c_eff, plan, source_counts)`` of the step.

    With LLEP, one all-gather of every rank's expert counts and token count (one host sync)
    gives the plan, the per-source expert counts ``[E_p, E]`` and K; without it, K is agreed by
    ``agree_num_chunks``, or computed locally when every rank holds the same N.
    """
    num_tokens, num_experts = routing_map.shape
    counts = routing_map.sum(dim=0, dtype=torch.int64)
    if imbalance_threshold is not None:
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
        k_chunks = num_chunks(n_max, token_budget, max_chunks)
        return k_chunks, max(1, ceil_div(n_max, k_chunks)), plan, table[:, :num_experts]
    if uniform_tokens:
        k_chunks = num_chunks(num_tokens, token_budget, max_chunks)
        return k_chunks, max(1, ceil_div(num_tokens, k_chunks)), None, None
    k_chunks, c_eff = agree_num_chunks(num_tokens, token_budget, max_chunks, group, device=device)
    return k_chunks, c_eff, None, None


def _virtual_slots(routing_map, topk, plan: Optional[LLEPPlan], source_counts, ep_rank, local):
    """``(slots, local_slots, slot_virtual, virtual_to_expert)``: expert slots per rank (padded
    to the most any rank hosts), those with weights here, and under an active LLEP plan the
    virtual expert of every routed slot (None without one)."""
    if plan is None or not plan.active:
        return local, local, None, None
    slots = local + plan.max_hosted
    local_slots = local + len(plan.hosted(ep_rank))
    slot_expert, slot_valid = routing_slots(routing_map, topk)
    slot_virtual, virtual_to_expert = pair_virtual_experts(
        slot_expert, slot_valid, source_counts, plan, ep_rank, slots
    )
    return slots, local_slots, slot_virtual, virtual_to_expert


def _reset_stats(stats: dict, step: _Step, device) -> None:
    """The step's sizes and plan, and zeroed device counters the chunks fold their sizes into."""
    stats.clear()
    stats.update(
        num_chunks=step.num_chunks,
        chunk_tokens=step.chunk_tokens,
        send_rows_bound=step.topk * step.chunk_tokens,
        recv_rows_bound=step.ep_size * step.topk * step.chunk_tokens,
        pairs_sent=sum(map(sum, step.send_splits)),
        llep_plan=step.plan,
        hosted_experts=step.plan.hosted(step.ep_rank) if step.plan is not None else (),
        max_recv_rows=torch.zeros(1, dtype=torch.int64, device=device),
        max_send_rows=torch.zeros(1, dtype=torch.int64, device=device),
        dropped=torch.zeros(1, dtype=torch.bool, device=device),
    )


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
    ``token_budget``, ``max_chunks``, ``imbalance_threshold`` and ``min_spill_tokens`` are refused
    as their flags are (:meth:`PipelinedLLEPSettings.check_values`).
    """
    if chunking not in CHUNKINGS:
        raise ValueError(f"chunking must be one of {CHUNKINGS}, got {chunking!r}")
    hidden_shape = hidden_states.shape
    x = hidden_states.reshape(-1, hidden_shape[-1])
    topk, ep_size, ep_rank = _check_inputs(x, probs, routing_map, weight1, weight2, topk, ep_group)
    num_tokens, num_experts = routing_map.shape
    local = num_experts // ep_size
    PipelinedLLEPSettings(  # the flags' check, for callers that built no settings (benchmarks)
        pipelined_llep=True, pipelined_llep_token_budget=token_budget,
        pipelined_llep_max_chunks=max_chunks, llep_imbalance_threshold=imbalance_threshold,
        llep_min_spill_tokens=min_spill_tokens).check_values()
    group = ep_group if ep_size > 1 else None

    with torch.no_grad():
        k_chunks, c_eff, plan, source_counts = _agree_chunks(
            routing_map, x.device, group, ep_size, token_budget, max_chunks, imbalance_threshold,
            min_spill_tokens, uniform_tokens,
        )
        slots, local_slots, slot_virtual, virtual_to_expert = _virtual_slots(
            routing_map, topk, plan, source_counts, ep_rank, local
        )
        chunk_counts = chunk_pair_counts(routing_map, slot_virtual, slots, ep_size, k_chunks, chunking)
        send_splits, recv_splits, recv_counts = exchange_chunk_counts(
            chunk_counts, group, ep_rank, ep_size
        )
        send_offsets = exclusive_cumsum(chunk_counts.sum(dim=2), dim=1)
    copies1 = copies2 = None
    if plan is not None and plan.active:
        copies1, copies2 = exchange_weight_copies(weight1, weight2, plan, ep_rank, group)

    step = _Step(
        group=group, ep_size=ep_size, ep_rank=ep_rank, topk=topk, num_tokens=num_tokens,
        num_experts=num_experts, num_local=local, num_chunks=k_chunks, chunk_tokens=c_eff,
        send_splits=send_splits, recv_splits=recv_splits, send_offsets=send_offsets,
        recv_counts=recv_counts, chunking=chunking, slots=slots, local_slots=local_slots,
        plan=plan, slot_virtual=slot_virtual, virtual_to_expert=virtual_to_expert,
        overlap=overlap, apply_probs_on_input=apply_probs_on_input, activation=activation,
        stats=stats,
    )
    if stats is not None:
        _reset_stats(stats, step, x.device)
    out = _PipelinedMoEFunction.apply(
        x, probs, weight1, weight2, copies1, copies2, routing_map, step
    )
    return out.view(hidden_shape)
