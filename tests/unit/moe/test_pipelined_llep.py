"""PipelinedLLEP (megatron.bounded.moe.pipelined_llep).

Single-process tests cover the pure parts (chunk count, chunk membership, the LLEP planner) and
EP = 1.  Multi-rank tests on gloo (2 and 4 ranks, one spawn per world size) compare the
chunked layer with (a) the unchunked static-capacity dispatcher path with a no-drop factor
(bitwise, K = 1), (b) a dense reference that applies every token's experts with the full
weights (K > 1, LLEP, ranks with different token counts), record the rows each rank receives
per chunk under balanced, 80%-to-one-expert and Zipf routings, and measure the bytes the layer
keeps alive in forward and backward with a dispatch-mode meter.  GPU tests (marked ``gpu``)
cover the side-stream schedule.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.bounded.moe.pipelined_llep import (
    PipelinedLLEPMoE,
    PipelinedLLEPSettings,
    agree_num_chunks,
    contiguous_chunk,
    dispatch_live_bytes_bound,
    num_chunks,
    pipelined_moe,
    plan_llep,
    strided_chunk,
)
from megatron.bounded.settings import BoundedArgumentError
from tests.unit.comparisons import moe_errors as _errors
from tests.unit.comparisons import dispatch_experts_combine
from tests.unit.comparisons import relative_error as _rel
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks, two_and_four_rank_fixtures
from tests.unit.routing import make_routing
from megatron.bounded.units import ceil_div

HIDDEN, FFN = 16, 8
MEMORY_BUDGETS = (128, 32, 16)  # K = 1, 4, 8 at N = 128


# --------------------------------------------------------------------------------------------
# Chunk count and membership
# --------------------------------------------------------------------------------------------


def test_num_chunks_paper_values():
    assert num_chunks(65536, 6554, 10) == 10
    assert num_chunks(32768, 10923, 10) == 3
    table7 = [num_chunks(n, 4096, 10) for n in (128, 1024, 8192, 32768, 65536, 131072)]
    assert table7 == [1, 1, 2, 8, 10, 10]


def test_num_chunks_edges_and_validation():
    assert num_chunks(0, 5, 10) == 1  # every rank runs at least one (possibly empty) chunk
    assert num_chunks(10, 5, 10) == 2 and num_chunks(11, 5, 10) == 3
    assert num_chunks(100, 1, 1) == 1
    with pytest.raises(ValueError, match="num_tokens"):
        num_chunks(-1, 10, 10)
    with pytest.raises(TypeError):
        num_chunks(100, 2.5, 10)


def test_agree_num_chunks_single_rank():
    assert agree_num_chunks(65536, 6554, 10) == (10, 6554)
    assert agree_num_chunks(131072, 4096, 10) == (10, 13108)  # cap binds: c_eff > c
    assert agree_num_chunks(0, 4096, 10) == (1, 1)


@pytest.mark.parametrize("n,k", [(0, 1), (1, 3), (7, 1), (10, 3), (37, 10), (64, 8), (5, 9)])
def test_chunk_membership(n, k):
    for fn in (strided_chunk, contiguous_chunk):
        chunks = [fn(n, k, i) for i in range(k)]
        for c in chunks:
            assert c.dtype == torch.int64
        allpos = torch.cat(chunks)
        assert torch.equal(torch.sort(allpos).values, torch.arange(n))  # each exactly once
        sizes = [c.numel() for c in chunks]
        assert max(sizes) - min(sizes) <= (1 if fn is strided_chunk else max(sizes))
        assert max(sizes) <= ceil_div(n, k)
    for i in range(k):
        assert strided_chunk(n, k, i).tolist() == list(range(i, n, k))


def test_chunk_membership_validation():
    for fn in (strided_chunk, contiguous_chunk):
        with pytest.raises(ValueError):
            fn(10, 0, 0)
        with pytest.raises(ValueError):
            fn(10, 3, 3)
        with pytest.raises(ValueError):
            fn(10, 3, -1)
        with pytest.raises(ValueError):
            fn(-1, 3, 0)


# --------------------------------------------------------------------------------------------
# LLEP planner (pure)
# --------------------------------------------------------------------------------------------


def _rank_loads_from_plan(plan):
    """Rank loads implied by the spills (independent recomputation)."""
    local = plan.num_experts // plan.ep_size
    loads = [0] * plan.ep_size
    for e, load in enumerate(plan.loads):
        loads[e // local] += plan.kept(e)
    for s in plan.spills:
        loads[s.helper] += s.count
    return loads


def _check_plan_consistent(plan):
    local = plan.num_experts // plan.ep_size
    assert _rank_loads_from_plan(plan) == list(plan.balanced_rank_loads)
    assert sum(plan.balanced_rank_loads) == sum(plan.loads)
    for e in range(plan.num_experts):
        mine = sorted((s for s in plan.spills if s.expert == e), key=lambda s: s.start)
        assert plan.kept(e) >= 0
        pos = plan.kept(e)
        for s in mine:  # the helpers' ranges tile [kept, load) in order
            assert s.start == pos and s.count > 0 and s.owner == e // local
            assert s.helper != s.owner
            pos += s.count
        assert pos == plan.loads[e]
        assert len({s.helper for s in mine}) == len(mine)  # one copy per (expert, helper)


def test_plan_llep_balanced_below_threshold_moves_nothing():
    plan = plan_llep([10, 12, 11, 9, 10, 11, 12, 10], 4, threshold=1.3)
    assert not plan.active and plan.spills == ()
    assert plan.balanced_rank_loads == plan.rank_loads
    assert plan.imbalance <= 1.3


def test_plan_llep_one_hot_expert_moves_load_off_the_hottest_rank():
    # 8 experts on 4 ranks, top-2: expert 0 takes 80% of 1000 tokens.
    loads = [800, 200, 150, 150, 200, 200, 150, 150]
    plan = plan_llep(loads, 4, threshold=1.2)
    _check_plan_consistent(plan)
    assert plan.active
    before, after = max(plan.rank_loads), max(plan.balanced_rank_loads)
    assert after < before
    assert after == ceil_div(sum(loads), 4)  # everything above the mean was placed
    assert {s.expert for s in plan.spills} == {0}  # the hot expert alone covers the excess
    assert plan.hosted(0) == ()
    assert all(plan.hosted(r) == (0,) for r in (1, 2, 3))


def test_plan_llep_properties_random_and_threshold():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ep = [2, 4, 8][trial % 3]
        local = 1 + trial % 3
        weights = torch.rand(ep * local, generator=g) ** 4
        loads = (weights / weights.sum() * 5000).round().long().tolist()
        plan = plan_llep(loads, ep, threshold=1.1, min_spill_tokens=1 + trial % 5)
        _check_plan_consistent(plan)
        if plan.imbalance > 1.1:
            assert max(plan.balanced_rank_loads) <= max(plan.rank_loads)
            if plan.active:
                assert max(plan.balanced_rank_loads) < max(plan.rank_loads)
            if plan.spills and 1 + trial % 5 == 1:
                assert max(plan.balanced_rank_loads) == ceil_div(sum(loads), ep)
        else:
            assert not plan.active
        for s in plan.spills:
            assert s.count >= 1 + trial % 5
        assert plan_llep(loads, ep, 1.1, 1 + trial % 5) == plan  # deterministic (pure)
    # A high threshold turns balancing off for the same skewed loads.
    assert not plan_llep([800, 200, 150, 150, 200, 200, 150, 150], 4, threshold=4.0).active


def test_plan_llep_validation():
    # its threshold and min_spill_tokens are settings values: pipelined_moe refuses bad ones
    # (test_functional_input_validation)
    with pytest.raises(ValueError, match="split"):
        plan_llep([1, 2, 3], 2, threshold=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        plan_llep([1, -2], 2, threshold=1.5)
    assert not plan_llep([0, 0, 0, 0], 2, threshold=1.0).active


# --------------------------------------------------------------------------------------------
# Shared helpers (single- and multi-process)
# --------------------------------------------------------------------------------------------


class _Cfg:
    """Config fields read by the dispatcher, the expert activation and PipelinedLLEPMoE; with a
    ``budget``, PipelinedLLEP's fields, checked as a model config checks them."""

    def __init__(self, num_experts, topk, factor=None, budget=None, max_chunks=10,
                 threshold=None, min_spill_tokens=1):
        self.num_moe_experts = num_experts
        self.moe_router_topk = topk
        self.moe_expert_rank_capacity_factor = factor
        self.gated_linear_unit = True
        self.activation_func = F.silu
        self.glu_linear_offset = 0.0
        self.activation_func_clamp_value = None
        llep = PipelinedLLEPSettings(
            pipelined_llep=budget is not None, pipelined_llep_token_budget=budget,
            pipelined_llep_max_chunks=max_chunks, llep_imbalance_threshold=threshold,
            llep_min_spill_tokens=min_spill_tokens)
        llep.check_values()
        vars(self).update(llep.fields())


def _weights(num_experts, seed=1234, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, HIDDEN, 2 * FFN, generator=g) * 0.3
    w2 = torch.randn(num_experts, FFN, HIDDEN, generator=g) * 0.3
    return w1.to(dtype), w2.to(dtype)


def _inputs(num_tokens, seed, dtype=torch.float32, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 1, hidden, generator=g).to(dtype)
    grad = torch.randn(num_tokens, 1, hidden, generator=g).to(dtype)
    return x, grad


def _activation():
    from megatron.bounded.moe.experts import _Activation

    return _Activation(_Cfg(8, 1))


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _result(out, leaves, stats=None):
    return {"out": out.detach(), "grads": [t.grad for t in leaves], "stats": stats}


def _run_pipelined(x, routing_map, probs, w1, w2, grad, act, group, **kw):
    leaves = _leaves(x, probs, w1, w2)
    stats = {}
    out = pipelined_moe(leaves[0], leaves[1], routing_map, leaves[2], leaves[3], act,
                        ep_group=group, stats=stats, **kw)
    (out * grad).sum().backward()
    stats = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in stats.items()}
    return _result(out, leaves, stats)


def _run_unchunked(x, routing_map, probs, w1, w2, grad, act, group, topk):
    """Our static-capacity dispatcher path with the no-drop factor cf = E_p."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bounded.moe.experts import grouped_mlp
    from megatron.bounded.moe.dispatch.token_dispatcher import StaticCapacityTokenDispatcher

    ep = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    local = w1.shape[0]
    cfg = _Cfg(local * ep, topk, factor=float(ep))
    d = StaticCapacityTokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), cfg,
                                      ProcessGroupCollection(ep=group))
    leaves = _leaves(x, probs, w1, w2)
    y, _, _ = dispatch_experts_combine(
        d, leaves[0], routing_map, leaves[1],
        lambda rows, tpe, p: grouped_mlp(rows, tpe, p, leaves[2], leaves[3], act))
    (y * grad).sum().backward()
    assert not bool(d.check_over_budget().item())
    return _result(y, leaves)


def _reference(x, routing_map, probs, w1_full, w2_full, grad, act, group):
    """Every token through its routed experts with the full weights (dense, fp64)."""
    leaves = _leaves(x.double(), probs.double(), w1_full.double(), w2_full.double())
    x2 = leaves[0].reshape(-1, x.shape[-1])
    out = torch.zeros_like(x2)
    for e in range(w1_full.shape[0]):
        y = (act(x2 @ leaves[2][e]) * leaves[1][:, e:e + 1]) @ leaves[3][e]
        out = out + torch.where(routing_map[:, e:e + 1], y, torch.zeros_like(y))
    out = out.view(x.shape)
    (out * grad.double()).sum().backward()
    grads = [t.grad for t in leaves]
    if group is not None:
        for t in grads[2:]:
            dist.all_reduce(t, group=group)
    return {"out": out.detach(), "grads": grads}



def _bitwise(a, b):
    names = ["out", "x", "probs", "w1", "w2"]
    vals = [(a["out"], b["out"])] + list(zip(a["grads"], b["grads"]))
    return {n: bool(torch.equal(u, v)) for n, (u, v) in zip(names, vals)}


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode that are still alive; peak over time."""

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Outputs that alias an input (views, in-place ops) allocate nothing.
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in self.live or key in inputs:
                    continue
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out


def test_live_bytes_meter_sanity():
    meter = _LiveBytes()
    x = torch.randn(1000, requires_grad=True)
    with meter:
        a = x * 2  # 4000 B
        b = a.exp()  # 4000 B, saved for backward (a is not)
        del a
        assert meter.current == 4000
        b.sum().backward()
        del b
    assert meter.peak >= 12000 and meter.current == 4000  # only x.grad is left


# --------------------------------------------------------------------------------------------
# EP = 1 (single process)
# --------------------------------------------------------------------------------------------


def test_ep1_k1_bitwise_and_k_gt_1_close():
    E, k, N = 8, 2, 40
    act = _activation()
    routing_map, probs = make_routing("skew80", N, E, k, 3)
    x, grad = _inputs(N, seed=4)
    w1, w2 = _weights(E)
    base = _run_unchunked(x, routing_map, probs, w1, w2, grad, act, None, k)
    one = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k, token_budget=N)
    assert one["stats"]["num_chunks"] == 1
    assert all(_bitwise(one, base).values()), _bitwise(one, base)
    ref = _reference(x, routing_map, probs, w1, w2, grad, act, None)
    for chunking in ("strided", "contiguous"):
        many = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k,
                              token_budget=6, chunking=chunking)
        assert many["stats"]["num_chunks"] == 7
        assert not many["stats"]["dropped"]
        errs = _errors(many, ref, 0, E)
        assert max(errs.values()) < 1e-5, errs


def test_ep1_bf16_and_probs_on_input():
    E, k, N = 8, 2, 40
    act = _activation()
    routing_map, probs = make_routing("zipf", N, E, k, 5)
    x, grad = _inputs(N, seed=6, dtype=torch.bfloat16)
    w1, w2 = _weights(E, dtype=torch.bfloat16)
    base = _run_unchunked(x, routing_map, probs, w1, w2, grad, act, None, k)
    one = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k, token_budget=N)
    assert all(_bitwise(one, base).values()), _bitwise(one, base)
    many = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k, token_budget=8)
    ref = _reference(x, routing_map, probs, w1, w2, grad, act, None)
    errs = _errors(many, ref, 0, E)
    assert max(errs.values()) < 2e-2, errs

    # moe_apply_probs_on_input: the prob scales the expert input instead of the activation.
    x, grad = _inputs(N, seed=7)
    w1, w2 = _weights(E)
    res = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k,
                         token_budget=8, apply_probs_on_input=True)
    leaves = _leaves(x.double(), probs.double(), w1.double(), w2.double())
    x2 = leaves[0].reshape(N, -1)
    out = torch.zeros_like(x2)
    for e in range(E):
        y = act((leaves[1][:, e:e + 1] * x2) @ leaves[2][e]) @ leaves[3][e]
        out = out + torch.where(routing_map[:, e:e + 1], y, torch.zeros_like(y))
    (out.view(x.shape) * grad.double()).sum().backward()
    ref = {"out": out.view(x.shape).detach(), "grads": [t.grad for t in leaves]}
    errs = _errors(res, ref, 0, E)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("chunking", ["strided", "contiguous"])
def test_chunk_pair_counts_are_exact(chunking):
    """Per chunk and destination rank, the pairs counted for the all-to-all sizes equal a direct
    count, with the owners' placement and with LLEP helpers (virtual experts)."""
    from megatron.bounded.moe.pipelined_llep.chunks import chunk_pair_counts

    N, E, k, ep, K = 23, 8, 2, 2, 4
    routing_map, _ = make_routing("zipf", N, E, k, 5)
    index = strided_chunk if chunking == "strided" else contiguous_chunk
    counts = chunk_pair_counts(routing_map, None, E // ep, ep, K, chunking)
    assert counts.shape == (K, ep, E // ep)
    for i in range(K):
        rows = routing_map[index(N, K, i)]
        for r in range(ep):
            for j in range(E // ep):
                assert counts[i, r, j] == rows[:, r * (E // ep) + j].sum()
    # virtual experts: 3 slots per rank, virtual id = rank * 3 + slot; the sentinel 6 is unused
    slot_virtual = torch.tensor([[0, 4], [5, 6], [2, 3]] * 8)[:N]
    counts = chunk_pair_counts(routing_map, slot_virtual, 3, ep, K, chunking)
    assert counts.shape == (K, ep, 3)
    for i in range(K):
        virt = slot_virtual[index(N, K, i)]
        assert counts[i].reshape(-1).tolist() == [int((virt == v).sum()) for v in range(6)]
    assert counts.sum() == (slot_virtual < 6).sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_inside_an_outer_checkpoint(reentrant):
    """Full-layer recompute around the operator (as a decoder layer's checkpoint) is exact."""
    from torch.utils.checkpoint import checkpoint

    E, k, N = 8, 2, 40
    act = _activation()
    routing_map, probs = make_routing("skew80", N, E, k, 8)
    x, grad = _inputs(N, seed=9)
    w1, w2 = _weights(E)
    plain = _run_pipelined(x, routing_map, probs, w1, w2, grad, act, None, topk=k,
                           token_budget=6)
    leaves = _leaves(x, probs, w1, w2)

    def layer(h, p, a, b):
        return pipelined_moe(h, p, routing_map, a, b, act, topk=k, token_budget=6)

    out = checkpoint(layer, *leaves, use_reentrant=reentrant)
    (out * grad).sum().backward()
    wrapped = _result(out, leaves)
    assert all(_bitwise(wrapped, plain).values()), _bitwise(wrapped, plain)


def test_module_reads_checked_config():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from types import SimpleNamespace

    from megatron.bounded.moe.experts import GroupedExperts

    E, k, N = 4, 2, 24
    cfg = _Cfg(E, k, budget=5, max_chunks=3)
    cfg.hidden_size = HIDDEN
    cfg.moe_ffn_hidden_size = FFN
    cfg.add_bias_linear = False
    cfg.params_dtype = torch.float32
    cfg.init_method = lambda w: torch.nn.init.normal_(w, std=0.1)
    cfg.output_layer_init_method = lambda w: torch.nn.init.normal_(w, std=0.1)
    cfg.use_cpu_initialization = True
    experts = GroupedExperts(E, cfg, pg_collection=ProcessGroupCollection(ep=None))
    moe = PipelinedLLEPMoE(cfg, experts)
    assert PipelinedLLEPMoE.enabled(cfg)
    assert (moe.token_budget, moe.max_chunks, moe.imbalance_threshold) == (5, 3, None)
    routing_map, probs = make_routing("balanced", N, E, k, 1)
    x, grad = _inputs(N, seed=2)
    x.requires_grad_(True)
    out = moe(x, probs, routing_map)
    (out * grad).sum().backward()
    stats = moe.last_stats
    assert stats["num_chunks"] == 3 and stats["chunk_tokens"] == 8  # cap binds: 24 / 3
    assert not stats["dropped"] and stats["max_recv_rows"] <= stats["recv_rows_bound"]
    ref = _reference(x.detach(), routing_map, probs, experts.weight1.detach(),
                     experts.weight2.detach(), grad, experts.activation, None)
    assert _rel(out.detach(), ref["out"]) < 1e-5
    assert _rel(experts.weight1.grad, ref["grads"][2]) < 1e-5
    for bad, match in ((dict(budget=0), "--pipelined-llep-token-budget C > 0"),
                       (dict(budget=-3), "--pipelined-llep-token-budget C > 0"),
                       (dict(budget=5, max_chunks=0), "--pipelined-llep-max-chunks must be >= 1"),
                       (dict(budget=5, min_spill_tokens=0), "--llep-min-spill-tokens must be"),
                       (dict(budget=5, threshold=0.5), "--llep-imbalance-threshold")):
        with pytest.raises(BoundedArgumentError, match=match):
            _Cfg(E, k, **bad)
    with pytest.raises(TypeError, match="grouped experts"):
        PipelinedLLEPMoE(cfg, SimpleNamespace(weight1=None))
    with pytest.raises(ValueError, match="chunking"):
        PipelinedLLEPMoE(cfg, experts, chunking="random")


def test_functional_input_validation():
    E, k, N = 4, 2, 8
    act = _activation()
    routing_map, probs = make_routing("balanced", N, E, k, 1)
    x, _ = _inputs(N, seed=2)
    w1, w2 = _weights(E)
    kw = dict(topk=k, token_budget=4)
    with pytest.raises(ValueError, match="routing_map"):
        pipelined_moe(x, probs, routing_map[:-1], w1, w2, act, **kw)
    with pytest.raises(ValueError, match="bool"):
        pipelined_moe(x, probs, routing_map.float(), w1, w2, act, **kw)
    with pytest.raises(ValueError, match="experts"):
        pipelined_moe(x, probs, routing_map, w1[:2], w2, act, **kw)
    with pytest.raises(ValueError, match="topk"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, topk=5, token_budget=4)
    with pytest.raises(ValueError, match="--pipelined-llep-token-budget C > 0"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, topk=k, token_budget=0)
    with pytest.raises(ValueError, match="max-chunks"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, topk=k, token_budget=4, max_chunks=0)
    with pytest.raises(ValueError, match="chunking"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, chunking="zigzag", **kw)
    with pytest.raises(ValueError, match="--llep-imbalance-threshold .*must be >= 1.0"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, imbalance_threshold=0.9, **kw)
    with pytest.raises(ValueError, match="--llep-min-spill-tokens must be >= 1"):
        pipelined_moe(x, probs, routing_map, w1, w2, act, imbalance_threshold=1.1,
                      min_spill_tokens=0, **kw)


# --------------------------------------------------------------------------------------------
# Multi-rank on gloo
# --------------------------------------------------------------------------------------------


def _scenario(rank, world, kind, N, E, k, seed, group, **kw):
    act = _activation()
    local = E // world
    routing_map, probs = make_routing(kind, N, E, k, seed * 100 + rank, ep_size=world)
    x, grad = _inputs(N, seed * 100 + 50 + rank)
    w1, w2 = _weights(E, seed=seed)
    sl = slice(rank * local, (rank + 1) * local)
    args = (x, routing_map, probs, w1[sl], w2[sl], grad, act, group)
    return args, (x, routing_map, probs, w1, w2, grad, act, group)


def _memory(fn, repeats=2):
    """Peak live bytes of ``fn``; the smaller of two runs, because gloo's worker thread drops its
    references to an all-to-all's tensors a moment after the call returns (that only ever adds
    a transient buffer to a run)."""
    peaks = []
    for _ in range(repeats):
        meter = _LiveBytes()
        with meter:
            fn()
        peaks.append(meter.peak)
    return min(peaks)


def _multi_rank_body(rank, world):
    group = dist.group.WORLD
    E, k = 8, 2
    local = E // world
    out = {"bitwise": {}, "close": {}, "rows": {}, "llep": {}}

    # (a) K = 1: bitwise equal to the unchunked static-capacity path (cf = E_p).
    for kind in ("balanced", "skew80"):
        mine, _ = _scenario(rank, world, kind, 24, E, k, 1, group)
        base = _run_unchunked(*mine, topk=k)
        one = _run_pipelined(*mine, topk=k, token_budget=24)
        out["bitwise"][kind] = {"cmp": _bitwise(one, base), "K": one["stats"]["num_chunks"]}

    # (b) K > 1, strided and contiguous, against the dense reference.
    for kind in ("balanced", "skew80", "zipf", "one_rank"):
        mine, full = _scenario(rank, world, kind, 40, E, k, 2, group)
        ref = _reference(*full)
        results = {}
        for chunking in ("strided", "contiguous"):
            res = _run_pipelined(*mine, topk=k, token_budget=7, chunking=chunking)
            results[chunking] = res
            out["close"][(kind, chunking)] = {"err": _errors(res, ref, rank, local),
                                              "stats": res["stats"]}
        # Equal N on every rank: K without the agreement collective, same bits.
        same = _run_pipelined(*mine, topk=k, token_budget=7, uniform_tokens=True)
        out["close"][(kind, "strided")]["uniform"] = _bitwise(same, results["strided"])

    # (c) Received rows per chunk, one-hot 80% and Zipf routings, larger N and many chunks;
    # "one_rank" sends every pair to rank 0, the worst case the static bound is sized for.
    for kind in ("balanced", "skew80", "zipf", "one_rank"):
        mine, _ = _scenario(rank, world, kind, 96, E, k, 3, group)
        res = _run_pipelined(*mine, topk=k, token_budget=12)
        out["rows"][kind] = {**res["stats"], "routed_pairs": int(mine[1].sum())}

    # (d) LLEP: hot expert 0 on rank 0; threshold 1.0 balances, results stay exact.
    mine, full = _scenario(rank, world, "skew80", 40, E, k, 4, group)
    ref = _reference(*full)
    for threshold in (1.0, 100.0):
        res = _run_pipelined(*mine, topk=k, token_budget=9, imbalance_threshold=threshold)
        plan = res["stats"]["llep_plan"]
        out["llep"][threshold] = {
            "err": _errors(res, ref, rank, local),
            "active": plan.active,
            "before": max(plan.rank_loads),
            "after": max(plan.balanced_rank_loads),
            "hosted": res["stats"]["hosted_experts"],
            "stats": {k_: v for k_, v in res["stats"].items() if k_ != "llep_plan"},
        }
    # K = 1 with LLEP: same numbers as without balancing up to reassociation.
    res = _run_pipelined(*mine, topk=k, token_budget=40, imbalance_threshold=1.0)
    out["llep"]["k1"] = _errors(res, ref, rank, local)

    # Two overloaded owners: copies of both hot experts, several copies on one helper possible.
    mine, full = _scenario(rank, world, "hot2", 40, E, k, 7, group)
    ref = _reference(*full)
    res = _run_pipelined(*mine, topk=k, token_budget=9, imbalance_threshold=1.0)
    plan = res["stats"]["llep_plan"]
    out["llep"]["hot2"] = {"err": _errors(res, ref, rank, local),
                           "owners": sorted({s.owner for s in plan.spills}),
                           "max_hosted": plan.max_hosted,
                           "before": max(plan.rank_loads), "after": max(plan.balanced_rank_loads),
                           "dropped": res["stats"]["dropped"]}

    # (e) Ranks with different token counts (rank r has 33 - 5r; N = 0 on no rank).
    n_r = 33 - 5 * rank
    mine, full = _scenario(rank, world, "zipf", n_r, E, k, 5, group)
    ref = _reference(*full)
    res = _run_pipelined(*mine, topk=k, token_budget=6, imbalance_threshold=1.0)
    out["uneven"] = {"err": _errors(res, ref, rank, local), "K": res["stats"]["num_chunks"],
                     "c": res["stats"]["chunk_tokens"],
                     "agreed": agree_num_chunks(n_r, 6, 10, group)}
    # A rank without tokens still takes part in every collective.
    n_r = 0 if rank == world - 1 else 12
    mine, full = _scenario(rank, world, "balanced", n_r, E, k, 6, group)
    ref = _reference(*full)
    res = _run_pipelined(*mine, topk=k, token_budget=5)
    out["empty_rank"] = {"err": _errors(res, ref, rank, local) if n_r else None,
                         "K": res["stats"]["num_chunks"]}

    # (e') Collectives of one step with equal N (K without an agreement): one all-gather of the
    # per-chunk, per-expert counts; then every chunk exchanges rows only: token rows and probs
    # in dispatch, output rows in combine (forward) and, in backward, the recomputed dispatch
    # with the output-gradient rows, then the row and prob gradients back.
    calls = {"all_gather": 0, "all_to_all_single": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    mine, _ = _scenario(rank, world, "zipf", 40, E, k, 8, group)
    for name in calls:
        setattr(dist, name, counted(name))
    try:
        res = _run_pipelined(*mine, topk=k, token_budget=7, uniform_tokens=True)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    out["collectives"] = {**calls, "K": res["stats"]["num_chunks"]}

    # (f) Live bytes in forward + backward (dispatch-mode meter), H large so rows dominate.
    H, N = 64, 128
    w_g = torch.Generator().manual_seed(9)
    w1 = torch.randn(local, H, 2 * FFN, generator=w_g) * 0.1
    w2 = torch.randn(local, FFN, H, generator=w_g) * 0.1
    act = _activation()
    peaks = {}
    for kind in ("balanced", "skew80", "zipf"):
        routing_map, probs = make_routing(kind, N, E, k, 700 + rank)
        x, grad = _inputs(N, 800 + rank, hidden=H)
        args = (x, routing_map, probs, w1, w2, grad, act, group)
        peaks[("unchunked", kind)] = _memory(lambda: _run_unchunked(*args, topk=k))
        for budget in MEMORY_BUDGETS:
            peaks[(budget, kind)] = _memory(lambda: _run_pipelined(*args, topk=k,
                                                                   token_budget=budget))
    out["peaks"] = peaks
    weights = w1.numel() + w2.numel()
    # Created by every variant: the cloned leaves and their gradients (x, probs, weights), the
    # output and the loss product; plus two weight-gradient-sized temporaries of the expert
    # backward (the masked GEMM result, and the running sum over chunks or autograd's copy).
    out["fixed_bytes"] = 4 * (2 * (N * H + N * E + weights) + 2 * N * H + 2 * weights)
    out["meta"] = {"H": H, "N": N, "E": E, "k": k, "F": FFN}
    return out


two_rank, four_rank, ranks = two_and_four_rank_fixtures(_multi_rank_body)


def test_chunks_exchange_rows_only(ranks):
    """No per-chunk count exchange: the step's one all-gather carries every chunk's sizes and
    per-expert counts (3 row all-to-alls per chunk in forward, 5 in backward)."""
    for res in ranks:
        calls = res["collectives"]
        assert calls["K"] == 6
        assert calls["all_gather"] == 1
        assert calls["all_to_all_single"] == 8 * calls["K"]


def test_k1_bitwise_equal_to_unchunked(ranks):
    for res in ranks:
        for kind, r in res["bitwise"].items():
            assert r["K"] == 1
            assert all(r["cmp"].values()), (kind, r["cmp"])


def test_k_gt_1_matches_reference(ranks):
    for res in ranks:
        for key, r in res["close"].items():
            assert r["stats"]["num_chunks"] == 6  # ceil(40 / 7)
            assert max(r["err"].values()) < 1e-5, (key, r["err"])
            assert not r["stats"]["dropped"]
            if "uniform" in r:
                assert all(r["uniform"].values()), r["uniform"]


def test_received_rows_within_bound(ranks):
    world = len(ranks)
    k = 2
    for kind in ("balanced", "skew80", "zipf", "one_rank"):
        stats = [res["rows"][kind] for res in ranks]
        for s in stats:
            assert s["num_chunks"] == 8 and s["chunk_tokens"] == 12
            assert s["recv_rows_bound"] == world * k * 12
            assert s["max_recv_rows"] <= world * k * 12
            assert s["max_send_rows"] <= k * 12
            assert not s["dropped"]
            # exact all-to-all sizes: every routed pair is sent once, no padding row
            assert s["pairs_sent"] == s["routed_pairs"]
        hottest = max(s["max_recv_rows"] for s in stats)
        if kind == "one_rank":
            # The bound is attained, exactly, on rank 0 and nowhere else; nothing dropped.
            assert stats[0]["max_recv_rows"] == world * k * 12
            assert all(s["max_recv_rows"] == 0 for s in stats[1:])
            assert all(s["max_send_rows"] == k * 12 for s in stats)
        elif kind == "skew80":
            # Expert 0's rank receives almost a full chunk of pairs from every source: the
            # instrument sees the skew, and the static bound is what keeps it in check.
            assert hottest >= world * 12 * 0.75
            assert hottest > 1.3 * world * k * 12 / world
        else:
            assert hottest >= world * k * 12 / world * 0.5


def test_llep_moves_load_and_stays_exact(ranks):
    world = len(ranks)
    for res in ranks:
        on, off = res["llep"][1.0], res["llep"][100.0]
        assert on["active"] and not off["active"]
        assert on["after"] < on["before"]
        assert off["after"] == off["before"]
        for r in (on, off):
            assert max(r["err"].values()) < 1e-5, r["err"]
            assert not r["stats"]["dropped"]
            assert r["stats"]["max_recv_rows"] <= r["stats"]["recv_rows_bound"]
        assert max(res["llep"]["k1"].values()) < 1e-5
    for res in ranks:
        h2 = res["llep"]["hot2"]
        assert max(h2["err"].values()) < 1e-5, h2["err"]
        assert not h2["dropped"]
        if world == 4:  # ranks 0 and 3 are both overloaded; 1 and 2 help both
            assert h2["owners"] == [0, 3] and h2["after"] < h2["before"]
            assert h2["max_hosted"] >= 2
    # Helpers are other ranks than expert 0's owner.
    assert ranks[0]["llep"][1.0]["hosted"] == ()
    assert any(res["llep"][1.0]["hosted"] for res in ranks[1:])
    assert sum(len(res["llep"][1.0]["hosted"]) for res in ranks) <= 8 * world


def test_ranks_with_different_token_counts(ranks):
    world = len(ranks)
    for res in ranks:
        u = res["uneven"]
        assert u["K"] == 6 and u["c"] == 6 and u["agreed"] == (6, 6)
        assert max(u["err"].values()) < 1e-5, u["err"]
        e = res["empty_rank"]
        assert e["K"] == 3
        if e["err"] is not None:
            assert max(e["err"].values()) < 1e-5, e["err"]
    assert ranks[world - 1]["empty_rank"]["err"] is None


def test_live_bytes_bounded_for_every_routing(ranks):
    world = len(ranks)
    for res in ranks:
        peaks, meta = res["peaks"], res["meta"]
        H, N, E, k, F_ = meta["H"], meta["N"], meta["E"], meta["k"], meta["F"]
        for budget in MEMORY_BUDGETS:
            bound = dispatch_live_bytes_bound(world, k, budget, H, 2 * F_, 4)
            # Exact all-to-all sizes follow the routing (a skewed chunk fills more of the hot
            # rank's receive rows), but for every routing the live set beyond the fixed tensors
            # stays within the chunk buffers' bound plus O(N * k + c * E) routing metadata.
            values = [peaks[(budget, kind)] for kind in ("balanced", "skew80", "zipf")]
            extra = max(values) - res["fixed_bytes"]
            metadata = 64 * N * k + 8 * budget * E * world
            assert extra <= bound["chunk_working_set"] + metadata, (budget, extra, bound)
        # Smaller chunks, smaller live set; the unchunked path holds the whole routed batch.
        # Compared beyond the fixed tensors (inputs, weights, gradients: the same in every path),
        # the part that shrinks about like c: K = 8 keeps well under half of K = 1 and of the
        # unchunked path.
        small, mid, whole = (peaks[(b, "balanced")] for b in sorted(MEMORY_BUDGETS))
        assert small < mid < whole
        fixed = res["fixed_bytes"]
        unchunked = peaks[("unchunked", "balanced")]
        assert small - fixed < 0.4 * (unchunked - fixed), (small, unchunked, fixed)
        assert small - fixed < 0.4 * (whole - fixed), (small, whole, fixed)


# --------------------------------------------------------------------------------------------
# GPU (marked ``gpu``; skipped without CUDA)
# --------------------------------------------------------------------------------------------

def _gpu_body(rank, world):
    """NCCL, side-stream schedule vs. the same schedule without overlap: identical bits."""
    torch.cuda.set_device(rank)
    E, k, N = 8, 2, 256
    act = _activation()
    local = E // world
    routing_map, probs = make_routing("skew80", N, E, k, 40 + rank)
    x, grad = _inputs(N, 41 + rank)
    w1, w2 = _weights(E)
    sl = slice(rank * local, (rank + 1) * local)
    dev = [t.cuda() for t in (x, routing_map, probs, w1[sl], w2[sl], grad)]
    group = dist.group.WORLD
    runs = {}
    for overlap in (True, False):
        runs[overlap] = _run_pipelined(dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], act,
                                       group, topk=k, token_budget=40, overlap=overlap,
                                       imbalance_threshold=1.0)
    torch.cuda.synchronize()
    return {"same": _bitwise(runs[True], runs[False]), "K": runs[True]["stats"]["num_chunks"]}


@pytest.mark.gpu
@requires_cuda
def test_gpu_overlap_schedule_matches_sequential():
    world = min(2, torch.cuda.device_count())
    if world < 2:
        # One GPU: the schedule still runs (EP = 1, no side stream needed), check it is exact.
        E, k, N = 8, 2, 512
        act = _activation()
        routing_map, probs = make_routing("zipf", N, E, k, 5)
        x, grad = _inputs(N, 6)
        w1, w2 = _weights(E)
        dev = [t.cuda() for t in (x, routing_map, probs, w1, w2, grad)]
        res = _run_pipelined(dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], act, None,
                             topk=k, token_budget=64)
        ref = _reference(x, routing_map, probs, w1, w2, grad, act, None)
        ours = {"out": res["out"].cpu(), "grads": [g.cpu() for g in res["grads"]]}
        assert max(_errors(ours, ref, 0, E).values()) < 1e-4
        return
    results = run_on_ranks(_gpu_body, world, backend="nccl", timeout_s=300)
    for r in results:
        assert r["K"] == 7
        assert all(r["same"].values()), r["same"]


@pytest.mark.gpu
@requires_cuda
def test_gpu_peak_memory_shrinks_with_chunks():
    """EP = 1 on one GPU: max_memory_allocated of forward + backward, K = 1 vs K = 8."""
    E, k, N, H = 8, 2, 4096, 1024
    act = _activation()
    routing_map, probs = make_routing("skew80", N, E, k, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(N, H, generator=g).cuda()
    grad = torch.randn(N, H, generator=g).cuda()
    w1 = (torch.randn(E, H, 2 * FFN, generator=g) * 0.02).cuda()
    w2 = (torch.randn(E, FFN, H, generator=g) * 0.02).cuda()
    routing_map, probs = routing_map.cuda(), probs.cuda()
    peaks = {}
    for budget in (N, N // 8):
        leaves = _leaves(x, probs, w1, w2)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = pipelined_moe(leaves[0], leaves[1], routing_map, leaves[2], leaves[3], act,
                            topk=k, token_budget=budget)
        (out * grad).sum().backward()
        torch.cuda.synchronize()
        peaks[budget] = torch.cuda.max_memory_allocated() - base
        del out, leaves
    rows_bytes = dispatch_live_bytes_bound(1, k, N // 8, H, 2 * FFN, 4)["chunk_working_set"]
    fixed = 4 * (4 * N * H + 2 * N * E + 4 * (w1.numel() + w2.numel()))
    # what every budget holds at the peak: the output and the leaves' gradients
    held = 4 * (2 * N * H + N * E + w1.numel() + w2.numel())
    assert peaks[N // 8] - held < 0.5 * (peaks[N] - held), peaks
    assert peaks[N // 8] <= fixed + rows_bytes + 64 * N * k + 8 * N * E, peaks
