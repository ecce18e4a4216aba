"""The router's softmax top-k routing in one autograd node (megatron/bounded/moe/topk_routing.py):
routing probabilities, map, logged load-balancing loss and the gradients of the logits and of the
router weight are bitwise upstream's ``TopKRouter.routing``; other configurations take upstream's
path; the chunked-recompute contexts keep their counts; fewer aten ops than upstream."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

HIDDEN = 16
# (sequence, batch, experts, top-k)
SHAPES = ((24, 2, 8, 2), (33, 1, 6, 3), (20, 3, 16, 4), (9, 2, 8, 8))
# router weights: random; duplicated expert rows (tied logits in every token); one row for all
# experts (all-equal logits); large (softmax probabilities underflow to zero)
WEIGHT_KINDS = ("random", "tied_pairs", "equal_rows", "spread")
# (training, gradients enabled)
MODES = ((True, True), (True, False), (False, True), (False, False))
AUX_LOSS_COEFF = 1e-2
# config overrides within the common case
COMMON_SETTINGS = {
    "aux_loss": {},
    "aux_loss_per_token": {"calculate_per_token_loss": True},
    "aux_loss_coeff_zero": {"moe_aux_loss_coeff": 0.0},
    "no_load_balancing": {"moe_router_load_balancing_type": "none"},
}
BACKWARD_SCALE = 0.375  # MoEAuxLossAutoScaler's scale, as the training loop sets it


def _config(experts: int, topk: int, dtype: torch.dtype, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=experts,
        moe_router_topk=topk, moe_ffn_hidden_size=8, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=AUX_LOSS_COEFF, use_cpu_initialization=True, add_bias_linear=False,
        params_dtype=dtype,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def _router(config, is_mtp_layer: bool = False):
    """Our router over a tensor-and-context-parallel group of all ranks (gloo, or NCCL)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bounded.moe.chunk_routing import ChunkedRoutingTopKRouter

    world = dist.group.WORLD
    groups = ProcessGroupCollection(tp=world, cp=world, tp_cp=world, tp_dp_cp=world)
    router = ChunkedRoutingTopKRouter(config, pg_collection=groups, is_mtp_layer=is_mtp_layer)
    router.set_layer_number(1)  # the metrics tracker records only numbered layers
    return router


def _set_weight(router, kind: str, generator: torch.Generator) -> None:
    experts, hidden = router.weight.shape
    weight = torch.randn(experts, hidden, generator=generator)
    if kind == "tied_pairs":
        weight[1::2] = weight[0::2][: experts // 2]
    elif kind == "equal_rows":
        weight[:] = weight[0]
    elif kind == "spread":
        weight *= 60.0
    elif kind != "random":
        raise ValueError(kind)
    with torch.no_grad():
        router.weight.copy_(weight)


def _spy_fast_routing() -> list:
    """Count the calls of softmax_topk_routing made by the router from now on (this process)."""
    from megatron.bounded.moe import chunk_routing

    calls = []
    fast = chunk_routing.softmax_topk_routing

    def counted(*args, **kwargs):
        calls.append(1)
        return fast(*args, **kwargs)

    chunk_routing.softmax_topk_routing = counted
    return calls


def _route(routing, router, x, grad_probs, training: bool, grad_enabled: bool,
           padding_mask=None) -> dict:
    """``routing(router, logits)`` from the gating of ``x``; its outputs, logged metrics and, with
    gradients, the gradients of the logits and of the router weight from ``grad_probs``."""
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_metrics_tracker,
        router_gating_linear,
    )

    get_moe_metrics_tracker().clear()
    router.train(training)
    router.weight.grad = None
    with torch.set_grad_enabled(grad_enabled):
        logits = router_gating_linear(x, router.weight, None, x.dtype)
        if grad_enabled:
            logits.retain_grad()
        kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
        probs, routing_map = routing(router, logits, **kwargs)
    result = {"probs": probs.detach(), "routing_map": routing_map}
    if grad_enabled:
        probs.backward(grad_probs)
        result.update(logits_grad=logits.grad, weight_grad=router.weight.grad.clone())
    for name, entry in get_moe_metrics_tracker().metrics.items():
        result[f"metric {name}"] = entry.values.clone()
    return result


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _mismatches(got: dict, expected: dict) -> list:
    """Names of the results that differ in any bit (or exist on one side only)."""
    if got.keys() != expected.keys():
        return [f"keys {sorted(got)} != {sorted(expected)}"]
    return [
        name for name in expected
        if got[name].dtype != expected[name].dtype or got[name].shape != expected[name].shape
        or not torch.equal(_bits(got[name]), _bits(expected[name]))
    ]


def _upstream_and_ours(router, x, grad_probs, training, grad_enabled, padding_mask=None):
    from megatron.core.transformer.moe.router import TopKRouter

    upstream = _route(TopKRouter.routing, router, x, grad_probs, training, grad_enabled,
                      padding_mask)
    ours = _route(type(router).routing, router, x, grad_probs, training, grad_enabled,
                  padding_mask)
    return upstream, ours


def _compare_cases(rank, world_size, device: str, dtypes: tuple, setting: str) -> list:
    """Every shape, weight kind and mode: [(case, mismatching results, fast path used)]."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    calls = _spy_fast_routing()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(BACKWARD_SCALE, device=device))
    generator = torch.Generator().manual_seed(100 + rank)
    outcomes = []
    for dtype in dtypes:
        for seq, batch, experts, topk in SHAPES:
            config = _config(experts, topk, dtype, **COMMON_SETTINGS[setting])
            router = _router(config).to(device)
            for kind in WEIGHT_KINDS:
                _set_weight(router, kind, generator)
                x = torch.randn(seq, batch, HIDDEN, generator=generator).to(device, dtype)
                grad_probs = torch.randn(seq * batch, experts, generator=generator)
                grad_probs = grad_probs.to(device, dtype)
                for training, grad_enabled in MODES:
                    before = len(calls)
                    upstream, ours = _upstream_and_ours(router, x, grad_probs, training,
                                                        grad_enabled)
                    case = (str(dtype), seq, batch, experts, topk, kind, training, grad_enabled)
                    outcomes.append((case, _mismatches(ours, upstream), len(calls) > before))
    return outcomes


def _assert_all_equal(outcomes: list) -> None:
    failed = [(case, names) for case, names, _ in outcomes if names]
    assert not failed, f"results differing from upstream: {failed}"
    assert all(used for _, _, used in outcomes), "the fast routing was not used"


@pytest.mark.parametrize("setting", sorted(COMMON_SETTINGS))
def test_routing_is_bitwise_upstream_on_cpu(setting):
    dtypes = (torch.bfloat16, torch.float32, torch.float16, torch.float64)
    (outcomes,) = run_on_ranks(_compare_cases, 1, args=("cpu", dtypes, setting), timeout_s=300)
    _assert_all_equal(outcomes)


def _compare_over_two_ranks(rank, world_size) -> list:
    """The load-balancing counts all-reduced over a tensor-parallel group of two ranks."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    calls = _spy_fast_routing()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(BACKWARD_SCALE))
    generator = torch.Generator().manual_seed(7 + rank)
    outcomes = []
    for dtype in (torch.bfloat16, torch.float32):
        router = _router(_config(8, 2, dtype))
        _set_weight(router, "random", torch.Generator().manual_seed(3))  # same on both ranks
        x = torch.randn(24, 2, HIDDEN, generator=generator).to(dtype)
        grad_probs = torch.randn(48, 8, generator=generator).to(dtype)
        upstream, ours = _upstream_and_ours(router, x, grad_probs, True, True)
        outcomes.append((str(dtype), _mismatches(ours, upstream), len(calls) == 1))
        calls.clear()
    return outcomes


def test_routing_is_bitwise_upstream_with_tensor_parallel_counts():
    for outcomes in run_on_ranks(_compare_over_two_ranks, 2, timeout_s=120):
        _assert_all_equal(outcomes)


# settings outside the common case, each alone: (config overrides, router keyword arguments)
FALLBACK_SETTINGS = {
    "pre_softmax": ({"moe_router_pre_softmax": True}, {}),
    "sigmoid": ({"moe_router_score_function": "sigmoid"}, {}),
    "capacity_factor": ({"moe_expert_capacity_factor": 1.0,
                         "moe_token_dispatcher_type": "alltoall"}, {}),
    "z_loss": ({"moe_z_loss_coeff": 1e-3}, {}),
    "group_topk": ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, {}),
    "scaling_factor": ({"moe_router_topk_scaling_factor": 2.5}, {}),
    "seq_aux_loss": ({"moe_router_load_balancing_type": "seq_aux_loss"}, {}),
    "repeated_mtp_layer": ({"mtp_num_layers": 1, "mtp_use_repeated_layer": True},
                           {"is_mtp_layer": True}),
    "padding_mask": ({}, {}),
    "deterministic": ({}, {}),
}


def _compare_fallback(rank, world_size, name: str) -> tuple:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    overrides, router_kwargs = FALLBACK_SETTINGS[name]
    calls = _spy_fast_routing()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(BACKWARD_SCALE))
    generator = torch.Generator().manual_seed(5)
    router = _router(_config(8, 2, torch.float32, **overrides), **router_kwargs)
    _set_weight(router, "random", generator)
    x = torch.randn(12, 2, HIDDEN, generator=generator)
    grad_probs = torch.randn(24, 8, generator=generator)
    padding_mask = None
    if name == "padding_mask":
        padding_mask = torch.zeros(12, 2, dtype=torch.bool)
        padding_mask[-3:] = True
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(name == "deterministic")
    try:
        upstream, ours = _upstream_and_ours(router, x, grad_probs, True, True, padding_mask)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return _mismatches(ours, upstream), len(calls)


@pytest.mark.parametrize("name", sorted(FALLBACK_SETTINGS))
def test_other_settings_take_upstreams_path(name):
    (result,) = run_on_ranks(_compare_fallback, 1, args=(name,), timeout_s=120)
    mismatches, fast_calls = result
    assert not mismatches, f"{name}: results differing from upstream: {mismatches}"
    assert fast_calls == 0, f"{name}: the fast routing was used"


def _compare_chunked_contexts(rank, world_size, dtype: torch.dtype) -> dict:
    """Counts collected chunk by chunk and the routing of each chunk under ``applying`` (loss
    from the micro-batch's counts): ours against upstream's routing in the same contexts."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        compute_routing_scores_for_aux_loss,
        router_gating_linear,
    )
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron.bounded.moe.chunk_routing import RoutingCounts, applying, collecting

    calls = _spy_fast_routing()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(BACKWARD_SCALE))
    generator = torch.Generator().manual_seed(11)
    router = _router(_config(8, 2, dtype))
    _set_weight(router, "tied_pairs", generator)
    router.train()
    chunks = [torch.randn(rows, 1, HIDDEN, generator=generator).to(dtype) for rows in (7, 7, 3)]
    ours, reference = RoutingCounts(), RoutingCounts()
    with torch.no_grad(), collecting(ours):
        for x in chunks:
            logits = router_gating_linear(x, router.weight, None, dtype)
            router.routing(logits)
            routing_map, _ = compute_routing_scores_for_aux_loss(logits.view(-1, 8), 2, "softmax")
            reference.add(routing_map, router.tp_cp_group)  # what the router added before
    ours.finalize()
    reference.finalize()
    outcome = {
        "counts": torch.equal(ours.global_counts, reference.global_counts)
        and ours.global_counts.dtype == reference.global_counts.dtype
        and (ours.local_tokens, ours.total_tokens)
        == (reference.local_tokens, reference.total_tokens),
        "mismatches": [],
    }
    for x in chunks:
        grad_probs = torch.randn(x.shape[0], 8, generator=generator).to(dtype)
        with applying(ours):
            upstream = _route(TopKRouter.routing, router, x, grad_probs, True, True)
            mine = _route(type(router).routing, router, x, grad_probs, True, True)
        outcome["mismatches"] += _mismatches(mine, upstream)
    outcome["fast_calls"] = len(calls)
    return outcome


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_chunked_contexts_keep_upstreams_results(dtype):
    (outcome,) = run_on_ranks(_compare_chunked_contexts, 1, args=(dtype,), timeout_s=120)
    assert outcome["counts"], "the collected counts differ from upstream's routing maps"
    assert not outcome["mismatches"], outcome["mismatches"]
    assert outcome["fast_calls"] == 6  # 3 chunks collected, 3 applied


class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that reach the kernels (autograd's backward included)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _autograd_nodes(tensor: torch.Tensor) -> int:
    """Nodes of ``tensor``'s graph (its leaves' AccumulateGrad excluded)."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return len(seen)


def _count_ops(rank, world_size, tokens: int, experts: int, topk: int) -> dict:
    """aten ops of the routing's forward and backward (from leaf logits), and its autograd
    nodes, for upstream's and our routing in training with the load-balancing loss."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(BACKWARD_SCALE))
    router = _router(_config(experts, topk, torch.bfloat16))
    router.train()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens // 2, 2, experts, generator=generator).to(torch.bfloat16)
    grad_probs = torch.randn(tokens, experts, generator=generator).to(torch.bfloat16)
    counts = {}
    for name, routing in (("upstream", TopKRouter.routing), ("ours", type(router).routing)):
        leaf = logits.clone().requires_grad_()
        with _AtenOps() as forward:
            probs, _ = routing(router, leaf)
        nodes = _autograd_nodes(probs)
        with _AtenOps() as backward:
            probs.backward(grad_probs)
        counts[name] = {"forward": sum(forward.ops.values()),
                        "backward": sum(backward.ops.values()), "nodes": nodes}
    return counts


def test_fewer_aten_ops_and_autograd_nodes_than_upstream():
    (counts,) = run_on_ranks(_count_ops, 1, args=(4096, 32, 4), timeout_s=120)
    upstream, ours = counts["upstream"], counts["ours"]
    message = f"aten ops and autograd nodes: upstream {upstream}, ours {ours}"
    assert ours["forward"] + ours["backward"] < upstream["forward"] + upstream["backward"], message
    assert ours["forward"] < upstream["forward"], message
    assert ours["backward"] < upstream["backward"], message
    assert ours["nodes"] < upstream["nodes"], message


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("setting", sorted(COMMON_SETTINGS))
def test_routing_is_bitwise_upstream_on_cuda(setting):
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    (outcomes,) = run_on_ranks(_compare_cases, 1, args=("cuda", dtypes, setting),
                               backend="nccl", timeout_s=300, fresh_process=True)
    _assert_all_equal(outcomes)
