"""Choosing the operators' knobs (``--auto-bounds``) and the flags that would make a plan fit."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron.bounded.budget.config import (
    GiB, BALANCED_ROUTING_SKEW, HOST_STATE_BYTES_PER_ELEMENT, BudgetConfig, _as_config,
    _ceil_div, _stage_layers,
)
from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.budget.terms import (
    TERM_LABELS, Budget, _model_state, checkpointed_chunks, estimate_config, max_seq_length,
)
from megatron.bounded.budget.widths import parameter_counts, pipelined_llep_chunks

# Pinned host<->device copies measured on H200 machines (1 GiB copies): 55 GB/s one
# way, 43.7 GB/s each way when both directions run at once.
HOST_LINK_ONE_WAY_BYTES_PER_S = 55e9

HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S = 43.7e9

# Achieved dense bf16 rate used to turn FLOPs into time for overlap estimates: an assumption
# (the paper reports 91-233 TFLOP/s per GPU end to end).
ASSUMED_ACHIEVED_FLOPS = 200e12

# Ring-DTP: the vocabulary projection (forward + backward) takes about this many times the
# materialized one, strips being recomputed in backward (an assumption for this implementation;
# the paper reports +4-5% for its own).
RING_DTP_TIME_FACTOR = 1.35

# Fixed latency per extra Ring-DTP token chunk per ring hop and pass (an assumption).
RING_DTP_CHUNK_LATENCY_S = 50e-6

# Fixed launch/synchronization latency PipelinedLLEP adds per extra chunk, per MoE layer and
# pass (forward, recompute, backward): an assumption, not a measurement.
PIPELINED_LLEP_CHUNK_LATENCY_S = 0.5e-3

# Token-chunk sizes choose_bounds tries for Ring-DTP.
RING_DTP_CHUNK_CANDIDATES = (65536, 32768, 16384, 8192, 4096, 2048, 1024)

# The operators choose_bounds may switch on, by name.
ALL_OPERATORS = ("offload_stream_optimizer", "sco", "ring_dtp", "pipelined_llep")

# Those pretrain_gpt.py runs; --auto-bounds chooses among these only.
OPERATORS_IN_PRETRAIN = ALL_OPERATORS


def _boundary_count(cfg: BudgetConfig) -> int:
    """Checkpoint boundaries alive at the end of forward on the largest stage (full recompute)."""
    if cfg.recompute != "full":
        return 0
    return max((checkpointed_chunks(cfg, len(layers)) * (cfg.pp - stage)
                for stage, layers in enumerate(_stage_layers(cfg)) if layers), default=0)


def _layer_forward_flops(cfg: BudgetConfig, moe: bool) -> float:
    """FLOPs of one layer's forward on this rank (GEMMs + causal attention)."""
    n, h = cfg.tokens, cfg.hidden
    q = cfg.heads * cfg.kv_channels
    qkv = (cfg.heads + 2 * cfg.groups) * cfg.kv_channels
    g = 3 if cfg.gated else 2
    flops = 2 * n * h * qkv / cfg.tp + 2 * n * q * h / cfg.tp
    flops += 2 * n * (cfg.seq_length // max(1, cfg.cp)) * q / cfg.tp  # causal: half of 4·N·S·q
    if moe:
        flops += 2 * n * cfg.topk * g * h * cfg.moe_ffn / cfg.etp
        flops += 2 * n * g * h * cfg.shared_ffn / cfg.tp + 2 * n * h * cfg.experts
    else:
        flops += 2 * n * g * h * cfg.ffn / cfg.tp
    return flops


# The settings objects --auto-bounds chooses (BudgetConfig fields), in command-line order.
CHOSEN_SETTINGS = ("offload_stream", "sco", "ring_dtp", "pipelined_llep")

# The knobs it sets, and their values with every operator off.
_OFF = dict(
    offload_stream_optimizer=False, sco_host_budget_gb=0.0, ring_dtp=False,
    ring_dtp_chunk_tokens=None, ring_dtp_gradient_rows=None, pipelined_llep=False,
    pipelined_llep_token_budget=None,
)


def chosen_settings(cfg: BudgetConfig) -> Dict[str, object]:
    """``{BudgetConfig field: settings object}`` of the operators --auto-bounds chooses."""
    return {name: getattr(cfg, name) for name in CHOSEN_SETTINGS}


def knob_flags(cfg: BudgetConfig) -> Dict[str, object]:
    """``{flag attribute: value}`` of the knobs --auto-bounds chooses."""
    merged = {}
    for settings in chosen_settings(cfg).values():
        merged.update(settings.fields())
    return {name: merged[name] for name in _OFF}


def knob_command_line(cfg: BudgetConfig) -> str:
    """The pretrain_gpt.py flags of the operators switched on in ``cfg``."""
    return " ".join(flag for settings in chosen_settings(cfg).values() if settings.enabled
                    for flag in settings.to_flags())


def _candidates(cfg: BudgetConfig, operators=ALL_OPERATORS) -> List[BudgetConfig]:
    """Every knob combination choose_bounds considers (``operators`` only; layout untouched)."""
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    base = cfg.with_flags(**_OFF)
    has_moe = any(cfg.moe_layers)
    # SCO: offload the first k boundaries; host budget = k · N·H·b (rounded up to 1 MB)
    sco_options = [SCOSettings()]
    if cfg.recompute == "full" and "sco" in operators:
        boundaries = _boundary_count(base)
        per = n * h * b
        sco_options += [SCOSettings.holding(k * per) for k in range(1, boundaries + 1)]
    ring_options: List[Tuple[bool, Optional[int]]] = [(False, None)]
    if "ring_dtp" in operators:
        ring_options += [(True, None)] + [(True, c) for c in RING_DTP_CHUNK_CANDIDATES if c < n]
    pllep_options: List[Optional[int]] = [None]
    # PipelinedLLEP replaces the static-capacity dispatch and cannot run with paged stash
    static_dispatch = bool(cfg.capacity_factor) or cfg.paged_stash
    if has_moe and "pipelined_llep" in operators and not static_dispatch:
        for k_chunks in range(2, max(2, cfg.pipelined_llep.pipelined_llep_max_chunks) + 1):
            pllep_options.append(_ceil_div(n, k_chunks))
    host_state = HOST_STATE_BYTES_PER_ELEMENT * _state_params_fast(base)
    out = []
    offload_options = (False, True) if "offload_stream_optimizer" in operators else (False,)
    for offload in offload_options:
        for sco in sco_options:
            # the pinned host memory per GPU must hold the boundaries (and the optimizer state)
            if sco.host_budget_bytes + (host_state if offload else 0) > cfg.host_bytes_per_gpu:
                continue
            for ring, chunk in ring_options:
                for budget in pllep_options:
                    out.append(base.with_flags(
                        offload_stream_optimizer=offload, sco_host_budget_gb=sco.sco_host_budget_gb,
                        ring_dtp=ring, ring_dtp_chunk_tokens=chunk,
                        pipelined_llep=budget is not None, pipelined_llep_token_budget=budget,
                    ))
    return out


def choose_bounds(args_or_cfg, operators=ALL_OPERATORS) -> dict:
    """Pick the operators' knobs that make the plan fit HBM with the least expected slowdown.

    Every combination of OffloadStreamAdamW (off/on), SCO (offload the first k boundaries,
    k = 0..B, host budget k·N·H·b, within the host memory per GPU left after the optimizer
    state), Ring-DTP (off / on, token chunks from :data:`RING_DTP_CHUNK_CANDIDATES`) and
    PipelinedLLEP (off / K = 2..K_max chunks, c = ceil(N/K)) is ranked by :func:`bounds_cost`
    (ties: fewer operators first); the first one whose budget fits is returned. Only the
    operators named in ``operators`` (see :data:`ALL_OPERATORS`) are considered. The layout
    (TP/PP/EP/DP), the sequence and the model are never changed.

    Returns ``{"feasible", "settings", "flags", "command_line", "cost_s", "cost_breakdown",
    "budget", "tried"}``: ``settings`` the chosen settings objects by :data:`CHOSEN_SETTINGS`
    name, ``flags`` their knobs' values; when nothing fits, the cheapest plan among those with
    the smallest total and ``feasible`` is False.
    """
    cfg = _as_config(args_or_cfg)
    ranked = []
    for cand in _candidates(cfg, operators):
        cost = bounds_cost(cand)
        n_ops = sum(settings.enabled for settings in chosen_settings(cand).values())
        ranked.append((sum(cost.values()), n_ops, -(cand.ring_dtp.ring_dtp_chunk_tokens or 0), cand,
                       cost))
    ranked.sort(key=lambda item: item[:3])
    best_infeasible = None
    tried = 0
    for total_cost, _, _, cand, cost in ranked:
        tried += 1
        budget = estimate_config(cand)
        host_used = sum(budget.host_terms.values())
        if budget.feasible and host_used <= cand.host_bytes_per_gpu:
            return _choice(True, cand, budget, total_cost, cost, tried)
        if best_infeasible is None or budget.total < best_infeasible[0].total:
            best_infeasible = (budget, cand, total_cost, cost)
    budget, cand, total_cost, cost = best_infeasible
    return _choice(False, cand, budget, total_cost, cost, tried)


def _choice(feasible: bool, cand: BudgetConfig, budget: Budget, total_cost: float, cost: dict,
            tried: int) -> dict:
    return {
        "feasible": feasible, "settings": chosen_settings(cand), "flags": knob_flags(cand),
        "command_line": knob_command_line(cand), "cost_s": total_cost,
        "cost_breakdown": cost, "budget": budget, "tried": tried,
    }


def bounds_cost(cfg: BudgetConfig) -> Dict[str, float]:
    """Expected added seconds per step (per rank) of the operators switched on in ``cfg``.

    * OffloadStreamAdamW: 12 B/param each way over the host link (24 B/param moved) at
      ~43.7 GB/s each way with both directions busy: 12·Θ_state / 43.7e9 (the GPU-resident
      fused AdamW it replaces is ~0.01 s per 1e9 params: neglected).
    * SCO: each offloaded boundary is copied out during one layer's forward and back during one
      layer's recompute + backward (~3× the forward); only the part of a copy that outlasts that
      compute is exposed: Σ max(0, N·H·b/55e9 - t_fwd) + max(0, N·H·b/55e9 - 3·t_fwd), with
      t_fwd = layer forward FLOPs / 200 TFLOP/s (assumed achieved rate).
    * Ring-DTP: (1.35 - 1) × the materialized vocabulary projection time 6·N·H·V / 200e12, plus
      50 µs per extra token chunk per ring hop per pass (forward, backward).
    * PipelinedLLEP: (K - 1) extra chunks × 0.5 ms launch/sync latency × passes (forward,
      recompute, backward) × MoE layers.
    """
    cost: Dict[str, float] = {}
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    if cfg.offload_stream.enabled:
        state = _state_params_fast(cfg)
        cost["offload_stream_optimizer"] = (
            HOST_STATE_BYTES_PER_ELEMENT * state / HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S
        )
    if cfg.sco.host_budget_bytes > 0 and cfg.recompute == "full":
        per = n * h * b
        k = min(_boundary_count(cfg), cfg.sco.host_budget_bytes // per)
        copy = per / HOST_LINK_ONE_WAY_BYTES_PER_S
        t_fwd = _layer_forward_flops(cfg, any(cfg.moe_layers)) / ASSUMED_ACHIEVED_FLOPS
        t_fwd *= max(1, cfg.recompute_layers)
        cost["sco"] = k * (max(0.0, copy - t_fwd) + max(0.0, copy - 3 * t_fwd))
    if cfg.ring_dtp.enabled:
        t_vocab = 6.0 * n * h * cfg.vocab / ASSUMED_ACHIEVED_FLOPS
        chunk = cfg.ring_dtp.ring_dtp_chunk_tokens
        chunks = _ceil_div(n, chunk) if chunk else 1
        cost["ring_dtp"] = (RING_DTP_TIME_FACTOR - 1.0) * t_vocab + (
            (chunks - 1) * max(1, cfg.ring_group) * 2 * RING_DTP_CHUNK_LATENCY_S
        )
    if cfg.pipelined_llep.enabled:
        k_chunks, _ = pipelined_llep_chunks(cfg)
        passes = 3 if cfg.recompute == "full" else 2
        n_moe = max(sum(1 for i in layers if cfg.moe_layers[i]) for layers in _stage_layers(cfg))
        cost["pipelined_llep"] = (k_chunks - 1) * PIPELINED_LLEP_CHUNK_LATENCY_S * passes * n_moe
    return cost


def _state_params_fast(cfg: BudgetConfig) -> int:
    """Parameters whose optimizer state the largest stage updates (as in the model-state term)."""
    best = 0
    for stage in range(cfg.pp):
        _, _, state, _ = _model_state(cfg, parameter_counts(cfg, stage))
        best = max(best, state)
    return best


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
        need = min(boundaries, max(3, _ceil_div(-budget.headroom, per) + 2))
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
        c = _ceil_div(cfg.tokens, k_chunks)
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


def _auto_bounds_fix(budget: Budget) -> List[str]:
    """--auto-bounds' choice; when none fits, what is left outside the four operators."""
    cfg = budget.config
    auto = choose_bounds(cfg)
    if auto["feasible"]:
        return [f"all at once, cheapest (--auto-bounds): {auto['command_line']}"]
    out = [
        "no setting of the four operators fits this layout; "
        f"the best reaches {_gib(auto['budget'].total)} ("
        f"dominant: {TERM_LABELS[auto['budget'].dominant]})"
    ]
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
    out.append(_shorter_sequence_fix(cfg))
    if cfg.cp == 1:
        out.append(
            "split each sequence over ranks (context parallelism: N = S/CP per rank; needs "
            "Transformer Engine here)"
        )
    return out


def _shorter_sequence_fix(cfg: BudgetConfig) -> str:
    longest = max_seq_length(_strong_config(cfg))
    if not longest:
        return "not even 1,024 tokens fit: the model state alone is too large"
    return (
        f"shorter sequences: the longest --seq-length that fits is {longest:,} (at "
        f"--micro-batch-size {cfg.micro_batch}, with --offload-stream-optimizer, every "
        f"boundary offloaded by SCO, --ring-dtp --ring-dtp-chunk-tokens 4096 and "
        f"{'static-capacity' if cfg.capacity_factor else 'standard'} dispatch)"
    )


# One per fix, in the order they are suggested.
_FIXES = (_offload_fix, _recompute_or_sco_fix, _pipelined_llep_fix, _routing_skew_fix,
          _ring_dtp_fix, _auto_bounds_fix)


def _suggest_fixes(budget: Budget) -> List[str]:
    return [fix for suggest in _FIXES for fix in suggest(budget)]


def _strong_config(cfg: BudgetConfig) -> BudgetConfig:
    """``cfg`` with the streamed optimizer, SCO with whatever host memory is left and Ring-DTP
    with 4,096-token chunks, and the dispatch as configured except PipelinedLLEP, whose absolute
    token budget would not follow a shorter sequence (standard dispatch at the assumed skew)."""
    host_left = cfg.host_bytes_per_gpu - HOST_STATE_BYTES_PER_ELEMENT * _state_params_fast(
        cfg.with_flags(offload_stream_optimizer=True)
    )
    return cfg.with_flags(**dict(
        _OFF, offload_stream_optimizer=True,
        sco_host_budget_gb=SCOSettings.holding(max(0, host_left)).sco_host_budget_gb,
        ring_dtp=True, ring_dtp_chunk_tokens=4096,
    ))


def auto_config(result: dict, cfg: BudgetConfig) -> BudgetConfig:
    """``cfg`` with the settings of a :func:`choose_bounds` result."""
    return cfg.replace(**result["settings"])


def fixes(budget: Budget) -> List[str]:
    """For an infeasible plan, the flags that would make it fit (empty when feasible)."""
    if budget.feasible or budget.config is None:
        return []
    if budget._fixes is None:
        budget._fixes = _suggest_fixes(budget)
    return budget._fixes
