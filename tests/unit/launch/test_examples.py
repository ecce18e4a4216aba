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
from megatron.bounded.units import GB

REPO_ROOT = Path(__file__).resolve().parents[3]
example_argv = load_tool("example_argv.py").example_argv

EXAMPLES = {
    # script: (world size, expected layers, environment)
    "examples/moe_small/train.sh": (2, 8, {"NUM_GPUS": "2"}),
    # SCO's pinned budget is checked against this host's memory: keep it small here
    "examples/moe_120b/train.sh": (16, 7, {"SCO_HOST_BUDGET_GB": "1"}),
    "examples/moe_241b/train.sh": (32, 14, {"SCO_HOST_BUDGET_GB": "1"}),
    "examples/moe_667b/train.sh": (64, 39, {"SCO_HOST_BUDGET_GB": "1"}),
    "examples/qwen3_30b_a3b/train.sh": (8, 48, {"GPUS_PER_NODE": "8", "SCO_HOST_BUDGET_GB": "1"}),
    "examples/gpt_oss_20b/train.sh": (8, 24, {"GPUS_PER_NODE": "8", "SCO_HOST_BUDGET_GB": "1"}),
    "examples/kimi_k2/train.sh": (128, 61, {"GPUS_PER_NODE": "8", "NNODES": "16",
                                            "SCO_HOST_BUDGET_GB": "1"}),
}


def recorded_flags(script: str, env_overrides: dict, extra: list[str] = ()) -> list[str]:
    """The pretrain_gpt.py flags ``script`` launches with, ``extra`` passed to it (nothing runs)."""
    argv = example_argv(REPO_ROOT / script, dict(os.environ, **env_overrides),
                        ["--metrics-jsonl", "m.jsonl", *extra])
    return argv[argv.index("pretrain_gpt.py") + 1 :]


def _validate(rank, world_size, flags, example_world_size):
    os.environ["WORLD_SIZE"] = str(example_world_size)  # validate_args reads the job's size here
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # as examples/common/launch.sh exports it
    from megatron.bounded.upstream import patches
    from megatron.bounded.launch import run_summary
    from megatron.bounded.launch.arguments import replace_refused_flags
    from megatron.bounded.launch.planning import plan_command_line, validate_quietly
    from megatron.bounded.moe.backend import select_moe_backend

    patches.apply_patches()  # as pretrain_gpt.py does on import
    from megatron.bounded.activations import host_memory

    # the examples' nodes (250 GB per GPU), not the RAM of this machine
    host_memory.plan_for_host(250 * GB)

    flags, _ = replace_refused_flags(flags)  # as pretrain_gpt.py: the plan's flags appended
    flags, plan_line = plan_command_line(flags, plan_off="off" in flags)
    args, _, _ = validate_quietly(flags)
    return {
        "plan_line": plan_line,
        "summary": run_summary.describe(args),
        "moe": (select_moe_backend(args), args.moe_expert_rank_capacity_factor, args.moe_paged_stash,
                args.moe_paged_stash_buffer_size_factor_cuda),
        "graph": (args.cuda_graph_impl, args.check_for_nan_in_loss_and_grad),
        "tensorboard_dir": args.tensorboard_dir,
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


def _validate_here(monkeypatch, flags, example_world_size):
    """``_validate`` in this process (cheaper than a new one); monkeypatch restores what it sets."""
    monkeypatch.setenv("WORLD_SIZE", str(example_world_size))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return _validate(0, 1, flags, example_world_size)


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_flags_validate(script):
    world_size, layers, env = EXAMPLES[script]
    flags = recorded_flags(script, env)
    result = run_on_ranks(_validate, 1, args=(flags, world_size))[0]
    assert result["num_layers"] == layers
    assert result["expert_model_parallel_size"] == world_size
    assert result["metrics_jsonl"] == "m.jsonl"  # extra flags reach pretrain_gpt.py
    paper_scale = script != "examples/moe_small/train.sh"
    # the scripts give no operator: the planner chooses them
    for flag in ("--offload-stream-optimizer", "--sco-host-budget-gb", "--ring-dtp", "--pipelined-llep",
                 "--recompute-granularity"):
        assert flag not in flags
    assert result["plan_line"].startswith("[bounded] plan: added")
    # the paper's layout: every sequence split over all GPUs (the families': over the heads a
    # node's GPUs can split), one sequence per data-parallel rank
    context_parallel = min(world_size, 8) if "NNODES" in env else world_size
    assert result["context_parallel_size"] == (context_parallel if paper_scale else 1)
    if paper_scale:
        assert result["global_batch_size"] == world_size // context_parallel
        # operators and layouts not run under the whole-iteration graph: an eager step
        assert result["graph"][0] == "none" and "torch" in result["moe"][0]
    else:
        # the small example at 4,096 tokens: nothing can drop at factor = EP, the stash (EP > 1
        # only: with one rank the rows are exactly the routed ones) holds EP x the average rows,
        # and the step is captured whole with the loss checked on the host
        assert result["operators"] == [False] * 4
        stash = world_size > 1
        assert result["moe"] == ("torch", float(world_size), stash, float(world_size) if stash else 1.1)
        assert result["graph"] == ("full_iteration", False)
        assert "CUDA graph whole iteration (NaN/inf checked on the host" in result["summary"]
        assert "GroupedExperts" in result["summary"]


def test_operators_all_gives_the_four_and_the_planner_keeps_them(monkeypatch):
    flags = recorded_flags("examples/moe_241b/train.sh", {"OPERATORS": "all", "SCO_HOST_BUDGET_GB": "1"})
    for flag in ("--offload-stream-optimizer", "--sco-host-budget-gb", "--ring-dtp", "--pipelined-llep"):
        assert flag in flags
    assert flags[flags.index("--recompute-granularity") + 1] == "full"
    result = _validate_here(monkeypatch, flags, 32)
    assert result["operators"] == [True] * 4 and result["graph"][0] == "none"
    assert "--sco-host-budget-gb" not in result["plan_line"].split(" (")[0]


@pytest.mark.parametrize("env,extra", [({"PLAN": "off"}, []), ({}, ["--bounded-moe-backend", "upstream"])])
def test_upstream_path_on_request(monkeypatch, env, extra):
    """PLAN=off, or --bounded-moe-backend upstream as an extra flag: upstream's alltoall
    dispatcher and SequentialMLP, eager."""
    flags = recorded_flags("examples/moe_small/train.sh", dict(env, NUM_GPUS="1"), extra)
    assert ("--bounded-plan" in flags) == (env.get("PLAN") == "off")
    result = _validate_here(monkeypatch, flags, 1)
    assert result["moe"][:3] == ("upstream", None, False) and result["graph"] == ("none", True)
    assert "MoE upstream MoEAlltoAllTokenDispatcher (EP=1) + SequentialMLP" in result["summary"]
    if extra:
        assert "upstream's MoE path kept: --bounded-moe-backend upstream" in result["plan_line"]
    else:
        assert result["plan_line"] is None


def test_logging_flags_follow_the_environment():
    # the recording stand-in answers the tensorboard import probe like an environment that has it
    flags = recorded_flags("examples/moe_small/train.sh", {"NUM_GPUS": "1", "TENSORBOARD_DIR": "/tb"})
    assert flags[flags.index("--tensorboard-dir") + 1] == "/tb" and "--wandb-project" not in flags
    flags = recorded_flags("examples/moe_small/train.sh", {"NUM_GPUS": "1", "TENSORBOARD_DIR": "",
                                                           "WANDB_API_KEY": "k", "WANDB_PROJECT": "p"})
    assert "--tensorboard-dir" not in flags
    assert flags[flags.index("--wandb-project") + 1] == "p"
    assert flags[flags.index("--wandb-exp-name") + 1] == "moe_small"
    assert flags[flags.index("--wandb-save-dir") + 1].endswith("results/wandb/moe_small")  # no --save here


def _run_example(script: str, env: dict, *args):
    return subprocess.run(["bash", str(REPO_ROOT / script), *args], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)


def test_data_path_without_tokenizer_is_refused_with_the_fix():
    done = _run_example("examples/moe_small/train.sh", {"NUM_GPUS": "1", "DATA_PATH": "/data/x_text_document",
                                                       "PYTHON": "false"})
    assert done.returncode == 2 and "TOKENIZER_MODEL" in done.stderr and "preprocess_data" in done.stderr


def test_gpt2_bpe_offline_says_what_to_do():
    done = _run_example("examples/moe_small/train.sh", {
        "NUM_GPUS": "1", "DATA_PATH": "/data/x", "TOKENIZER_TYPE": "GPT2BPETokenizer",
        "VOCAB_FILE": "/v/vocab.json", "MERGE_FILE": "/v/merges.txt", "HF_HUB_OFFLINE": "1", "PYTHON": "false"})
    assert done.returncode == 2
    assert "network" in done.stderr and "--save-tokenizer" in done.stderr and "TOKENIZER_MODEL=DIR" in done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="counts this machine's GPUs")
@pytest.mark.skipif(not (REPO_ROOT / ".venv/bin/python").exists(), reason="needs the project's .venv")
def test_dry_run_without_gpus_plans_one_gpu_with_the_project_venv(tmp_path):
    # a python3 on PATH that cannot run anything: the example must pick .venv/bin/python itself
    (tmp_path / "python3").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "python3").chmod(0o755)
    env = {"DRY_RUN": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env_without = {key: value for key, value in os.environ.items() if key not in ("NUM_GPUS", "PYTHON")}
    done = subprocess.run(["bash", str(REPO_ROOT / "examples/moe_small/train.sh")],
                          env=dict(env_without, **env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planning for NUM_GPUS=1" in done.stderr and "ZeroDivisionError" not in done.stderr
    assert "[bounded] plan: added" in done.stdout and "Per-GPU memory budget" in done.stdout


def test_environment_overrides_reach_the_flags():
    flags = recorded_flags(
        "examples/moe_120b/train.sh",
        {"SEQ_LENGTH": "1048576", "GLOBAL_BATCH_SIZE": "32", "CHECKPOINT_DIR": "/ckpt",
         "OPERATORS": "all"},
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
        "examples/moe_667b/train.sh", {"SEQ_LENGTH": "1048576", "CONTEXT_PARALLEL_SIZE": "16",
                                       "OPERATORS": "all"}
    )
    assert flags[flags.index("--context-parallel-size") + 1] == "16"
    assert flags[flags.index("--global-batch-size") + 1] == "4"  # DP = 64 / 16
    # the 667B script's 20 chunks of N = 65,536 tokens
    assert flags[flags.index("--pipelined-llep-token-budget") + 1] == "3277"


def test_wandb_key_without_the_package_is_refused_with_the_fix():
    done = _run_example("examples/moe_small/train.sh", {"NUM_GPUS": "1", "WANDB_API_KEY": "k", "PYTHON": "false"})
    assert done.returncode == 2 and "wandb package is not importable" in done.stderr
