#!/usr/bin/env python
"""Per-GPU memory budget (the paper's Eq. 6) of a pretrain_gpt.py command line, on the CPU.

    python tools/memory_budget.py [--world-size N] [--json PATH] [--auto-bounds] \\
        [--no-formulas] <pretrain_gpt.py flags>

The pretrain_gpt.py flags are parsed by upstream's parser with this project's argument provider
(``megatron.bounded.launch.arguments.add_bounded_args``) and checked by upstream's ``validate_args``,
exactly as pretrain_gpt.py does, but nothing is initialized: no torch.distributed, no CUDA, no
tokenizer. The world size comes from ``--world-size`` (a flag of this tool, removed before
parsing) or else the ``WORLD_SIZE`` environment variable, or 1. Then
``megatron.bounded.budget.estimate`` prints the table: every term in GiB and % of HBM, the
dominant term, the verdict and, for a plan that does not fit, the flags that would fix it.

Tool options (removed before the pretrain_gpt.py flags are parsed):
  --world-size N              ranks of the job (sets WORLD_SIZE for validate_args)
  --json PATH                 also write the terms, total, verdict, notes and fixes as JSON
  --no-formulas               leave the per-term formulas out of the table
  --ring-dtp-group-size P     ranks of the Ring-DTP ring (default: the data-parallel size)
With the pretrain_gpt.py flag --auto-bounds the tool also chooses the operators' knobs
(megatron.bounded.budget.choose_bounds) and prints the budget with them; the exit status then
refers to that plan.

Pinned host memory (SCO, the streamed optimizer) is checked against this machine's RAM, as
pretrain_gpt.py checks it where it runs; planning here for another machine, give its host memory
per GPU with the pretrain_gpt.py flag --budget-host-gb.

Exit status: 0 the plan fits, 3 it does not (pretrain_gpt.py would warn and launch), 2
pretrain_gpt.py refuses the flags: invalid flags, ``--memory-budget-check error`` with a plan that
does not fit, or ``--auto-bounds`` with no setting that fits.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

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
    # a planning assumption the budget takes (megatron.bounded.budget.estimate), not a training flag
    tool.add_argument("--ring-dtp-group-size", type=int, default=None)
    return tool.parse_known_args(argv)


def parse_training_args(argv, world_size):
    """(args, run settings): upstream parse_args + validate_args with our provider, then our
    validation; no distributed or CUDA init.

    Upstream prints its argument table while validating: that goes to a buffer, shown only if
    validation fails.
    """
    upstream, ours = _quiet_imports()
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("RANK", "0")
    from megatron.bounded.launch.fast_path import FLAG, expand_fast_path, given_flags

    argv, replaced = ours.replace_refused_flags(argv)  # as pretrain_gpt.py replaces them
    fast_path_line = None
    if FLAG in given_flags(argv):  # (parsed twice only when the fast path rewrites the flags)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            argv, fast_path_line = expand_fast_path(argv, ours.parse_without_validation(argv))
    if fast_path_line:
        print(fast_path_line)  # as pretrain_gpt.py prints it: the budget is of these flags
    saved_argv = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = upstream.parse_args(ours.add_bounded_args)
            for note in replaced:
                ours.note_substitution(args, note)
            _plan_for_stated_host(argv, args)
            ours.validate_flags_early(args)  # what pretrain_gpt.py refuses before upstream's checks
            upstream.validate_args(args, {})
    except SystemExit:
        sys.stderr.write(captured.getvalue())
        raise
    except Exception as exc:  # upstream validation raises AssertionError / ValueError
        sys.stderr.write(captured.getvalue())
        print(f"memory_budget: the flags do not validate: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        raise SystemExit(EXIT_BAD_FLAGS) from exc
    finally:
        sys.argv = saved_argv
    try:
        settings = ours.validate_bounded_args(args)
    except ours.BoundedArgumentError as exc:
        # the checks pretrain_gpt.py runs: a plan it would refuse to start is not planned
        print(f"memory_budget: pretrain_gpt.py refuses these flags: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_FLAGS) from exc
    return args, settings


def _plan_for_stated_host(argv, args) -> None:
    """With --budget-host-gb the pinned host memory is checked against that much per GPU (the
    plan is for the machine that trains, not this one); without it, against this host's RAM,
    as pretrain_gpt.py checks it."""
    from megatron.bounded.activations import host_memory
    from megatron.bounded.budget.config import BudgetSettings
    from megatron.bounded.launch.fast_path import given_flags

    stated = "--budget-host-gb" in given_flags(argv)
    settings = BudgetSettings.from_args(args, check=False)
    host_memory.plan_for_host(settings.host_bytes_per_gpu if stated else None)


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
    args, settings = parse_training_args(rest, world)

    from megatron.bounded import budget as B

    try:
        cfg = B.BudgetConfig.from_args(args, settings, ring_group=tool_opts.ring_dtp_group_size)
        cfg, placed = B.place_kept_attention(cfg)  # as pretrain_gpt.py resolves auto
        plan = B.estimate_config(cfg)
    except ValueError as exc:  # e.g. no vocabulary size to count the parameters with
        print(f"memory_budget: the budget cannot be computed: {exc}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    if placed:
        print(f"--chunked-recompute-keep-attention auto: "
              f"{cfg.chunked_attention.chunked_recompute_keep_attention} ({placed})")
    print(B.render(plan, with_notes=not tool_opts.no_formulas))
    record = {"budget": B.to_dict(plan)}
    verdict = plan.feasible
    if settings.budget.auto_bounds:
        auto = B.choose_bounds(cfg)
        print()
        if auto["feasible"]:
            print(f"--auto-bounds: fits with {auto['command_line'] or '(no operator)'} "
                  f"(expected cost {auto['cost_s']:.3f} s/step: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in auto["cost_breakdown"].items())
                  + ")")
        else:
            print("--auto-bounds: no setting of the operators fits; closest: "
                  f"{auto['command_line']}")
        print(B.render(auto["budget"], with_notes=False))
        record["auto_bounds"] = {
            "feasible": auto["feasible"], "flags": auto["flags"],
            "command_line": auto["command_line"], "cost_s": auto["cost_s"],
            "cost_breakdown": auto["cost_breakdown"], "budget": B.to_dict(auto["budget"]),
        }
        verdict = auto["feasible"]
    if tool_opts.json is not None:
        tool_opts.json.parent.mkdir(parents=True, exist_ok=True)
        tool_opts.json.write_text(json.dumps(record, indent=2) + "\n")
    refusal = B.plan_refusal(settings.budget, verdict)
    if refusal:
        print(f"memory_budget: pretrain_gpt.py refuses this plan: {refusal}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    return EXIT_FITS if verdict else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
