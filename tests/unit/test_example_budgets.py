"""The memory budget of each example script is the one recorded in ``data/example_budgets.json``:
every term's bytes, the total, the predicted peak, the verdict and --auto-bounds' choice.

The record was made with the package at the commit it names; a change of the budget's arithmetic
must come with a new record (and the measurements on the operator pages that justify it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.unit.test_examples import EXAMPLES, recorded_flags

RECORD = json.loads((Path(__file__).parent / "data" / "example_budgets.json").read_text())
LONG_CONTEXT = ["--seq-length", "524288", "--max-position-embeddings", "524288",
                "--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1", "--hbm-gb", "30"]
CASES = [(script, world, env, []) for script, (world, _layers, env) in EXAMPLES.items()]
CASES.append(("examples/moe_small/train.sh", 2, {"NUM_GPUS": "2"}, LONG_CONTEXT))


def _budget_of(script, world, env, extra, monkeypatch):
    from megatron.bounded import budget
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch.arguments import (
        add_bounded_args, parse_without_validation, validate_bounded_args,
    )
    from megatron.bounded.launch.fast_path import expand_fast_path
    from megatron.bounded.upstream import patches
    from megatron.training.arguments import parse_args, validate_args

    patches.apply_patches()
    # the record is of the budget, not of the RAM of the machine the test runs on: an unknown
    # host, whose pinned memory is not checked
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 0)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    flags = recorded_flags(script, env, extra)
    flags, _ = expand_fast_path(flags, parse_without_validation(flags))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    args = parse_args(add_bounded_args)
    validate_args(args, {})
    settings = validate_bounded_args(args)
    plan = budget.estimate(args, settings)
    choice = budget.choose_bounds(budget.BudgetConfig.from_args(args, settings))
    return {
        "terms": {name: int(value) for name, value in plan.terms.items()},
        "total": int(plan.total), "peak_allocated": int(plan.peak_allocated),
        "feasible": bool(plan.feasible), "auto_bounds": choice["command_line"],
    }


@pytest.mark.parametrize("script, world, env, extra", CASES,
                         ids=[case[0] + (" long context" if case[3] else "") for case in CASES])
def test_example_budget_is_the_recorded_one(script, world, env, extra, monkeypatch):
    key = script + (" " + " ".join(extra) if extra else "")
    assert _budget_of(script, world, env, extra, monkeypatch) == RECORD["budgets"][key]


def test_the_record_covers_a_plan_that_does_not_fit():
    # so that --auto-bounds' choice and the fixes are compared too, not only fitting plans
    assert any(not entry["feasible"] and entry["auto_bounds"] for entry in RECORD["budgets"].values())
