"""Flags of public MoE recipes that need Transformer Engine run here, replaced before upstream's
validation and named on the start-up line, or are refused at argument time; and the torch-native
paths that replace them compute the same values:

* ``--delay-wgrad-compute`` (upstream asserts on it without TE): the ordinary weight gradient;
* ``--moe-router-padding-for-fp8`` / ``-for-quantization``: dropped with fp8 (the config raised);
* ``--cuda-graph-impl transformer_engine`` (upstream's train() asserted after the model was on
  the GPU): megatron-core's local graphs with the scopes they capture, else none;
* ``--moe-shared-expert-overlap`` with the torch-native backend (refused): the shared experts on a
  side CUDA stream, inline on CPU, with the same outputs and gradients;
* ``--use-precision-aware-optimizer`` (needs TE's FusedAdam): the distributed optimizer when every
  optimizer dtype is fp32, refused below fp32;
* ``--moe-pad-expert-input-to-capacity`` with the torch-native backend (failed at model build):
  upstream's drops, slabs padded to the experts' capacity, upstream's drop-and-pad layer's values;
* ``--apply-layernorm-1p`` (the torch norm asserted at model build): zero-centred torch norms;
* ``--async-save`` (megatron-core's default writer needs nvidia-resiliency-ext): its own writer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.bounded.launch import arguments
from tests.conftest import MINIMAL_PRETRAIN_FLAGS, requires_cuda
from tests.unit.distributed import run_on_ranks

BASE = list(MINIMAL_PRETRAIN_FLAGS)
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm"]
TE_GRAPHS = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp",
             "moe_router", "moe_preprocess"]
DROP_AND_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
LOCAL = "-> local (megatron-core's per-layer graphs, each captured layer whole"
HIDDEN, FFN = 16, 8


@pytest.fixture
def validated(monkeypatch):
    """The flags as pretrain_gpt.py takes them: replaced on the command line, upstream's parser
    and validation (patched), the notes, our validation; returns (args, settings)."""
    from megatron.training import arguments as upstream

    from megatron.bounded.upstream import patches

    patches.apply_patches()
    monkeypatch.setenv("WORLD_SIZE", "1")

    def validate(flags):
        argv, notes = arguments.replace_refused_flags([*BASE, *flags])
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        with contextlib.redirect_stdout(io.StringIO()):
            args = upstream.parse_args(arguments.add_bounded_args)
            upstream.validate_args(args, {})
        for note in notes:
            arguments.note_substitution(args, note)
        return args, arguments.validate_bounded_args(args)

    return validate


def start_up_line(args, settings) -> str:
    from megatron.bounded.launch.run_summary import describe

    return describe(settings.view_of(args))


def upstream_validation(monkeypatch, flags):
    """Upstream's parser and validation on ``flags`` as given (nothing replaced)."""
    from megatron.training import arguments as upstream

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    with contextlib.redirect_stdout(io.StringIO()):
        upstream.validate_args(upstream.parse_args(arguments.add_bounded_args), {})


# --- deferred weight gradients, router padding for fp8 -------------------------------------------


@pytest.mark.parametrize("impl", [[], ["--transformer-impl", "transformer_engine"]])
def test_delay_wgrad_compute_is_replaced_before_upstreams_validation(monkeypatch, validated, impl):
    flags = ["--delay-wgrad-compute", "--overlap-grad-reduce", "--use-distributed-optimizer", *impl]
    with pytest.raises(AssertionError, match="wgrad"):
        upstream_validation(monkeypatch, flags)  # what upstream does with them
    args, settings = validated(flags)
    assert args.delay_wgrad_compute is False and args.overlap_grad_reduce
    line = start_up_line(args, settings)
    assert "--delay-wgrad-compute -> each weight gradient computed with its input gradient" in line
    assert not settings.transformer_config(args).delay_wgrad_compute


def test_expert_parallel_overlap_is_replaced_and_the_model_config_builds(validated):
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(AssertionError, match="only supported with expert model parallelism"):
        TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                          num_moe_experts=4, moe_token_dispatcher_type="alltoall", bf16=True,
                          overlap_moe_expert_parallel_comm=True)  # upstream, at one rank
    args, settings = validated([*MOE, "--bf16", "--overlap-moe-expert-parallel-comm"])
    assert args.overlap_moe_expert_parallel_comm is False
    assert "--overlap-moe-expert-parallel-comm -> the expert-parallel exchange in order" \
        in start_up_line(args, settings)
    assert not settings.transformer_config(args).overlap_moe_expert_parallel_comm


@pytest.mark.parametrize("padding", ["--moe-router-padding-for-fp8",
                                     "--moe-router-padding-for-quantization"])
def test_router_padding_for_fp8_goes_with_fp8(validated, padding):
    args, settings = validated([*MOE, "--bf16", "--fp8-format", "hybrid", padding])
    config = settings.transformer_config(args)  # raised: fp8/fp4 must be specified
    assert config.fp8 is None and not config.moe_router_padding_for_quantization
    line = start_up_line(args, settings)
    assert f"{padding} -> the experts' token counts unpadded" in line and "--fp8-format -> " in line


# --- Transformer Engine's per-layer CUDA graphs ----------------------------------------------------


@pytest.mark.parametrize("flags,impl,modules,named", [
    # dropless MoE: its dispatch sizes the exchange on the host, which no graph captures
    (MOE, "none", [], "-> none: the MoE layers' dispatch reads token counts on the host"),
    # a static dispatch: every layer (MoE ones too) graphed whole; no partial MoE scopes
    (MOE + ["--moe-expert-rank-capacity-factor", "2"], "local", ["attn"],
     "-> local (megatron-core's per-layer graphs, each captured layer whole; scopes attn), "
     "without mlp, moe_router, moe_preprocess (mlp: megatron-core takes scope mlp only where a "
     "layer is dense; moe_router, moe_preprocess: local graphs capture no part of a layer)"),
    (MOE + DROP_AND_PAD, "local", ["attn"], f"{LOCAL}; scopes attn)"),
    ([], "local", ["attn", "mlp"], f"{LOCAL}; scopes attn mlp), without moe_router, moe_preprocess"),
    (["--reset-attention-mask", "--attention-dropout", "0"], "none", [],
     "-> none: attention within documents"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "none", [], "-> none: --recompute-granularity full"),
], ids=["dropless-moe", "rank-capacity", "drop-and-pad", "dense", "documents", "full-recompute"])
def test_transformer_engine_graphs_become_local_graphs_where_they_capture(validated, flags, impl,
                                                                           modules, named):
    args, settings = validated([*flags, *TE_GRAPHS])
    assert args.cuda_graph_impl == impl
    assert [scope.name for scope in args.cuda_graph_modules] == modules
    assert not args.te_rng_tracker  # upstream turns TE's RNG tracker on for TE graphs
    line = start_up_line(args, settings)
    assert "--cuda-graph-impl transformer_engine (scopes attn mlp moe_router moe_preprocess) " \
           + named in line, line
    config = settings.transformer_config(args)  # upstream's checks of the scopes
    assert config.cuda_graph_impl == impl
    assert [scope.name for scope in config.cuda_graph_modules] == modules


def test_transformer_engine_graphs_of_a_whole_layer_become_local_ones(validated):
    args, settings = validated(["--cuda-graph-impl", "transformer_engine"])
    assert (args.cuda_graph_impl, args.cuda_graph_modules) == ("local", [])
    assert "CUDA graph per layer (local)" in start_up_line(args, settings)


def test_command_line_rewrite_takes_every_spelling_off():
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron.bounded.launch.te_choices import set_on_command_line

    parser = arguments.add_bounded_args(add_megatron_arguments(argparse.ArgumentParser()))
    argv = ["--cuda-graph-impl=transformer_engine", "--cuda-graph-scope", "attn", "mlp",
            "--lr", "-1e-4", "--delay-wgrad-compute", "--seq-length", "8"]
    rewritten = set_on_command_line(argv, parser, {
        "cuda_graph_impl": "local", "cuda_graph_modules": ["attn"],
        "cuda_graph_scope_deprecated": None, "delay_wgrad_compute": False})
    assert rewritten == ["--lr", "-1e-4", "--seq-length", "8", "--cuda-graph-impl", "local",
                         "--cuda-graph-modules", "attn"]


# --- the precision-aware optimizer ------------------------------------------------------------


def test_precision_aware_optimizer_in_fp32_is_the_distributed_optimizer(validated):
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(RuntimeError, match="FusedAdam from TransformerEngine"):
        OptimizerConfig(use_precision_aware_optimizer=True, use_distributed_optimizer=True)
    args, settings = validated(["--use-precision-aware-optimizer", "--use-distributed-optimizer",
                                "--bf16"])
    assert args.use_precision_aware_optimizer is False
    assert "--use-precision-aware-optimizer -> the distributed optimizer's fp32 master weights" \
           in start_up_line(args, settings)


def test_precision_aware_optimizer_with_bf16_moments_keeps_them_in_bf16(validated):
    args, settings = validated(["--use-precision-aware-optimizer", "--use-distributed-optimizer",
                                "--bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"])
    assert args.use_precision_aware_optimizer is False
    assert "with Adam's moments stored in bf16" in start_up_line(args, settings)
    from megatron.bounded.launch import te_choices

    assert te_choices.moment_dtypes(args) == (torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("dtypes", [["--exp-avg-dtype", "fp16"], ["--main-params-dtype", "fp16"],
                                    ["--exp-avg-sq-dtype", "fp8", "--main-grads-dtype", "bf16"]])
def test_optimizer_state_below_fp32_is_refused_before_upstreams_validation(monkeypatch, capsys,
                                                                         dtypes):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, "--use-precision-aware-optimizer",
                                      "--use-distributed-optimizer", "--bf16", *dtypes])
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exited:
        arguments.check_flags_before_upstream()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"{dtypes[0]} {dtypes[1]}" in err
    assert "as fp32 or bf16" in err  # what runs instead


# --- shared experts beside the dispatch -----------------------------------------------------------


def test_shared_expert_overlap_runs_on_the_torch_native_backend_and_is_named(validated):
    args, settings = validated([*MOE, "--moe-shared-expert-intermediate-size", "32",
                                "--moe-shared-expert-overlap"])
    assert args.moe_shared_expert_overlap
    config = settings.transformer_config(args)  # upstream ties the flag to its dispatchers
    assert config.moe_shared_expert_overlap
    assert "--moe-shared-expert-overlap -> the shared experts on a side CUDA stream" in \
           start_up_line(args, settings)


# --- asynchronous checkpoint writer -----------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                    reason="nvidia-resiliency-ext is installed: its writer is kept")
def test_async_save_uses_megatron_cores_own_writer_without_nvidia_resiliency_ext(validated):
    from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

    flags = ["--async-save", "--use-persistent-ckpt-worker", "--ckpt-format", "torch_dist"]
    with pytest.raises(ModuleNotFoundError, match="nvidia-resiliency-ext"):
        get_async_strategy("nvrx")  # what megatron-core's start-up calls for these flags
    args, settings = validated(flags)
    assert args.async_save and args.async_strategy == "mcore"
    assert get_async_strategy(args.async_strategy)[0] == "mcore"
    assert "--async-save -> megatron-core's own asynchronous checkpoint writer" in \
           start_up_line(args, settings)


# One MoE layer of 4 experts, top-2, SwiGLU, fp32, on CPU.
LAYER = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4,
             moe_router_topk=2, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
             bias_activation_fusion=False, use_cpu_initialization=True,
             params_dtype=torch.float32, moe_router_load_balancing_type="none")


def _moe_config(**fields):
    """The layer's config for the torch-native backend."""
    from megatron.bounded.model.config import BoundedTransformerConfig

    return BoundedTransformerConfig(**{**LAYER, "transformer_impl": "local",
                                       "bounded_moe_backend": "torch", **fields})


def _cpu_gating(router):
    # upstream's router moves its weight to CUDA in gating(); on CPU compute the logits here
    router.gating = types.MethodType(lambda self, inp: F.linear(inp, self.weight), router)


def _forward_backward(layer, x, grad):
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    (y * grad).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def _shared_overlap_body(rank, world_size, device):
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron.bounded.moe.moe_layer import bounded_moe_submodules

    parallel_state.initialize_model_parallel()
    pg = get_default_pg_collection()
    results = {}
    for overlap in (False, True):
        config = _moe_config(moe_shared_expert_intermediate_size=24,
                             moe_shared_expert_overlap=overlap)
        torch.manual_seed(11)
        layer = bounded_moe_submodules(config)(config=config, pg_collection=pg).to(device)
        if device == "cpu":
            _cpu_gating(layer.router)
        x = torch.randn(12, 2, HIDDEN, generator=torch.Generator().manual_seed(5)).to(device)
        values = _forward_backward(layer, x, torch.ones_like(x))
        stream = layer.shared_experts_side_stream
        # the layer's own side stream, kept for its next forward (none when inline)
        results[overlap] = (layer.shared_experts_on_side_stream, values,
                            stream is not None and stream != torch.cuda.current_stream(device))
    on_side = results[True][0] and not results[False][0]
    names = ["output", "input grad"] + [f"{n} grad" for n, _ in layer.named_parameters()]
    own_stream = {overlap: result[2] for overlap, result in results.items()}
    differences = {name: (float((a - b).abs().max()), float(a.abs().max()))
                   for name, a, b in zip(names, results[False][1], results[True][1])}
    return on_side, differences, own_stream


def test_shared_expert_overlap_gives_the_same_outputs_and_gradients_on_cpu():
    on_side, differences, own_stream = run_on_ranks(_shared_overlap_body, 1, args=("cpu",),
                                                    timeout_s=180)[0]
    assert on_side and own_stream == {False: False, True: False}  # inline: no stream made
    # inline on CPU: the same computation
    assert all(diff == 0.0 for diff, _ in differences.values()), differences


@pytest.mark.gpu
@requires_cuda
def test_gpu_shared_experts_on_a_side_stream_give_the_same_values():
    # a fresh process: the fork server's preloaded modules may have touched CUDA already
    on_side, differences, own_stream = run_on_ranks(_shared_overlap_body, 1, args=("cuda",),
                                                    timeout_s=180, backend="nccl",
                                                    fresh_process=True)[0]
    # the same kernels; the gradient of the layer's input may sum its terms in another order
    assert on_side and max(diff for diff, _ in differences.values()) <= 1e-6, differences
    assert own_stream == {False: False, True: True}  # the overlapping layer holds its stream


# --- drop-and-pad on the torch-native dispatcher ----------------------------------------------


def _drop_and_pad_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping,
        get_default_pg_collection,
        topk_routing_with_score_function,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.moe.dispatch.send_plan import routing_slots
    from megatron.bounded.moe.moe_layer import bounded_moe_submodules
    from tests.conftest import keep_upstream_dispatcher_on_cpu

    keep_upstream_dispatcher_on_cpu()  # test-only (this worker): upstream's alltoall on CPU
    parallel_state.initialize_model_parallel()
    pg = get_default_pg_collection()
    out = {}
    layout = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                  moe_token_dispatcher_type="alltoall")
    ours = bounded_moe_submodules(_moe_config(**layout))(config=_moe_config(**layout),
                                                        pg_collection=pg)
    _cpu_gating(ours.router)
    logits = torch.randn(24, 4, generator=torch.Generator().manual_seed(3))
    # upstream's router on the same logits: top-k, then its drops with padding
    probs, routed = topk_routing_with_score_function(logits, 2, use_pre_softmax=False,
                                                     score_function="softmax")
    _, padded = apply_router_token_dropping(probs, routed, router_topk=2, capacity_factor=1.0,
                                            pad_to_capacity=True)
    ours.router.eval()
    our_probs, our_map = ours.router.routing(logits)
    dispatcher = ours.token_dispatcher
    dispatcher.dispatch_preprocess(torch.randn(24, HIDDEN), our_map, our_probs)
    plan = dispatcher._state["plan"]
    experts, valid = routing_slots(our_map, 2)
    kept = torch.zeros_like(our_map)
    kept[torch.arange(24).unsqueeze(1).expand(-1, 2)[plan.slot_keep],
         experts[plan.slot_keep]] = True
    out["sets"] = dict(
        kept_equal=bool(torch.equal(kept, padded & routed)),
        dropped_equal=bool(torch.equal(routed & ~kept, routed & ~padded)),
        dropped=int((routed & ~padded).sum()),
        padding_pairs=int((padded & ~routed).sum()),
        slab_rows=plan.capacity, overflow=bool(plan.overflow.any()),
    )
    # whole layers: upstream's drop-and-pad MoE layer (alltoall, SequentialMLP) against ours
    torch.manual_seed(7)
    upstream = get_moe_module_spec(use_te=False, num_experts=4)(
        config=TransformerConfig(**LAYER, **layout), pg_collection=pg)
    with torch.no_grad():
        ours.router.weight.copy_(upstream.router.weight)
        for e, expert in enumerate(upstream.experts.local_experts):
            ours.experts.weight1[e].copy_(expert.linear_fc1.weight.t())
            ours.experts.weight2[e].copy_(expert.linear_fc2.weight.t())
    _cpu_gating(upstream.router)
    ours.router.train()
    x = torch.randn(12, 2, HIDDEN, generator=torch.Generator().manual_seed(5))
    grad = torch.randn_like(x)
    results = []
    for layer in (upstream, ours):
        xl = x.clone().requires_grad_()
        y, _ = layer(xl)
        (y * grad).sum().backward()
        results.append((y.detach(), xl.grad, layer.router.weight.grad))
    w1 = torch.stack([e.linear_fc1.weight.grad.t() for e in upstream.experts.local_experts])
    out["layer"] = [float((a - b).abs().max()) for a, b in zip(*results)] + [
        float((ours.experts.weight1.grad - w1).abs().max())]
    out["pad_flag_restored"] = ours.config.moe_pad_expert_input_to_capacity
    return out


@pytest.fixture(scope="module")
def drop_and_pad():
    return run_on_ranks(_drop_and_pad_body, 1, timeout_s=180)[0]


def test_drop_and_pad_keeps_and_drops_the_pairs_upstreams_router_does(drop_and_pad):
    sets = drop_and_pad["sets"]
    assert sets["kept_equal"] and sets["dropped_equal"], sets
    assert sets["dropped"] > 0 and sets["padding_pairs"] > 0  # the case drops and pads
    # every expert's capacity (12 rows of 24 tokens x top-2 / 4 experts) for the 4 local ones
    assert sets["slab_rows"] == 4 * 12 and not sets["overflow"]


def test_drop_and_pad_layer_equals_upstreams(drop_and_pad):
    assert max(drop_and_pad["layer"]) <= 1e-5, drop_and_pad["layer"]
    assert drop_and_pad["pad_flag_restored"] is True


# --- zero-centred norms ---------------------------------------------------------------------


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_zero_centered_norm_equals_the_norm_with_weight_plus_one(normalization):
    from megatron.bounded.model.norms import ZeroCenteredNorm

    config = types.SimpleNamespace(normalization=normalization)
    norm = ZeroCenteredNorm(config, HIDDEN, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(HIDDEN))  # initialised to 0
    reference = (torch.nn.RMSNorm if normalization == "RMSNorm" else torch.nn.LayerNorm)(
        HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
        reference.weight.copy_(norm.weight + 1)
        if norm.bias is not None:
            norm.bias.normal_()
            reference.bias.copy_(norm.bias)
    x = torch.randn(5, 3, HIDDEN)
    grad = torch.randn_like(x)
    outputs = []
    for module in (norm, reference):
        xl = x.clone().requires_grad_()
        y = module(xl)
        (y * grad).sum().backward()
        outputs.append((y, xl.grad, module.weight.grad))
    for ours, theirs in zip(*outputs):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_zero_centered_norms_replace_the_torch_norms_of_a_spec(zero_centered):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron.bounded.model.norms import ZeroCenteredNorm, use_zero_centered_norms

    layer = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    config = types.SimpleNamespace(layernorm_zero_centered_gamma=zero_centered)
    assert use_zero_centered_norms(layer, config) is layer
    slots = layer.submodules
    attention = slots.self_attention.submodules
    norms = {slots.input_layernorm, slots.pre_mlp_layernorm, attention.q_layernorm,
             attention.k_layernorm}
    assert norms == {ZeroCenteredNorm if zero_centered else WrappedTorchNorm}


# --- the recipes' flags build the model and train a step ------------------------------------


def _build_and_step_body(rank, world_size, flags):
    os.environ["WORLD_SIZE"] = "1"
    torch._dynamo.config.disable = True  # test-only (this worker): no CPU compile of helpers
    from tests.unit.model import test_families as families

    args, settings = families._parse(flags)
    model = families._build(args, settings)
    loss, missing, bad, zero = families._train_step(model, args)
    norms = sorted({type(module).__name__ for name, module in model.named_modules()
                    if name.endswith(("layernorm", "_norm", "enorm", "hnorm"))
                    and type(module).__name__ != "IdentityOp"})  # a slot without a norm
    return dict(loss=loss, missing=missing, bad=bad, zero=zero, norms=norms,
                line=[note for note in getattr(args, "bounded_substitutions", None) or []])


RECIPES = {
    "delay-wgrad-compute": ["--delay-wgrad-compute", "--overlap-grad-reduce",
                            "--use-distributed-optimizer"],
    "padding-for-fp8": MOE + ["--bf16", "--fp8-format", "hybrid", "--moe-router-padding-for-fp8"],
    "shared-expert-overlap": MOE + ["--moe-shared-expert-intermediate-size", "32",
                                    "--moe-shared-expert-overlap"],
    "drop-and-pad": MOE + DROP_AND_PAD,
    "layernorm-1p-rmsnorm": MOE + ["--apply-layernorm-1p", "--normalization", "RMSNorm",
                                   "--qk-layernorm", "--mtp-num-layers", "1",
                                   "--position-embedding-type", "rope"],
    "layernorm-1p-layernorm": ["--apply-layernorm-1p"],
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_flags_build_the_model_and_train_a_step(name):
    flags = [*BASE, "--bounded-plan", "off", *RECIPES[name]]
    if "--bf16" in flags:
        flags.remove("--bf16")  # the step runs the built model on CPU in fp32
    result = run_on_ranks(_build_and_step_body, 1, args=(flags,), timeout_s=240)[0]
    assert abs(result["loss"]) < float("inf") and not result["missing"] and not result["bad"]
    assert not result["zero"], f"gradients all zero after one step: {result['zero']}"
    if "--apply-layernorm-1p" in flags:
        assert result["norms"] == ["ZeroCenteredNorm"], result["norms"]
