"""--bounded-fast-path: which flags it adds for a command line, and why it leaves parts out."""

from __future__ import annotations

import pytest

from megatron.bounded.launch import fast_path
from megatron.bounded.launch.arguments import parse_without_validation
from megatron.bounded.launch.fast_path import expand_fast_path

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
    "--global-batch-size", "2", "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-experts", "4", "--moe-router-topk", "2", "--transformer-impl", "local",
]


def expand(*flags):
    argv = BASE + ["--bounded-fast-path", *flags]
    expanded, line = expand_fast_path(argv, parse_without_validation(argv))
    assert expanded[: len(argv)] == argv  # only appends
    return expanded[len(argv):], line


def value(added, flag):
    return added[added.index(flag) + 1]


@pytest.mark.parametrize("ep", [2, 8])
def test_no_drop_factor_and_stash_sized_by_ep_and_the_whole_iteration_graph(ep):
    added, line = expand("--expert-model-parallel-size", str(ep))
    assert value(added, "--bounded-moe-backend") == "torch"
    assert value(added, "--moe-expert-rank-capacity-factor") == str(ep)
    assert "--moe-paged-stash" in added
    assert value(added, "--moe-paged-stash-buffer-size-factor-cuda") == str(ep)
    assert value(added, "--cuda-graph-impl") == "full_iteration"
    assert "--no-check-for-nan-in-loss-and-grad" in added
    assert line.startswith("[bounded] fast path: added --bounded-moe-backend torch")
    assert "checked on the host" in line and ";" not in line


def test_one_ep_rank_at_factor_one_has_nothing_to_page():
    added, line = expand()
    assert value(added, "--moe-expert-rank-capacity-factor") == "1"
    assert "--moe-paged-stash" not in added
    assert value(added, "--cuda-graph-impl") == "full_iteration"
    assert "no paged stash: with EP = 1 and a rank capacity factor of at most 1" in line
    # a larger factor leaves padding rows that the stash does not keep
    added, _ = expand("--moe-expert-rank-capacity-factor", "1.5", "--cuda-graph-impl", "none")
    assert "--moe-paged-stash" in added


def test_residual_add_runs_eagerly_without_dropout_and_bias():
    added, _ = expand("--hidden-dropout", "0", "--disable-bias-linear")
    assert "--no-bias-dropout-fusion" in added
    for flags in (["--disable-bias-linear"], ["--hidden-dropout", "0"]):  # dropout 0.1 / biases
        assert "--no-bias-dropout-fusion" not in expand(*flags)[0]


def test_manual_garbage_collection_unless_given():
    added, _ = expand()
    assert "--manual-gc" in added
    assert value(added, "--manual-gc-interval") == str(fast_path.MANUAL_GC_INTERVAL)
    added, _ = expand("--manual-gc-interval", "7")
    assert "--manual-gc" in added and "--manual-gc-interval" not in added
    added, _ = expand("--manual-gc")
    assert "--manual-gc" not in added and "--manual-gc-interval" not in added


def test_without_the_flag_nothing_changes():
    assert expand_fast_path(BASE, parse_without_validation(BASE)) == (BASE, None)


def test_large_ep_stays_dropless_and_says_why():
    added, line = expand("--expert-model-parallel-size", "16")
    assert added == ["--bounded-moe-backend", "torch"]
    assert "dropless" in line and "EP=16" in line


def test_explicit_flags_win_and_a_factor_below_ep_keeps_the_graph_off():
    added, line = expand("--expert-model-parallel-size", "2", "--moe-expert-rank-capacity-factor", "1.5")
    assert "--moe-expert-rank-capacity-factor" not in added and "--moe-paged-stash" in added
    assert "--cuda-graph-impl" not in added
    assert "no whole-iteration CUDA graph: rank capacity factor 1.5 < EP=2" in line
    # asking for no graph keeps the eager step (with the static dispatch and paged stash)
    added, line = expand("--expert-model-parallel-size", "2", "--cuda-graph-impl", "none")
    assert "--cuda-graph-impl" not in added and "--moe-paged-stash" in added
    assert "no whole-iteration CUDA graph: --cuda-graph-impl none given" in line
    added, line = expand("--expert-model-parallel-size", "2",
                         "--moe-paged-stash-buffer-size-factor-cuda", "0.5")
    assert "--moe-paged-stash-buffer-size-factor-cuda" not in added and "--cuda-graph-impl" not in added
    assert "lets the stash overflow" in line


@pytest.mark.parametrize(
    "flags,missing,reason",
    [
        (["--bounded-moe-backend", "upstream"], "--bounded-moe-backend", "upstream's MoE path kept"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
         "--moe-paged-stash", "no paged stash: --recompute-granularity full"),
        (["--sco-host-budget-gb", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"], "--cuda-graph-impl", "--sco-host-budget-gb not run under the graph"),
        (["--eval-iters", "10"], "--cuda-graph-impl", "evaluation (--eval-iters 10)"),
        (["--reset-attention-mask"], "--cuda-graph-impl",
         "attention within packed documents not run under the graph"),
        (["--pipelined-llep", "--pipelined-llep-token-budget", "8"], "--bounded-moe-backend", "--pipelined-llep"),
    ],
)
def test_each_part_left_out_names_its_reason(flags, missing, reason):
    added, line = expand(*flags)
    assert missing not in added
    assert reason in line


def test_dense_models_are_left_alone():
    moe = BASE.index("--num-experts")
    argv = BASE[:moe] + BASE[moe + 4:]
    expanded, line = expand_fast_path(argv + [fast_path.FLAG], parse_without_validation(argv + [fast_path.FLAG]))
    assert expanded == argv + [fast_path.FLAG] and "dense model" in line
