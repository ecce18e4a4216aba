#!/usr/bin/env python
"""The planner's cost model against measured step times: one row per measurement.

    python tools/benchmarks/cost_model_table.py [ROWS_JSON] [--markdown]

ROWS_JSON (default docs/results/planner_1xh100/step_times.json) lists measured steps, each with
the example script and environment that ran it, the extra flags, the GPU and host memory of the
machine (``hbm_gb``, ``host_gb`` per GPU, decimal GB), the measured seconds per iteration, and
where the record is. Each row's command line is rebuilt by the example script
itself (``tools/example_argv.py``: the torchrun command it would run), planned as pretrain_gpt.py
plans it (``PLAN=off`` rows are not: their plan's flags are in the row), and the cost model's
seconds per step (``megatron.bounded.budget.predicted_step``) are printed beside the measured
ones; ``--markdown`` prints the table of docs/planner.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
DEFAULT_ROWS = REPO_ROOT / "docs" / "results" / "planner_1xh100" / "step_times.json"


def example_flags(row: dict) -> list:
    """The pretrain_gpt.py flags the row's example script passes (its torchrun command)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from example_argv import example_argv

    env = {**os.environ, "DRY_RUN": "0", "TENSORBOARD_DIR": "", "CHECKPOINT_DIR": "", **row["env"]}
    argv = example_argv(REPO_ROOT / row["example"], env, row.get("extra", []))
    return argv[argv.index("pretrain_gpt.py") + 1:]


def predicted(row: dict):
    """(the plan's start-up line or None, the cost model's StepCost) of the row's command."""
    from megatron.bounded import budget
    from megatron.bounded.activations import host_memory
    from megatron.bounded.units import GB
    from megatron.bounded.launch import arguments
    from megatron.bounded.launch.planning import plan_command_line, validate_quietly
    from megatron.bounded.upstream import patches

    patches.apply_patches()
    host_memory.plan_for_host(int(row["host_gb"] * GB))  # the machine that ran it
    os.environ.setdefault("WORLD_SIZE", str(row["env"].get("NUM_GPUS", "1")))
    argv, _ = arguments.replace_refused_flags(example_flags(row))
    argv += ["--hbm-gb", str(row["hbm_gb"])]
    plan_off = row["env"].get("PLAN") == "off"
    with contextlib.redirect_stdout(io.StringIO()):
        argv, line = plan_command_line(argv, plan_off=plan_off)
        args, _, _ = validate_quietly(argv)
    return line, budget.predicted_step(args)


def rows_of(path: Path) -> list:
    return json.loads(path.read_text())["rows"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    markdown = "--markdown" in argv
    paths = [Path(a) for a in argv if a != "--markdown"] or [DEFAULT_ROWS]
    if markdown:
        print("| run | measured s/step | predicted s/step | predicted / measured | date | commit "
              "| hardware | command |")
        print("|---|---|---|---|---|---|---|---|")
    for row in rows_of(paths[0]):
        _, cost = predicted(row)
        ratio = cost.seconds / row["measured_s"]
        if markdown:
            print(f"| {row['name']} | {row['measured_s']:.4g} | {cost.seconds:.4g} | {ratio:.3f} "
                  f"| {row['date']} | {row['commit']} | {row['hardware']} | `{row['command']}` |")
        else:
            terms = ", ".join(f"{k} {v:.3g}" for k, v in cost.terms.items() if v)
            print(f"{row['name']}: measured {row['measured_s']:.4g} s, predicted "
                  f"{cost.seconds:.4g} s ({ratio:.3f}): {terms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
