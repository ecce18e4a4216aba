"""The planner (--bounded-plan auto): what it adds to a command line, what it never changes, and
what it refuses, on a small MoE model on the CPU."""

from __future__ import annotations

import pytest

from megatron.bounded import budget
from megatron.bounded.budget import planner
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.units import GB

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-experts", "4", "--moe-router-topk", "2", "--transformer-impl", "local",
    "--bf16", "--use-distributed-optimizer", "--hbm-gb", "80", "--disable-bias-linear",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--position-embedding-type", "rope",
]


@pytest.fixture(autouse=True)
def planning_machine(monkeypatch):
    """One GPU process per job unless a test says otherwise; a host of 250 GB per GPU."""
    from megatron.bounded.activations import host_memory
    from megatron.bounded.upstream import patches

    patches.apply_patches()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    host_memory.plan_for_host(250 * GB)
    yield
    host_memory.plan_for_host(None)


def plan(*flags):
    """(the flags the planner appends, its start-up line) for BASE + ``flags``."""
    from megatron.bounded.launch.planning import plan_command_line

    argv = BASE + list(flags)
    planned, line = plan_command_line(argv, plan_off=False)
    assert planned[: len(argv)] == argv  # only appends
    return planned[len(argv):], line


def value(added, flag):
    return added[added.index(flag) + 1]


def test_short_sequences_get_the_static_dispatch_and_the_whole_iteration_graph():
    added, line = plan()
    assert value(added, "--bounded-moe-backend") == "torch"
    assert value(added, "--moe-expert-rank-capacity-factor") == "1"
    assert "--moe-paged-stash" not in added  # EP 1 at factor 1: nothing to page
    assert value(added, "--cuda-graph-impl") == "full_iteration"
    assert "--no-check-for-nan-in-loss-and-grad" in added
    assert "--manual-gc" in added and value(added, "--manual-gc-interval") == "100"
    assert value(added, "--micro-batch-size") == "4"  # the whole share of the batch in one
    assert line.startswith("[bounded] plan: added --micro-batch-size 4")
    assert "no paged stash: with EP = 1" in line


def test_expert_parallelism_pages_the_stash_by_its_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    added, _ = plan("--expert-model-parallel-size", "2")
    assert value(added, "--moe-expert-rank-capacity-factor") == "2"
    assert "--moe-paged-stash" in added
    assert value(added, "--moe-paged-stash-buffer-size-factor-cuda") == "2"


def test_the_residual_add_runs_eagerly_only_without_dropout_and_bias():
    assert "--no-bias-dropout-fusion" in plan()[0]
    assert "--no-bias-dropout-fusion" not in plan("--hidden-dropout", "0.1")[0]


GIVEN = [
    ["--micro-batch-size", "2"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ["--cuda-graph-impl", "none"],
    ["--attention-backend", "flash"],
    ["--manual-gc-interval", "7"],
    ["--moe-expert-rank-capacity-factor", "1.5"],
    ["--bounded-moe-backend", "upstream"],
    ["--ring-dtp", "--untie-embeddings-and-output-weights"],
]


@pytest.mark.parametrize("flags", GIVEN, ids=lambda flags: flags[0])
def test_a_given_flag_is_never_overridden(flags):
    from megatron.bounded.launch.planning import given_attributes

    added, _ = plan(*flags)
    assert not given_attributes(added) & given_attributes(flags), added


def test_a_long_sequence_is_planned_with_the_bounded_operators():
    added, line = plan("--seq-length", "1048576", "--max-position-embeddings", "1048576",
                       "--hidden-size", "1024", "--num-attention-heads", "16", "--num-layers", "4",
                       "--untie-embeddings-and-output-weights", "--vocab-size", "32000",
                       "--hbm-gb", "80")
    assert value(added, "--recompute-granularity") == "full"
    assert "--ring-dtp" in added and "--chunked-recompute-tokens" in added
    assert "--cuda-graph-impl" not in added
    assert "that fits" in line


def test_a_length_beyond_the_gpu_is_refused_with_the_longest_that_fits():
    flags = ["--seq-length", "16777216", "--max-position-embeddings", "16777216",
             "--hidden-size", "1024", "--num-attention-heads", "16", "--vocab-size", "32000",
             "--untie-embeddings-and-output-weights", "--hbm-gb", "24"]
    with pytest.raises(BoundedArgumentError) as refused:
        plan(*flags)
    text = str(refused.value)
    assert "The longest --seq-length that fits is" in text
    longest = int(text.split("The longest --seq-length that fits is ")[1].split(" ")[0]
                  .rstrip(".").replace(",", ""))
    assert 0 < longest < 16777216
    # and 0.95 × that length is planned
    shorter = int(longest * 0.95) // 1024 * 1024
    added, _ = plan(*flags, "--seq-length", str(shorter), "--max-position-embeddings", str(shorter))
    assert "--recompute-granularity" in added


def test_the_explicit_whole_iteration_graph_around_an_operator_is_refused():
    from megatron.bounded.launch.planning import validate_quietly

    with pytest.raises(BoundedArgumentError, match="--cuda-graph-impl full_iteration with --ring-dtp"):
        validate_quietly(BASE + ["--micro-batch-size", "1", "--untie-embeddings-and-output-weights",
                                 "--ring-dtp", "--cuda-graph-impl", "full_iteration",
                                 "--no-check-for-nan-in-loss-and-grad"])


def test_planning_off_adds_nothing():
    from megatron.bounded.launch.planning import plan_command_line

    assert plan_command_line(BASE, plan_off=True) == (BASE, None)


@pytest.mark.parametrize("flags,reason", [
    (["--eval-iters", "10"], "evaluation (--eval-iters 10)"),
    (["--reset-attention-mask"], "attention within packed documents"),
    (["--bounded-moe-backend", "upstream"], "upstream's MoE path kept: --bounded-moe-backend upstream"),
])
def test_each_part_left_out_names_its_reason(flags, reason):
    added, line = plan(*flags)
    assert reason in line
    assert "--cuda-graph-impl" not in added


def test_the_cost_model_ranks_kept_attention_before_recomputing_it():
    from megatron.bounded.launch.planning import validate_quietly

    flags = BASE + ["--micro-batch-size", "1", "--seq-length", "65536",
                    "--max-position-embeddings", "65536", "--recompute-granularity", "full",
                    "--recompute-method", "uniform", "--recompute-num-layers", "1",
                    "--bounded-moe-backend", "torch", "--chunked-recompute-tokens", "16384",
                    "--chunked-recompute-attention"]
    seconds = {}
    for keep in ("off", "gpu"):
        args, _, _ = validate_quietly(flags + ["--chunked-recompute-keep-attention", keep])
        seconds[keep] = budget.predicted_step(args)
    assert seconds["gpu"].terms["attention"] < seconds["off"].terms["attention"]
    assert seconds["gpu"].seconds < seconds["off"].seconds


def test_flags_of_writes_what_the_parser_reads():
    from megatron.core.transformer.enums import AttnBackend

    assert planner.flags_of({"attention_backend": AttnBackend.fused, "manual_gc": True,
                             "check_for_nan_in_loss_and_grad": False, "ring_dtp": False,
                             "moe_expert_rank_capacity_factor": 2.0,
                             "recompute_granularity": None}) == [
        "--attention-backend", "fused", "--manual-gc", "--no-check-for-nan-in-loss-and-grad",
        "--moe-expert-rank-capacity-factor", "2"]


@pytest.mark.parametrize("given", [False, True])
def test_the_streamed_optimizer_comes_with_the_distributed_optimizer(given):
    """OffloadStreamAdamW runs inside the distributed optimizer: a plan with it turns that on
    unless the flags already do (then it adds nothing the user gave)."""
    import argparse

    args = argparse.Namespace(use_distributed_optimizer=given, ring_dtp=False)
    streamed = [option for option in planner._operator_options(args, set(), 4096)
                if option.get("offload_stream_optimizer")]
    assert streamed
    for option in streamed:
        assert option.get("use_distributed_optimizer") is (None if given else True), option
