"""The start-up line (megatron.bounded.launch.run_summary.describe): what runs, and for each choice asked
for that cannot run here, what replaced it and why."""

from __future__ import annotations

import sys

import pytest

from megatron.bounded.launch import arguments
from megatron.bounded.launch.run_summary import describe

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "0",
    "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
HYBRIDEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]


@pytest.fixture
def without_te_or_deepep(monkeypatch):
    from megatron.core.transformer.moe import fused_a2a

    monkeypatch.setattr(arguments, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(arguments, "apex_available", lambda: False)
    monkeypatch.setattr(fused_a2a, "HAVE_HYBRIDEP", False)
    monkeypatch.setattr(fused_a2a, "HAVE_DEEP_EP", False)
    return fused_a2a


def line(monkeypatch, *flags):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    args = parse_args(arguments.add_bounded_args)
    arguments.validate_bounded_args(args)
    return describe(args)


def test_hybridep_without_deepep_or_te_names_the_replacement_and_why(monkeypatch, without_te_or_deepep):
    text = line(monkeypatch, *MOE, *HYBRIDEP)
    assert text.startswith("[bounded] run: MoE torch-native all-to-all dispatcher (dropless, EP=1) + GroupedExperts")
    asked = text.split("instead of what was asked: ", 1)[1]
    assert asked.startswith("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep -> "
                            "torch-native all-to-all dispatcher")
    assert "DeepEP's HybridEPBuffer (deep_ep) is not installed" in asked
    assert "Transformer Engine is not installed" in asked


def test_with_a_rank_capacity_factor_the_replacement_is_static(monkeypatch, without_te_or_deepep):
    text = line(monkeypatch, *MOE, *HYBRIDEP, "--moe-expert-rank-capacity-factor", "1.5")
    assert "-> torch-native all-to-all dispatcher (static, rank capacity factor 1.5, EP=1)" in text


def test_hybridep_that_can_be_built_is_not_replaced(monkeypatch, without_te_or_deepep):
    without_te_or_deepep.HAVE_HYBRIDEP = True  # monkeypatched: restored after the test
    text = line(monkeypatch, *MOE, *HYBRIDEP)
    assert "MoE upstream MoEFlexTokenDispatcher (hybridep) (EP=1) + SequentialMLP" in text
    assert "instead of what was asked" not in text


def test_transformer_engine_choices_without_te_are_replaced(monkeypatch, without_te_or_deepep):
    text = line(monkeypatch, "--transformer-impl", "transformer_engine", "--use-transformer-engine-op-fuser")
    assert text.startswith("[bounded] run: dense (no MoE) |")
    assert "attention SDPA (flash first)" in text  # the local implementation runs
    assert "--transformer-impl transformer_engine -> local" in text
    assert "--use-transformer-engine-op-fuser -> local linears: Transformer Engine is not installed" in text


def test_defaults_graph_and_operators(monkeypatch, without_te_or_deepep):
    flags = [flag for flag in BASE]
    where = flags.index("--eval-interval")
    del flags[where:where + 2]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags, *MOE, "--bounded-moe-backend", "torch",
                                      "--moe-expert-rank-capacity-factor", "1", "--moe-paged-stash",
                                      "--cuda-graph-impl", "full_iteration",
                                      "--no-check-for-nan-in-loss-and-grad", "--log-interval", "7",
                                      "--attention-backend", "fused"])
    from megatron.training.arguments import parse_args

    args = parse_args(arguments.add_bounded_args)
    arguments.validate_bounded_args(args)
    text = describe(args)
    assert "static, rank capacity factor 1, EP=1) + GroupedExperts (torch._grouped_mm) |" in text
    assert "attention SDPA (cuDNN first)" in text
    assert "CUDA graph whole iteration (NaN/inf checked on the host every 7 iterations)" in text
    assert "operators paged stash" in text
    assert "defaults set: --eval-interval 1000" in text
    assert "instead of what was asked" not in text  # torch asked for explicitly


def test_upstream_default_path_is_named(monkeypatch, without_te_or_deepep):
    text = line(monkeypatch, *MOE, "--moe-token-dispatcher-type", "alltoall")
    assert "MoE upstream MoEAlltoAllTokenDispatcher (EP=1) + SequentialMLP" in text
    assert "CUDA graph none |" in text and "operators none" in text


@pytest.mark.parametrize("flags,kernel,boundaries", [
    (["--reset-attention-mask"], "flash variable-length kernel", "EOD tokens"),
    (["--dataloader-inter-document-masking"], "flash variable-length kernel",
     "the dataset's document lengths"),
    (["--reset-attention-mask", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--chunked-recompute-tokens", "8",
      "--chunked-recompute-attention", "--attention-backend", "fused"],
     "flash kernels per document and block pair", "EOD tokens"),
])
def test_attention_within_documents_is_named(monkeypatch, without_te_or_deepep, flags, kernel,
                                             boundaries):
    text = line(monkeypatch, "--attention-dropout", "0", *flags)
    assert f"attention within documents ({kernel}; boundaries at {boundaries})" in text


@pytest.mark.parametrize("keep,where", [("gpu", "on the GPU"), ("host", "in pinned host memory")])
def test_kept_attention_is_named_with_its_placement(monkeypatch, without_te_or_deepep, keep, where):
    chunked = ["--attention-dropout", "0", "--recompute-granularity", "full", "--recompute-method",
               "uniform", "--recompute-num-layers", "1", "--chunked-recompute-tokens", "8",
               "--chunked-recompute-attention"]
    assert "kept" not in line(monkeypatch, *chunked)
    text = line(monkeypatch, *chunked, "--chunked-recompute-keep-attention", keep)
    assert f"kept {where} for the recompute (not run again)" in text


def test_multi_token_prediction_layers_are_named_with_their_spec(monkeypatch, without_te_or_deepep):
    assert "MTP" not in line(monkeypatch, *MOE)
    text = line(monkeypatch, *MOE, "--mtp-num-layers", "2")
    assert "| attention SDPA (flash first) | MTP 2 layers (the decoder's layer spec) |" in text
    spec = "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec"
    assert "MTP 1 layer (upstream's MTP spec)" in line(
        monkeypatch, *MOE, "--mtp-num-layers", "1", "--spec", *spec.rsplit(".", 1))


def test_recompute_is_named_with_its_modules(monkeypatch, without_te_or_deepep):
    assert "recompute" not in line(monkeypatch, *MOE)
    text = line(monkeypatch, *MOE, "--moe-grouped-gemm", "--recompute-granularity", "selective",
                "--recompute-modules", "layernorm", "moe_act")
    assert "| attention SDPA (flash first) | recompute selective: layernorm, moe_act | CUDA graph" \
        in text
    # upstream's default module, and the one --moe-layer-recompute adds
    assert "recompute selective: core_attn |" in line(
        monkeypatch, "--recompute-granularity", "selective")
    assert "recompute selective: core_attn, moe |" in line(
        monkeypatch, *MOE, "--recompute-granularity", "selective", "--moe-layer-recompute")
    assert "recompute full (uniform, 1 layer per checkpoint) |" in line(
        monkeypatch, "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1")
