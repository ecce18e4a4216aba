"""The planner on the command line: ``--bounded-plan auto`` (the default) appends the flags of the
fastest plan that fits to the command line before upstream parses it, so that what runs is an
ordinary command line that upstream's and this project's validation check like any other, and a
plan that cannot fit is refused before anything is built.

The planner (:func:`megatron.bounded.budget.plan_run`) needs the flags as upstream's validation
leaves them (the data-parallel size, the defaults it derives): it plans on a copy validated here
with upstream's argument table held back; the flags given on the command line are never changed.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import warnings
from typing import List, Optional, Sequence, Tuple

from megatron.bounded import budget
from megatron.bounded.launch.arguments import (
    RunSettings, add_bounded_args, validate_bounded_args, validate_flags_early,
    with_this_gpu_memory,
)
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.units import GB


def given_attributes(argv: Sequence[str]) -> set:
    """The ``args`` attributes the flags of ``argv`` set (``--no-x`` sets ``x``)."""
    names = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        names.add(name)
        if name.startswith("no_"):
            names.add(name[3:])
    return names


def plan_for_stated_host(parsed, default_gb: Optional[float]) -> None:
    """Plan and check pinned host memory against ``--budget-host-gb`` per GPU when it is given,
    else ``default_gb``; with neither, as it is (this host's RAM per GPU process unless planned
    otherwise). ``parsed``: the flags parsed without validation."""
    from megatron.bounded.activations import host_memory

    stated = parsed.budget_host_gb or default_gb
    if stated is not None and math.isfinite(stated) and stated > 0:  # else its check refuses it
        host_memory.plan_for_host(int(stated * GB))


def validate_quietly(argv: Sequence[str]) -> Tuple[object, RunSettings, str]:
    """``(args, settings, upstream's output)``: ``argv`` parsed and validated as pretrain_gpt.py
    does (upstream's parser with our flags, our early checks, upstream's validation, ours),
    with upstream's argument table and warnings held back. Raises what validation raises."""
    from megatron.training.arguments import parse_args, validate_args

    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = parse_args(add_bounded_args)
            validate_flags_early(args)
            validate_args(args, {})
            settings = validate_bounded_args(args)
    finally:
        sys.argv = saved
    return args, settings, captured.getvalue()


def plan_command_line(argv: Sequence[str], plan_off: bool) -> Tuple[List[str], Optional[str]]:
    """``(argv with the plan's flags appended, the start-up line)``; ``argv`` unchanged with
    ``plan_off`` (``--bounded-plan off``: no line) or when the flags do not validate (the line
    says why; the real parse then reports it). Raises :class:`BoundedArgumentError` when no plan fits."""
    argv = list(argv)
    if plan_off:
        return argv, None
    given = given_attributes(argv)
    # upstream's validation needs a micro-batch; the planner chooses it when none is given
    stand_in = [] if "micro_batch_size" in given else ["--micro-batch-size", "1"]
    try:
        args, settings, _ = validate_quietly(argv + stand_in)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - the validation that follows reports it
        return argv, (f"[bounded] plan: none made, the flags as given ({type(error).__name__}: "
                      f"{error}; the validation below reports it)")
    settings = with_this_gpu_memory(settings)
    args.hbm_gb = settings.budget.hbm_gb
    plan = budget.plan_run(args, given)
    if not plan.feasible:
        at_longest = budget.longest_plan(args, given, plan.longest)
        raise BoundedArgumentError(budget.planner_refusal(plan, args, at_longest))
    return argv + plan.command_line(), plan.line()

