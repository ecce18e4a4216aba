"""The published launch flags of today's MoE families (tests/families.py) go through
pretrain_gpt.py's own parsing and validation unchanged, the model they ask for is the model built,
layer by layer, and it trains a step on CPU.

Per family, on one gloo rank: ``pretrain_gpt.parse_flags`` (the replaced TE-only choices, the
early checks, upstream's validation with our flags, ours), ``pretrain_gpt.build_model_config`` and
upstream's ``GPTModelBuilder``; then every decoder layer is compared with what the flags ask for
(attention module and core attention, windows and sinks, qk layernorm, QKV bias, dense or MoE
per --moe-layer-freq, experts, shared experts and their width, the router, the activation), the
MTP layers too; then one forward and backward with a finite loss and a finite gradient on every
parameter.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys

import pytest

from tests.conftest import keep_upstream_dispatcher_on_cpu
from tests.families import FAMILIES, FAMILIES_BY_NAME
from tests.unit.distributed import run_on_ranks

SEQ_LENGTH = 64
WINDOWED_SEQ_LENGTH = 160  # longer than gpt-oss's window of 127 tokens back


def _parse(flags):
    """``pretrain_gpt.parse_flags`` on ``flags``; a refusal fails with its message."""
    import pretrain_gpt

    sys.argv = ["pretrain_gpt.py", *flags]
    printed, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            return pretrain_gpt.parse_flags()
    except SystemExit as exit:
        raise AssertionError(f"refused (exit {exit.code}): {errors.getvalue()[-1500:]}") from None


def _build(args, settings):
    import pretrain_gpt
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from tests.conftest import keep_upstream_checkpoint_on_cpu, keep_upstream_rotary_on_cpu

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    parallel_state.initialize_model_parallel()
    # test-only (this worker): attention dropout forks the tracker's CUDA generator; on CPU it
    # holds nothing and dropout draws from the CPU generator
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: None
    tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", args.seed)
    model_config = pretrain_gpt.build_model_config(args, settings)
    model_config.transformer.use_cpu_initialization = True  # no GPU here
    return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())


def moe_layers(moe_layer_freq, num_layers: int) -> list:
    """Which layers (0-based) --moe-layer-freq makes MoE layers: every N-th for an integer N,
    else the pattern's 1s."""
    if isinstance(moe_layer_freq, int):
        return [index % moe_layer_freq == 0 for index in range(num_layers)]
    assert len(moe_layer_freq) == num_layers, moe_layer_freq
    return [bool(entry) for entry in moe_layer_freq]


def windowed_layers(args) -> list:
    """Which layers (0-based) --window-size with --window-attn-skip-freq makes sliding-window:
    all but every N-th (1-based) for an integer N, else the pattern's 1s."""
    if not args.window_size:
        return [False] * args.num_layers
    skip = args.window_attn_skip_freq
    if skip is None:
        return [True] * args.num_layers
    if isinstance(skip, int):
        return [(index + 1) % skip != 0 for index in range(args.num_layers)]
    return [bool(entry) for entry in skip]


def _check_attention(layer, args, windowed: bool):
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron.bounded.attention.core import SDPACoreAttention

    attention = layer.self_attention
    if args.multi_latent_attention:
        assert isinstance(attention, MLASelfAttention), type(attention)
        if args.qk_layernorm:
            assert attention.kv_layernorm is not None
            assert args.q_lora_rank is None or attention.q_layernorm is not None
    else:
        assert isinstance(attention, SelfAttention), type(attention)
        norms = (attention.q_layernorm, attention.k_layernorm)
        assert all(norm is not None for norm in norms) == bool(args.qk_layernorm), norms
        has_bias = attention.linear_qkv.bias is not None and attention.linear_qkv.bias.numel() > 0
        assert has_bias == bool(args.add_qkv_bias or args.add_bias_linear)
    core = attention.core_attention
    assert isinstance(core, SDPACoreAttention), type(core)
    # the left extent of the layer's causal window (the right one is 0), None: whole sequence
    assert core.window == (args.window_size[0] if windowed else None), (layer.layer_number,
                                                                        core.window)
    offset = getattr(core, "softmax_offset", None)
    if args.softmax_type == "learnable":  # a learnable sink logit per head
        assert offset is not None and offset.requires_grad and offset.shape == (
            args.num_attention_heads,)
    else:
        assert offset is None


def _check_mlp(layer, args, moe: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlp = layer.mlp
    if not moe:
        assert isinstance(mlp, MLP) and not isinstance(mlp, MoELayer), type(mlp)
        assert mlp.linear_fc2.weight.shape[1] == args.ffn_hidden_size
        return None
    assert isinstance(mlp, MoELayer), type(mlp)
    assert mlp.num_local_experts == args.num_experts
    router = mlp.router
    assert router.topk == args.moe_router_topk
    assert router.score_function == args.moe_router_score_function
    assert (router.expert_bias is not None) == bool(args.moe_router_enable_expert_bias)
    assert router.config.moe_router_num_groups == args.moe_router_num_groups
    assert router.config.moe_router_group_topk == args.moe_router_group_topk
    assert router.config.moe_router_topk_scaling_factor == args.moe_router_topk_scaling_factor
    shared = mlp.shared_experts
    if args.moe_shared_expert_intermediate_size:
        assert shared is not None
        assert shared.linear_fc2.weight.shape[1] == args.moe_shared_expert_intermediate_size
    else:
        assert shared is None
    activation = mlp.config.activation_func
    expected = F.silu if args.swiglu else (F.gelu if not args.quick_geglu else None)
    if args.quick_geglu:
        assert activation.__name__ == "quick_gelu" and mlp.config.gated_linear_unit
        assert mlp.config.glu_linear_offset == args.glu_linear_offset
        assert mlp.config.activation_func_clamp_value == args.activation_func_clamp_value
    else:
        assert activation is expected, activation
        assert mlp.config.gated_linear_unit == bool(args.swiglu)
    return type(mlp.experts).__name__


def _check_layers(model, args):
    """Every decoder layer and MTP layer as the flags ask; the experts' classes."""
    from megatron.bounded.attention.core import SDPACoreAttention

    layers = list(model.decoder.layers)
    assert len(layers) == args.num_layers
    moe = moe_layers(args.moe_layer_freq, args.num_layers)
    windowed = windowed_layers(args)
    experts = [_check_attention(layer, args, windowed[index]) or
               _check_mlp(layer, args, moe[index]) for index, layer in enumerate(layers)]
    if args.mtp_num_layers:
        mtp_layers = list(model.mtp.layers)
        assert len(mtp_layers) == args.mtp_num_layers
        for mtp_layer in mtp_layers:
            inner = mtp_layer.mtp_model_layer
            assert isinstance(inner.self_attention.core_attention, SDPACoreAttention), type(
                inner.self_attention.core_attention)
    else:
        assert getattr(model, "mtp", None) is None
    return experts


def _train_step(model, args):
    import torch

    torch.manual_seed(0)
    tokens = torch.randint(0, args.padded_vocab_size, (1, args.seq_length))
    labels = torch.randint(0, args.padded_vocab_size, (1, args.seq_length))
    positions = torch.arange(args.seq_length).unsqueeze(0)
    losses = model(tokens, positions, attention_mask=None, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    missing = [name for name, param in model.named_parameters()
               if param.requires_grad and param.grad is None]
    bad = [name for name, param in model.named_parameters()
           if param.grad is not None and not torch.isfinite(param.grad).all()]
    return loss.item(), missing, bad


def _memory_budget_tool(flags):
    """(exit status, printed) of tools/memory_budget.py on ``flags``, in this process."""
    from tests.tool_modules import load_tool

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = load_tool("memory_budget.py").main(["--world-size", "1", *flags])
        except SystemExit as exit:
            status = exit.code
    return status, printed.getvalue()


def _family_body(rank, world_size, name):
    import traceback

    import torch

    os.environ["WORLD_SIZE"] = "1"
    # test-only (this worker): upstream's torch.compile'd helpers would compile on the CPU for
    # longer than the step runs; the values are the same eager
    torch._dynamo.config.disable = True
    keep_upstream_dispatcher_on_cpu()  # the families without grouped experts use upstream's
    family = FAMILIES_BY_NAME[name]
    windowed = "--window-size" in family.flags
    flags = family.command_line(WINDOWED_SEQ_LENGTH if windowed else SEQ_LENGTH)
    result = {"tool": _memory_budget_tool(flags)}
    try:
        args, settings = _parse(flags)
    except AssertionError as refusal:
        return {**result, "refusal": str(refusal)}
    result.update(refusal=None, substitutions=list(getattr(args, "bounded_substitutions", None) or []))
    try:
        model = _build(args, settings)
        result["experts"] = _check_layers(model, args)
        result["loss"], result["missing"], result["bad"] = _train_step(model, args)
    except Exception:  # reported by the test that needs the model (the budget's test goes on)
        result["failure"] = traceback.format_exc()
    return result


@functools.lru_cache(maxsize=None)
def family_run(name: str) -> dict:
    """One worker per family (parse, budget tool, model, step), shared by the tests below."""
    return run_on_ranks(_family_body, 1, args=(name,), timeout_s=240)[0]


def _case(family):
    return pytest.param(family.name, id=family.name)


@pytest.mark.parametrize("name", [_case(family) for family in FAMILIES])
def test_family_flags_build_the_model_asked_for_and_train_a_step(name):
    result = family_run(name)
    assert result["refusal"] is None, result["refusal"]
    assert "failure" not in result, result["failure"]
    assert result["loss"] == result["loss"] and abs(result["loss"]) < float("inf"), result
    assert not result["missing"], f"parameters without a gradient: {result['missing']}"
    assert not result["bad"], f"non-finite gradients: {result['bad']}"
    flags = FAMILIES_BY_NAME[name].flags
    if "--moe-grouped-gemm" in flags:  # our grouped experts, not upstream's per-expert loop
        assert {kind for kind in result["experts"] if kind} == {"GroupedExperts"}, result
    replaced = [flag for flag in ("--moe-permute-fusion", "--moe-router-fusion", "--fp8-format",
                                  "--fp8-param-gather", "--enable-gpt-oss",
                                  "--export-force-local-attention") if flag in flags]
    if "--cross-entropy-fusion-impl" in flags and \
            flags[flags.index("--cross-entropy-fusion-impl") + 1] == "te":  # native runs as asked
        replaced.append("--cross-entropy-fusion-impl")
    for flag in replaced:
        assert any(note.startswith(flag) for note in result["substitutions"]), (flag, result)


@pytest.mark.parametrize("name", [family.name for family in FAMILIES])
def test_memory_budget_tool_agrees_with_pretrain(name):
    """tools/memory_budget.py plans what pretrain_gpt.py accepts and refuses, with the same
    message, what it refuses."""
    result = family_run(name)
    status, printed = result["tool"]
    if result["refusal"] is None:
        assert status in (0, 3), printed[-3000:]
        assert "dominant" in printed, printed[-3000:]
    else:
        assert status == 2, printed[-3000:]
        message = result["refusal"].split("[bounded] error: ", 1)[1].strip()
        assert message in printed, (message, printed[-3000:])
