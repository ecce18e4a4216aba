"""The experts' fc1 weight gradient handed to the dispatch exchange
(megatron.bounded.moe.wgrad_handoff).

Single-process tests check what the pending computation holds and that it gives the experts' own
gradient bitwise; two- and four-rank gloo tests check that the whole dispatch -> experts ->
combine backward is bitwise unchanged by the handoff and that the pending GEMM runs between the
start and the wait of the dispatch's backward exchange.  The time it saves on GPUs is measured by
``tools/benchmarks/bench_moe_dispatch.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.bounded.moe.experts import _Activation, grouped_mlp
from megatron.bounded.moe.wgrad_handoff import ExpertWeightGradOverlap, WeightGradHandoff
from tests.unit.comparisons import dispatch_experts_combine
from tests.unit.distributed import run_on_ranks

HIDDEN, FFN = 16, 8


def _activation():
    cfg = types.SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                glu_linear_offset=0.0, activation_func_clamp_value=None)
    return _Activation(cfg)


def _expert_case(counts, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + pad
    x = torch.randn(rows, HIDDEN, generator=g)
    probs = torch.rand(rows, generator=g)
    w1 = torch.randn(len(counts), HIDDEN, 2 * FFN, generator=g) * 0.3
    w2 = torch.randn(len(counts), FFN, HIDDEN, generator=g) * 0.3
    grad = torch.randn(rows, HIDDEN, generator=g)
    return x, torch.tensor(counts), probs, w1, w2, grad


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def test_pending_gradient_holds_only_the_input_rows_and_fc1_gradient():
    x, counts, probs, w1, w2, grad = _expert_case([3, 0, 5, 2], pad=4)
    valid = int(counts.sum())
    act = _activation()
    plain = _leaves(x, probs, w1, w2)
    grouped_mlp(plain[0], counts, plain[1], plain[2], plain[3], act).backward(grad)

    handed = _leaves(x, probs, w1, w2)
    handoff = WeightGradHandoff((handed[2],))
    grouped_mlp(handed[0], counts, handed[1], handed[2], handed[3], act,
                wgrad_handoff=handoff).backward(grad)
    # The experts' backward gave every gradient but weight1's, bitwise as without the handoff.
    assert handed[2].grad is None
    for i in (0, 1, 3):
        assert torch.equal(handed[i].grad[:valid] if i < 2 else handed[i].grad,
                           plain[i].grad[:valid] if i < 2 else plain[i].grad), i
    # What the pending GEMM keeps alive: x [R, H] and d fc1 [R, 2F] (plus the [E] offsets).
    held = [c.cell_contents for c in handoff._pending.__closure__
            if isinstance(c.cell_contents, torch.Tensor)]
    big = sorted(tuple(t.shape) for t in held if t.dim() == 2)
    assert big == sorted([(x.shape[0], HIDDEN), (x.shape[0], 2 * FFN)])
    assert all(t.dim() == 2 or t.numel() == len(counts) for t in held)
    (grad_w1,) = handoff.run()
    assert grad_w1.dtype == w1.dtype and torch.equal(grad_w1, plain[2].grad)
    assert handoff._pending is None and handoff.run() == (None,)


def test_handoff_is_checked():
    x, counts, probs, w1, w2, _ = _expert_case([2, 2], pad=0)
    with pytest.raises(ValueError, match=r"\(weight1,\)"):
        grouped_mlp(x, counts, probs, w1, w2, _activation(), wgrad_handoff=WeightGradHandoff((w2,)))
    handoff = WeightGradHandoff((w1,))
    handoff.defer(lambda: (w1,))
    with pytest.raises(RuntimeError, match="one pending"):
        handoff.defer(lambda: (w1,))
    bad = WeightGradHandoff((w1,))
    bad.defer(lambda: (w1, w2))
    with pytest.raises(RuntimeError, match="2 gradients for 1"):
        bad.run()


def test_overlap_opens_one_handoff_per_forward_for_weight1():
    experts = types.SimpleNamespace(weight1=torch.nn.Parameter(torch.zeros(2, 4, 4)))
    overlap = ExpertWeightGradOverlap(experts)
    assert overlap.take() is None
    first = overlap.open()
    assert first.params == (experts.weight1,)
    assert overlap.take() is first and overlap.take() is None
    overlap.open()
    second = overlap.open()  # an untaken handoff is replaced
    assert overlap.take() is second


# --------------------------------------------------------------------------------------------
# Multi-rank on gloo: the dispatch round trip with and without the handoff
# --------------------------------------------------------------------------------------------


def _round_trip_body(rank, world_size, factor):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bounded.kernels import collectives
    from megatron.bounded.moe.dispatch import token_dispatcher as td

    num_experts, topk, num_tokens = 4 * world_size, 2, 24
    local = num_experts // world_size
    cfg = types.SimpleNamespace(num_moe_experts=num_experts, moe_router_topk=topk,
                                moe_expert_rank_capacity_factor=factor)
    g = torch.Generator().manual_seed(10 + rank)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    val, idx = logits.softmax(-1).topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(num_tokens, num_experts).scatter(1, idx, val)
    x = torch.randn(num_tokens, 1, HIDDEN, generator=g)
    grad = torch.randn(num_tokens, 1, HIDDEN, generator=g)
    w = torch.Generator().manual_seed(99)
    w1 = torch.randn(local, HIDDEN, 2 * FFN, generator=w) * 0.3
    w2 = torch.randn(local, FFN, HIDDEN, generator=w) * 0.3
    act = _activation()

    events = []
    start, run = collectives.start_all_to_all, WeightGradHandoff.run

    class _LoggedWork:
        def __init__(self, work, rows):
            self.work, self.rows = work, rows

        def wait(self):
            events.append(("wait", self.rows))
            return self.work.wait()

    def logged_start(t, *args):
        out, work = start(t, *args)
        events.append(("start", t.shape[0]))
        return out, _LoggedWork(work, t.shape[0])

    def logged_run(self):
        events.append(("run", self._pending is not None))
        return run(self)

    collectives.start_all_to_all = logged_start
    WeightGradHandoff.run = logged_run

    def step(overlap: bool):
        dispatcher = td.StaticCapacityTokenDispatcher(
            local, list(range(rank * local, (rank + 1) * local)), cfg,
            ProcessGroupCollection(ep=dist.group.WORLD))
        leaves = _leaves(x, probs, w1, w2)
        link = ExpertWeightGradOverlap(types.SimpleNamespace(weight1=leaves[2]))
        dispatcher.wgrad_overlap = link if overlap else None

        def experts(rows, tokens_per_expert, row_probs):
            return grouped_mlp(rows, tokens_per_expert, row_probs, leaves[2], leaves[3], act,
                               wgrad_handoff=link.take() if overlap else None)

        y, _, _ = dispatch_experts_combine(dispatcher, leaves[0], routing_map, leaves[1], experts)
        events.clear()
        (y * grad).sum().backward()
        return y.detach(), [t.grad for t in leaves], list(events)

    try:
        plain_out, plain_grads, plain_events = step(overlap=False)
        out, grads, handoff_events = step(overlap=True)
    finally:
        collectives.start_all_to_all, WeightGradHandoff.run = start, run
    return {
        "bitwise": torch.equal(out, plain_out)
        and all(torch.equal(a, b) for a, b in zip(grads, plain_grads)),
        "plain_events": plain_events,
        "handoff_events": handoff_events,
    }


@pytest.mark.parametrize("world_size,factor", [(2, 2.0), (4, 1.0), (2, None)])
def test_round_trip_bitwise_and_the_gemm_runs_during_the_exchange(world_size, factor):
    for rank, res in enumerate(run_on_ranks(_round_trip_body, world_size, args=(factor,))):
        assert res["bitwise"], rank
        assert not any(kind == "run" for kind, _ in res["plain_events"])
        events = res["handoff_events"]
        runs = [i for i, (kind, _) in enumerate(events) if kind == "run"]
        # One pending GEMM, run exactly once, after an exchange started and before it is awaited.
        assert len(runs) == 1 and events[runs[0]][1] is True, events
        i = runs[0]
        assert events[i - 1][0] == "start" and events[i + 1] == ("wait", events[i - 1][1]), events
