"""The memory budget of each example script is the one recorded in ``data/example_budgets.json``:
what the planner (``--bounded-plan auto``, the default) adds to the script's flags, or its
refusal, and every term's bytes, the total, the predicted peak and the verdict of the command line
that runs (the planned one; the flags as given with ``--bounded-plan off`` or a refused plan).

The record was made with the package at the commit it names; a change of the budget's arithmetic,
of the cost model or of the planner's choices must come with a new record (and the measurements on
the operator pages that justify it): ``python -m tests.unit.budget.test_example_budgets`` writes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.launch.test_examples import EXAMPLES, recorded_flags
from megatron.bounded.units import GB

RECORD_PATH = Path(__file__).parents[1] / "data" / "example_budgets.json"
RECORD = json.loads(RECORD_PATH.read_text())
LONG_CONTEXT = ["--seq-length", "524288", "--max-position-embeddings", "524288",
                "--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1", "--hbm-gb", "30"]
# the same flags run as given (at the micro-batch PLAN=off gives): a command line that does not fit
LONG_CONTEXT_AS_GIVEN = LONG_CONTEXT + ["--micro-batch-size", "1", "--bounded-plan", "off"]
# a length no plan fits on a GPU of 30 GB: the planner's refusal (the budget recorded is of the
# flags as given, which validate with a micro-batch)
BEYOND_REACH = ["--seq-length", "16777216", "--max-position-embeddings", "16777216",
                "--micro-batch-size", "1", "--hbm-gb", "30"]
CASES = [(script, world, env, []) for script, (world, _layers, env) in EXAMPLES.items()]
CASES += [("examples/moe_small/train.sh", 2, {"NUM_GPUS": "2"}, extra)
          for extra in (LONG_CONTEXT, LONG_CONTEXT_AS_GIVEN, BEYOND_REACH)]
# the host memory per GPU the plans are for (tools/memory_budget.py's default), not this host's
PLANNED_HOST_GB = 250


def _key(script, extra):
    return script + (" " + " ".join(extra) if extra else "")


def _budget_of(script, world, env, extra, monkeypatch):
    """``{"plan", "refusal", "terms", "total", "peak_allocated", "feasible"}`` of the script's
    flags as pretrain_gpt.py plans and validates them: ``plan`` the flags the planner appends
    (None with --bounded-plan off or when it refuses, then ``refusal`` says why), the budget that
    of the command line that runs (of the flags as given when the plan is refused)."""
    from megatron.bounded import budget
    from megatron.bounded.activations import host_memory
    from megatron.bounded.launch import planning
    from megatron.bounded.launch.arguments import replace_refused_flags
    from megatron.bounded.settings import BoundedArgumentError
    from megatron.bounded.upstream import patches

    patches.apply_patches()
    # the record is of the plan for the examples' machines, not of the machine the test runs on:
    # the budget's GPU (one H200, unless the flags give --hbm-gb) and 250 GB of host memory per
    # GPU (restored after the test)
    monkeypatch.setattr(planning, "with_this_gpu_memory", lambda settings: settings)
    monkeypatch.setattr(host_memory, "_planned_bytes_per_gpu", PLANNED_HOST_GB * GB)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    flags, _ = replace_refused_flags(recorded_flags(script, env, extra))
    plan_off = "--bounded-plan" in flags and flags[flags.index("--bounded-plan") + 1] == "off"
    refusal = None
    try:
        planned, _line = planning.plan_command_line(flags, plan_off=plan_off)
    except BoundedArgumentError as refused:
        planned, refusal = flags, str(refused)
    args, settings, _ = planning.validate_quietly(planned)
    plan = budget.estimate(args, settings)
    return {
        "plan": None if plan_off or refusal else " ".join(planned[len(flags):]),
        "refusal": refusal,
        "terms": {name: int(value) for name, value in plan.terms.items()},
        "total": int(plan.total), "peak_allocated": int(plan.peak_allocated),
        "feasible": bool(plan.feasible),
    }


NAMES = {" ".join(LONG_CONTEXT): " long context",
         " ".join(LONG_CONTEXT_AS_GIVEN): " long context as given",
         " ".join(BEYOND_REACH): " beyond reach"}


@pytest.mark.parametrize("script, world, env, extra", CASES,
                         ids=[case[0] + NAMES.get(" ".join(case[3]), "") for case in CASES])
def test_example_budget_is_the_recorded_one(script, world, env, extra, monkeypatch):
    assert _budget_of(script, world, env, extra, monkeypatch) == RECORD["budgets"][_key(script, extra)]


def test_the_record_covers_a_plan_that_does_not_fit():
    # so that the budget of a command line that does not fit and the planner's refusal are
    # compared too, not only fitting plans; and the planner's operators where the flags need them
    budgets = RECORD["budgets"]
    assert any(not entry["feasible"] and entry["plan"] is None and entry["refusal"] is None
               for entry in budgets.values())
    assert any(entry["refusal"] and "The longest --seq-length that fits is" in entry["refusal"]
               for entry in budgets.values())
    long_context = budgets[_key("examples/moe_small/train.sh", LONG_CONTEXT)]
    as_given = budgets[_key("examples/moe_small/train.sh", LONG_CONTEXT_AS_GIVEN)]
    assert long_context["feasible"] and not as_given["feasible"]
    assert long_context["total"] < as_given["total"]
    assert any(flag in long_context["plan"].split() for flag in
               ("--offload-stream-optimizer", "--sco-host-budget-gb", "--ring-dtp"))


def _write_record(commit: str) -> None:
    """Record every case with the package as it is (``commit``: the commit it is at)."""
    budgets = {}
    for script, world, env, extra in CASES:
        with pytest.MonkeyPatch.context() as monkeypatch:
            budgets[_key(script, extra)] = _budget_of(script, world, env, extra, monkeypatch)
    record = {
        "budgets": budgets,
        "recorded_at": commit,
        "what": "for each example script's flags (the extra flags follow the script name), as "
                "pretrain_gpt.py plans and validates them: the flags the planner "
                "(--bounded-plan auto) appends (plan; null with --bounded-plan off or a refused "
                "plan, whose refusal is kept), and megatron.bounded.budget.estimate of the command "
                "line that runs (bytes per term, total, peak allocated, verdict) for one H200 "
                f"unless --hbm-gb is given, {PLANNED_HOST_GB} GB of host memory per GPU",
    }
    RECORD_PATH.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    _write_record(sys.argv[1] if len(sys.argv) > 1 else subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        check=True).stdout.strip())
