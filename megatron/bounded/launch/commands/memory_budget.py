"""Per-GPU memory budget (the paper's Eq. 6) of a pretrain_gpt.py command line, on the CPU, for
the machine that will train.

    bounded-memory-budget [--world-size N] [--json PATH] [--no-formulas] <pretrain_gpt.py flags>
    python tools/memory_budget.py ...        (the same, from a clone without installing it)

The pretrain_gpt.py flags go through what pretrain_gpt.py does before it builds anything: the
planner (``--bounded-plan auto``, the default) appends the flags of the fastest plan that fits and
prints its start-up line, then upstream's parser and ``validate_args`` and this project's checks
run; nothing is initialized: no torch.distributed, no CUDA, no tokenizer. The world size comes
from ``--world-size`` (a flag of this tool, removed before parsing) or else the ``WORLD_SIZE``
environment variable, or 1. Then ``megatron.bounded.budget.estimate`` prints the table: every term
in GiB and % of HBM, the dominant term, the verdict and, for a plan that does not fit, the flags
that would fix it.

Tool options (removed before the pretrain_gpt.py flags are parsed):
  --world-size N              ranks of the job (sets WORLD_SIZE for validate_args)
  --json PATH                 also write the terms, total, verdict, notes, fixes and plan as JSON
  --no-formulas               leave the per-term formulas out of the table
  --ring-dtp-group-size P     ranks of the Ring-DTP ring (default: the data-parallel size)
  --this-machine              plan for this machine (its GPU and its RAM per GPU process,
                              LOCAL_WORLD_SIZE), print nothing but a refusal: the example scripts
                              run this before torchrun, so that a plan no GPU fits is refused
                              with one message

The plan is for the training machine, not this one: its GPU memory is --hbm-gb (default one
H200's without a visible GPU) and its host memory per GPU --budget-host-gb (default 250, a node of
2 TB and 8 GPUs), whatever this machine has.

Exit status: 0 the plan fits, 3 it does not (only with --memory-budget-check warn or off:
pretrain_gpt.py would launch it), 2 pretrain_gpt.py refuses the flags: invalid flags, no plan that
fits, or a plan that does not fit with --memory-budget-check error (the default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

EXIT_FITS, EXIT_BAD_FLAGS, EXIT_DOES_NOT_FIT = 0, 2, 3

def _quiet_imports():
    """Import upstream's argument code (patched) without its TE/Apex fallback warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.bounded.upstream import patches
        from megatron.training import arguments as upstream  # noqa: F401
        from megatron.bounded.launch import arguments as ours  # noqa: F401

        patches.apply_patches()  # e.g. flag validation without a GPU
    return upstream, ours


def split_argv(argv):
    """(this tool's options, the pretrain_gpt.py flags)."""
    tool = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    tool.add_argument("--world-size", type=int, default=None)
    tool.add_argument("--json", type=Path, default=None)
    tool.add_argument("--no-formulas", action="store_true")
    tool.add_argument("--this-machine", action="store_true")
    # a planning assumption the budget takes (megatron.bounded.budget.estimate), not a training flag
    tool.add_argument("--ring-dtp-group-size", type=int, default=None)
    return tool.parse_known_args(argv)


def parse_training_args(argv, world_size, this_machine=False):
    """(args, run settings, the plan's start-up line): as pretrain_gpt.py, the refused choices
    replaced, the planner's flags appended (unless --bounded-plan off), then upstream's parse and
    validation and ours; no distributed or CUDA init.

    Upstream prints its argument table while validating: that goes to a buffer, shown only if
    validation fails. A plan that cannot fit is refused as pretrain_gpt.py refuses it.
    ``this_machine``: plan for this host's RAM (and GPU), as pretrain_gpt.py will.
    """
    _quiet_imports()
    from megatron.bounded.budget.config import DEFAULT_PLANNED_HOST_GB

    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("RANK", "0")
    from megatron.bounded.launch import arguments as ours
    from megatron.bounded.launch.planning import (
        plan_command_line, plan_for_stated_host, validate_quietly,
    )

    argv, replaced = ours.replace_refused_flags(argv)  # as pretrain_gpt.py replaces them
    refused = "[bounded] error:" if this_machine else "memory_budget: pretrain_gpt.py refuses this plan:"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = ours.parse_without_validation(argv)
    except SystemExit:  # argparse printed why
        raise SystemExit(EXIT_BAD_FLAGS) from None
    # the machine that trains: this one, or the host memory per GPU stated (default: 250 GB)
    plan_for_stated_host(parsed, None if this_machine else DEFAULT_PLANNED_HOST_GB)
    try:
        argv, plan_line = plan_command_line(argv, plan_off=parsed.bounded_plan == "off")
    except ours.BoundedArgumentError as exc:
        print(f"{refused} {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_FLAGS) from exc
    try:
        args, settings, _ = validate_quietly(argv)
    except ours.BoundedArgumentError as exc:
        # the checks pretrain_gpt.py runs: a plan it would refuse to start is not planned
        print(f"memory_budget: pretrain_gpt.py refuses these flags: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_FLAGS) from exc
    except SystemExit:
        raise
    except Exception as exc:  # upstream validation raises AssertionError / ValueError
        print(f"memory_budget: the flags do not validate: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        raise SystemExit(EXIT_BAD_FLAGS) from exc
    for note in replaced:
        ours.note_substitution(args, note)
    return args, settings, plan_line


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return EXIT_FITS if argv else EXIT_BAD_FLAGS
    tool_opts, rest = split_argv(argv)
    world = tool_opts.world_size
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "0") or 0) or None
    if world is None:
        print("memory_budget: no --world-size and no WORLD_SIZE: assuming 1 rank",
              file=sys.stderr)
        world = 1
    from megatron.bounded.activations import host_memory

    try:
        return _plan_and_report(tool_opts, rest, world)
    finally:
        host_memory.plan_for_host(None)  # the planned host is this call's, not the process's


def _plan_and_report(tool_opts, rest, world) -> int:
    args, settings, plan_line = parse_training_args(rest, world, tool_opts.this_machine)
    if tool_opts.this_machine:
        return EXIT_FITS  # the launch that follows prints the plan
    if plan_line:
        print(plan_line)  # as pretrain_gpt.py prints it: the budget is of these flags

    from megatron.bounded import budget as B

    try:
        cfg = B.BudgetConfig.from_args(args, settings, ring_group=tool_opts.ring_dtp_group_size)
        cfg, placed = B.place_kept_attention(cfg)  # as pretrain_gpt.py resolves auto
        plan = B.estimate_config(cfg)
    except ValueError as exc:  # e.g. no vocabulary size to count the parameters with
        print(f"memory_budget: the budget cannot be computed: {exc}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    if placed:
        print(cfg.chunked_attention.placed_text(placed))
    print(B.render(plan, with_notes=not tool_opts.no_formulas))
    record = {"budget": B.to_dict(plan), "plan": plan_line}
    verdict = plan.feasible
    if tool_opts.json is not None:
        tool_opts.json.parent.mkdir(parents=True, exist_ok=True)
        tool_opts.json.write_text(json.dumps(record, indent=2) + "\n")
    refusal = B.plan_refusal(settings.budget, verdict)
    if refusal:
        print(f"memory_budget: pretrain_gpt.py refuses this plan: {refusal}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    return EXIT_FITS if verdict else EXIT_DOES_NOT_FIT
