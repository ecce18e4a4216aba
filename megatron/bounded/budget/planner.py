"""The planner: the fastest predicted exact configuration of a run that fits, for every knob the
command line leaves open.

:func:`plan_run` takes the parsed flags (upstream's and ours, validated), the flags the user
gave (never changed: they are constraints) and the memory of the GPU and host the run is for,
and chooses, from the operator registry (:mod:`megatron.bounded.registry`) and the upstream
features beside it:

* the micro-batch (a divisor of the samples each data-parallel rank takes per step),
* recompute (none, or full with one layer per checkpoint), the chunked recompute's tokens and
  its attention sublayer, and where attention is kept for the recompute (off, gpu, host),
* SCO (the fewest checkpoint boundaries offloaded that make the plan fit), OffloadStreamAdamW,
  Ring-DTP and its token chunks, PipelinedLLEP and its token budget,
* the MoE dispatch (torch-native static capacity with paged stash, or dropless) and
  upstream's whole-iteration CUDA graph, with the host-side settings of an eager step
  (``--manual-gc``, no bias-dropout "fusion" without dropout and biases).

Every combination is ranked by the cost model (:mod:`megatron.bounded.budget.cost`); in that
order, the first whose budget fits the GPU, whose pinned host memory fits the host, and that
passes the flag checks ``pretrain_gpt.py`` applies (``check``) is the plan. When none fits,
:attr:`Plan.longest` is the longest ``--seq-length`` the smallest plan fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from megatron.core.transformer.enums import AttnBackend

from megatron.bounded.activations.host_memory import check_pinned_host_memory
from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.attention.documents import document_source
from megatron.bounded.budget.config import DEFAULT_HBM_GB, BudgetConfig
from megatron.bounded.budget.cost import StepCost, step_cost
from megatron.bounded.budget.fixes import infrastructure_fixes
from megatron.bounded.budget.terms import (
    Budget, estimate_config, max_seq_length, model_state, pinned_host_gib,
)
from megatron.bounded.budget.widths import parameter_counts
from megatron.bounded.registry import OPERATORS
from megatron.bounded.settings import BoundedArgumentError, flag_name
from megatron.bounded.units import GB, GiB, ceil_div

# Largest expert-parallel size at which the no-drop rank capacity factor (= EP) is chosen: each
# rank's receive buffer holds EP × its average routed rows (a node of 8 GPUs: 8×).
MAX_NO_DROP_EP = 8

# Steps between two garbage collections with --manual-gc (an eager step creates and frees
# thousands of Python objects per layer; the automatic collector would run in mid-step).
MANUAL_GC_INTERVAL = 100

# Share of the GPU's memory a plan may fill. On one H100, a plan of 71.9 GiB allocated (75.0 GiB
# with the budget's allowance, of 79.2) ran its forward and backward at 1M tokens, then failed in
# its first all-reduce, most likely for NCCL's buffers, allocated then outside PyTorch's cache
# (docs/planner.md).
PLAN_HBM_FRACTION = 0.85

# Token sizes tried for the chunked recompute, Ring-DTP's strips and PipelinedLLEP's budget.
CHUNK_TOKENS = (16384, 32768, 65536)
RING_DTP_CHUNK_TOKENS = (4096, 16384, 65536)

# The flag groups the planner sets, by the ``args`` attributes that fix each when given.
GROUPS = {
    "micro_batch": ("micro_batch_size",),
    "recompute": ("recompute_granularity", "recompute_method", "recompute_num_layers"),
    "chunked_recompute": ("chunked_recompute_tokens",),
    "chunked_attention": ("chunked_recompute_attention",),
    "keep_attention": ("chunked_recompute_keep_attention",),
    "sco": ("sco_host_budget_gb",),
    "offload_stream": ("offload_stream_optimizer",),
    "ring_dtp": ("ring_dtp",),
    "ring_dtp_chunk": ("ring_dtp_chunk_tokens",),
    "pipelined_llep": ("pipelined_llep",),
    "pipelined_llep_budget": ("pipelined_llep_token_budget",),
    "moe_backend": ("bounded_moe_backend",),
    "capacity": ("moe_expert_rank_capacity_factor",),
    "paged_stash": ("moe_paged_stash",),
    "paged_stash_factor": ("moe_paged_stash_buffer_size_factor_cuda",),
    "graph": ("cuda_graph_impl",),
}

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
NO_RECOMPUTE = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)


@dataclass
class Plan:
    """The planner's choice: ``flags`` (``{args attribute: value}``, only knobs left open),
    its budget and predicted step; ``feasible`` False when no plan fits (then ``flags`` is the
    smallest plan's, and ``longest`` the longest ``--seq-length`` it fits)."""

    flags: Dict[str, object]
    budget: Budget  # planned for PLAN_HBM_FRACTION of the GPU's memory
    cost: StepCost
    feasible: bool
    considered: int
    hbm_bytes: int  # the GPU's memory
    longest: Optional[int] = None
    left_out: List[str] = field(default_factory=list)  # what the plan leaves out, and why

    def command_line(self) -> List[str]:
        """The flags as they go on the command line."""
        return flags_of(self.flags)

    def line(self) -> str:
        """The start-up line."""
        added = " ".join(self.command_line()) or "nothing"
        return (f"[bounded] plan: added {added} (the fastest predicted of {self.considered} "
                f"plans, {self.cost.seconds:.3g} s per step, that fits: peak allocated "
                f"{self.budget.peak_allocated / GiB:.2f} GiB, {self.budget.total / GiB:.1f} GiB "
                f"with the allowance, of {self.hbm_bytes / GiB:.1f} GiB; --bounded-plan off "
                f"runs the flags as given)" + "".join(f"; {why}" for why in self.left_out))


# upstream's flags that are on unless turned off with --no-…
ON_BY_DEFAULT = ("bias_dropout_fusion", "check_for_nan_in_loss_and_grad")


def flags_of(values: Dict[str, object]) -> List[str]:
    """Command-line flags of ``{args attribute: value}`` (False booleans as ``--no-…`` only
    where the attribute is on by default: ``bias_dropout_fusion``, ``check_for_nan_…``)."""
    out: List[str] = []
    for name, value in values.items():
        if name in ("recompute_method", "recompute_num_layers") and value is None:
            continue
        if name == "recompute_granularity" and value is None:
            continue  # no recompute: upstream's default
        if value is True:
            out.append(flag_name(name))
        elif value is False:
            if name in ON_BY_DEFAULT:
                out.append(flag_name("no_" + name))
        elif isinstance(value, enum.Enum):
            out += [flag_name(name), value.name]
        elif value is not None:
            out += [flag_name(name), f"{value:g}" if isinstance(value, float) else str(value)]
    return out



def given_groups(given: Iterable[str]) -> set:
    """The groups of :data:`GROUPS` fixed by the attributes ``given`` on the command line."""
    given = set(given)
    return {group for group, names in GROUPS.items() if given & set(names)}


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(args, fixed: set) -> List[dict]:
    """Every divisor of the samples each data-parallel rank takes per step (1 without a global
    batch: upstream then makes it micro-batch × DP)."""
    if "micro_batch" in fixed:
        return [{}]
    dp = max(1, getattr(args, "data_parallel_size", None) or 1)
    gbs = getattr(args, "global_batch_size", None)
    if not gbs:
        return [dict(micro_batch_size=1)]
    return [dict(micro_batch_size=m) for m in _divisors(max(1, gbs // dp))]


def _recompute_options(args, fixed: set, torch_moe: bool) -> List[dict]:
    """Recompute with the chunked recompute, its attention sublayer and kept attention."""
    if "recompute" in fixed:
        base = [{}]
        full = getattr(args, "recompute_granularity", None) == "full"
    else:
        base = [NO_RECOMPUTE, FULL_RECOMPUTE]
        full = None
    out = []
    for option in base:
        if not (option.get("recompute_granularity") == "full" if full is None else full):
            out.append(dict(option))
            continue
        # {}: the knob's default (off), left off the command line
        tokens = [{}] if "chunked_recompute" in fixed else (
            [{}] + ([dict(chunked_recompute_tokens=t) for t in CHUNK_TOKENS] if torch_moe else []))
        for chunk in tokens:
            chunked = chunk.get("chunked_recompute_tokens",
                                getattr(args, "chunked_recompute_tokens", 0) or 0)
            attention = [{}] if "chunked_attention" in fixed else (
                [{}] + ([dict(chunked_recompute_attention=True)] if chunked else []))
            for sublayer in attention:
                on = sublayer.get("chunked_recompute_attention",
                                  bool(getattr(args, "chunked_recompute_attention", False)))
                keeps = [{}] if "keep_attention" in fixed or not on else [{}] + [
                    dict(chunked_recompute_keep_attention=k) for k in ("gpu", "host")]
                out += [{**option, **chunk, **sublayer, **keep} for keep in keeps]
    return out


def _operator_options(args, fixed: set, tokens: int) -> List[dict]:
    """OffloadStreamAdamW × Ring-DTP (with chunks)."""
    # OffloadStreamAdamW is the distributed optimizer's inner optimizer: the plan turns on both
    streamed = dict(offload_stream_optimizer=True)
    if not getattr(args, "use_distributed_optimizer", False):
        streamed["use_distributed_optimizer"] = True
    offload = [{}] if "offload_stream" in fixed else [
        dict(offload_stream_optimizer=False), streamed]
    if "ring_dtp" in fixed:
        ring_on = bool(getattr(args, "ring_dtp", False))
        rings = [{}] if not ring_on or "ring_dtp_chunk" in fixed else [
            {}] + [dict(ring_dtp_chunk_tokens=c) for c in RING_DTP_CHUNK_TOKENS if c < tokens]
    else:
        rings = [dict(ring_dtp=False)] + [dict(ring_dtp=True)] + [
            dict(ring_dtp=True, ring_dtp_chunk_tokens=c) for c in RING_DTP_CHUNK_TOKENS
            if c < tokens]
    return [{**o, **r} for o, r in itertools.product(offload, rings)]


def torch_backend_blocker(args) -> Optional[str]:
    """Why the MoE layers keep upstream's dispatcher and experts (None: the torch-native ones
    can run)."""
    if getattr(args, "bounded_moe_backend", "auto") == "upstream":
        return "--bounded-moe-backend upstream"
    if getattr(args, "transformer_impl", "local") != "local":
        return (f"--transformer-impl {args.transformer_impl} builds upstream's MoE layer (the "
                "torch-native path needs --transformer-impl local)")
    return None


def _dispatch_options(args, fixed: set, tokens: int) -> List[dict]:
    """The dispatch as the flags leave it, and with the torch-native backend: PipelinedLLEP
    (token budgets), the static-capacity dispatch (no-drop factor EP) or the dropless one."""
    backend = {} if "moe_backend" in fixed else dict(bounded_moe_backend="torch")
    ep = args.expert_model_parallel_size
    if "pipelined_llep" in fixed:
        if not args.pipelined_llep:
            pllep = []
        elif "pipelined_llep_budget" in fixed:
            pllep = [{}]
        else:
            pllep = [dict(pipelined_llep_token_budget=c) for c in _pllep_budgets(tokens)] or [{}]
    else:
        pllep = [dict(pipelined_llep=True, pipelined_llep_token_budget=c)
                 for c in _pllep_budgets(tokens)]
    static_given = "capacity" in fixed and args.moe_expert_rank_capacity_factor is not None
    pllep_given = "pipelined_llep" in fixed and args.pipelined_llep
    # the dispatch as the flags leave it (upstream's path where the torch-native one is refused)
    out = [{}] if not (static_given or pllep_given) else []
    out += [{**backend, **p} for p in pllep] if not static_given else []
    if not pllep_given:
        if "capacity" in fixed:
            out.append(dict(backend, **({} if "pipelined_llep" in fixed else
                                         dict(pipelined_llep=False))))
        else:
            out.append(dict(backend, pipelined_llep=False, moe_expert_rank_capacity_factor=None))
            if ep <= MAX_NO_DROP_EP:
                out.append(dict(backend, pipelined_llep=False,
                                moe_expert_rank_capacity_factor=float(ep)))
    return out


def _pllep_budgets(tokens: int) -> List[int]:
    """PipelinedLLEP token budgets: the chunk sizes, and half the tokens."""
    return sorted({c for c in CHUNK_TOKENS if c < tokens} | ({ceil_div(tokens, 2)}
                                                               if tokens > 1 else set()))


def paged_stash_blocker(view) -> Optional[str]:
    """Why paged stash is left out of a static-capacity dispatch (None: it can run)."""
    if view.recompute_granularity == "full":
        return "--recompute-granularity full runs the experts' forward twice"
    if view.recompute_granularity == "selective" and "moe" in (view.recompute_modules or []):
        return "--recompute-modules moe runs the experts' forward twice"
    if getattr(view, "cpu_offloading_num_layers", 0):
        return "--cpu-offloading-num-layers"
    factor = view.moe_expert_rank_capacity_factor
    if view.expert_model_parallel_size == 1 and (factor or 0) <= 1:
        # one slab of N·k rows holds exactly the routed pairs: no padding rows to leave out
        return ("with EP = 1 and a rank capacity factor of at most 1 the experts' rows are exactly "
                "the routed ones, so paging them saves no memory")
    return None


def operators_not_under_graph(view) -> List[str]:
    """The flags of the registry's operators that are on in ``view`` and have not run under the
    whole-iteration CUDA graph."""
    return [flag_name(op.settings.SWITCH or dataclasses.fields(op.settings)[0].name)
            for op in OPERATORS if not op.under_graph and op.enabled(view)]


def not_under_graph(view) -> List[str]:
    """What in ``view`` has not run under the whole-iteration CUDA graph: the operators, full or
    selective recompute, and the layouts and features that have not."""
    blockers = operators_not_under_graph(view)
    if view.recompute_granularity is not None:
        blockers.append(f"--recompute-granularity {view.recompute_granularity}")
    layout = [
        (view.context_parallel_size > 1, "--context-parallel-size > 1"),
        (view.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
        (view.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1"),
        (view.eval_iters != 0, f"evaluation (--eval-iters {view.eval_iters})"),
        (document_source(view) is not None, "attention within packed documents"),
    ]
    return blockers + [what for present, what in layout if present]


def graph_blocker(view) -> Optional[str]:
    """Why the whole-iteration graph cannot replay ``view``'s step (None: it can)."""
    blockers = not_under_graph(view)
    if blockers:
        return ", ".join(blockers) + " not run under the graph"
    ep = view.expert_model_parallel_size
    factor = view.moe_expert_rank_capacity_factor
    if factor is None or factor < ep:
        return ("the dispatch is not static with a no-drop rank capacity factor (= EP): a step "
                "that syncs with the host or is rerun cannot be replayed")
    if view.moe_paged_stash and not (view.moe_paged_stash_buffer_size_factor_cuda or 0) >= ep:
        return "--moe-paged-stash-buffer-size-factor-cuda < EP lets the stash overflow and rerun"
    return None


def check_whole_iteration_graph(args) -> None:
    """Refuse an explicit ``--cuda-graph-impl full_iteration`` around what has not run under it."""
    if getattr(args, "cuda_graph_impl", "none") != "full_iteration":
        return
    blockers = operators_not_under_graph(args)
    if blockers:
        raise BoundedArgumentError(
            f"--cuda-graph-impl full_iteration with {', '.join(blockers)}: the whole-iteration "
            "graph replays one captured step, and these were not run under it: remove "
            f"--cuda-graph-impl full_iteration (or use none), or remove {', '.join(blockers)}."
        )


def _step_extras(view, fixed_names: set, graph: bool, add_graph: bool) -> dict:
    """The kernels and host-side settings of the chosen step: cuDNN's attention kernels first
    (faster than flash's at every length measured, not yet run under the whole-iteration graph),
    the graph (and the NaN check it replaces), manual garbage collection, no bias-dropout
    "fusion" without dropout and biases (upstream compiles that single add with torch.compile;
    its guards cost more than the add)."""
    extras = {}
    if (not graph and "attention_backend" not in fixed_names
            and getattr(view, "transformer_impl", "local") == "local"):
        extras["attention_backend"] = AttnBackend.fused
    if graph and add_graph:
        extras["cuda_graph_impl"] = "full_iteration"
        if view.check_for_nan_in_loss_and_grad and "check_for_nan_in_loss_and_grad" not in fixed_names:
            extras["check_for_nan_in_loss_and_grad"] = False
    if (view.num_experts and view.bias_dropout_fusion and view.hidden_dropout == 0
            and not view.add_bias_linear and "bias_dropout_fusion" not in fixed_names):
        extras["bias_dropout_fusion"] = False
    if not view.manual_gc and "manual_gc" not in fixed_names:
        extras["manual_gc"] = True
        if "manual_gc_interval" not in fixed_names:
            extras["manual_gc_interval"] = MANUAL_GC_INTERVAL
    return extras


def _view(args, flags: dict) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **flags})


def run_checks(view) -> None:
    """The checks ``pretrain_gpt.py`` applies to our flags (every registry operator's
    ``check()`` and the graph's), on a candidate's flags."""
    for op in OPERATORS:
        op.settings.from_args(view, check=True)
    check_whole_iteration_graph(view)


def _state_elements(cfg: BudgetConfig) -> int:
    """Optimizer state elements of the largest pipeline stage (as the model-state term)."""
    return max(model_state(cfg, parameter_counts(cfg, stage))[2] for stage in range(cfg.pp))


@dataclass
class _Candidate:
    flags: dict
    cfg: BudgetConfig
    cost: StepCost
    graph: bool
    left_out: List[str]  # what the candidate leaves out, and why


def _candidates(args, given: set) -> Iterable[_Candidate]:
    """Every combination of the open knobs, costed (not yet budgeted)."""
    fixed = given_groups(given)
    blocker = torch_backend_blocker(args) if args.num_experts else None
    torch_moe = bool(args.num_experts) and blocker is None
    kept = [f"upstream's MoE path kept: {blocker}"] if blocker else []
    cp = max(1, args.context_parallel_size)
    state_cache: Dict[Tuple[bool, bool], int] = {}
    for micro in _micro_batches(args, fixed):
        micro_batch = micro.get("micro_batch_size", args.micro_batch_size) or 1
        tokens = micro_batch * args.seq_length // cp
        microbatches = _microbatches(args, micro_batch)
        dispatch = _dispatch_options(args, fixed, tokens) if torch_moe else [{}]
        for parts in itertools.product(_recompute_options(args, fixed, torch_moe),
                                       _operator_options(args, fixed, tokens), dispatch):
            flags = dict(micro)
            for part in parts:
                flags.update(part)
            view = _view(args, flags)
            left_out = list(kept)
            if torch_moe and view.moe_expert_rank_capacity_factor and not view.moe_paged_stash \
                    and "paged_stash" not in fixed:
                reason = paged_stash_blocker(view)
                if reason:
                    left_out.append(f"no paged stash: {reason}")
                else:
                    flags["moe_paged_stash"] = True
                    if "paged_stash_factor" not in fixed:
                        flags["moe_paged_stash_buffer_size_factor_cuda"] = float(
                            view.expert_model_parallel_size)
                    view = _view(args, flags)
            if "graph" in fixed:
                graph = view.cuda_graph_impl == "full_iteration"
            else:
                reason = graph_blocker(view) if torch_moe else "not a torch-native MoE model"
                graph = reason is None
                if reason:
                    left_out.append(f"no whole-iteration CUDA graph: {reason}")
            flags.update(_step_extras(view, given, graph, add_graph="graph" not in fixed))
            cfg = BudgetConfig.from_args(_view(args, flags))
            key = (cfg.offload_stream.enabled, cfg.ring_dtp.enabled)
            if key not in state_cache:
                state_cache[key] = _state_elements(cfg)
            yield _Candidate(flags, cfg, step_cost(cfg, microbatches, graph, state_cache[key]),
                             graph, left_out)


def _host_fits(budget: Budget) -> bool:
    try:
        check_pinned_host_memory(pinned_host_gib(budget), BoundedArgumentError)
    except BoundedArgumentError:
        return False
    return True


def _with_sco(candidate: _Candidate, budget: Budget, given: set):
    """The candidate with the fewest checkpoint boundaries SCO must offload for it to fit
    (None when full recompute is off, SCO is given, or even every boundary is not enough)."""
    cfg = candidate.cfg
    if cfg.recompute != "full" or "sco" in given_groups(given):
        return None
    per = cfg.tokens * cfg.hidden * cfg.act_bytes
    boundaries = budget.details.get("boundaries") or 0
    # two boundaries are restored on the device at a time in backward
    need = min(boundaries, ceil_div(-budget.headroom, per) + 2)
    for count in sorted({need, boundaries}):
        if count <= 2:
            continue
        sco = SCOSettings.holding(count * per).sco_host_budget_gb
        flags = dict(candidate.flags, sco_host_budget_gb=sco)
        trial = estimate_config(cfg.with_flags(sco_host_budget_gb=sco))
        if trial.feasible:  # (of the planning share of the GPU's memory)
            return flags, trial
    return None


def plan_run(args: argparse.Namespace, given: Iterable[str],
             check: Callable[[argparse.Namespace], None] = run_checks) -> Plan:
    """The fastest predicted plan that fits for the validated flags ``args`` (whose
    ``hbm_gb`` is the GPU's memory), changing none of the attributes in ``given``; ``check``
    raises :class:`BoundedArgumentError` for a candidate ``pretrain_gpt.py`` would refuse."""
    given = set(given)
    hbm_gb = getattr(args, "hbm_gb", None) or DEFAULT_HBM_GB
    args = _view(args, dict(hbm_gb=hbm_gb * PLAN_HBM_FRACTION))
    ranked = sorted(_candidates(args, given), key=lambda c: c.cost.seconds)
    best: Optional[Tuple[_Candidate, Budget]] = None
    smallest: Optional[Tuple[_Candidate, Budget]] = None
    refused: List[str] = []
    for candidate in ranked:
        if best is not None and candidate.cost.seconds >= best[0].cost.seconds:
            break
        budget = estimate_config(candidate.cfg)
        if not budget.feasible:
            repaired = _with_sco(candidate, budget, given)
            if repaired is None:
                if smallest is None or budget.total < smallest[1].total:
                    smallest = (candidate, budget)
                continue
            flags, budget = repaired
            candidate = _recosted(args, candidate, flags, budget.config)
            if best is not None and candidate.cost.seconds >= best[0].cost.seconds:
                continue
        if not _host_fits(budget):
            continue
        try:
            check(_view(args, candidate.flags))
        except BoundedArgumentError as error:
            refused.append(str(error))
            continue
        best = (candidate, budget)
    if best is not None:
        candidate, budget = best
        return Plan(candidate.flags, budget, candidate.cost, True, len(ranked), int(hbm_gb * GB),
                    left_out=candidate.left_out)
    return _refusal(smallest, len(ranked), int(hbm_gb * GB), refused)


def _recosted(args, candidate: _Candidate, flags: dict, cfg: BudgetConfig) -> _Candidate:
    cost = step_cost(cfg, _microbatches(args, cfg.micro_batch), candidate.graph,
                     _state_elements(cfg))
    return _Candidate(flags, cfg, cost, candidate.graph, candidate.left_out)


def _microbatches(args, micro_batch: int) -> int:
    """Micro-batches per rank and step."""
    dp = max(1, args.data_parallel_size or 1)
    return max(1, (args.global_batch_size or micro_batch * dp) // (micro_batch * dp))


def _smallest(smallest) -> Tuple[Optional[BudgetConfig], dict]:
    """The smallest candidate with every boundary offloaded (where full recompute is on), and
    its flags."""
    if smallest is None:
        return None, {}
    cfg, flags = smallest[0].cfg, dict(smallest[0].flags)
    if cfg.recompute == "full" and not cfg.sco.enabled:
        per = cfg.tokens * cfg.hidden * cfg.act_bytes
        boundaries = smallest[1].details.get("boundaries") or 0
        flags["sco_host_budget_gb"] = SCOSettings.holding(boundaries * per).sco_host_budget_gb
        cfg = cfg.with_flags(sco_host_budget_gb=flags["sco_host_budget_gb"])
    return cfg, flags


def _refusal(smallest, considered: int, hbm_bytes: int, refused: List[str]) -> Plan:
    """No plan fits: the smallest one, and the longest sequence length it fits."""
    cfg, flags = _smallest(smallest)
    if cfg is None:  # every candidate that fits refused by a check or the host
        reason = f": {max(set(refused), key=refused.count)}" if refused else ""
        raise BoundedArgumentError("no plan of the knobs left open that fits passes the flag "
                                   f"checks and the host's pinned memory{reason}")
    longest = max_seq_length(cfg.replace(micro_batch=1))
    return Plan(flags, estimate_config(cfg), smallest[0].cost, False, considered, hbm_bytes,
                longest=longest)


def longest_plan(args: argparse.Namespace, given: Iterable[str], longest: int,
                 check: Callable[[argparse.Namespace], None] = run_checks) -> Optional[Plan]:
    """The plan at ``--seq-length longest`` (micro-batch 1), to name the flags that get there."""
    if not longest:
        return None
    shorter = _view(args, dict(seq_length=longest, micro_batch_size=1,
                               max_position_embeddings=max(longest, args.max_position_embeddings or 0)))
    plan = plan_run(shorter, set(given) | {"seq_length", "micro_batch_size"}, check)
    return plan if plan.feasible else None


def refusal(plan: Plan, args: argparse.Namespace, at_longest: Optional[Plan]) -> str:
    """Why no plan of the open knobs fits, the longest sequence that does and the flags there."""
    budget = plan.budget
    text = (f"--seq-length {args.seq_length:,} at --micro-batch-size {budget.config.micro_batch} "
            f"does not fit {PLAN_HBM_FRACTION:.0%} of one GPU's {plan.hbm_bytes / GiB:.1f} GiB with "
            f"any plan of the knobs left open: the smallest ({' '.join(plan.command_line()) or 'the flags as given'}) "
            f"needs {budget.total / GiB:.1f} GiB (dominant: {budget.dominant}). ")
    if plan.longest:
        text += f"The longest --seq-length that fits is {plan.longest:,}"
        if at_longest is not None:
            text += (f" (planned there: {' '.join(at_longest.command_line()) or 'nothing added'}; "
                     f"{at_longest.cost.seconds:.3g} s per step predicted)")
        text += ". "
    else:
        text += "Not even 1,024 tokens fit: the model state alone is too large. "
    others = infrastructure_fixes(budget, shorter=False)
    if others:
        text += "Or: " + "; ".join(others) + "."
    return text


def predicted_step(args: argparse.Namespace) -> StepCost:
    """The cost model's step for validated flags ``args`` as they run (no planning)."""
    cfg = BudgetConfig.from_args(args)
    graph = getattr(args, "cuda_graph_impl", "none") == "full_iteration"
    return step_cost(cfg, _microbatches(args, cfg.micro_batch), graph, _state_elements(cfg))
