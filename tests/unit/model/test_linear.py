"""megatron.bounded.model.linear: bitwise upstream's linear autograd function where it applies, and
upstream's own function for every call it does not cover."""

from __future__ import annotations

import pytest
import torch

from megatron.bounded.model import linear as lean
from tests.conftest import requires_cuda
from tests.unit.distributed import run_on_ranks

SHAPES = [((7, 2, 24), 40), ((5, 1, 16), 8), ((9, 24), 12)]  # [s, b, h] and [t, h] inputs


def _upstream(input, weight, bias):
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication,
    )

    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, False, False, False, None, None, None, 1
    )


def _outputs_and_grads(function, input, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (input, weight, bias)]
    out = function(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves if t is not None]


def _compare(device, dtype, input_shape, out_features, with_bias, transposed_grad):
    generator = torch.Generator().manual_seed(sum(input_shape) + out_features)
    input = torch.randn(input_shape, generator=generator).to(device, dtype)
    weight = torch.randn(out_features, input_shape[-1], generator=generator).to(device, dtype)
    bias = torch.randn(out_features, generator=generator).to(device, dtype) if with_bias else None
    grad = torch.randn(*input_shape[:-1], out_features, generator=generator).to(device, dtype)
    if transposed_grad:  # a non-contiguous output gradient, as a transpose's backward gives
        grad = grad.transpose(0, 1).contiguous().transpose(0, 1)
    ours = _outputs_and_grads(lean.linear, input, weight, bias, grad)
    upstream = _outputs_and_grads(_upstream, input, weight, bias, grad)
    assert len(ours) == len(upstream)
    for a, b in zip(ours, upstream):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("input_shape,out_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bitwise_upstream_on_cpu(dtype, input_shape, out_features, with_bias):
    _compare("cpu", dtype, input_shape, out_features, with_bias, transposed_grad=False)


def test_non_contiguous_output_gradient_is_bitwise_upstream():
    _compare("cpu", torch.float32, (6, 3, 16), 12, True, transposed_grad=True)


def test_input_gradient_only_when_needed():
    input = torch.randn(4, 8)
    weight = torch.randn(3, 8, requires_grad=True)
    lean.linear(input, weight).sum().backward()
    assert weight.grad is not None and input.grad is None


def test_upstream_keeps_every_call_with_communication_or_buffers():
    x = torch.ones(2, 3)
    assert lean.runs_lean(x, False, False, False, None, 1)
    assert not lean.runs_lean(x, True, False, False, None, 1)  # gradient-accumulation fusion
    assert not lean.runs_lean(x, False, True, False, None, 1)  # the input gradient's all-reduce
    assert not lean.runs_lean(x, False, False, True, None, 1)  # sequence parallel
    assert not lean.runs_lean(x, False, False, False, [], 1)  # deferred weight gradients
    assert not lean.runs_lean(x, False, False, False, None, 2)  # GTP-sharded weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not lean.runs_lean(x, False, False, False, None, 1)


def test_patch_routes_each_call_by_its_arguments():
    from megatron.bounded.upstream.layers import linear_without_tensor_parallelism

    seen = []

    def upstream(*args):
        seen.append(args[3:])
        return "upstream"

    patched = linear_without_tensor_parallelism(upstream)
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    assert torch.equal(patched(x, w, None, False, False, False), x @ w.t()) and not seen
    assert patched(x, w, None, True, False, False, None, 0, "tp", 1) == "upstream"
    assert patched(x, w, None, False, False, False, grad_output_buffer=[]) == "upstream"
    assert seen == [(True, False, False, None, 0, "tp", 1), (False, False, False, [], 0, None, 1)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bitwise_upstream_on_cuda(with_bias):
    for dtype in (torch.bfloat16, torch.float32):
        _compare("cuda", dtype, (512, 2, 256), 384, with_bias, transposed_grad=False)
        _compare("cuda", dtype, (512, 2, 256), 384, with_bias, transposed_grad=True)


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_one_rank_regions_are_the_identity_and_larger_groups_go_to_upstream():
    from megatron.bounded.upstream.layers import identity_without_tensor_parallelism

    seen = []
    for make in (identity_without_tensor_parallelism,):
        region = make(lambda input_, group: seen.append(group.size()) or "upstream")
        x = torch.randn(3, 2, requires_grad=True)
        assert region(x, group=_Group(1)) is x and not seen
        assert region(x, group=_Group(2)) == "upstream" and seen == [2]


def _region_gradients(rank, world_size):
    from megatron.core.tensor_parallel import mappings

    from megatron.bounded.upstream.layers import identity_without_tensor_parallelism

    group = torch.distributed.group.WORLD  # one rank
    equal = []
    for name in ("copy_to_tensor_model_parallel_region",
                 "reduce_from_tensor_model_parallel_region"):
        upstream = getattr(mappings, name)
        outputs, grads = [], []
        for region in (upstream, identity_without_tensor_parallelism(upstream)):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
            out = region(x, group=group)
            (out * torch.arange(12.0).view(4, 3)).sum().backward()
            outputs.append(out.detach())
            grads.append(x.grad)
        equal.append(torch.equal(*outputs) and torch.equal(*grads))
    return equal


def test_one_rank_regions_give_upstreams_values_and_gradients():
    assert run_on_ranks(_region_gradients, 1) == [[True, True]]
