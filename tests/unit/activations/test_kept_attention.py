"""--chunked-recompute-keep-attention: the recompute takes the attention tensors the forward kept
instead of running attention again. On CPU in float64 with full recompute and the attention
sublayer in chunks: losses and every gradient bitwise those of the recomputing model, attention's
forward run once per layer instead of twice, the store holding each layer's K, V, output and
log-sum-exp until its recompute and empty after the backward (host: copied out in forward, one
layer copied back ahead in backward). The budget's terms and ``auto``'s choice; bad settings in
test_bad_input.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import (
    keep_upstream_checkpoint_on_cpu,
    keep_upstream_rotary_on_cpu,
    requires_cuda,
    small_bounded_gpt,
)
from tests.unit.distributed import run_on_ranks
from tests.unit.budget.test_budget import N, small
from megatron.bounded.units import GB, GiB

SEQ, BATCH, VOCAB, CHUNK = 24, 1, 64, 8


def _model(keep: str, experts):
    moe = dict(
        num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-1,
        bounded_moe_backend="torch", moe_grouped_gemm=False, pipelined_llep=True,
        pipelined_llep_token_budget=4,
    ) if experts else {}
    return small_bounded_gpt(
        SEQ, VOCAB, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1, chunked_recompute_tokens=CHUNK, chunked_recompute_attention=True,
        chunked_recompute_keep_attention=keep, **moe,
    )


def _batch():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(BATCH, SEQ)


def _step(keep: str, experts):
    """(losses, gradients, attention forwards run, the store's figures after the forward and
    after the backward) of one training step."""
    from megatron.bounded.activations import chunked_attention
    from megatron.bounded.activations.kept_attention import kept_attention

    store = kept_attention()
    store.clear()
    store.stats.update(dict.fromkeys(store.stats, 0))
    model = _model(keep, experts)
    model.train()
    forwards = [0]
    attention_forward = chunked_attention.attention_forward

    def counted(*args, **kwargs):
        forwards[0] += 1
        return attention_forward(*args, **kwargs)

    chunked_attention.attention_forward = counted
    try:
        tokens, labels, positions = _batch()
        losses = model(tokens, positions, attention_mask=None, labels=labels)
        after_forward = {"entries": len(store), "device_bytes": store.device_bytes(),
                         "host_bytes": store.pool.in_use_bytes}
        losses.sum().backward()
    finally:
        chunked_attention.attention_forward = attention_forward
    after_backward = {"entries": len(store), "device_bytes": store.device_bytes(),
                      "host_bytes": store.pool.in_use_bytes, **store.stats}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, forwards[0], after_forward, after_backward


def _compare(rank, world_size, keep, experts):
    from megatron.core import parallel_state

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    parallel_state.initialize_model_parallel(1, 1)
    try:
        expected = _step("off", experts)
        got = _step(keep, experts)
    finally:
        parallel_state.destroy_model_parallel()
    assert torch.equal(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        assert torch.equal(got[1][name], expected[1][name]), name
    return expected[2], got[2], got[3], got[4]


# per token and layer in float64: K and V (2 groups of 8), the output (4 heads of 8), and the
# log-sum-exp of the 4 heads, which the reference kernel keeps in the inputs' precision
KEPT_PER_TOKEN = (2 * 16 + 32) * 8 + 4 * 8


@pytest.mark.parametrize("experts", [None, 4])
@pytest.mark.parametrize("keep", ["gpu", "host"])
def test_kept_attention_is_exact_and_runs_attention_once_per_layer(keep, experts):
    recomputing, kept, after_forward, after_backward = run_on_ranks(
        _compare, 1, args=(keep, experts), timeout_s=180)[0]
    layers = 2
    assert recomputing == 2 * layers and kept == layers
    layer_bytes = SEQ * BATCH * KEPT_PER_TOKEN
    assert after_forward["entries"] == layers
    if keep == "gpu":
        assert after_forward["device_bytes"] == layers * layer_bytes
        assert after_forward["host_bytes"] == 0
    else:  # every layer's copy on the host, none left on the device
        assert after_forward["device_bytes"] == 0
        assert after_forward["host_bytes"] == layers * layer_bytes
    assert after_backward["entries"] == 0 and after_backward["device_bytes"] == 0
    assert after_backward["host_bytes"] == 0  # every host buffer back in the pool
    assert after_backward["kept"] == after_backward["taken"] == layers
    if keep == "host":
        # the last layer's copy comes back on demand; taking it starts the first layer's
        assert after_backward["on_demand_restores"] == 1 and after_backward["prefetches"] == 1
        assert after_backward["offloaded_bytes"] == layers * layer_bytes


def test_store_keeps_on_the_host_and_copies_back_a_layer_ahead():
    from megatron.bounded.activations.kept_attention import KeptAttention

    store = KeptAttention()
    layers = [object() for _ in range(3)]
    tensors = {layer: [torch.randn(5, 2, 3), torch.randn(2, 3, 5)] for layer in layers}
    for layer in layers:
        store.keep(layer, tensors[layer], "reference", on_host=True)
    assert store.device_bytes() == 0 and store.pool.in_use_bytes == 3 * (30 + 30) * 4
    for index, layer in reversed(list(enumerate(layers))):
        got, kernel = store.take(layer)
        assert kernel == "reference"
        assert all(torch.equal(a, b) for a, b in zip(got, tensors[layer]))
        # the one taken next is on its way back; the others wait on the host
        assert store.device_bytes() == (60 * 4 if index else 0)
    assert store.take(layers[0]) is None
    assert store.stats["prefetches"] == 2 and store.stats["on_demand_restores"] == 1
    # a forward whose backward never came: its entry is replaced, not added
    store.keep(layers[0], tensors[layers[0]], "reference", on_host=False)
    store.keep(layers[0], tensors[layers[1]], "reference", on_host=False)
    assert len(store) == 1 and torch.equal(store.take(layers[0])[0][0], tensors[layers[1]][0])


def _kept(keep: str, **flags):
    from megatron.bounded import budget as B

    args = small(chunked_recompute_tokens=32, chunked_recompute_attention=True,
                 pipelined_llep=True, pipelined_llep_token_budget=64,
                 chunked_recompute_keep_attention=keep, **flags)
    return B.estimate(args)


def test_budget_counts_the_kept_tensors_per_phase():
    from megatron.bounded.activations.chunked_attention import saved_bytes_per_token

    off, gpu, host = _kept("off"), _kept("gpu"), _kept("host")
    layers = gpu.details["layers"]
    per_layer = N * saved_bytes_per_token(4 * 16, 2 * 16, 4, 2)
    phases = {name: budget.details["phases"] for name, budget in
              (("off", off), ("gpu", gpu), ("host", host))}
    # on the GPU every layer's at the loss, the others' in the last layer's backward
    assert phases["gpu"]["loss"] - phases["off"]["loss"] == layers * per_layer
    assert phases["gpu"]["layer"] - phases["off"]["layer"] == (layers - 1) * per_layer
    # on the host one layer's worth on the GPU in each phase, all of them pinned
    assert phases["host"]["loss"] - phases["off"]["loss"] == per_layer
    assert phases["host"]["layer"] - phases["off"]["layer"] == per_layer
    assert host.host_terms["kept attention"] == layers * per_layer
    assert "kept attention" not in gpu.host_terms and off.terms["kept_attention"] == 0
    peak_phase = gpu.details["peak_phase"]
    assert gpu.terms["kept_attention"] == (layers if peak_phase == "loss" else layers - 1) \
        * per_layer


def test_auto_takes_the_gpu_then_the_host_then_off(monkeypatch):
    from megatron.bounded import budget as B
    from megatron.bounded.activations import host_memory

    auto = _kept("auto", hbm_gb=10.0)
    assert auto.config.chunked_attention.chunked_recompute_keep_attention == "gpu"
    assert auto.terms == _kept("gpu", hbm_gb=10.0).terms
    # a GPU between the host plan's peak and the GPU plan's: the host
    gpu, host = _kept("gpu"), _kept("host")
    assert host.total < gpu.total
    hbm_gb = (host.total + gpu.total) / 2 / GB
    between = _kept("auto", hbm_gb=hbm_gb)
    assert between.config.chunked_attention.chunked_recompute_keep_attention == "host"
    placed, why = B.place_kept_attention(_kept("auto", hbm_gb=hbm_gb).config.with_flags(
        chunked_recompute_keep_attention="auto"))
    assert why.startswith("gpu: ") and "host: " in why and "fits" in why
    # a host without room for the pinned copies: off
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 1024)
    monkeypatch.setattr(host_memory, "_planned_bytes_per_gpu", None)
    crowded = _kept("auto", hbm_gb=hbm_gb)
    assert crowded.config.chunked_attention.chunked_recompute_keep_attention == "off"


def test_pretrain_gpt_resolves_auto_before_the_model_is_built(monkeypatch, capsys):
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch.arguments import validate_bounded_args
    from tests.unit.launch.test_bad_input import BASE, CHUNKED_ATTENTION, REPO_ROOT, parse

    monkeypatch.syspath_prepend(str(REPO_ROOT))
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 64 * GiB)
    import pretrain_gpt

    args = parse(monkeypatch, [*CHUNKED_ATTENTION, "--chunked-recompute-keep-attention", "auto"])
    settings = validate_bounded_args(args)
    assert settings.chunked_attention.chunked_recompute_keep_attention == "auto"
    planned = pretrain_gpt.plan_memory(args, settings)
    assert planned.chunked_attention.chunked_recompute_keep_attention == "gpu"
    launch_lines = [line for line in capsys.readouterr().out.splitlines()
                    if "--chunked-recompute-keep-attention auto:" in line]
    assert len(launch_lines) == 1
    assert launch_lines[0].startswith("[bounded] --chunked-recompute-keep-attention auto: gpu (gpu: ")
    # what the model config is built from
    assert planned.view_of(args).chunked_recompute_keep_attention == "gpu"
    # tools/memory_budget.py prints the placement in the same words
    from megatron.bounded.launch.commands import memory_budget as tool

    flags = [*BASE, *CHUNKED_ATTENTION, "--chunked-recompute-keep-attention", "auto"]
    assert tool.main(["--world-size", "1", *flags]) in (0, 3)
    tool_lines = [line for line in capsys.readouterr().out.splitlines()
                  if "--chunked-recompute-keep-attention auto:" in line]
    assert len(tool_lines) == 1
    assert tool_lines[0].startswith("--chunked-recompute-keep-attention auto: gpu (gpu: ")


@pytest.mark.gpu
@requires_cuda
def test_gpu_host_copies_free_the_device_and_come_back_bitwise():
    """On a GPU: the copies to pinned memory run on the side stream and free each layer's device
    blocks once done; the copies back (one ahead) give the tensors bitwise, while the compute
    stream overwrites the memory the first ones were in."""
    from megatron.bounded.activations.kept_attention import KeptAttention

    store, layers = KeptAttention(), [object() for _ in range(4)]
    generator = torch.Generator(device="cuda").manual_seed(0)

    def layer_tensors():
        return [torch.randn(65536, 1, 4, 64, device="cuda", generator=generator).bfloat16(),
                torch.randn(1, 16, 65536, device="cuda", generator=generator)]

    expected = {}
    for layer in layers:
        tensors = layer_tensors()
        expected[layer] = [t.cpu() for t in tensors]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        store.keep(layer, tensors, "cudnn", on_host=True)
        del tensors
        torch.cuda.synchronize()
        # the block is free once its copy is done (reused by the next layer's tensors)
        scratch = torch.empty(before // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
        del scratch
    assert store.device_bytes() == 0 and store.pool.in_use_bytes > 0
    for layer in reversed(layers):
        got, kernel = store.take(layer)
        # compute-stream work right after the take: it must see the copied tensors
        assert kernel == "cudnn"
        for a, b in zip(got, expected[layer]):
            assert torch.equal(a.cpu(), b)
        del got
    assert store.stats["prefetches"] == 3 and store.stats["on_demand_restores"] == 1
    assert store.pool.in_use_bytes == 0 and len(store) == 0
