"""The planner on the example scripts, as pretrain_gpt.py runs it: every example × GPU count ×
sequence length × GPU memory. A plan it makes passes every check pretrain_gpt.py applies, builds
its model config and fits the GPU; where none fits, the refusal names the longest length that
does (and that length is planned); a flag of the example is never changed."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.unit.launch.test_examples import recorded_flags
from megatron.bounded.units import GB

SCRIPTS = ("examples/moe_small/train.sh", "examples/qwen3_30b_a3b/train.sh",
           "examples/gpt_oss_20b/train.sh", "examples/kimi_k2/train.sh",
           "examples/moe_120b/train.sh")
GPUS = (1, 8, 16)
LENGTHS = (4096, 131072, 1048576, 4194304)
HBM_GB = (85.0, 150.1)  # one H100 80 GB and one H200, as torch reports them
HOST_GB = 250
LONGEST = re.compile(r"The longest --seq-length that fits is ([\d,]+)")


def example_env(script: str, gpus: int, length: int) -> dict:
    per_node, nodes = min(gpus, 8), max(1, gpus // 8)
    env = {"SEQ_LENGTH": str(length), "TRAIN_ITERS": "10", "NNODES": str(nodes)}
    env.update({"NUM_GPUS": str(per_node)} if "moe_small" in script else
               {"GPUS_PER_NODE": str(per_node)})
    return env


def plan_example(script: str, gpus: int, length: int, hbm_gb: float, monkeypatch):
    """(the example's flags, the flags planned, the start-up line) or the refusal."""
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch.arguments import replace_refused_flags
    from megatron.bounded.launch.planning import plan_command_line
    from megatron.bounded.upstream import patches

    patches.apply_patches()
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    host_memory.plan_for_host(HOST_GB * GB)
    flags = recorded_flags(script, example_env(script, gpus, length), ["--hbm-gb", str(hbm_gb)])
    flags, _ = replace_refused_flags(flags)
    planned, line = plan_command_line(flags, plan_off=False)
    return flags, planned, line


def check_plan(flags, planned, hbm_gb):
    """Every check pretrain_gpt.py applies, the model config, the budget at the GPU's memory, and
    no given flag changed."""
    from megatron.bounded import budget
    from megatron.bounded.launch.planning import given_attributes, validate_quietly

    args, settings, _ = validate_quietly(planned)
    settings.transformer_config(args)  # the model config builds (its own checks included)
    plan = budget.estimate(args, settings)
    assert plan.feasible and plan.hbm_bytes == int(hbm_gb * GB)
    added = planned[len(flags):]
    assert not given_attributes(added) & given_attributes(flags), added


GRID = list(itertools.product(SCRIPTS, GPUS, LENGTHS, HBM_GB))


@pytest.mark.parametrize("script, gpus, length, hbm_gb", GRID,
                         ids=[f"{s.split('/')[1]}-{g}gpu-{n}-{h:g}GB" for s, g, n, h in GRID])
def test_every_plan_passes_the_checks_and_fits_or_names_the_longest(script, gpus, length, hbm_gb,
                                                                    monkeypatch):
    from megatron.bounded.settings import BoundedArgumentError

    if "moe_small" not in script and gpus == 1 and length > 4096:
        pytest.skip("the full-size families on one GPU: the 4,096-token case shows the refusal")
    try:
        flags, planned, line = plan_example(script, gpus, length, hbm_gb, monkeypatch)
    except BoundedArgumentError as refused:
        text = str(refused)
        assert "does not fit" in text
        longest = LONGEST.search(text)
        assert longest or "Not even 1,024 tokens fit" in text, text
        if longest:
            assert int(longest.group(1).replace(",", "")) < length
        return
    assert line.startswith("[bounded] plan: added"), line
    check_plan(flags, planned, hbm_gb)


def test_the_longest_length_named_is_planned(monkeypatch):
    from megatron.bounded.settings import BoundedArgumentError

    script = "examples/moe_small/train.sh"
    with pytest.raises(BoundedArgumentError) as refused:
        plan_example(script, 1, 8388608, 85.0, monkeypatch)
    longest = int(LONGEST.search(str(refused.value)).group(1).replace(",", ""))
    flags, planned, _ = plan_example(script, 1, longest * 95 // 100 // 1024 * 1024, 85.0,
                                     monkeypatch)
    check_plan(flags, planned, 85.0)


DOCUMENTED_DRY_RUNS = [  # (environment, script): the dry runs the examples and README document
    ({}, "examples/moe_small/train.sh"),
    ({"SEQ_LENGTH": "1048576"}, "examples/moe_small/train.sh"),
    ({"NUM_GPUS": "8", "SEQ_LENGTH": "131072"}, "examples/moe_small/train.sh"),
    ({"SEQ_LENGTH": "1048576"}, "examples/moe_120b/train.sh"),
    ({"SEQ_LENGTH": "1048576"}, "examples/moe_241b/train.sh"),
    ({"SEQ_LENGTH": "1048576"}, "examples/moe_667b/train.sh"),
    ({"GPUS_PER_NODE": "8"}, "examples/gpt_oss_20b/train.sh"),
    ({"GPUS_PER_NODE": "8"}, "examples/qwen3_30b_a3b/train.sh"),
    ({"GPUS_PER_NODE": "8", "NNODES": "16"}, "examples/kimi_k2/train.sh"),
]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans for this machine's GPUs")
@pytest.mark.parametrize("env, script", DOCUMENTED_DRY_RUNS,
                         ids=[f"{s.split('/')[1]}-{'-'.join(e.values()) or 'default'}"
                              for e, s in DOCUMENTED_DRY_RUNS])
def test_the_documented_dry_run_plans_a_fit_for_its_target(env, script):
    """On this CPU machine, whatever its RAM: exit 0, the plan's line, a budget that fits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    launch_env = {key: value for key, value in os.environ.items()
                  if key not in ("NUM_GPUS", "GPUS_PER_NODE", "HBM_GB", "HOST_GB")}
    launch_env.update(env, DRY_RUN="1", PYTHON=sys.executable)
    done = subprocess.run(["bash", str(repo / script), "--no-formulas"], env=launch_env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[bounded] plan: added" in done.stdout and "verdict: FITS" in done.stdout
