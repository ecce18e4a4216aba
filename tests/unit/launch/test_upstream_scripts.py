"""Megatron-LM's Mixtral 8x7B example flags (tests/upstream_scripts.py, scaled down) go through this
project's pretrain_gpt.py unchanged: upstream's and our validation accept them, the model config
is built, and --moe-grouped-gemm, which upstream's local implementation would ignore
(SequentialMLP), runs our grouped experts. CPU only; upstream's pretrain() is replaced by a
recorder."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

from tests.unit.distributed import run_on_ranks
from tests.upstream_scripts import mixtral_8x7b_flags, without


def _main_body(rank, world_size, flags):
    os.environ["WORLD_SIZE"] = "1"
    import pretrain_gpt
    from megatron.core.transformer.moe.moe_layer import MoELayer

    recorded = {}

    def record_pretrain(cfg, datasets_provider, model_type, forward_step, **kwargs):
        recorded["cfg"] = cfg

    pretrain_gpt.pretrain = record_pretrain
    sys.argv = ["pretrain_gpt.py", *flags]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        pretrain_gpt.main()
    model = recorded["cfg"].model
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()  # what pretrain() would have set up
    block = model.transformer_layer_spec(model)
    mlp = block.layer_specs[0].submodules.mlp
    from megatron.training import get_args

    args = get_args()
    return {
        "summary": [line for line in printed.getvalue().splitlines() if line.startswith("[bounded] run:")],
        "layer": mlp.func.__name__ if hasattr(mlp, "func") else repr(mlp),
        "is_moe_layer": issubclass(mlp.func, MoELayer),
        "experts": mlp.keywords["submodules"].experts.__name__,
        "config": (model.transformer.num_moe_experts, model.transformer.moe_grouped_gemm,
                   model.transformer.moe_router_topk, model.transformer.num_layers),
        "eval_interval": args.eval_interval,
        "sequence_parallel": args.sequence_parallel,
    }


def test_mixtral_flags_train_with_our_grouped_experts(tmp_path):
    flags = mixtral_8x7b_flags(tmp_path / "checkpoints")
    result = run_on_ranks(_main_body, 1, args=(flags,), timeout_s=240)[0]
    assert result["config"] == (8, True, 2, 2)
    assert result["layer"] == "BoundedMoELayer" and result["is_moe_layer"]
    assert result["experts"] == "GroupedExperts"  # not upstream's SequentialMLP
    assert result["eval_interval"] == 1000
    assert result["sequence_parallel"] is False  # upstream turns it off at TP = 1
    (summary,) = result["summary"]
    assert "torch-native all-to-all dispatcher (dropless, EP=1) + GroupedExperts" in summary
    assert "--moe-grouped-gemm -> GroupedExperts on torch._grouped_mm" in summary
    assert "defaults set" not in summary  # the script passes --eval-interval itself


@pytest.fixture
def parsed(monkeypatch):
    """Parse and validate a flag list in this process, as pretrain_gpt.py does."""
    from megatron.bounded.upstream import patches
    from megatron.bounded.launch.arguments import add_bounded_args, validate_bounded_args
    from megatron.training import arguments as upstream

    patches.apply_patches()  # upstream.validate_args is then the patched one
    monkeypatch.setenv("WORLD_SIZE", "1")

    def parse(flags):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
        args = upstream.parse_args(add_bounded_args)
        upstream.validate_args(args, {})
        validate_bounded_args(args)
        return args

    return parse


def test_eval_interval_gets_older_megatrons_default(parsed, tmp_path):
    from megatron.bounded.launch.run_summary import describe

    args = parsed(without(mixtral_8x7b_flags(tmp_path), "--eval-interval"))
    assert args.eval_interval == 1000
    assert "defaults set: --eval-interval 1000 (not given" in describe(args)
    args = parsed(mixtral_8x7b_flags(tmp_path) + ["--eval-interval", "7"])
    assert args.eval_interval == 7 and "defaults set" not in describe(args)


def test_grouped_gemm_without_the_flag_keeps_upstreams_experts(parsed, tmp_path):
    from megatron.bounded.moe.backend import select_moe_backend

    args = parsed(without(mixtral_8x7b_flags(tmp_path), "--moe-grouped-gemm", takes_value=False))
    assert select_moe_backend(args) == "upstream"
    args = parsed(mixtral_8x7b_flags(tmp_path))
    assert select_moe_backend(args) == "torch"
