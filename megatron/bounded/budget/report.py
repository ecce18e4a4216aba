"""The budget as users see it: the table, its JSON form, and the launch-time check."""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron.bounded.activations.host_memory import check_pinned_host_memory, pinned_limit_per_gpu
from megatron.bounded.budget.config import BudgetConfig, operator_settings
from megatron.bounded.budget.fixes import fixes
from megatron.bounded.budget.terms import (
    PINNED_HOST_FIXES, TERM_LABELS, Budget, estimate, pinned_host_gib, stage_budgets,
)
from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.units import GB, GiB


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def _stage_text(details) -> str:
    if details.get("pp", 1) > 1:
        return f", pipeline stage {details.get('stage')} (the largest of {details.get('pp')})"
    return ""


def to_dict(budget: Budget) -> dict:
    return {
        "terms": dict(budget.terms),
        "total": budget.total,
        "peak_allocated": budget.peak_allocated,
        "hbm_bytes": budget.hbm_bytes,
        "feasible": budget.feasible,
        "dominant": budget.dominant,
        "notes": dict(budget.notes),
        "host_terms": dict(budget.host_terms),
        "details": {k: v for k, v in budget.details.items() if _jsonable(v)},
        "fixes": fixes(budget),
    }


def render(budget: Budget, with_notes: bool = True) -> str:
    """The table: GiB and % of HBM per term, the dominant term, the verdict and fixes."""
    gib = lambda x: x / GiB  # noqa: E731
    hbm = budget.hbm_bytes
    d = budget.details
    lines = [
        f"Per-GPU memory budget (Eq. 6){_stage_text(d)}: HBM {hbm / GB:g} GB "
        f"(= {gib(hbm):.2f} GiB; decimal GB, one H200 by default)",
        f"  N = {d.get('tokens', '?'):,} tokens/rank, world {d.get('world')}, "
        f"TP {d.get('tp')} PP {d.get('pp')} CP {d.get('cp')} EP {d.get('ep')} "
        f"DP {d.get('dp')}, expert-DP {d.get('edp')}",
        f"  operators: {d.get('operators') or 'none'}",
        "",
        f"  {'term':<30}{'GiB':>10}{'% HBM':>9}",
        "  " + "-" * 49,
    ]
    for name, value in budget.terms.items():
        lines.append(f"  {TERM_LABELS.get(name, name):<30}{gib(value):>10.2f}"
                     f"{100 * value / hbm:>8.1f}%")
    lines.append("  " + "-" * 49)
    if d.get("peak_phase"):
        lines.append(f"  peak phase: {d['peak_phase']} (terms of other phases are live at "
                     f"other moments and not added; the peak's terms: "
                     f"{', '.join(d['peak_terms'])})")
    first = d.get("first_iteration_peak")
    if first is not None and first != budget.peak_allocated:
        lines.append(f"  first iteration's peak  {gib(first):.2f} GiB (before the streamed "
                     f"optimizer's staging exists)")
    lines.append(f"  peak allocated  {gib(budget.peak_allocated):.2f} GiB "
                 f"(what torch.cuda.max_memory_allocated will report)")
    lines.append(f"  {'total':<30}{gib(budget.total):>10.2f}{100 * budget.total / hbm:>8.1f}%")
    lines.append("")
    lines.append(f"  dominant term: {TERM_LABELS.get(budget.dominant, budget.dominant)}")
    if budget.feasible:
        lines.append(f"  verdict: FITS, {gib(budget.headroom):.2f} GiB to spare")
    else:
        lines.append(f"  verdict: DOES NOT FIT, over by {gib(-budget.headroom):.2f} GiB")
        suggested = fixes(budget)
        if suggested:
            lines.append("  to make it fit:")
            lines.extend(f"    - {fix}" for fix in suggested)
    if budget.host_terms:
        lines.append("")
        lines.append("  host (pinned) memory per GPU, not in the total:")
        for name, value in budget.host_terms.items():
            lines.append(f"    {name:<28}{gib(value):>10.2f} GiB")
        limit, where = pinned_limit_per_gpu()
        host_total = gib(sum(budget.host_terms.values()))
        if limit:
            lines.append(f"    {'total':<28}{host_total:>10.2f} GiB "
                         + ("(within" if host_total <= limit else "(EXCEEDS")
                         + f" {limit:.1f} GiB: {where})")
    if with_notes:
        lines.append("")
        lines.append("  formulas:")
        for name in budget.terms:
            lines.append(f"    {TERM_LABELS.get(name, name)}: {budget.notes.get(name, '')}")
    return "\n".join(lines)


class MemoryBudgetError(RuntimeError):
    """The launch configuration does not fit the HBM (``--memory-budget-check error``)."""


DOES_NOT_FIT = ("the launch configuration does not fit the GPU memory (--memory-budget-check "
                "error, the default; remove --bounded-plan off to let the planner choose the "
                "knobs you did not give, or pass --memory-budget-check warn to launch anyway)")


def plan_refusal(settings, fits: bool) -> Optional[str]:
    """Why pretrain_gpt.py refuses a plan before launch (``settings``: its BudgetSettings;
    ``fits``: whether the plan fits), or None when it launches."""
    if fits:
        return None
    return DOES_NOT_FIT if settings.memory_budget_check == "error" else None


def launch_check(args, settings=None) -> Budget:
    """Evaluate the budget before any allocation: with ``--memory-budget-check`` off it is only
    returned, warn prints the table when the plan does not fit, error raises
    :class:`MemoryBudgetError` with the table. ``settings`` as for :func:`estimate`."""
    budget = estimate(args, settings)
    mode = budget.config.budget.memory_budget_check
    if mode == "off" or budget.feasible:
        return budget
    if mode == "error":
        raise MemoryBudgetError(DOES_NOT_FIT + ":\n" + render(budget))
    if os.environ.get("RANK", "0") == "0":  # before distributed init: one table per job
        print(render(budget, with_notes=False), flush=True)
    return budget


def check_host_memory(args, settings=None) -> None:
    """Refuse a launch whose pinned host memory (SCO, the attention kept on the host, the streamed
    or upstream's host optimizer), per GPU times the GPU processes of this host, does not fit the
    host's RAM. ``settings`` as for :func:`estimate`."""
    ops = operator_settings(args, settings)
    if not (ops["sco"].enabled or ops["offload_stream"].enabled
            or ops["chunked_attention"].chunked_recompute_keep_attention in ("host", "auto")
            or getattr(args, "optimizer_cpu_offload", False)):
        return
    try:
        cfg = BudgetConfig.from_args(args, settings)
    except ValueError as error:  # e.g. no vocabulary size to count the parameters with
        raise BoundedArgumentError(f"the pinned host memory cannot be estimated: {error}.") from None
    pinned = max((pinned_host_gib(stage) for stage in stage_budgets(cfg)),
                 key=lambda users: sum(users.values()))
    check_pinned_host_memory(pinned, BoundedArgumentError,
                             fix="; ".join(PINNED_HOST_FIXES[flag] for flag in pinned))
