"""Multi-token prediction (``--mtp-num-layers``) built with this project's layer spec.

The model is built as ``pretrain_gpt.py`` builds it (``build_model_config`` and upstream's
``GPTModelBuilder``) on one gloo rank on CPU. The reference is the same model whose MTP block is
built by upstream's own ``mtp_block_spec`` (its local spec: ``DotProductAttention``,
``MoELayer`` with ``SequentialMLP``), with the same weights: losses and gradients must agree.
"""

from __future__ import annotations

import contextlib
import sys

import pytest

from tests.conftest import MINIMAL_PRETRAIN_FLAGS
from tests.unit.distributed import run_on_ranks

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
FLAGS = [
    "--mtp-num-layers", "1", "--transformer-impl", "local", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--use-cpu-initialization",
]
SEQ, BATCH = 32, 2


def _model_config(flags):
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args

    from megatron.bounded.launch.arguments import add_bounded_args, validate_bounded_args

    sys.argv = ["pretrain_gpt.py", *MINIMAL_PRETRAIN_FLAGS, *FLAGS, *flags]
    args = parse_args(add_bounded_args)
    validate_args(args, {})
    settings = validate_bounded_args(args)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_config = pretrain_gpt.build_model_config(args, settings)
    model_config.vocab_size = 128  # --vocab-size; the tokenizer, which pads it, is not built
    return model_config, pretrain_gpt.ActivationOffload(settings.sco), (args, settings)


def _build(model_config):
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(0)
    builder = model_config.get_builder_cls()(model_config)
    return builder.build_model(ProcessGroupCollection.use_mpu_process_groups()).double()


def _build_with_upstream_mtp_spec(model_config):
    """The model as upstream builds it: its own ``mtp_block_spec``, not the patched one."""
    from megatron.training.models import gpt

    patched = gpt.mtp_block_spec
    gpt.mtp_block_spec = patched.__wrapped__
    try:
        return _build(model_config)
    finally:
        gpt.mtp_block_spec = patched


def _module_names(mtp_layer) -> dict:
    layer = mtp_layer.mtp_model_layer
    mlp = layer.mlp
    return {
        "layer": type(layer).__name__,
        "core_attention": type(layer.self_attention.core_attention).__name__,
        "mlp": type(mlp).__name__,
        "experts": type(getattr(mlp, "experts", None)).__name__,
    }


def _grouped_from_sequential(model, reference):
    """(name, module) of ``model``'s grouped experts that are a ``SequentialMLP`` in
    ``reference``."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron.bounded.moe.experts import GroupedExperts

    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, GroupedExperts)
            and isinstance(reference.get_submodule(name), SequentialMLP)]


def _copy_weights(reference, model) -> None:
    """``model`` gets ``reference``'s weights: every parameter of the same name, and expert
    weights from upstream's ``SequentialMLP`` where ``model`` has grouped experts."""
    import torch

    own = dict(model.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in own:
                own[name].copy_(param)
                copied.add(name)
        for name, module in _grouped_from_sequential(model, reference):
            module.load_from_sequential_mlp(reference.get_submodule(name))
            copied.update(f"{name}.{p}" for p, _ in module.named_parameters())
    assert copied == set(own), sorted(set(own) - copied)


def _step(model, tokens, labels, offload=None):
    """(per-token loss, MTP loss, gradients by parameter name) of one forward and backward, the
    forward inside ``offload``'s context (SCO) when given."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    model.train()
    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    # upstream's dot-product attention builds its default mask on the GPU: given here (SDPA
    # implies the causal mask and ignores it)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with offload.context() if offload is not None else contextlib.nullcontext():
        loss = model(tokens, positions, attention_mask=causal, labels=labels)
    loss.sum().backward()
    mtp_loss = MTPLossLoggingHelper.tracker["loss_values"].clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), mtp_loss, grads


def _compare(rank, world_size, flags):
    import torch

    from megatron.core.tensor_parallel import random as tp_random

    from tests.conftest import keep_upstream_checkpoint_on_cpu, keep_upstream_rotary_on_cpu
    from tests.unit.comparisons import relative_error

    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    # upstream's dot-product attention forks the model-parallel CUDA generator for its (here
    # zero) dropout; without a GPU the fork is a no-op of the shim above
    tp_random.get_cuda_rng_tracker().set_states({tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME: None})
    from megatron.bounded import budget

    model_config, offload, (args, settings) = _model_config(flags)
    model = _build(model_config)
    counts = budget.parameter_counts(budget.BudgetConfig.from_args(args, settings))
    reference = _build_with_upstream_mtp_spec(model_config)
    _copy_weights(reference, model)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, 128, (BATCH, SEQ), generator=generator)
    ours, ref = _step(model, tokens, labels, offload), _step(reference, tokens, labels)
    grad_errors = {name: relative_error(grad, ref[2][name])
                   for name, grad in ours[2].items() if name in ref[2]}
    for name, module in _grouped_from_sequential(model, reference):
        # in upstream's per-expert layout
        for e, expert in enumerate(reference.get_submodule(name).local_experts):
            grad_errors[f"{name}.{e}.fc1"] = relative_error(
                module.weight1.grad[e].t(), expert.linear_fc1.weight.grad)
            grad_errors[f"{name}.{e}.fc2"] = relative_error(
                module.weight2.grad[e].t(), expert.linear_fc2.weight.grad)
    return {
        "ours": _module_names(model.mtp.layers[0]),
        "reference": _module_names(reference.mtp.layers[0]),
        "decoder": _module_names(type("L", (), {"mtp_model_layer": model.decoder.layers[-1]})),
        "loss": relative_error(ours[0], ref[0]),
        "mtp_loss": relative_error(ours[1], ref[1]),
        "mtp_loss_value": float(ours[1].sum()),
        "grads": grad_errors,
        "mtp_grads": sorted(n for n in ours[2] if n.startswith("mtp.")),
        "sco": offload.offload.stats if offload.offload is not None else None,
        "budget_mtp_params": counts["mtp"] + counts["mtp_experts"],
        "built_mtp_params": sum(p.numel() for p in model.mtp.parameters()),
        "budget_params": counts["dense"] + counts["expert"],
        "built_params": sum(p.numel() for p in model.parameters()),
        "uncompared": sorted(
            name for name in ours[2] if name not in ref[2]
            and not any(name.startswith(grouped) for grouped, _ in
                        _grouped_from_sequential(model, reference))),
    }


TORCH_MOE = MOE + ["--bounded-moe-backend", "torch"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
CHUNKED = TORCH_MOE + FULL_RECOMPUTE + ["--chunked-recompute-tokens", "24"]


@pytest.mark.parametrize("flags, layer, mlp, experts", [
    (MOE, "TransformerLayer", "MoELayer", "SequentialMLP"),
    (TORCH_MOE, "TransformerLayer", "BoundedMoELayer", "GroupedExperts"),
    (MOE + ["--pipelined-llep", "--pipelined-llep-token-budget", "16"], "TransformerLayer",
     "BoundedMoELayer", "GroupedExperts"),
    (CHUNKED, "ChunkedRecomputeTransformerLayer", "BoundedMoELayer", "GroupedExperts"),
    (CHUNKED + ["--chunked-recompute-attention"], "ChunkedRecomputeTransformerLayer",
     "BoundedMoELayer", "GroupedExperts"),
    (TORCH_MOE + FULL_RECOMPUTE + ["--sco-host-budget-gb", "1"], "TransformerLayer",
     "BoundedMoELayer", "GroupedExperts"),
], ids=["upstream-moe-backend", "torch-moe-backend", "pipelined-llep", "chunked-recompute",
        "chunked-attention", "sco"])
def test_mtp_layer_is_built_from_our_spec_and_matches_upstreams(flags, layer, mlp, experts):
    result = run_on_ranks(_compare, 1, args=(flags,))[0]
    assert result["ours"] == {"layer": layer, "core_attention": "SDPACoreAttention",
                              "mlp": mlp, "experts": experts}
    assert result["decoder"]["mlp"] == mlp and result["decoder"]["experts"] == experts
    assert result["reference"]["core_attention"] == "DotProductAttention"
    assert result["reference"]["mlp"] == "MoELayer"
    assert result["reference"]["experts"] == "SequentialMLP"
    assert result["mtp_loss_value"] > 0
    assert result["loss"] <= 1e-12
    assert result["mtp_loss"] <= 1e-6  # upstream logs it in a float32 tracker
    assert result["mtp_grads"], "the MTP layer got no gradient"
    assert not result["uncompared"]
    # the budget counts the MTP layers' parameters, and the whole model's, as built
    assert result["budget_mtp_params"] == result["built_mtp_params"] > 0
    assert result["budget_params"] == result["built_params"]
    if "--sco-host-budget-gb" in flags:
        # two decoder layers and the MTP layer's hidden state and next tokens' embedding, all
        # offloaded; the MTP checkpoint brings its two back together (boundaries_on_device)
        assert result["sco"]["offloaded_boundaries"] == result["sco"]["boundaries_seen"] == 4
        assert result["sco"]["max_restored_on_device"] <= 3
    for name, error in result["grads"].items():
        assert error <= 1e-10, (name, error)


def test_other_model_configs_keep_upstreams_mtp_spec():
    """Only a decoder built by ``bounded_decoder_spec`` with the local implementation (no
    ``--spec``, ``--transformer-impl local``) gets the MTP block of our spec."""
    from types import SimpleNamespace

    from megatron.bounded.model.specs import bounded_decoder_spec
    from megatron.bounded.upstream.models import mtp_block_from_bounded_spec

    mtp_block_spec = mtp_block_from_bounded_spec(lambda config, spec, vp_stage=None: "upstream's")
    for layer_spec, impl in ((object(), "local"), (bounded_decoder_spec, "transformer_engine")):
        config = SimpleNamespace(transformer_layer_spec=layer_spec, transformer=SimpleNamespace(
            transformer_impl=impl, mtp_num_layers=1))
        assert mtp_block_spec(config, None) == "upstream's"
