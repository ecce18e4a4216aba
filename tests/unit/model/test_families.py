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
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", args.seed)
    # the experts' stream, as upstream's model_parallel_cuda_manual_seed adds it (one rank):
    # --moe-router-force-load-balancing draws its random logits from it
    tracker.add(tensor_parallel.random.get_expert_parallel_rng_tracker_name(), args.seed + 1024)
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
        # query, keys and values, and with --attention-output-gate a gate per query channel
        kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        width = (args.num_attention_heads * (2 if args.attention_output_gate else 1)
                 + 2 * groups) * kv_channels
        assert attention.linear_qkv.weight.shape[0] == width, (attention.linear_qkv.weight.shape,
                                                               width)
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
    assert mlp.config.moe_expert_capacity_factor == args.moe_expert_capacity_factor
    assert mlp.config.moe_pad_expert_input_to_capacity == bool(
        args.moe_pad_expert_input_to_capacity)
    shared = mlp.shared_experts
    if args.moe_shared_expert_intermediate_size:
        assert shared is not None
        assert shared.linear_fc2.weight.shape[1] == args.moe_shared_expert_intermediate_size
        # --moe-shared-expert-gate: a sigmoid gate on the shared experts' output
        assert (shared.gate_weight is not None) == bool(args.moe_shared_expert_gate)
        # --moe-shared-expert-overlap: upstream's overlap in its dispatcher, or the torch-native
        # layer's side stream
        overlapped = mlp.shared_expert_overlap or getattr(mlp, "shared_experts_on_side_stream",
                                                          False)
        assert overlapped == bool(args.moe_shared_expert_overlap), type(mlp)
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


def _norms(module):
    """The normalization modules under ``module`` (by class name: torch's, megatron-core's and
    this project's)."""
    return {name: sub for name, sub in module.named_modules()
            if name.split(".")[-1].endswith("layernorm") or type(sub).__name__.endswith("Norm")}


def _check_norms(model, args):
    """--apply-layernorm-1p: every norm of the model zero-centred (``ZeroCenteredNorm``, or the
    norm fused into the MLA query projection applying 1 + weight); else none."""
    from megatron.bounded.model.mla import NormedColumnParallelLinear
    from megatron.bounded.model.norms import ZeroCenteredNorm

    norms = _norms(model)
    assert norms, "no norm found"
    for name, norm in norms.items():
        if isinstance(norm, NormedColumnParallelLinear):
            assert norm.zero_centered == bool(args.layernorm_zero_centered_gamma), name
        elif norm is not None and hasattr(norm, "weight"):
            assert isinstance(norm, ZeroCenteredNorm) == bool(args.layernorm_zero_centered_gamma), (
                name, type(norm))


def _check_recompute(model, args):
    """Selective recompute: the modules the flags name are the model config's, as upstream's
    layers read them."""
    from megatron.bounded.activations.selective_recompute import selected_modules

    config = model.config
    assert config.recompute_granularity == args.recompute_granularity
    if args.recompute_granularity == "selective":  # none named: upstream's core_attn
        asked = list(args.recompute_modules or ["core_attn"])
        assert list(config.recompute_modules) == asked, (config.recompute_modules, asked)
        assert set(selected_modules(config)) >= set(asked)


def _check_layers(model, args):
    """Every decoder layer and MTP layer as the flags ask; the norms and the recompute; the
    experts' classes."""
    from megatron.bounded.attention.core import SDPACoreAttention

    _check_norms(model, args)
    _check_recompute(model, args)
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


def _train_step(model, args, eod=None):
    """One forward and backward on random tokens; with ``eod``, a few of them are ``eod`` and
    the model gets the packed documents they end (``--reset-attention-mask``)."""
    import torch

    from megatron.bounded.attention.documents import documents_of_batch

    torch.manual_seed(0)
    tokens = torch.randint(0, args.padded_vocab_size, (1, args.seq_length))
    labels = torch.randint(0, args.padded_vocab_size, (1, args.seq_length))
    positions = torch.arange(args.seq_length).unsqueeze(0)
    documents = None
    if eod is not None:  # documents of 1, 1 and 2 tokens, then two long ones
        tokens[:, [0, 1, 3, args.seq_length // 2]] = eod
        documents = documents_of_batch({"tokens": tokens}, "eod", eod)
    losses = model(tokens, positions, attention_mask=None, labels=labels,
                   packed_seq_params=documents)
    loss = losses.float().mean()
    loss.backward()
    missing = [name for name, param in model.named_parameters()
               if param.requires_grad and param.grad is None]
    bad = [name for name, param in model.named_parameters()
           if param.grad is not None and not torch.isfinite(param.grad).all()]
    zero = [name for name, param in model.named_parameters()
            if param.grad is not None and not param.grad.any()]
    return loss.item(), missing, bad, zero


def _memory_budget_tool(flags):
    """(exit status, printed) of tools/memory_budget.py on ``flags``, in this process."""
    from megatron.bounded.launch.commands import memory_budget

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = memory_budget.main(["--world-size", "1", *flags])
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
        result["loss"], result["missing"], result["bad"], result["zero"] = _train_step(model, args)
    except Exception:  # reported by the test that needs the model (the budget's test goes on)
        result["failure"] = traceback.format_exc()
    return result


@functools.lru_cache(maxsize=None)
def family_run(name: str) -> dict:
    """One worker per family (parse, budget tool, model, step), shared by the tests below."""
    return run_on_ranks(_family_body, 1, args=(name,), timeout_s=240)[0]


def _case(family):
    return pytest.param(family.name, id=family.name)


# Refusals and failures that are known and expected to go away, by what their message holds:
# optimizer moments in bf16 need a torch-native optimizer that keeps them (the model zoo's PR=fp8
# flags); upstream's TransformerConfig asserts that --overlap-moe-expert-parallel-comm (the zoo's
# A2A_OVERLAP=1, Megatron-LM's selective-recompute case) has EP > 1, which one rank has not.
@pytest.mark.parametrize("name", [_case(family) for family in FAMILIES])
def test_family_flags_build_the_model_asked_for_and_train_a_step(name):
    result = family_run(name)
    assert result["refusal"] is None, result["refusal"]
    assert "failure" not in result, result["failure"]
    assert result["loss"] == result["loss"] and abs(result["loss"]) < float("inf"), result
    assert not result["missing"], f"parameters without a gradient: {result['missing']}"
    assert not result["bad"], f"non-finite gradients: {result['bad']}"
    assert not result["zero"], f"gradients all zero after one step: {result['zero']}"
    flags = FAMILIES_BY_NAME[name].flags
    if "--moe-grouped-gemm" in flags:  # our grouped experts, not upstream's per-expert loop
        assert {kind for kind in result["experts"] if kind} == {"GroupedExperts"}, result
    replaced = [flag for flag in ("--moe-permute-fusion", "--moe-router-fusion", "--fp8-format",
                                  "--fp8-param-gather", "--enable-gpt-oss",
                                  "--export-force-local-attention", "--delay-wgrad-compute",
                                  "--moe-router-padding-for-fp8") if flag in flags]
    if "--cuda-graph-impl" in flags:
        replaced.append("--cuda-graph-impl transformer_engine")
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


# The recipes at their published sizes, planned for one node of 8 GPUs: PP 1 (the 4 layers are
# one stage), EP the published size up to the node's 8 GPUs, and the tensor, context and
# expert-tensor parallel sizes either as published ("published") or 1 ("tp1"); the rest of the
# node is data parallel. Without Transformer Engine or Apex, --sequence-parallel with TP > 1 is
# refused (torch's norms take whole sequences): "tp1" plans what this build runs.
NODE_GPUS = 8
TP, PP, EP = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--expert-model-parallel-size")
ETP, CP = "--expert-tensor-parallel-size", "--context-parallel-size"
LAYOUTS = ("published", "tp1")


def one_node(family, layout: str) -> dict:
    """The parallel sizes of ``family``'s plan on one node (the rule above)."""
    published = family.published_dims
    sizes = {flag: published[flag] if layout == "published" else ("1",) for flag in (TP, CP, ETP)}
    return {**sizes, PP: ("1",), EP: (str(min(int(published[EP][0]), NODE_GPUS)),)}


def _published_body(rank, world_size, name, layout):
    import traceback

    os.environ["WORLD_SIZE"] = str(NODE_GPUS)
    family = FAMILIES_BY_NAME[name]
    flags = family.published_command_line(one_node(family, layout))
    from megatron.bounded.launch.commands import memory_budget

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = memory_budget.main(["--world-size", str(NODE_GPUS), *flags])
        except SystemExit as exit:
            status = exit.code
        except Exception:
            status, printed = None, io.StringIO(traceback.format_exc())
    result = {"flags": flags, "status": status, "printed": printed.getvalue(), "refusal": None}
    if status == 2:  # the tool refuses: pretrain_gpt.py must refuse these flags alike
        try:
            _parse(flags)
        except AssertionError as refusal:
            result["refusal"] = str(refusal)
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", [family.name for family in FAMILIES if family.published_dims])
def test_recipe_at_published_sizes_is_planned_on_one_node(name, layout):
    """tools/memory_budget.py plans each recipe at its published sizes (4 layers) on one node of
    8 GPUs: it fits (0) or prints its verdict (3); it refuses (2) only as pretrain_gpt.py does."""
    family = FAMILIES_BY_NAME[name]
    result = run_on_ranks(_published_body, 1, args=(name, layout), timeout_s=240)[0]
    flags, status, printed = result["flags"], result["status"], result["printed"]
    for flag, values in family.published_dims.items():  # the published sizes are planned
        if flag not in (TP, PP, EP, ETP, CP):
            assert flags[flags.index(flag) + 1:flags.index(flag) + 1 + len(values)] == list(values)
    assert flags[flags.index("--num-layers") + 1] == "4"
    assert "Traceback" not in printed, printed[-3000:]
    assert status in (0, 2, 3), (status, printed[-3000:])
    if status == 2:
        assert result["refusal"] is not None, ("pretrain_gpt.py accepts what the tool refuses",
                                               printed[-3000:])
        message = result["refusal"].split("[bounded] error: ", 1)[-1].strip()
        assert message in printed, (message, printed[-3000:])
    else:
        assert "dominant" in printed and "verdict" in printed.lower(), printed[-3000:]


def test_every_recipe_holds_its_published_sizes():
    """The recipes hold their published sizes once, with the parallel sizes the plan reads."""
    from tests.families import RECIPES

    for family in RECIPES:
        dims = family.published_dims
        assert {TP, PP, EP, ETP, CP, "--hidden-size", "--seq-length", "--vocab-size",
                "--global-batch-size"} <= set(dims), family.name
        for flag in dims:
            if flag not in (TP, PP, EP, ETP, CP, "--vocab-size"):
                assert flag in family.flags, (family.name, flag)  # a size the recipe sets
