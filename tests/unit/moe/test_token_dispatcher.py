"""Static-capacity dispatcher (megatron.bounded.moe.dispatch.token_dispatcher).

Single-process tests check the slab arithmetic against plain Python loops; multi-rank tests run
dispatch -> grouped experts -> combine on gloo (2 and 4 ranks) against a reference that applies
every token's routed experts directly with the full expert weights, and against upstream's
dispatcher + SequentialMLP / MoELayer with the same weights and routing.  GPU tests (marked
``gpu``) compare with upstream's alltoall dispatcher and capture a CUDA graph.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.bounded.kernels.row_gather import SKIP
from megatron.bounded.moe.dispatch.token_dispatcher import (
    StaticCapacityTokenDispatcher,
    capacity_rows,
    finalize_send_rows,
    plan_receive,
    plan_send,
    routing_slots,
)
from tests.unit.comparisons import moe_errors as _compare
from tests.unit.comparisons import dispatch_experts_combine
from tests.unit.comparisons import relative_error as _rel
from tests.conftest import requires_cuda, requires_two_gpus
from tests.unit.distributed import run_on_ranks, two_and_four_rank_fixtures
from tests.unit.routing import make_routing

HIDDEN, FFN = 16, 8


# --------------------------------------------------------------------------------------------
# Helpers shared by the single- and multi-process tests
# --------------------------------------------------------------------------------------------


class _Cfg:
    """The config fields the dispatcher and the expert activation read."""

    def __init__(self, num_experts, topk, factor, gated=True, func=F.silu):
        self.num_moe_experts = num_experts
        self.moe_router_topk = topk
        self.moe_expert_rank_capacity_factor = factor
        self.gated_linear_unit = gated
        self.activation_func = func
        self.glu_linear_offset = 0.0
        self.activation_func_clamp_value = None


def _pg(group):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(ep=group)


def _python_positions(routing_map, ep_size):
    """{(token, expert): (dest rank, position in slab)} with an explicit loop (the spec)."""
    num_tokens, num_experts = routing_map.shape
    local = num_experts // ep_size
    out = {}
    for r in range(ep_size):
        pos = 0
        for e in range(r * local, (r + 1) * local):
            for n in range(num_tokens):
                if routing_map[n, e]:
                    out[(n, e)] = (r, pos)
                    pos += 1
    return out


def _slab_loads(routing_map, ep_size):
    local = routing_map.shape[1] // ep_size
    return [int(routing_map[:, r * local : (r + 1) * local].sum()) for r in range(ep_size)]


def _factor_for(capacity, num_tokens, topk, ep_size):
    """A capacity factor whose slab size is exactly ``capacity`` rows."""
    factor = capacity * ep_size / (num_tokens * topk)
    assert capacity_rows(num_tokens, topk, ep_size, factor) == capacity
    return factor


def _weights(num_experts, gated=True, seed=1234, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    fc1 = 2 * FFN if gated else FFN
    w1 = torch.randn(num_experts, HIDDEN, fc1, generator=g) * 0.3
    w2 = torch.randn(num_experts, FFN, HIDDEN, generator=g) * 0.3
    return w1.to(dtype), w2.to(dtype)


def _inputs(num_tokens, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 1, HIDDEN, generator=g).to(dtype)
    grad = torch.randn(num_tokens, 1, HIDDEN, generator=g).to(dtype)
    return x, grad


def reference_moe(x, probs, routing_map, w1, w2, activation, keep=None):
    """Every token through its routed experts with the full weights; ``keep`` masks pairs."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(x2)
    mask = routing_map if keep is None else routing_map & keep
    for e in range(w1.shape[0]):
        act = activation(x2 @ w1[e])
        y = (act * probs[:, e : e + 1]).to(act.dtype) @ w2[e]
        out = out + torch.where(mask[:, e : e + 1], y, torch.zeros_like(y))
    return out.view_as(x)


def _our_step(dispatcher, x, routing_map, probs, w1, w2, grad, activation):
    """dispatch -> grouped experts -> combine, forward and backward; returns values and grads."""
    from megatron.bounded.moe.experts import grouped_mlp

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, probs, w1, w2)]
    y, tokens_per_expert, h = dispatch_experts_combine(
        dispatcher, leaves[0], routing_map, leaves[1],
        lambda rows, tpe, p: grouped_mlp(rows, tpe, p, leaves[2], leaves[3], activation),
    )
    assert tokens_per_expert.dtype == torch.int64 and tokens_per_expert.device == x.device
    (y * grad).sum().backward()
    return {
        "out": y.detach(),
        "grads": [t.grad for t in leaves],
        "tokens_per_expert": tokens_per_expert.tolist(),
        "rows": h.shape[0],
    }


def _reference_step(x, routing_map, probs, w1, w2, grad, activation, keep=None, group=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, probs, w1, w2)]
    out = reference_moe(leaves[0], leaves[1], routing_map, leaves[2], leaves[3], activation, keep)
    (out * grad).sum().backward()
    grads = [t.grad for t in leaves]
    if group is not None:  # weight gradients are a sum over every rank's tokens
        for t in grads[2:]:
            dist.all_reduce(t, group=group)
    return {"out": out.detach(), "grads": grads}



def _bitwise(a, b):
    same = torch.equal(a["out"], b["out"])
    return same and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


def _partial_routing(num_tokens, num_experts, topk, experts, seed):
    """Top-k routing among ``experts`` only; token 0 is routed nowhere and every third token to
    one expert, so some slots are unused (they point at send row 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    blocked = torch.ones(num_experts, dtype=torch.bool)
    blocked[list(experts)] = False
    logits[:, blocked] = float("-inf")
    val, idx = logits.softmax(dim=-1).topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    routing_map[0] = False
    thirds = torch.arange(1, num_tokens, 3)
    routing_map[thirds, idx[thirds, -1]] = False
    probs = torch.zeros(num_tokens, num_experts).scatter(1, idx, val) * routing_map
    return routing_map, probs


def _padding_poison_check(group, rank, world_size, routing_map, probs, topk, factor, seed):
    """One step with clean and one with poisoned expert padding rows (NaN/Inf in every grouped
    GEMM output row past offs[-1]: the expert output, x gradient and probs gradient there).
    Returns whether every consumed result (token outputs, x / probs / weight gradients) is
    finite and bitwise the clean one, and how many padding rows the experts saw."""
    from megatron.bounded.kernels import collectives as collectives_mod
    from megatron.bounded.moe import experts as experts_mod
    from megatron.bounded.moe.dispatch import token_dispatcher as dispatcher_mod
    from megatron.bounded.moe.experts import _Activation
    from tests.unit.moe.test_grouped_experts import padding_poisoned_grouped_mm

    num_tokens, num_experts = routing_map.shape
    local = num_experts // world_size
    mine = list(range(rank * local, (rank + 1) * local))
    x, grad = _inputs(num_tokens, seed)
    w1, w2 = (w[mine] for w in _weights(num_experts, seed=seed))
    cfg = _Cfg(num_experts, topk, factor)

    def step():
        d = StaticCapacityTokenDispatcher(local, mine, cfg, _pg(group))
        return _our_step(d, x, routing_map, probs, w1, w2, grad, _Activation(cfg)), d

    clean, _ = step()
    real, real_gather = experts_mod.grouped_mm, dispatcher_mod.gather_rows

    def poisoned_gather(source, index):  # rows the gather skips hold NaN, as garbage may on a GPU
        out = real_gather(source, index).clone()
        out[index == SKIP] = float("nan")
        return out

    experts_mod.grouped_mm = padding_poisoned_grouped_mm(real)
    # the dispatcher's own gathers and the row permutations it takes from collectives
    dispatcher_mod.gather_rows = collectives_mod.gather_rows = poisoned_gather
    try:
        poisoned, d = step()
    finally:
        experts_mod.grouped_mm = real
        dispatcher_mod.gather_rows = collectives_mod.gather_rows = real_gather
    return {
        "padding_rows": poisoned["rows"] - sum(poisoned["tokens_per_expert"]),
        "dropped": bool(d.check_over_budget().item()),
        "finite": all(bool(torch.isfinite(t).all()) for t in [poisoned["out"]] + poisoned["grads"]),
        "bitwise": _bitwise(poisoned, clean),
    }


# --------------------------------------------------------------------------------------------
# Single process: sizes and slab arithmetic
# --------------------------------------------------------------------------------------------


def test_capacity_rows_is_exact_ceiling():
    assert capacity_rows(100, 8, 2, 1.1) == 440  # float arithmetic alone would give 441
    assert capacity_rows(100, 8, 2, 1.5) == 600
    assert capacity_rows(7, 2, 4, 1.0) == 4  # ceil(3.5)
    assert capacity_rows(16384, 8, 2, 1.5) == 98304
    assert capacity_rows(0, 8, 2, 1.5) == 0
    with pytest.raises(ValueError):
        capacity_rows(10, 2, 2, 0.0)


def test_routing_slots_ascending_and_partial_rows():
    routing_map = torch.tensor(
        [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool
    )
    experts, valid = routing_slots(routing_map, 2)
    assert valid.tolist() == [[True, True], [True, False], [False, False], [True, True]]
    assert experts[0].tolist() == [1, 3] and experts[3].tolist() == [0, 1]
    assert experts[1, 0].item() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_send_matches_python_layout(seed):
    num_tokens, num_experts, topk, ep_size = 23, 8, 3, 2
    routing_map, _ = make_routing("balanced", num_tokens, num_experts, topk, seed, ep_size=ep_size)
    spec = _python_positions(routing_map, ep_size)
    loads = _slab_loads(routing_map, ep_size)
    # N·k rows: nothing can drop (the drop arithmetic is skipped)
    for capacity in (num_tokens * topk, max(loads), max(loads) - 1, min(loads) - 2):
        plan = plan_send(routing_map, topk, ep_size, capacity)
        assert plan.can_drop == (capacity < num_tokens * topk)
        finalize_send_rows(plan, ep_size * capacity)
        expected_overflow = any(load > capacity for load in loads)
        assert bool(plan.overflow.item()) == expected_overflow
        kept_rows = {}
        for n in range(num_tokens):
            for s in range(topk):
                e = int(plan.slot_expert[n, s])
                r, pos = spec[(n, e)]
                assert bool(plan.slot_keep[n, s]) == (pos < capacity)
                if pos < capacity:
                    assert int(plan.slot_rows[n, s]) == r * capacity + pos
                    kept_rows[r * capacity + pos] = (n, s)
        # Inverse tables: each kept row knows its pair; every other row is padding.
        for row in range(ep_size * capacity):
            assert bool(plan.row_valid[row]) == (row in kept_rows)
            if row in kept_rows:
                n, s = kept_rows[row]
                assert int(plan.row_token[row]) == n and int(plan.row_pair[row]) == n * topk + s
            # the row gather reads the token of a kept row and skips padding
            assert int(plan.row_token[row]) == (kept_rows[row][0] if row in kept_rows else SKIP)
        counts = plan.send_counts.tolist()
        for r in range(ep_size):
            for j in range(num_experts // ep_size):
                e = r * (num_experts // ep_size) + j
                expect = sum(1 for (n, ee), (_, p) in spec.items() if ee == e and p < capacity)
                assert counts[r][j] == expect


def test_plan_send_dropless_offsets():
    routing_map, _ = make_routing("balanced", 17, 6, 2, 4, ep_size=3)
    plan = plan_send(routing_map, 2, 3, capacity=None)
    loads = _slab_loads(routing_map, 3)
    starts = [0, loads[0], loads[0] + loads[1]]
    spec = _python_positions(routing_map, 3)
    assert not plan.overflow.item() and bool(plan.slot_keep.all())
    for n in range(17):
        for s in range(2):
            r, pos = spec[(n, int(plan.slot_expert[n, s]))]
            assert int(plan.slot_rows[n, s]) == starts[r] + pos


@pytest.mark.parametrize("slab_rows", [7, None])
def test_plan_receive_groups_by_expert_padding_last(slab_rows):
    recv_counts = torch.tensor([[2, 0, 3], [1, 4, 0]])  # [source, local expert]
    ep_size, local = recv_counts.shape
    # Received rows, labelled (source, expert, index) or padding, in slab order.
    received = []
    for s in range(ep_size):
        slab = [(s, j, i) for j in range(local) for i in range(int(recv_counts[s, j]))]
        if slab_rows is not None:
            slab += [("pad", s, i) for i in range(slab_rows - len(slab))]
        received.append(slab)
    flat = [label for slab in received for label in slab]
    layout = plan_receive(recv_counts, slab_rows, num_rows=len(flat))
    grouped = [flat[i] for i in layout.gather_index.tolist()]
    expected = [(s, j, i) for j in range(local) for s in range(ep_size)
                for i in range(int(recv_counts[s, j]))]
    expected += [label for label in flat if label[0] == "pad"]
    assert grouped == expected
    assert layout.tokens_per_expert.tolist() == [3, 4, 3]
    # dest_index is the inverse permutation.
    assert [flat[i] for i in range(len(flat))] == [grouped[d] for d in layout.dest_index.tolist()]
    # The gather maps skip exactly the rows written as padding (nothing is padding when dropless).
    grouped_skipped = [label[0] == "pad" for label in grouped]
    received_skipped = [label[0] == "pad" for label in flat]
    assert (layout.grouped_source == SKIP).tolist() == grouped_skipped
    assert (layout.received_source == SKIP).tolist() == received_skipped
    assert torch.equal(layout.grouped_source[~torch.tensor(grouped_skipped)],
                       layout.gather_index[~torch.tensor(grouped_skipped)])
    assert torch.equal(layout.received_source[~torch.tensor(received_skipped)],
                       layout.dest_index[~torch.tensor(received_skipped)])


# --------------------------------------------------------------------------------------------
# Single process, EP = 1 (no communication)
# --------------------------------------------------------------------------------------------


def test_ep1_static_and_dropless_match_reference_and_each_other():
    from megatron.bounded.moe.experts import _Activation

    num_tokens, num_experts, topk = 20, 4, 2
    routing_map, probs = make_routing("skew", num_tokens, num_experts, topk, 3)
    x, grad = _inputs(num_tokens, seed=5)
    w1, w2 = _weights(num_experts)
    cfg = _Cfg(num_experts, topk, 1.0)
    act = _Activation(cfg)
    static = StaticCapacityTokenDispatcher(num_experts, list(range(num_experts)), cfg, _pg(None))
    assert static.capacity_for(num_tokens) == num_tokens * topk
    ours = _our_step(static, x, routing_map, probs, w1, w2, grad, act)
    assert not static.check_over_budget().item()  # one slab of N*k rows never overflows
    assert ours["rows"] == num_tokens * topk
    dropless = StaticCapacityTokenDispatcher(
        num_experts, list(range(num_experts)), cfg, _pg(None), capacity_factor=None
    )
    exact = _our_step(dropless, x, routing_map, probs, w1, w2, grad, act)
    ref = _reference_step(x, routing_map, probs, w1, w2, grad, act)
    errors = _compare(ours, ref, 0, num_experts)
    assert max(errors.values()) <= 1e-5, errors
    assert _bitwise(ours, exact)
    assert ours["tokens_per_expert"] == routing_map.sum(0).tolist()


@pytest.mark.parametrize("factor", [1.0, 1.5, None])
def test_ep1_grouping_is_the_identity_and_is_skipped(factor):
    """One EP rank: the receive layout would be the identity (the slab is already expert-major
    with its padding last), so the dispatcher hands the received rows to the experts as they are
    and the combine takes the experts' rows back unpermuted."""
    num_tokens, num_experts, topk = 20, 4, 2
    routing_map, probs = _partial_routing(num_tokens, num_experts, topk, range(num_experts), 3)
    cfg = _Cfg(num_experts, topk, 1.0)
    d = StaticCapacityTokenDispatcher(num_experts, list(range(num_experts)), cfg, _pg(None),
                                      capacity_factor=factor)
    x, _ = _inputs(num_tokens, seed=2)
    send_hidden, send_probs = d.dispatch_preprocess(x, routing_map, probs)
    recv_hidden, recv_probs = d.token_dispatch(send_hidden, send_probs)
    state = d._state
    slab = state["plan"].capacity
    layout = plan_receive(state["recv_counts"], slab, None if slab else send_hidden.shape[0])
    rows = torch.arange(send_hidden.shape[0])
    assert torch.equal(layout.gather_index, rows) and torch.equal(layout.dest_index, rows)
    grouped, tokens_per_expert, grouped_probs = d.dispatch_postprocess(recv_hidden, recv_probs)
    assert grouped is recv_hidden and grouped_probs is recv_probs and state["layout"] is None
    assert torch.equal(tokens_per_expert, layout.tokens_per_expert)
    assert d.combine_preprocess(grouped) is grouped


def test_ep1_expert_padding_garbage_reaches_no_token_result():
    num_tokens, num_experts, topk = 20, 4, 2
    routing_map, probs = _partial_routing(num_tokens, num_experts, topk, range(num_experts), 3)
    res = _padding_poison_check(None, 0, 1, routing_map, probs, topk, factor=1.5, seed=4)
    assert res["padding_rows"] > 0 and not res["dropped"]
    assert res["finite"] and res["bitwise"], res


def test_ep1_sticky_flag_and_reset():
    from megatron.bounded.moe.experts import _Activation

    num_tokens, num_experts, topk = 12, 4, 2
    routing_map, probs = make_routing("skew", num_tokens, num_experts, topk, 8)
    x, grad = _inputs(num_tokens, seed=9)
    w1, w2 = _weights(num_experts)
    cfg = _Cfg(num_experts, topk, 0.5)  # half the pairs fit
    act = _Activation(cfg)
    d = StaticCapacityTokenDispatcher(num_experts, list(range(num_experts)), cfg, _pg(None))
    assert d.check_over_budget() is None  # nothing dispatched yet
    d.reset_over_budget()  # harmless before the first dispatch
    _our_step(d, x, routing_map, probs, w1, w2, grad, act)
    flag = d.check_over_budget()
    assert flag.dtype == torch.bool and flag.shape == (1,) and bool(flag.item())
    d._comm_manager.moe_expert_rank_capacity_factor = 2.0
    _our_step(d, x, routing_map, probs, w1, w2, grad, act)
    assert bool(d.check_over_budget().item())  # sticky
    d.reset_over_budget()
    assert d.check_over_budget() is flag and not bool(flag.item())  # cleared in place
    _our_step(d, x, routing_map, probs, w1, w2, grad, act)
    assert not bool(d.check_over_budget().item())


# --------------------------------------------------------------------------------------------
# Multi-rank on gloo
# --------------------------------------------------------------------------------------------


def _new_dispatcher(rank, world_size, num_experts, topk, factor):
    local = num_experts // world_size
    cfg = _Cfg(num_experts, topk, factor)
    return StaticCapacityTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), cfg, _pg(dist.group.WORLD)
    ), cfg


def _scenario(rank, world_size, kind, num_tokens, num_experts, topk, factor, seed=0):
    """One dispatch of ours (with ``factor``) and the reference; returns comparison data."""
    from megatron.bounded.moe.experts import _Activation

    local = num_experts // world_size
    routing_map, probs = make_routing(kind, num_tokens, num_experts, topk, seed * 100 + rank, ep_size=world_size)
    x, grad = _inputs(num_tokens, seed * 100 + 50 + rank)
    w1, w2 = _weights(num_experts, seed=seed)
    d, cfg = _new_dispatcher(rank, world_size, num_experts, topk, factor)
    act = _Activation(cfg)
    ours = _our_step(d, x, routing_map, probs, w1[rank * local:(rank + 1) * local],
                     w2[rank * local:(rank + 1) * local], grad, act)
    keep = None
    if factor is not None:
        capacity = capacity_rows(num_tokens, topk, world_size, factor)
        spec = _python_positions(routing_map, world_size)
        keep = torch.zeros_like(routing_map)
        for (n, e), (_, pos) in spec.items():
            keep[n, e] = pos < capacity
    ref = _reference_step(x, routing_map, probs, w1, w2, grad, act, keep=keep,
                          group=dist.group.WORLD)
    return {
        "dispatcher": d,
        "ours": ours,
        "ref": ref,
        "errors": _compare(ours, ref, rank, local),
        "flag": bool(d.check_over_budget().item()),
        "dropped": 0 if keep is None else int((routing_map & ~keep).sum()),
        "loads": _slab_loads(routing_map, world_size),
        "inputs": (x, routing_map, probs, w1[rank * local:(rank + 1) * local],
                   w2[rank * local:(rank + 1) * local], grad, act),
    }


def _global_max_load(rank, world_size, kind, num_tokens, num_experts, topk, seed):
    """Largest slab any rank sends, from every rank's routing (same seeds as _scenario)."""
    loads = []
    for r in range(world_size):
        routing_map, _ = make_routing(kind, num_tokens, num_experts, topk, seed * 100 + r, ep_size=world_size)
        loads.extend(_slab_loads(routing_map, world_size))
    return max(loads)


def _needed_factor(dispatcher) -> float:
    """The smallest factor that would have dropped nothing since the last reset (sticky)."""
    return float(dispatcher.slab_demand.item())


def _summary(res):
    return {
        "errors": res["errors"],
        "flag": res["flag"],
        "dropped": res["dropped"],
        "loads": res["loads"],
        "needed_factor": _needed_factor(res["dispatcher"]),
        "tokens_per_expert": res["ours"]["tokens_per_expert"],
        "rows": res["ours"]["rows"],
    }


def _multi_rank_body(rank, world_size):
    N, E = 20, 8
    out = {}

    # Balanced / skewed routing, factor large enough to drop nothing; equal to dropless.
    for kind, topk in (("balanced", 2), ("skew", 2), ("skew80_split", 1), ("one_rank", 2)):
        static = _scenario(rank, world_size, kind, N, E, topk, factor=float(world_size))
        dropless = _scenario(rank, world_size, kind, N, E, topk, factor=None)
        out[kind] = _summary(static)
        out[kind]["dropless_errors"] = dropless["errors"]
        out[kind]["bitwise_static_vs_dropless"] = _bitwise(static["ours"], dropless["ours"])
        out[kind]["dropless_rows"] = dropless["ours"]["rows"]

    # 80% of the pairs to expert 0 (top-1): the slab to rank 0 holds exactly 0.8 N rows.
    cut = (N * 4) // 5
    fits = _scenario(rank, world_size, "skew80_split", N, E, 1,
                     factor=_factor_for(cut, N, 1, world_size))
    over = _scenario(rank, world_size, "skew80_split", N, E, 1,
                     factor=_factor_for(cut - 1, N, 1, world_size))
    out["skew80_fits"] = _summary(fits)
    out["skew80_over"] = _summary(over)

    # Flag exactly when some slab of this rank overflows (random routing, top-2).
    peak = _global_max_load(rank, world_size, "balanced", N, E, 2, seed=7)
    for name, capacity in (("at_peak", peak), ("below_peak", peak - 1), ("tight", peak - 3)):
        res = _scenario(rank, world_size, "balanced", N, E, 2,
                        factor=_factor_for(capacity, N, 2, world_size), seed=7)
        out[name] = _summary(res)
        out[name]["capacity"] = capacity

    # Sticky across dispatches, cleared by reset; then the runner's dropless rerun.
    first = _scenario(rank, world_size, "balanced", N, E, 2,
                      factor=_factor_for(peak - 3, N, 2, world_size), seed=7)
    d = first["dispatcher"]
    sticky = [bool(d.check_over_budget().item())]
    first_needed = _needed_factor(d)
    d._comm_manager.moe_expert_rank_capacity_factor = float(world_size)  # no drops now
    _our_step(d, *first["inputs"])
    sticky.append(bool(d.check_over_budget().item()))
    # What PagedStashRunner.prepare_for_rerun does: factor None, reset the flag.
    d._comm_manager.moe_expert_rank_capacity_factor = None
    needed_before_reset = _needed_factor(d)
    d.reset_over_budget()
    sticky.append(bool(d.check_over_budget().item()))
    needed_after_reset = _needed_factor(d)
    rerun = _our_step(d, *first["inputs"])
    sticky.append(bool(d.check_over_budget().item()))
    out["needed_factor_sticky"] = [first_needed, needed_before_reset, needed_after_reset,
                                   _needed_factor(d)]
    fresh, _ = _new_dispatcher(rank, world_size, E, 2, None)
    dropless = _our_step(fresh, *first["inputs"])
    out["sticky"] = sticky
    out["rerun_bitwise_dropless"] = _bitwise(rerun, dropless)
    full_reference = _scenario(rank, world_size, "balanced", N, E, 2, None, seed=7)["ref"]
    out["rerun_vs_reference"] = _compare(rerun, full_reference, rank, E // world_size)

    # Garbage in the experts' padding rows. Every token routes to the last rank's experts only,
    # some to fewer than k: every send slab 0 is empty, so the unused slots point at a returned
    # padding row. Then top-1 with 80% of the pairs to expert 0 and slabs of 10 rows: pairs to
    # rank 0 are dropped while the slabs to the other ranks are partly or wholly padding.
    world = dist.group.WORLD
    last = range(E - E // world_size, E)
    routing_map, probs = _partial_routing(N, E, 2, last, seed=11 + rank)
    out["poison_unused_slots"] = _padding_poison_check(
        world, rank, world_size, routing_map, probs, 2, float(world_size), seed=12)
    routing_map, probs = make_routing("skew80_split", N, E, 1, 13 + rank, ep_size=world_size)
    out["poison_dropped_pairs"] = _padding_poison_check(
        world, rank, world_size, routing_map, probs, 1, _factor_for(10, N, 1, world_size), seed=14)
    return out


two_rank, four_rank, ranks = two_and_four_rank_fixtures(_multi_rank_body)


@pytest.mark.parametrize("kind", ["balanced", "skew", "skew80_split", "one_rank"])
def test_large_factor_matches_reference_and_dropless(ranks, kind):
    for rank, res in enumerate(ranks):
        r = res[kind]
        assert not r["flag"] and r["dropped"] == 0
        assert max(r["errors"].values()) <= 1e-5, (rank, r["errors"])
        assert max(r["dropless_errors"].values()) <= 1e-5, (rank, r["dropless_errors"])
        assert r["bitwise_static_vs_dropless"], rank
        # Static buffer: E_p slabs of capacity rows; dropless: exactly the received pairs.
        assert r["rows"] == len(ranks) * capacity_rows(20, 2 if kind != "skew80_split" else 1,
                                                       len(ranks), float(len(ranks)))
        assert r["dropless_rows"] == sum(r["tokens_per_expert"])


def test_rank_receiving_zero_tokens(ranks):
    # Only rank 0's experts are routed to: every other rank's experts see no rows.
    world = len(ranks)
    total = sum(sum(res["one_rank"]["tokens_per_expert"]) for res in ranks)
    assert total == world * 20 * 2
    assert sum(ranks[0]["one_rank"]["tokens_per_expert"]) == total
    for res in ranks[1:]:
        assert res["one_rank"]["tokens_per_expert"] == [0] * (8 // world)
        assert res["one_rank"]["dropless_rows"] == 0


def test_skew80_overflow_boundary(two_rank):
    for rank, res in enumerate(two_rank):
        fits, over = res["skew80_fits"], res["skew80_over"]
        assert fits["loads"][0] == 16  # 80% of 20 tokens to expert 0 on rank 0
        assert not fits["flag"] and fits["dropped"] == 0
        assert max(fits["errors"].values()) <= 1e-5
        # One row short: exactly one pair per rank is dropped and the flag is raised.
        assert over["flag"] and over["dropped"] == 1
        # The output equals the reference with exactly that pair removed (it adds zero).
        assert max(over["errors"].values()) <= 1e-5, over["errors"]


@pytest.mark.parametrize("case", ["at_peak", "below_peak", "tight"])
def test_over_budget_flag_exactly_when_a_slab_overflows(ranks, case):
    flags = []
    for res in ranks:
        r = res[case]
        overflowing = any(load > r["capacity"] for load in r["loads"])
        assert r["flag"] == overflowing
        assert (r["dropped"] > 0) == overflowing
        # Whatever is dropped contributes zero; the rest is exact.
        assert max(r["errors"].values()) <= 1e-5, r["errors"]
        flags.append(r["flag"])
        # the smallest factor without drops: the fullest slab over the even share N·k/E_p
        even_share = 20 * 2 / len(ranks)
        assert r["needed_factor"] == pytest.approx(max(r["loads"]) / even_share)
        assert (round(r["needed_factor"] * even_share) > r["capacity"]) == r["flag"]
    if case == "at_peak":
        assert not any(flags)
    else:
        assert any(flags)  # some rank sends the peak slab


def test_flag_sticky_and_dropless_rerun_bitwise(ranks):
    for res in ranks:
        # After the tight dispatch (True), a dispatch without drops keeps it, reset clears it,
        # and the dropless rerun never raises it.
        assert res["sticky"][1:] == [res["sticky"][0], False, False]
        # the slab demand is sticky the same way; reset clears it, the dropless rerun adds none
        first, before_reset, after_reset, after_rerun = res["needed_factor_sticky"]
        assert first > 0 and before_reset == first and after_reset == 0.0 and after_rerun == 0.0
        assert res["rerun_bitwise_dropless"]
        assert max(res["rerun_vs_reference"].values()) <= 1e-5
    assert any(res["sticky"][0] for res in ranks)


def test_expert_padding_garbage_reaches_no_token_result(ranks):
    for rank, res in enumerate(ranks):
        unused, dropped = res["poison_unused_slots"], res["poison_dropped_pairs"]
        assert unused["finite"] and unused["bitwise"], (rank, unused)
        assert dropped["finite"] and dropped["bitwise"], (rank, dropped)
        assert dropped["dropped"]
    # Experts saw padding in both cases (in the first, all ranks but the last receive nothing
    # else; in the second, all ranks but rank 0).
    assert any(res["poison_unused_slots"]["padding_rows"] > 0 for res in ranks)
    assert any(res["poison_dropped_pairs"]["padding_rows"] > 0 for res in ranks)


# --------------------------------------------------------------------------------------------
# Against upstream on CPU (gloo, 2 ranks).  Upstream's dispatchers allocate CUDA buffers as soon
# as EP > 1 and its alltoall dispatcher creates CUDA streams, so the upstream side runs at EP = 1
# on each rank (allgather dispatcher, which then does no communication, + SequentialMLP holding
# all experts) while ours runs at EP = 2 with each rank's slice of the same weights.  The
# alltoall dispatcher is compared on GPU below.
# --------------------------------------------------------------------------------------------


def _upstream_config(num_experts, topk, ep_size):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        expert_model_parallel_size=ep_size,
    )


def _cpu_gating(router):
    # Upstream's router moves its weight to CUDA in gating(); on CPU compute the logits here.
    router.gating = types.MethodType(lambda self, inp: F.linear(inp, self.weight), router)


def _single_rank_collection(rank, world_size):
    """A ProcessGroupCollection whose groups all hold this rank only (EP = TP = 1)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    singles = [dist.new_group([r]) for r in range(world_size)]  # collective: same order
    mine = singles[rank]
    return ProcessGroupCollection(tp=mine, cp=mine, tp_cp=mine, tp_dp_cp=mine, ep=mine,
                                  expt_tp=mine, tp_ep=mine, expt_dp=mine)


def _upstream_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from megatron.bounded.moe.experts import GroupedExperts
    from megatron.bounded.moe.moe_layer import BoundedMoELayer, bounded_moe_submodules

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
    out = {}
    try:
        pg = get_default_pg_collection()  # EP = world size (ours)
        pg_one = _single_rank_collection(rank, world_size)  # EP = 1 (upstream reference)
        E, k, N = 8, 2, 24
        local = E // world_size
        sl = slice(rank * local, (rank + 1) * local)
        cfg_up = _upstream_config(E, k, 1)
        torch.manual_seed(1000)  # same full expert weights on every rank
        seq = SequentialMLP(E, cfg_up, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                     linear_fc2=RowParallelLinear),
                            pg_collection=pg_one)
        cfg = _upstream_config(E, k, world_size)
        cfg.moe_expert_rank_capacity_factor = float(world_size)
        ours_experts = GroupedExperts(local, cfg, pg_collection=pg)
        with torch.no_grad():
            for j, e in enumerate(range(sl.start, sl.stop)):
                ours_experts.weight1[j].copy_(seq.local_experts[e].linear_fc1.weight.t())
                ours_experts.weight2[j].copy_(seq.local_experts[e].linear_fc2.weight.t())
        routing_map, probs = make_routing("skew", N, E, k, rank, ep_size=world_size)
        x, grad = _inputs(N, seed=40 + rank)

        def run(dispatcher, experts):
            xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
            y, _, _ = dispatch_experts_combine(
                dispatcher, xl, routing_map, pl, lambda *rows: experts(*rows)[0])
            (y * grad).sum().backward()
            return y.detach(), xl.grad, pl.grad

        up = run(MoEAllGatherTokenDispatcher(E, list(range(E)), cfg_up, pg_collection=pg_one),
                 seq)
        mine = run(StaticCapacityTokenDispatcher(local, list(range(sl.start, sl.stop)), cfg,
                                                 pg_collection=pg), ours_experts)
        w1_up = torch.stack([e.linear_fc1.weight.grad.t() for e in seq.local_experts])
        w2_up = torch.stack([e.linear_fc2.weight.grad.t() for e in seq.local_experts])
        for t in (w1_up, w2_up):  # every rank's tokens contribute to the expert gradients
            dist.all_reduce(t)
        out["dispatch"] = {
            "out": _rel(mine[0], up[0]),
            "x": _rel(mine[1], up[1]),
            "probs": _rel(mine[2], up[2]),
            "w1": _rel(ours_experts.weight1.grad, w1_up[sl]),
            "w2": _rel(ours_experts.weight2.grad, w2_up[sl]),
        }

        # Whole layers: upstream MoELayer (local spec, SequentialMLP, EP = 1) vs ours (EP = 2).
        cfg_layer_up = _upstream_config(E, k, 1)
        cfg_ours = _upstream_config(E, k, world_size)
        cfg_ours.moe_expert_rank_capacity_factor = float(world_size)
        cfg_ours.moe_token_dispatcher_type = "alltoall"
        torch.manual_seed(7)
        upstream_layer = get_moe_module_spec(use_te=False, num_experts=E)(
            config=cfg_layer_up, pg_collection=pg_one)
        ours_layer = bounded_moe_submodules(cfg_ours)(config=cfg_ours, pg_collection=pg)
        assert isinstance(ours_layer, BoundedMoELayer)
        with torch.no_grad():
            ours_layer.router.weight.copy_(upstream_layer.router.weight)
            for j, e in enumerate(range(sl.start, sl.stop)):
                expert = upstream_layer.experts.local_experts[e]
                ours_layer.experts.weight1[j].copy_(expert.linear_fc1.weight.t())
                ours_layer.experts.weight2[j].copy_(expert.linear_fc2.weight.t())
        for layer in (upstream_layer, ours_layer):
            _cpu_gating(layer.router)
        xs = torch.randn(N // 2, 2, HIDDEN, generator=torch.Generator().manual_seed(90 + rank))
        gs = torch.randn_like(xs)
        results = []
        for layer in (upstream_layer, ours_layer):
            xl = xs.clone().requires_grad_()
            y, bias = layer(xl)
            (y * gs).sum().backward()
            results.append((y.detach(), xl.grad, layer.router.weight.grad.clone(), bias))
        w1_up = torch.stack([e.linear_fc1.weight.grad.t()
                             for e in upstream_layer.experts.local_experts])
        dist.all_reduce(w1_up)
        out["layer"] = {
            "backend": ours_layer.moe_backend,
            "dispatcher": type(ours_layer.token_dispatcher).__name__,
            "experts": type(ours_layer.experts).__name__,
            "type_restored": cfg_ours.moe_token_dispatcher_type,
            "bias_none": results[1][3] is None,
            "out": _rel(results[1][0], results[0][0]),
            "x": _rel(results[1][1], results[0][1]),
            "router_w": _rel(results[1][2], results[0][2]),
            "w1": _rel(ours_layer.experts.weight1.grad, w1_up[sl]),
            "flag": bool(ours_layer.token_dispatcher.check_over_budget().item()),
            # the experts' fc1 weight gradient is handed to the dispatch exchange (wgrad_handoff)
            "wgrad_overlap_wired": ours_layer.token_dispatcher.wgrad_overlap is not None
            and ours_layer.token_dispatcher.wgrad_overlap is ours_layer.experts.wgrad_overlap,
        }
        # The same layer with PipelinedLLEP (5 chunks of <= 5 tokens, LLEP balancing on).
        cfg_llep = _upstream_config(E, k, world_size)
        cfg_llep.pipelined_llep, cfg_llep.pipelined_llep_token_budget = True, 5
        cfg_llep.pipelined_llep_max_chunks, cfg_llep.llep_imbalance_threshold = 10, 1.0
        cfg_llep.llep_min_spill_tokens = 1
        llep_layer = bounded_moe_submodules(cfg_llep)(config=cfg_llep, pg_collection=pg)
        with torch.no_grad():
            llep_layer.router.weight.copy_(upstream_layer.router.weight)
            llep_layer.experts.weight1.copy_(ours_layer.experts.weight1)
            llep_layer.experts.weight2.copy_(ours_layer.experts.weight2)
        _cpu_gating(llep_layer.router)
        xl = xs.clone().requires_grad_()
        y, _ = llep_layer(xl)
        (y * gs).sum().backward()
        out["llep_layer"] = {
            "enabled": llep_layer.pipelined_llep is not None,
            "out": _rel(y.detach(), results[0][0]),
            "x": _rel(xl.grad, results[0][1]),
            "router_w": _rel(llep_layer.router.weight.grad, results[0][2]),
            "w1": _rel(llep_layer.experts.weight1.grad, w1_up[sl]),
        }
        from megatron.core.dist_checkpointing.mapping import apply_factories

        sd = ours_layer.experts.sharded_state_dict(prefix="experts.")
        apply_factories(sd)  # upstream SequentialMLP's per-expert layout
        out["sharded"] = {
            key: sorted((tuple(t.global_shape), tuple(t.global_offset)) for t in shards)
            for key, shards in sd.items()
        }
        out["allreduce"] = [getattr(p, "allreduce", None) for p in ours_layer.experts.parameters()]
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def upstream_two_rank():
    return run_on_ranks(_upstream_body, world_size=2, timeout_s=120)


def test_matches_upstream_dispatcher_and_sequential_mlp(upstream_two_rank):
    for res in upstream_two_rank:
        errors = res["dispatch"]
        assert max(errors.values()) <= 1e-5, errors


def test_bounded_moe_layer_matches_upstream_moe_layer(upstream_two_rank):
    for rank, res in enumerate(upstream_two_rank):
        r = res["layer"]
        assert r["backend"] == "torch"
        assert r["dispatcher"] == "StaticCapacityTokenDispatcher"
        assert r["experts"] == "GroupedExperts"
        assert r["type_restored"] == "alltoall"
        assert r["bias_none"] and not r["flag"] and r["wgrad_overlap_wired"]
        for key in ("out", "x", "router_w", "w1"):
            assert r[key] <= 1e-5, (rank, key, r[key])
        # Expert weights are EP-sharded: 4 of 8 experts per rank, offset by the rank (in
        # upstream's [experts, 2 x ffn, hidden] layout, one shard per expert and SwiGLU half).
        assert res["sharded"]["experts.weight1"] == sorted(
            ((8, 2 * FFN, HIDDEN), (e, half * FFN, 0))
            for e in range(4 * rank, 4 * rank + 4) for half in range(2)
        )
        assert res["allreduce"] == [False, False]


def test_pipelined_llep_layer_matches_upstream_moe_layer(upstream_two_rank):
    for rank, res in enumerate(upstream_two_rank):
        r = res["llep_layer"]
        assert r["enabled"]
        for key in ("out", "x", "router_w", "w1"):
            assert r[key] <= 1e-5, (rank, key, r[key])


def test_backend_selection_rules():
    from megatron.bounded.moe.moe_layer import select_moe_backend

    cfg = types.SimpleNamespace(moe_expert_rank_capacity_factor=None,
                                moe_token_dispatcher_type="alltoall",
                                moe_flex_dispatcher_backend="deepep")
    assert select_moe_backend(cfg) == "upstream"
    cfg.moe_expert_rank_capacity_factor = 1.5
    assert select_moe_backend(cfg) == "torch"
    cfg.moe_token_dispatcher_type = "flex"
    cfg.moe_flex_dispatcher_backend = "hybridep"
    # Without DeepEP's HybridEP and Transformer Engine upstream's path cannot run.
    assert select_moe_backend(cfg) == "torch"
    cfg.bounded_moe_backend = "upstream"
    assert select_moe_backend(cfg) == "upstream"
    cfg.moe_expert_rank_capacity_factor = None
    cfg.bounded_moe_backend = "torch"
    assert select_moe_backend(cfg) == "torch"
    cfg.bounded_moe_backend = "bogus"
    with pytest.raises(ValueError):
        select_moe_backend(cfg)


# --------------------------------------------------------------------------------------------
# GPU (marked ``gpu``; skipped without CUDA)
# --------------------------------------------------------------------------------------------

def _cuda_case(num_tokens=512, num_experts=8, topk=2, dtype=torch.bfloat16):
    from megatron.bounded.moe.experts import _Activation

    routing_map, probs = make_routing("skew", num_tokens, num_experts, topk, 21)
    x, grad = _inputs(num_tokens, seed=22)
    w1, w2 = _weights(num_experts)
    cfg = _Cfg(num_experts, topk, 1.0)
    dev = lambda t: t.cuda()  # noqa: E731
    return (dev(x.to(dtype)), dev(routing_map), dev(probs), dev(w1.to(dtype)),
            dev(w2.to(dtype)), dev(grad.to(dtype)), _Activation(cfg)), cfg


def _eager_then_captured(dispatcher, leaves, routing_map, grad, act):
    """dispatch -> grouped experts -> combine, forward + backward: 3 eager warm-up steps on a side
    stream, then the same step captured in a CUDA graph and replayed twice. Returns the eager and
    the replayed (output, grads of ``leaves`` = x, probs, w1, w2) and the eager over-budget flag
    (the flag is reset before capture, so a set flag afterwards was raised inside the graph)."""
    from megatron.bounded.moe.experts import grouped_mlp

    x, probs, w1, w2 = leaves
    d = dispatcher

    def step():
        y, _, _ = dispatch_experts_combine(
            d, x, routing_map, probs, lambda rows, tpe, p: grouped_mlp(rows, tpe, p, w1, w2, act))
        (y.float() * grad.float()).sum().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in leaves:
                t.grad = None
            eager_y = step()
    torch.cuda.current_stream().wait_stream(side)
    eager = [eager_y.detach().clone()] + [t.grad.clone() for t in leaves]
    flag_eager = bool(d.check_over_budget().item())
    d.reset_over_budget()
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_y = step()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    return eager, [graph_y.detach()] + [t.grad for t in leaves], flag_eager


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_equals_eager():
    """dispatch -> experts -> combine forward + backward captured in a CUDA graph (EP = 1)."""
    (x, routing_map, probs, w1, w2, grad, act), cfg = _cuda_case()
    cfg.moe_expert_rank_capacity_factor = 0.75  # tight: some pairs drop, the flag must set
    d = StaticCapacityTokenDispatcher(8, list(range(8)), cfg, _pg(None))
    leaves = (x.clone().requires_grad_(True), probs.clone().requires_grad_(True),
              torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone()))
    eager, replayed, _ = _eager_then_captured(d, leaves, routing_map, grad, act)
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)
    assert bool(d.check_over_budget().item())  # raised inside the replayed graph
    d.reset_over_budget()
    assert not bool(d.check_over_budget().item())


def _nccl_graph_body(rank, world_size):
    """EP = 2 over NCCL: dispatch -> experts -> combine forward + backward, eager then captured."""
    from megatron.bounded.moe.experts import _Activation

    num_experts, topk, num_tokens = 8, 2, 512
    local = num_experts // world_size
    cfg = _Cfg(num_experts, topk, 0.75)  # tight: some pairs drop, the flag must set
    routing_map, probs = make_routing("skew", num_tokens, num_experts, topk, rank, ep_size=world_size)
    x, grad = _inputs(num_tokens, seed=40 + rank)
    w1, w2 = _weights(num_experts)
    sl = slice(rank * local, (rank + 1) * local)
    dtype = torch.bfloat16
    d = StaticCapacityTokenDispatcher(
        local, list(range(sl.start, sl.stop)), cfg, _pg(dist.group.WORLD)
    )
    act = _Activation(cfg)
    routing_map, probs, grad = routing_map.cuda(), probs.cuda(), grad.cuda().to(dtype)
    leaves = (x.cuda().to(dtype).requires_grad_(True), probs.clone().requires_grad_(True),
              torch.nn.Parameter(w1[sl].cuda().to(dtype)), torch.nn.Parameter(w2[sl].cuda().to(dtype)))
    eager, replayed, flag_eager = _eager_then_captured(d, leaves, routing_map, grad, act)
    return {
        "equal": [torch.equal(a, b) for a, b in zip(replayed, eager)],
        "flag_eager": flag_eager,
        "flag_replay": bool(d.check_over_budget().item()),
    }


@pytest.mark.gpu
@requires_two_gpus
def test_gpu_two_rank_nccl_cuda_graph_replay_equals_eager():
    """Sync-free proven by capture at EP = 2: the all-to-alls run inside the CUDA graph."""
    results = run_on_ranks(_nccl_graph_body, 2, backend="nccl", timeout_s=300)
    for rank, result in enumerate(results):
        assert all(result["equal"]), (rank, result)
    # the over-budget flag is raised on the rank(s) whose slabs overflow, eagerly and in replay
    assert [r["flag_replay"] for r in results] == [r["flag_eager"] for r in results]
    assert any(r["flag_replay"] for r in results)


@pytest.mark.gpu
@requires_cuda
def test_gpu_matches_upstream_alltoall_and_sequential_mlp():
    """Upstream's alltoall dispatcher + SequentialMLP vs ours on one GPU (EP = 1), bf16 and fp32."""
    import os

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron.bounded.moe.experts import GroupedExperts

    created = False
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
        dist.init_process_group("nccl", rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)  # expert weights are initialized under its RNG fork
    try:
        pg = get_default_pg_collection()
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            E, k, N = 8, 2, 256
            cfg = _upstream_config(E, k, 1)
            cfg.moe_token_dispatcher_type = "alltoall"
            cfg.use_cpu_initialization = False
            torch.manual_seed(3)
            seq = SequentialMLP(E, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                      linear_fc2=RowParallelLinear),
                                pg_collection=pg).cuda().to(dtype)
            ours = GroupedExperts(E, cfg, pg_collection=pg).cuda().to(dtype)
            ours.load_from_sequential_mlp(seq)
            routing_map, probs = make_routing("skew", N, E, k, 5)
            x, grad = _inputs(N, seed=6)
            routing_map, probs = routing_map.cuda(), probs.cuda()
            x, grad = x.cuda().to(dtype), grad.cuda().to(dtype)

            def run(dispatcher, experts):
                xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
                y, _, _ = dispatch_experts_combine(
                    dispatcher, xl, routing_map, pl, lambda *rows: experts(*rows)[0])
                (y.float() * grad.float()).sum().backward()
                return y.detach(), xl.grad, pl.grad

            up = run(MoEAlltoAllTokenDispatcher(E, list(range(E)), cfg, pg_collection=pg), seq)
            cfg.moe_expert_rank_capacity_factor = 1.0
            mine = run(StaticCapacityTokenDispatcher(E, list(range(E)), cfg, pg_collection=pg),
                       ours)
            for a, b in zip(mine, up):
                assert _rel(a.float(), b.float()) <= tol
            w1_up = torch.stack([e.linear_fc1.weight.grad.t() for e in seq.local_experts])
            assert _rel(ours.weight1.grad.float(), w1_up.float()) <= tol
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
