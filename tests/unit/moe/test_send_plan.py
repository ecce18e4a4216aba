"""The static send plan and the send rows' probabilities (megatron.bounded.moe.dispatch.send_plan).

On CPU both entry points return the eager reference. The Triton kernels, run in Triton's
interpreter on CPU, equal the reference field by field (``slot_expert`` on used slots; on unused
ones the documented choice) for balanced, skewed and partial routings, 1, 2 and 4 ranks, 8 to 64
experts and capacities that drop, fit exactly, hold N·k rows or none; the probabilities forward
and backward bitwise. On the GPU the CUDA path is checked the same way.
"""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.moe.dispatch.send_plan import (
    gather_send_probs,
    gather_send_probs_reference,
    plan_static_send,
    plan_static_send_reference,
)
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks
from tests.unit.routing import make_routing

SLOT_FIELDS = ("slot_valid", "slot_keep", "slot_rows")
COUNT_FIELDS = ("send_counts", "routed_counts", "overflow")
ROW_FIELDS = ("row_pair", "row_token", "row_valid")
SIZES = ("num_tokens", "topk", "ep_size", "num_local_experts", "capacity", "can_drop",
         "num_send_rows")


def _partial(routing_map, seed):
    """``routing_map`` with about a third of its pairs removed and token 0 routed nowhere: tokens
    with 0 to k - 1 routed experts, whose unused slots are invalid."""
    generator = torch.Generator().manual_seed(seed)
    removed = torch.rand(routing_map.shape, generator=generator) < 0.35
    partial = routing_map & ~removed
    partial[0] = False
    return partial


def _slab_loads(routing_map, ep_size):
    return routing_map.view(routing_map.shape[0], ep_size, -1).sum(dim=(0, 2))


def _capacities(routing_map, topk, ep_size, regimes):
    """Slab rows for each regime: ``none`` (0), ``drop`` (half the fullest slab), ``exact`` (the
    fullest slab), ``all`` (N·k: no drop arithmetic), ``more`` (N·k + 5)."""
    fullest = int(_slab_loads(routing_map, ep_size).max())
    all_pairs = routing_map.shape[0] * topk
    rows = {"none": 0, "drop": fullest // 2, "exact": fullest, "all": all_pairs,
            "more": all_pairs + 5}
    return sorted({rows[regime] for regime in regimes})


EVERY_REGIME = ("none", "drop", "exact", "all", "more")


def _cases():
    """(name, routing_map, topk, ep_size, capacity) for balanced, skewed and partial routings."""
    balanced, _ = make_routing("balanced", 150, 8, 2, 0)
    skew, _ = make_routing("skew", 150, 8, 3, 1)
    zipf, _ = make_routing("zipf", 150, 64, 8, 2)
    routings = [  # (name, routing map, topk, EP sizes, capacity regimes)
        ("balanced", balanced, 2, (1, 2, 4), EVERY_REGIME),
        ("balanced partial", _partial(balanced, 7), 2, (1, 2, 4), EVERY_REGIME),
        ("skew", skew, 3, (1, 2), EVERY_REGIME),
        ("skew partial", _partial(skew, 7), 3, (1, 2), EVERY_REGIME),
        ("zipf E=64", zipf, 8, (4,), ("drop", "exact", "all")),
        ("zipf E=64 partial", _partial(zipf, 7), 8, (1,), ("none", "drop", "exact", "all")),
        # k = 6; 12 experts per rank (not powers of two)
        ("E=64 k=6 partial", _partial(make_routing("balanced", 37, 64, 6, 3)[0], 7), 6, (2,),
         ("drop", "all")),
        ("E=24 partial", _partial(make_routing("balanced", 90, 24, 3, 4)[0], 7), 3, (2,),
         ("drop", "exact", "all")),
        # a token routed to more than k experts (the top-3 map planned for k = 2)
        ("over-routed", skew, 2, (2,), ("drop", "all")),
        # more than one step of the per-expert count kernel
        ("N=4500 partial", _partial(make_routing("balanced", 4500, 8, 2, 5)[0], 7), 2, (2,),
         ("drop", "all")),
    ]
    return [
        (f"{name} ep={ep_size} C={capacity}", routing_map, topk, ep_size, capacity)
        for name, routing_map, topk, ep_sizes, regimes in routings
        for ep_size in ep_sizes
        for capacity in _capacities(routing_map, topk, ep_size, regimes)
    ]


def _unused_slot_experts(routing_map, topk):
    """``slot_expert`` as the kernels define it: the routed experts in ascending order, then the
    unrouted ones in ascending order."""
    num_experts = routing_map.shape[1]
    score = routing_map.to(torch.int64) * torch.arange(num_experts, 0, -1)
    return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]


def assert_same_plan(plan, reference, routing_map, name="", exact_slot_expert=True):
    """Every field of ``plan`` equals ``reference``'s (same dtypes and shapes); ``slot_expert``
    on used slots (and on unused ones too when ``exact_slot_expert``, else as documented)."""
    for size in SIZES:
        assert getattr(plan, size) == getattr(reference, size), (name, size)
    for field in ("slot_expert",) + SLOT_FIELDS + COUNT_FIELDS + ROW_FIELDS:
        got, expected = getattr(plan, field), getattr(reference, field)
        assert got.dtype == expected.dtype and got.shape == expected.shape, (name, field)
        assert got.device == expected.device, (name, field)
        if field != "slot_expert":
            assert torch.equal(got, expected), (name, field)
    used = reference.slot_valid
    assert torch.equal(plan.slot_expert[used], reference.slot_expert[used]), name
    if exact_slot_expert:
        assert torch.equal(plan.slot_expert, reference.slot_expert), name
    else:
        expected = _unused_slot_experts(routing_map.cpu(), reference.topk)
        assert torch.equal(plan.slot_expert.cpu(), expected), name


# --------------------------------------------------------------------------------------------
# CPU: the reference
# --------------------------------------------------------------------------------------------


def test_cases_cover_every_regime():
    none = dropped = exact = no_drop = partial = 0
    for _, routing_map, topk, ep_size, capacity in _cases():
        fullest = int(_slab_loads(routing_map, ep_size).max())
        none += capacity == 0
        dropped += 0 < capacity < fullest
        exact += capacity == fullest
        no_drop += capacity >= routing_map.shape[0] * topk
        partial += bool((routing_map.sum(dim=1) < topk).any())
    assert none and dropped and exact and no_drop and partial
    # the unused-slot rule agrees with the reference on every used slot
    routing_map = _partial(make_routing("balanced", 50, 8, 3, 0)[0], 1)
    plan = plan_static_send_reference(routing_map, 3, 2, 40)
    assert bool((~plan.slot_valid).any())
    expected = _unused_slot_experts(routing_map, 3)
    assert torch.equal(expected[plan.slot_valid], plan.slot_expert[plan.slot_valid])


def test_cpu_returns_the_reference_plan():
    for name, routing_map, topk, ep_size, capacity in _cases()[::3]:
        plan = plan_static_send(routing_map, topk, ep_size, capacity)
        reference = plan_static_send_reference(routing_map, topk, ep_size, capacity)
        assert_same_plan(plan, reference, routing_map, name)
        if not plan.can_drop:
            assert not plan.overflow.any()


def test_bad_arguments_raise():
    routing_map = make_routing("balanced", 10, 8, 2, 0)[0]
    for capacity in (None, -1):
        with pytest.raises(ValueError, match="capacity >= 0"):
            plan_static_send(routing_map, 2, 2, capacity)
    with pytest.raises(ValueError, match="2-D bool"):
        plan_static_send(routing_map.to(torch.int32), 2, 2, 4)
    with pytest.raises(ValueError, match="do not split"):
        plan_static_send(routing_map, 2, 3, 4)
    with pytest.raises(ValueError, match="exceeds the number of experts"):
        plan_static_send(routing_map, 9, 2, 4)


def test_cpu_probs_are_the_reference():
    routing_map, probs = make_routing("skew", 40, 8, 2, 0)
    plan = plan_static_send_reference(routing_map, 2, 2, 30)
    assert torch.equal(gather_send_probs(probs, plan), gather_send_probs_reference(probs, plan))


# --------------------------------------------------------------------------------------------
# The kernels, in Triton's interpreter
# --------------------------------------------------------------------------------------------


def _plan_body(rank, world_size):
    from megatron.bounded.moe.dispatch import send_plan as module

    # the kernels must write every element the plan holds: hand them garbage, not zeros
    empty = torch.empty
    module.torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).fill_(7)
    for name, routing_map, topk, ep_size, capacity in _cases():
        plan = module._launch_plan(routing_map, topk, ep_size, capacity)
        reference = module.plan_static_send_reference(routing_map, topk, ep_size, capacity)
        assert_same_plan(plan, reference, routing_map, name, exact_slot_expert=False)
    return True


def test_plan_kernels_equal_the_reference(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_plan_body, 1, fresh_process=True) == [True]


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _check_probs(module, routing_map, probs, topk, ep_size, capacity, fused):
    """Forward and backward of the fused gather against the reference, bitwise; the padding
    rows' gradient is NaN (the experts leave it unspecified)."""
    plan = module.plan_static_send_reference(routing_map, topk, ep_size, capacity)
    generator = torch.Generator().manual_seed(capacity)
    grad_send = torch.randn(plan.num_send_rows, generator=generator).to(probs.dtype)
    grad_send = grad_send.to(probs.device)
    grad_send[~plan.row_valid] = float("nan")
    results = []
    for gather in (fused, module.gather_send_probs_reference):
        leaf = probs.detach().clone().requires_grad_(True)
        send_probs = gather(leaf, plan)
        send_probs.backward(grad_send)
        results.append((send_probs.detach(), leaf.grad))
    (out, grad), (expected_out, expected_grad) = results
    assert out.dtype == expected_out.dtype and torch.equal(_bits(out), _bits(expected_out))
    assert grad.dtype == expected_grad.dtype and torch.equal(_bits(grad), _bits(expected_grad))
    assert not torch.isnan(grad).any()


def _probs_body(rank, world_size):
    from megatron.bounded.moe.dispatch import send_plan as module

    def fused(probs, plan):
        return module._GatherSendProbs.apply(
            probs, plan.slot_expert, plan.slot_rows, plan.slot_keep, plan.row_pair,
            plan.row_valid,
        )

    for dtype in (torch.float32, torch.bfloat16):
        for kind, num_experts, topk, ep_size in (("skew", 8, 3, 2), ("zipf", 64, 8, 4)):
            routing_map, probs = make_routing(kind, 150, num_experts, topk, 0)
            routing_map = _partial(routing_map, 3)
            probs = (probs * routing_map).to(dtype)
            fullest = int(_slab_loads(routing_map, ep_size).max())
            for capacity in (1, fullest // 2, fullest, 150 * topk):
                _check_probs(module, routing_map, probs, topk, ep_size, capacity, fused)
    return True


def test_probs_kernels_are_bitwise_the_reference(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the spawned process defines the kernel
    assert run_on_ranks(_probs_body, 1, fresh_process=True) == [True]


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
def test_gpu_plan_and_probs_equal_the_reference():
    from megatron.bounded.moe.dispatch import send_plan as module

    cases = _cases() + [
        (f"balanced N=4096 E=32 C={capacity}", make_routing("balanced", 4096, 32, 4, 9)[0], 4, 1,
         capacity)
        for capacity in (0, 4096, 5462, 16384)
    ] + [("zipf N=65536 E=256 ep=8", make_routing("zipf", 65536, 256, 8, 10)[0], 8, 8, 70000)]
    for name, routing_map, topk, ep_size, capacity in cases:
        routing_map = routing_map.cuda()
        plan = plan_static_send(routing_map, topk, ep_size, capacity)
        reference = plan_static_send_reference(routing_map, topk, ep_size, capacity)
        # CUDA's top-k orders the unused slots' experts its own way
        assert_same_plan(plan, reference, routing_map, name, exact_slot_expert=False)
    routing_map, probs = make_routing("skew", 3000, 32, 4, 11, ep_size=2)
    routing_map, probs = _partial(routing_map, 12).cuda(), probs.cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for capacity in (2000, 6000):
            _check_probs(module, routing_map, probs.to(dtype), 4, 2, capacity,
                         module.gather_send_probs)
