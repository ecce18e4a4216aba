"""Layer specs: the TE-free spec uses SDPA core attention and upstream's MoE layer."""

from __future__ import annotations

import sys

from tests.unit.distributed import run_on_ranks

FLAGS = [
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "1", "--eval-interval", "1", "--eval-iters", "0",
    "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--disable-bias-linear",
]


def _build_spec(rank, world_size, extra_flags):
    from megatron.core import parallel_state

    from megatron.bounded.launch.arguments import add_bounded_args, validate_bounded_args
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *FLAGS, *extra_flags]
    args = parse_args(add_bounded_args)
    validate_args(args, {})
    settings = validate_bounded_args(args)
    parallel_state.initialize_model_parallel()
    import pretrain_gpt

    model_config = pretrain_gpt.build_model_config(args, settings)
    spec = model_config.transformer_layer_spec(model_config, None)
    layer_specs = getattr(spec, "layer_specs", [spec])
    return {
        "config_class": type(model_config.transformer).__name__,
        "layers": len(layer_specs),
        "core_attention": [
            s.submodules.self_attention.submodules.core_attention.__name__ for s in layer_specs
        ],
        "mlp": [getattr(s.submodules.mlp, "func", s.submodules.mlp).__name__ for s in layer_specs],
    }


def test_moe_spec_uses_sdpa_attention_and_upstream_moe_layer():
    result = run_on_ranks(_build_spec, 1, args=(["--num-experts", "4", "--moe-router-topk", "2"],))[0]
    assert result["config_class"] == "BoundedTransformerConfig"
    assert result["layers"] == 3
    assert result["core_attention"] == ["SDPACoreAttention"] * 3
    assert result["mlp"] == ["MoELayer"] * 3


def test_capacity_factor_selects_torch_native_moe_layer():
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-expert-rank-capacity-factor", "1.5",
             "--moe-paged-stash"]
    result = run_on_ranks(_build_spec, 1, args=(flags,))[0]
    assert result["mlp"] == ["BoundedMoELayer"] * 3
    assert result["core_attention"] == ["SDPACoreAttention"] * 3


def test_torch_backend_without_factor_is_dropless_torch_native():
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--bounded-moe-backend", "torch"]
    result = run_on_ranks(_build_spec, 1, args=(flags,))[0]
    assert result["mlp"] == ["BoundedMoELayer"] * 3


def test_dense_spec_uses_sdpa_attention():
    result = run_on_ranks(_build_spec, 1, args=([],))[0]
    assert result["core_attention"] == ["SDPACoreAttention"]
    assert result["mlp"] == ["as_mlp_submodule"]  # upstream's dense MLP builder
