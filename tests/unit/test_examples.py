"""The example launch scripts produce flags that upstream's and our validation accept.

Each script is run with PYTHON pointing at a stand-in that records its command line instead of
launching torchrun; the recorded pretrain_gpt.py flags are then parsed and validated (upstream
validate_args and ours) for the script's world size, on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.distributed import run_on_ranks
from tests.tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[2]
example_argv = load_tool("example_argv.py").example_argv

EXAMPLES = {
    # script: (world size, expected layers, environment)
    "examples/moe_small/train.sh": (2, 8, {"NUM_GPUS": "2"}),
    # SCO's pinned budget is checked against this host's memory: keep it small here
    "examples/moe_120b/train.sh": (16, 7, {"SCO_HOST_BUDGET_GB": "1"}),
    "examples/moe_241b/train.sh": (32, 14, {"SCO_HOST_BUDGET_GB": "1"}),
    "examples/moe_667b/train.sh": (64, 39, {"SCO_HOST_BUDGET_GB": "1"}),
}


def recorded_flags(script: str, env_overrides: dict) -> list[str]:
    """The pretrain_gpt.py flags ``script`` launches with (nothing runs)."""
    argv = example_argv(REPO_ROOT / script, dict(os.environ, **env_overrides),
                        ["--metrics-jsonl", "m.jsonl"])
    return argv[argv.index("pretrain_gpt.py") + 1 :]


def _validate(rank, world_size, flags, example_world_size):
    os.environ["WORLD_SIZE"] = str(example_world_size)  # validate_args reads the job's size here
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as examples/common/launch.sh exports it
    from megatron.bounded import patches
    from megatron.bounded.arguments import add_bounded_args, validate_bounded_args
    from megatron.training.arguments import parse_args, validate_args

    patches.apply_patches()  # as pretrain_gpt.py does on import

    sys.argv = ["pretrain_gpt.py", *flags]
    args = parse_args(add_bounded_args)
    validate_args(args, {})
    validate_bounded_args(args)
    return {
        "num_layers": args.num_layers,
        "num_experts": args.num_experts,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "seq_length": args.seq_length,
        "context_parallel_size": args.context_parallel_size,
        "global_batch_size": args.global_batch_size,
        "metrics_jsonl": args.metrics_jsonl,
        "operators": [args.offload_stream_optimizer, args.sco_host_budget_gb > 0, args.ring_dtp,
                      args.pipelined_llep],
    }


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_flags_validate(script):
    world_size, layers, env = EXAMPLES[script]
    flags = recorded_flags(script, env)
    result = run_on_ranks(_validate, 1, args=(flags, world_size))[0]
    assert result["num_layers"] == layers
    assert result["expert_model_parallel_size"] == world_size
    assert result["metrics_jsonl"] == "m.jsonl"  # extra flags reach pretrain_gpt.py
    paper_scale = script != "examples/moe_small/train.sh"
    assert result["operators"] == [paper_scale] * 4  # the paper-scale scripts run all four
    # the paper's layout: every sequence split over all GPUs, one sequence per step
    assert result["context_parallel_size"] == (world_size if paper_scale else 1)
    if paper_scale:
        assert result["global_batch_size"] == 1


def test_operators_none_runs_upstream_paths_only():
    flags = recorded_flags("examples/moe_241b/train.sh", {"OPERATORS": "none"})
    for flag in ("--offload-stream-optimizer", "--sco-host-budget-gb", "--ring-dtp", "--pipelined-llep"):
        assert flag not in flags


def test_environment_overrides_reach_the_flags():
    flags = recorded_flags(
        "examples/moe_120b/train.sh",
        {"SEQ_LENGTH": "1048576", "GLOBAL_BATCH_SIZE": "32", "CHECKPOINT_DIR": "/ckpt"},
    )
    # N = 1M / CP 16 = 65,536 tokens per rank, in 10 chunks
    assert flags[flags.index("--pipelined-llep-token-budget") + 1] == "6554"
    assert flags[flags.index("--pipelined-llep-max-chunks") + 1] == "10"
    assert flags[flags.index("--seq-length") + 1] == "1048576"
    assert flags[flags.index("--global-batch-size") + 1] == "32"
    assert flags[flags.index("--save") + 1] == "/ckpt" and flags[flags.index("--load") + 1] == "/ckpt"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="would start training on a GPU")
def test_train_command_without_gpu_explains_and_exits_2():
    env = dict(os.environ, PYTHON=sys.executable)
    completed = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/train.sh")], env=env, capture_output=True, text=True
    )
    assert completed.returncode == 2
    assert "no CUDA GPU found" in completed.stderr and "Traceback" not in completed.stderr


def test_context_parallel_size_and_chunks_follow_the_environment():
    flags = recorded_flags(
        "examples/moe_667b/train.sh", {"SEQ_LENGTH": "1048576", "CONTEXT_PARALLEL_SIZE": "16"}
    )
    assert flags[flags.index("--context-parallel-size") + 1] == "16"
    assert flags[flags.index("--global-batch-size") + 1] == "4"  # DP = 64 / 16
    # the 667B script's 20 chunks of N = 65,536 tokens
    assert flags[flags.index("--pipelined-llep-token-budget") + 1] == "3277"
