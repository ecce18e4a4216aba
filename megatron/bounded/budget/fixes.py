"""The flags that would make a plan fit, printed under a budget that does not (the table of
``tools/memory_budget.py`` and of a refused launch): one suggestion per operator, then what is
left outside them (more GPUs, sharding, shorter sequences)."""

from __future__ import annotations

from typing import List

from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.budget.config import BALANCED_ROUTING_SKEW, BudgetConfig
from megatron.bounded.budget.terms import Budget, estimate_config, max_seq_length
from megatron.bounded.units import GiB, ceil_div


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _offload_fix(budget: Budget) -> List[str]:
    cfg, t = budget.config, budget.terms
    if cfg.offload_stream.enabled or t["model_state"] <= 0:
        return []
    on = estimate_config(cfg.with_flags(offload_stream_optimizer=True))
    if budget.total - on.total <= 0:
        return []
    return [
        f"--offload-stream-optimizer (model state {_gib(t['model_state'])} -> "
        f"{_gib(on.terms['model_state'])} + {_gib(on.terms['optimizer_staging'])} "
        f"staging)"
    ]


def _recompute_or_sco_fix(budget: Budget) -> List[str]:
    cfg, t = budget.config, budget.terms
    boundaries = budget.details["boundaries"]
    if cfg.recompute != "full" and t["layer_activations"] > 0:
        return [
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            f"(layer activations {_gib(t['layer_activations'])} -> one boundary per layer)"
        ]
    if cfg.recompute == "full" and cfg.sco.host_budget_bytes == 0 and boundaries > 2:
        per = cfg.tokens * cfg.hidden * cfg.act_bytes
        need = min(boundaries, max(3, ceil_div(-budget.headroom, per) + 2))
        gb = SCOSettings.holding(need * per).sco_host_budget_gb
        return [
            f"--sco-host-budget-gb {gb:g} (offloads {need} of {boundaries} "
            f"boundaries of {_gib(per)}; pinned host memory per GPU)"
        ]
    return []


def _pipelined_llep_fix(budget: Budget) -> List[str]:
    cfg, t = budget.config, budget.terms
    if t["moe_dispatch"] <= 0 or cfg.pipelined_llep.enabled:
        return []
    best = None
    for k_chunks in range(2, max(2, cfg.pipelined_llep.pipelined_llep_max_chunks) + 1):
        c = ceil_div(cfg.tokens, k_chunks)
        alt = estimate_config(cfg.with_flags(pipelined_llep=True, pipelined_llep_token_budget=c))
        if alt.total < budget.total and (best is None or alt.total < best[1].total):
            best = (c, alt)
    if best is not None:
        return [
            f"--pipelined-llep --pipelined-llep-token-budget {best[0]} (dispatch "
            f"{_gib(t['moe_dispatch'])} -> {_gib(best[1].terms['moe_dispatch'])}, "
            f"routing-independent)"
        ]
    return [
        f"PipelinedLLEP's worst case 2·E_p·k·c·H·b at E_p={cfg.ep} exceeds the "
        f"standard estimate for every c >= N/K_max: raise --pipelined-llep-max-chunks "
        f"or use a static capacity (--moe-expert-rank-capacity-factor)"
    ]


def _routing_skew_fix(budget: Budget) -> List[str]:
    cfg = budget.config
    if (budget.terms["moe_dispatch"] <= 0 or cfg.pipelined_llep.enabled or cfg.capacity_factor
            or cfg.routing_skew <= BALANCED_ROUTING_SKEW):
        return []
    # Measured on 2 GPUs at 737,280 tokens: 173 GiB estimated at skew 2, 86 GiB peak
    # allocated on rank 0 (the small example's router kept each rank near its even share).
    alt = estimate_config(cfg.with_flags(budget_routing_skew=BALANCED_ROUTING_SKEW))
    return [
        f"--budget-routing-skew {BALANCED_ROUTING_SKEW:g} if the router keeps the load "
        f"balanced (the estimate assumes the hottest rank receives {cfg.routing_skew:g}× "
        f"its even share of routed rows: {_gib(budget.total)} -> {_gib(alt.total)}"
        f"{', which fits' if alt.feasible else ''}; not a bound: a step "
        f"routed above it can still run out of memory)"
    ]


def _ring_dtp_fix(budget: Budget) -> List[str]:
    cfg, t = budget.config, budget.terms
    if t["vocab_projection"] <= 0 or cfg.ring_dtp.enabled:
        return []
    chunk = min(8192, cfg.tokens)
    alt = estimate_config(cfg.with_flags(ring_dtp=True, ring_dtp_chunk_tokens=chunk))
    return [
        f"--ring-dtp --ring-dtp-chunk-tokens {chunk} (vocabulary projection "
        f"{_gib(t['vocab_projection'])} -> {_gib(alt.terms['vocab_projection'])})"
    ]


def infrastructure_fixes(budget: Budget, shorter: bool = True) -> List[str]:
    """What is left when no setting of the operators fits: more GPUs, sharding, shorter
    sequences (``shorter``)."""
    cfg = budget.config
    out = []
    if budget.details["params_expert"] and cfg.experts:
        out.append(
            "increase --expert-model-parallel-size (more GPUs: expert state "
            f"{budget.details['params_expert']:,} params per rank)"
        )
    if cfg.fsdp_strategy is None and budget.details["params_dense"] > 0:
        out.append(
            "shard dense parameters and gradients too (--use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads_params)"
        )
    if shorter:
        out.append(_shorter_sequence_fix(cfg))
    if cfg.cp == 1:
        out.append(
            "split each sequence over more GPUs (--context-parallel-size C --cp-comm-type a2a: "
            "N = S/C tokens per rank)"
        )
    return out


def _shorter_sequence_fix(cfg: BudgetConfig) -> str:
    longest = max_seq_length(_strong_config(cfg))
    if not longest:
        return "not even 1,024 tokens fit: the model state alone is too large"
    return (
        f"shorter sequences: the longest --seq-length that fits is {longest:,} (at "
        f"--micro-batch-size {cfg.micro_batch}, with full recompute, --offload-stream-optimizer, "
        f"every boundary offloaded by SCO, --ring-dtp --ring-dtp-chunk-tokens 4096 and "
        f"{'static-capacity' if cfg.capacity_factor else 'standard'} dispatch)"
    )


# One per fix, in the order they are suggested.
_FIXES = (_offload_fix, _recompute_or_sco_fix, _pipelined_llep_fix, _routing_skew_fix,
          _ring_dtp_fix, infrastructure_fixes)


def _suggest_fixes(budget: Budget) -> List[str]:
    return [fix for suggest in _FIXES for fix in suggest(budget)]


def _strong_config(cfg: BudgetConfig) -> BudgetConfig:
    """``cfg`` with full recompute, the streamed optimizer, every checkpoint boundary offloaded
    by SCO and Ring-DTP with 4,096-token chunks, and the dispatch as configured except
    PipelinedLLEP, whose absolute token budget would not follow a shorter sequence (standard
    dispatch at the assumed skew)."""
    per = cfg.tokens * cfg.hidden * cfg.act_bytes
    boundaries = cfg.layers + cfg.mtp_layers
    full = cfg.replace(recompute="full", recompute_method="uniform", recompute_layers=1,
                       paged_stash=False)
    return full.with_flags(
        offload_stream_optimizer=True, pipelined_llep=False, pipelined_llep_token_budget=None,
        sco_host_budget_gb=SCOSettings.holding(boundaries * per).sco_host_budget_gb,
        ring_dtp=True, ring_dtp_chunk_tokens=4096,
    )


def fixes(budget: Budget) -> List[str]:
    """For an infeasible plan, the flags that would make it fit (empty when feasible)."""
    if budget.feasible or budget.config is None:
        return []
    if budget._fixes is None:
        budget._fixes = _suggest_fixes(budget)
    return budget._fixes
