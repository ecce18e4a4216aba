"""The budget's terms, one function each, and the budget of a pipeline stage (:func:`estimate`,
:class:`Budget`, :func:`max_seq_length`); the package docstring writes the terms out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.bounded.activations.host_memory import check_pinned_host_memory
from megatron.bounded.budget.config import BudgetConfig, as_config, stage_layers
from megatron.bounded.budget.phases import (
    kept_attention_terms, output_layer_bytes, recompute_phases,
)
from megatron.bounded.budget.widths import (
    activation_widths, boundary_and_rope_bytes, moe_rows, mtp_boundaries, mtp_loss_bytes,
    mtp_stored_layers, parameter_counts, pipelined_llep_chunks, sco_boundaries_on_device,
    selective_savings, token_mixer_bytes_per_token,
)
from megatron.bounded.optimizer.moment_dtype_adamw import STEP_CHUNK_ELEMENTS, step_transient_bytes
from megatron.bounded.optimizer.offload_stream_adamw import staging_bound_bytes
from megatron.bounded.units import GiB, ceil_div

# Fixed allowance for what the caching allocator does not count: the CUDA context and the
# libraries' own buffers (one H200 job at 132.4 GiB allocated trained in 139.8 GiB). NCCL with
# many communicators can take more.
CUDA_CONTEXT_BYTES = 1 * GiB

# Allocator fragmentation, a fraction of the predicted peak allocated: near the GPU's capacity
# (expandable segments) the reserved peak was 0.9% above the allocated one.
FRAGMENTATION_FRACTION = 0.03

TERM_LABELS = {
    "model_state": "model state",
    "optimizer_staging": "optimizer staging",
    "optimizer_step": "optimizer step temporaries",
    "checkpoint_boundaries": "checkpoint boundaries",
    "layer_activations": "layer activations",
    "moe_dispatch": "MoE dispatch",
    "paged_stash": "paged stash pages",
    "vocab_projection": "vocabulary projection",
    "kept_attention": "kept attention",
    "recompute_working_set": "recompute working set",
    "cuda_context_fragmentation": "CUDA context + fragmentation",
}

TERM_ORDER = tuple(TERM_LABELS)

# (bytes, note) of one term
Term = Tuple[int, str]


@dataclass
class Budget:
    """Per-GPU byte estimate, term by term (see the module docstring)."""

    terms: Dict[str, int]
    notes: Dict[str, str]
    hbm_bytes: int
    host_terms: Dict[str, int] = field(default_factory=dict)
    details: Dict[str, object] = field(default_factory=dict)
    config: Optional[BudgetConfig] = field(default=None, repr=False)
    _fixes: Optional[List[str]] = field(default=None, repr=False)
    # the predicted peak allocated; None: the sum of the terms less the allowance (no phases)
    peak_bytes: Optional[int] = None

    @property
    def peak_allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should report: with full recompute the model
        state plus the largest phase (the terms of the other phases are live at other moments),
        else the sum of the terms; without the CUDA context and fragmentation allowance."""
        if self.peak_bytes is not None:
            return self.peak_bytes
        return sum(self.terms.values()) - self.terms.get("cuda_context_fragmentation", 0)

    @property
    def total(self) -> int:
        """The peak allocated plus the CUDA context and fragmentation allowance."""
        return self.peak_allocated + self.terms.get("cuda_context_fragmentation", 0)

    @property
    def feasible(self) -> bool:
        return self.total <= self.hbm_bytes

    @property
    def dominant(self) -> str:
        """The largest term live at the peak (with phases: the model state or a term of the
        peak phase)."""
        live = self.details.get("peak_terms") or self.terms
        return max(live, key=self.terms.get)

    @property
    def headroom(self) -> int:
        """HBM left over (negative: the overshoot)."""
        return self.hbm_bytes - self.total



def _operators(cfg: BudgetConfig) -> str:
    ops = []
    if cfg.offload_stream.enabled:
        stream = cfg.offload_stream
        ops.append(f"OffloadStreamAdamW ({stream.offload_stream_slots} slots × "
                   f"{stream.offload_stream_bucket_numel:,})")
    if cfg.sco.host_budget_bytes > 0:
        ops.append(f"SCO (host budget {cfg.sco.host_budget_bytes / GiB:g} GiB)")
    if cfg.ring_dtp.enabled:
        tokens = cfg.ring_dtp.ring_dtp_chunk_tokens
        chunk = f", chunk {tokens:,}" if tokens else ""
        ops.append(f"Ring-DTP (P={cfg.ring_group}{chunk})")
    if cfg.pipelined_llep.enabled:
        k_chunks, c_eff = pipelined_llep_chunks(cfg)
        ops.append(f"PipelinedLLEP (K={k_chunks}, c_eff={c_eff:,})")
    if cfg.capacity_factor:
        ops.append(f"static capacity cf={cfg.capacity_factor:g}")
    if cfg.paged_stash:
        ops.append("paged stash")
    return ", ".join(ops)



def model_state(cfg: BudgetConfig, counts: Dict[str, int]) -> Tuple[int, int, int, str]:
    """(GPU bytes, host bytes, parameters whose optimizer state this rank updates, note)."""
    p, g = cfg.param_bytes, cfg.grad_bytes
    opt = cfg.master_bytes + cfg.moment_bytes
    shard_params = cfg.fsdp_strategy == "optim_grads_params"
    shard_grads = cfg.fsdp_strategy in ("optim_grads", "optim_grads_params")
    shard_opt = cfg.distributed_optimizer or (
        cfg.fsdp_strategy is not None and cfg.fsdp_strategy != "no_shard"
    )
    ring_w = max(1, (cfg.dp * cfg.cp) // max(1, cfg.ring_group))
    classes = (
        ("dense", counts["dense"], cfg.dense_shard),
        ("expert", counts["expert"], cfg.edp),
        ("ring_output", counts["ring_output"], ring_w),
    )
    gpu = host = 0.0
    state_params = 0.0
    for _, n, w in classes:
        wp = w if shard_params else 1
        wg = w if shard_grads else 1
        wo = w if shard_opt else 1
        gpu += n * p / wp + n * g / wg
        state_params += n / wo
        if cfg.offload_stream.enabled:
            host += n * opt / wo
        else:
            gpu += n * opt * (1.0 - cfg.cpu_offload_fraction) / wo
            host += n * opt * cfg.cpu_offload_fraction / wo
    sharding = "none"
    if cfg.fsdp_strategy is not None:
        sharding = f"Megatron-FSDP {cfg.fsdp_strategy}"
    elif cfg.distributed_optimizer:
        sharding = "distributed optimizer (optimizer state / W)"
    params = (
        f"Θ_dense={counts['dense']:,} (W={cfg.dense_shard}), "
        f"Θ_expert={counts['expert']:,} (W_e={cfg.edp})"
    )
    if counts["ring_output"]:
        params += f", Θ_ring_output={counts['ring_output']:,} (W={ring_w})"
    placement = "sharded over W" if shard_params else "replicated over DP"
    if cfg.offload_stream.enabled:
        note = (
            f"{params} params on this rank; OffloadStreamAdamW: the GPU keeps {p} B param + {g} B "
            f"grad per param ({placement}); fp32 master + moments ({opt} B/param, / W when "
            f"sharded) live on the host. The paper's 4Θ/W is this with 2 B gradients and "
            f"params/grads sharded over W (ZeRO-3)"
        )
    else:
        note = (
            f"{params}; bytes/param = {p} (param) + {g} "
            f"(grad{', fp32 accumulate' if g == 4 else ''})"
            f" + {opt} (master {cfg.master_bytes} + moments {cfg.moment_bytes}) / W; sharding: "
            f"{sharding}"
        )
        if cfg.cpu_offload_fraction:
            note += f"; upstream --optimizer-cpu-offload moves {cfg.cpu_offload_fraction:g} of it"
    return int(math.ceil(gpu)), int(math.ceil(host)), int(math.ceil(state_params)), note


def _staging(cfg: BudgetConfig, state_params: int) -> Tuple[int, str]:
    if not cfg.offload_stream.enabled:
        return 0, "0: OffloadStreamAdamW off"
    bucket, slots = cfg.offload_stream.offload_stream_bucket_numel, cfg.offload_stream.offload_stream_slots
    buckets = max(1, ceil_div(state_params, bucket))
    note = (
        f"staging_bound_bytes: min(slots, buckets) × largest bucket × 16 B with {slots} "
        f"slots, {buckets} buckets of ≤ {bucket:,} over {state_params:,} params"
    )
    return staging_bound_bytes(state_params, bucket, slots), note



def _optimizer_step_bytes(cfg: BudgetConfig, state_params: int) -> Tuple[int, str]:
    """The optimizer step's transient on the GPU."""
    if cfg.offload_stream.enabled:
        staging, note = _staging(cfg, state_params)
        return staging, "OffloadStreamAdamW staging: " + note
    if cfg.master_bytes and cfg.moment_bytes < 8:  # MomentDtypeAdamW, slice by slice
        transient = step_transient_bytes(state_params, cfg.moment_bytes)
        return transient, (f"AdamW with moments of {cfg.moment_bytes} B per element: fp32 "
                           f"temporaries of at most {STEP_CHUNK_ELEMENTS:,} elements per slice")
    # torch's multi-tensor Adam makes one fp32 temporary per parameter of the step
    return 4 * state_params, f"Adam step temporaries 4 B × {state_params:,} params"



def checkpointed_chunks(cfg: BudgetConfig, n_layers: int) -> int:
    """Checkpointed chunks of ``n_layers`` layers under full recompute, one boundary each per
    micro-batch: ``block`` checkpoints min(R, layers) single layers, ``uniform`` groups the
    layers by R (``--recompute-num-layers``)."""
    rnl = max(1, cfg.recompute_layers)
    if cfg.recompute_method == "block":
        return min(rnl, n_layers)
    return ceil_div(n_layers, rnl)



def _checkpoint_boundaries(
    cfg: BudgetConfig, n_layers: int, inflight: int, last: bool
) -> Tuple[int, int, int, str, int]:
    """(device bytes, host bytes, boundaries in total, note, layers stored in full); the last
    stage adds its multi-token-prediction layers' boundaries."""
    if cfg.recompute != "full" or n_layers == 0:
        return 0, 0, 0, "0: no full recompute (see layer activations)", n_layers
    per, rope = boundary_and_rope_bytes(cfg)
    chunks = checkpointed_chunks(cfg, n_layers)
    if cfg.recompute_method == "block":
        full_layers = n_layers - chunks
        how = f"block: {chunks} checkpointed layers"
    else:
        full_layers = 0
        how = f"uniform: ceil({n_layers}/{max(1, cfg.recompute_layers)}) = {chunks} chunks"
    mtp = mtp_boundaries(cfg, last)
    count = chunks * inflight + mtp
    if mtp:
        how += f" + {mtp} of the MTP layer(s) (hidden state and next tokens' embedding each)"
    offloaded = 0
    if cfg.sco.host_budget_bytes > 0:
        offloaded, on_device = sco_boundaries_on_device(cfg, count, last)
        note = (
            f"N·H·b = {per:,} B per boundary; {how} × {inflight} micro-batch(es) = {count}; "
            f"SCO offloads {offloaded} (host budget / N·H·b), device keeps (B - k) + "
            f"min(k, {3 if mtp else 2}) = "
            f"{on_device}"
        )
    else:
        on_device = count
        note = f"N·H·b = {per:,} B per boundary; {how} × {inflight} micro-batch(es) = {count}"
    if rope:
        note += f"; + one shared rotary table (S/CP)·kv·4 B = {rope:,} B"
    return on_device * per + rope, offloaded * per, count, note, full_layers



@dataclass
class _Stage:
    """What the terms of one pipeline stage share: its layers, the activation widths, the routed
    rows and the bytes a layer saves for backward."""

    index: int
    layer_ids: Tuple[int, ...]
    n_moe: int
    inflight: int  # 1F1B: micro-batches in flight on this stage
    last: bool
    widths: Dict[str, int]
    rows: Dict[str, int]
    stash_on: bool
    kept_width: int
    attn_tok: int
    moe_layer: int
    dense_layer: int
    selective: Dict[str, int] = field(default_factory=dict)  # selective_savings of the config
    full_layers: int = 0  # layers not checkpointed (set once the boundaries are counted)
    moe_full: int = 0  # MoE layers among them

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_dense(self) -> int:
        return self.n_layers - self.n_moe


def _stage_shape(cfg: BudgetConfig, stage: int) -> _Stage:
    n = cfg.tokens
    layer_ids = stage_layers(cfg)[stage]
    n_moe = sum(1 for i in layer_ids if cfg.moe_layers[i])
    w = activation_widths(cfg)
    cut = selective_savings(cfg)
    rows = moe_rows(cfg) if n_moe else {"buffer": 0, "active": 0, "kept": 0}
    stash_on = cfg.paged_stash and n_moe > 0
    # What a MoE layer keeps for its routed rows from its forward to its backward: the grouped
    # experts' input rows and fc1 output; nothing with PipelinedLLEP (a reentrant checkpoint that
    # saves the layer's input, counted with attention as the MLP input, and recomputes its
    # chunks in backward) or with the selective recompute of 'moe'; nothing on the device when
    # paged (paged-stash term).
    kept_width = 0 if cfg.pipelined_llep.enabled or stash_on or cut["rows"] else w["row_saved"]
    mixer_saved, mixer_grad = token_mixer_bytes_per_token(
        cfg, layer_ids, w["attn_saved"] - cut["attention"])
    w = {**w, "attn_grad": mixer_grad}
    attn_tok = n * mixer_saved
    return _Stage(
        index=stage, layer_ids=layer_ids, n_moe=n_moe, inflight=cfg.pp - stage,
        last=stage == cfg.pp - 1, widths=w, rows=rows, stash_on=stash_on, kept_width=kept_width,
        attn_tok=attn_tok,
        moe_layer=attn_tok + n * (w["moe_token_saved"] - cut["moe_tokens"])
        + rows["kept"] * kept_width,
        dense_layer=attn_tok + n * (w["dense_mlp_saved"] - cut["dense_mlp"]),
        selective=cut,
    )


def _layer_activations(cfg: BudgetConfig, s: _Stage) -> Term:
    """Layers not checkpointed: everything they save stays until their backward."""
    if not s.full_layers:
        return 0, "0: every layer is checkpointed (boundaries only)"
    w, rows = s.widths, s.rows
    dense_full = s.full_layers - s.moe_full
    value = (s.moe_full * s.moe_layer + dense_full * s.dense_layer) * s.inflight
    return value, (
        f"{s.full_layers} layer(s) not checkpointed × {s.inflight} micro-batch(es): per layer "
        f"N·{w['attn_saved']} B attention (b·(4H + 3·heads·kv + 2·groups·kv) + 4·heads) + "
        f"N·{w['moe_token_saved']} B router/shared expert (MoE layer) or "
        f"N·{w['dense_mlp_saved']} B (dense MLP) + routed rows kept {rows['kept']:,} × "
        f"{s.kept_width} B"
        + (" (PipelinedLLEP: none, its chunks are recomputed from the MLP input)"
           if cfg.pipelined_llep.enabled else "")
        + (" (paged: see paged stash)" if s.stash_on and not cfg.pipelined_llep.enabled else "")
        + _selective_note(cfg, s)
    )


def _selective_note(cfg: BudgetConfig, s: _Stage) -> str:
    """What the modules of selective recompute take off the note's per-layer counts."""
    if not cfg.recompute_modules:
        return ""
    cut = s.selective
    return (f"; less, recomputed in backward ({', '.join(cfg.recompute_modules)}): attention "
            f"N·{cut['attention']} B, MoE tokens N·{cut['moe_tokens']} B"
            + (", every routed row" if cut["rows"] else "")
            + f", dense MLP N·{cut['dense_mlp']} B")


def _selective_restored(cfg: BudgetConfig, s: _Stage) -> int:
    """What the layer in backward holds again of what its selective modules recomputed: the
    larger of a MoE and a dense layer's savings (the rows of 'moe' at the active count; with
    PipelinedLLEP its own backward recomputes them a chunk at a time, in the transient)."""
    n, cut = cfg.tokens, s.selective
    if not cfg.recompute_modules or not s.n_layers:
        return 0
    rows = cut["rows"] and not cfg.pipelined_llep.enabled
    moe = n * (cut["attention"] + cut["moe_tokens"]) + (
        s.rows["active"] * s.widths["row_saved"] if rows else 0)
    dense = n * (cut["attention"] + cut["dense_mlp"])
    return max(moe if s.n_moe else 0, dense if s.n_dense else 0)


def _moe_dispatch(cfg: BudgetConfig, s: _Stage) -> Term:
    """The dispatch and combine buffers of the MoE layer in flight."""
    if not s.n_moe:
        return 0, "0: no MoE layer on this stage"
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    value = 2 * s.rows["buffer"] * h * b
    if cfg.pipelined_llep.enabled:
        k_chunks, c_eff = pipelined_llep_chunks(cfg)
        return value, (
            f"PipelinedLLEP: 2·E_p·k·c_eff·H·b = 2·{cfg.ep}·{cfg.topk}·{c_eff:,}·{h}·{b} "
            f"(K = min(ceil(N/c), K_max) = {k_chunks}; worst case, independent of routing)"
        )
    if cfg.capacity_factor:
        return value, (
            f"static capacity: 2 (dispatch + combine) × E_p·ceil(cf·N·k/E_p) rows × H·b = "
            f"2·{s.rows['buffer']:,}·{h}·{b} (cf = {cfg.capacity_factor:g})"
        )
    return value, (
        f"standard (unbounded): 2·k·N·H·b × skew = 2·{cfg.topk}·{n:,}·{h}·{b} × "
        f"{cfg.routing_skew:g} (assumed routing skew: the hottest rank receives "
        f"{cfg.routing_skew:g}× its even share; not a bound)"
    )


def _paged_stash(cfg: BudgetConfig, s: _Stage) -> Term:
    """The pages holding the expert activations of the layers whose stash is not cancelled."""
    if not s.stash_on:
        return 0, "0: --moe-paged-stash off"
    if cfg.recompute == "full":
        # a recomputed layer's backward follows at once (its stash is cancelled); earlier
        # layers of the same chunk and non-checkpointed layers are paged
        chunk = 1 if cfg.recompute_method == "block" else max(1, cfg.recompute_layers)
        stashed_layers = min(chunk, s.n_moe) + s.moe_full * s.inflight
    else:
        stashed_layers = s.n_moe * s.inflight
    avg_rows = cfg.tokens * cfg.topk
    row_saved = s.widths["row_saved"]
    note = (f"factor × N·k × (H + fc1 width)·b × layers stashed = {cfg.stash_factor:g} × "
            f"{avg_rows:,} × {row_saved} B × {stashed_layers} (pages hold the grouped experts' "
            f"saved input rows and fc1 output at the average, not the capacity, row count; "
            f"with full recompute only the layers of one recomputed chunk and "
            f"non-checkpointed layers are paged)")
    return int(math.ceil(cfg.stash_factor * avg_rows * row_saved * stashed_layers)), note


def _vocab_projection(cfg: BudgetConfig, s: _Stage) -> Term:
    """The output layer and its loss (last stage), plus the hidden fed to it."""
    if not s.last:
        return 0, "0: no output layer on this pipeline stage"
    output, output_note = output_layer_bytes(cfg)
    mtp, mtp_note = mtp_loss_bytes(cfg)
    hidden = cfg.tokens * cfg.hidden * cfg.act_bytes
    return output + hidden + mtp, f"{output_note}, plus the hidden fed to it N·H·b" + mtp_note


def _backward_transient(cfg: BudgetConfig, s: _Stage) -> Term:
    """The largest backward transient of a sub-block, plus the hidden gradient in and out."""
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    w, rows = s.widths, s.rows
    grad_attn = n * w["attn_grad"]
    grad_moe = n * w["moe_token_grad"] + rows["active"] * w["row_grad"] if s.n_moe else 0
    grad_dense = n * w["dense_mlp_grad"] if s.n_dense else 0
    return max(grad_attn, grad_moe, grad_dense) + 2 * n * h * b, (
        f"backward transient max(attention N·{w['attn_grad']} B"
        + (f", MoE N·{w['moe_token_grad']} B + {rows['active']:,} rows × {w['row_grad']} B"
           if s.n_moe else "")
        + (f", dense MLP N·{w['dense_mlp_grad']} B" if s.n_dense else "")
        + ") + 2·N·H·b (hidden gradient in and out)"
    )


def _recompute_working_set(cfg: BudgetConfig, s: _Stage) -> Term:
    """One checkpointed chunk during its recompute and backward, plus the backward transient."""
    transient, transient_note = _backward_transient(cfg, s)
    if cfg.recompute != "full" or not s.n_layers:
        restored = _selective_restored(cfg, s)
        return transient + restored, (
            ("no recompute" if not restored else
             f"selective recompute: the layer in backward holds again what "
             f"{', '.join(cfg.recompute_modules)} recomputed, {restored:,} B")
            + ": saved activations are in 'layer activations'; " + transient_note
        )
    n, w, rows = cfg.tokens, s.widths, s.rows
    n_moe, n_dense = s.n_moe, s.n_dense
    fc1_rows = rows["active"] * (w["row_saved"] - w["row_inputs"]) if n_moe else 0
    chunk_layers = 1 if cfg.recompute_method == "block" else min(
        max(1, cfg.recompute_layers), s.n_layers
    )
    # the layer being differentiated: its input rows are in the dispatch term
    one_layer = max(
        s.attn_tok + n * w["moe_token_saved"] + fc1_rows if n_moe else 0,
        s.dense_layer if n_dense else 0,
    )
    # earlier layers of the same chunk keep what they saved
    earlier = (chunk_layers - 1) * max(s.moe_layer if n_moe else 0,
                                       s.dense_layer if n_dense else 0)
    return one_layer + earlier + transient, (
        f"one chunk of {chunk_layers} layer(s) recomputed; the layer in backward saves "
        f"attention N·{w['attn_saved']} B"
        + (f" + MoE tokens N·{w['moe_token_saved']} B + expert fc1 output "
           f"{rows['active']:,} rows × {w['row_saved'] - w['row_inputs']} B" if n_moe else "")
        + (f" (or dense MLP N·{w['dense_mlp_saved']} B)" if n_dense else "")
        + (f"; {chunk_layers - 1} earlier layer(s) of the chunk keep theirs" if chunk_layers > 1
           else "")
        + "; plus the " + transient_note
        + ("; rows = one PipelinedLLEP chunk E_p·k·c_eff (the bound holds in "
           "backward too)" if cfg.pipelined_llep.enabled and n_moe else "")
    )


def _phase_peak(cfg: BudgetConfig, s: _Stage, terms: Dict[str, int], notes: Dict[str, str],
                n_boundaries: int, state_params: int):
    """(peak allocated, peak phase, terms live at the peak, peak of each phase, the first
    iteration's peak); sets each phased term to its own phase's value (None for the phase
    entries without phases: every term is live at once)."""
    if cfg.recompute == "full" and s.n_layers and not s.full_layers:
        step = _optimizer_step_bytes(cfg, state_params)
        n_linear = sum(1 for i in s.layer_ids if cfg.linear_layers[i])
        phases = recompute_phases(cfg, s.n_moe, s.n_dense, n_linear, n_boundaries, s.last, step)
        # OffloadStreamAdamW keeps its staging from the first step on: every phase of a later
        # iteration holds it too, the first iteration's phases before its step do not (a
        # one-iteration job's peak is the first iteration's)
        staging = terms["optimizer_staging"] if cfg.offload_stream.enabled else 0

        def phase_bytes(name: str, later: bool = True) -> int:
            kept = staging if later and name != "step" else 0
            return sum(phases[name][0].values()) + kept + terms["model_state"]

        peak_phase = max(phases, key=phase_bytes)
        # every term at its own phase's value; the peak adds only the largest phase's terms
        for phase, (phase_terms, phase_notes) in phases.items():
            for name, value in phase_terms.items():
                if phase == peak_phase or name not in phases[peak_phase][0]:
                    terms[name] = value
                    notes[name] = f"[{phase}{', the peak' if phase == peak_phase else ''}] " + (
                        phase_notes[name])
        peak_terms = ["model_state", *phases[peak_phase][0]]
        if staging and "optimizer_staging" not in peak_terms:
            peak_terms.append("optimizer_staging")
            notes["optimizer_staging"] += "; kept from the first step on, so live at the peak"
        phase_peaks = {name: phase_bytes(name) for name in phases}
        first = max(phase_bytes(name, later=False) for name in phases)
        return phase_peaks[peak_phase], peak_phase, peak_terms, phase_peaks, first
    # Without full recompute of every layer, the saved activations are live from the forward to
    # each layer's backward; beside them, at the loss, the output layer and its loss (freed when
    # the backward starts), in the layers' backward, the dispatch buffers and the backward
    # transient; in the step the optimizer's temporaries (the activations are freed by then).
    # The streamed optimizer's staging is live throughout.
    throughout = ["model_state", "optimizer_staging", "checkpoint_boundaries",
                  "layer_activations", "paged_stash", "kept_attention"]
    phase_terms = {"backward": throughout + ["moe_dispatch", "recompute_working_set"]}
    if s.last:
        phase_terms = {"loss": throughout + ["vocab_projection"], **phase_terms}
    if not cfg.offload_stream.enabled:
        step, step_note = _optimizer_step_bytes(cfg, state_params)
        terms["optimizer_step"] = step
        notes["optimizer_step"] = step_note + "; the activations are freed by then"
        phase_terms["step"] = ["model_state", "optimizer_step"]
    phase_peaks = {phase: sum(terms[name] for name in names)
                   for phase, names in phase_terms.items()}
    peak_phase = max(phase_peaks, key=phase_peaks.get)
    for phase, names in phase_terms.items():
        for name in names:
            if name not in throughout:
                notes[name] = (f"[{phase}{', the peak' if phase == peak_phase else ''}] "
                               + notes[name])
    return phase_peaks[peak_phase], peak_phase, phase_terms[peak_phase], phase_peaks, None


def _estimate_stage(cfg: BudgetConfig, stage: int) -> Budget:
    counts = parameter_counts(cfg, stage)
    s = _stage_shape(cfg, stage)
    terms: Dict[str, int] = {}
    notes: Dict[str, str] = {}
    host: Dict[str, int] = {}

    gpu_state, host_state, state_params, note = model_state(cfg, counts)
    terms["model_state"], notes["model_state"] = gpu_state, note
    if host_state:
        host["optimizer state"] = host_state
    terms["optimizer_staging"], notes["optimizer_staging"] = _staging(cfg, state_params)
    # the step's phase sets it below, except with the streamed optimizer
    terms["optimizer_step"] = 0
    notes["optimizer_step"] = "0: the streamed optimizer steps through its staging buffers"

    ckpt, sco_host, n_boundaries, note, s.full_layers = _checkpoint_boundaries(
        cfg, s.n_layers, s.inflight, s.last
    )
    terms["checkpoint_boundaries"], notes["checkpoint_boundaries"] = ckpt, note
    if sco_host:
        host["SCO boundaries"] = sco_host
    stored_ids = s.layer_ids[s.n_layers - s.full_layers:] if s.full_layers else ()
    s.moe_full = sum(1 for i in stored_ids if cfg.moe_layers[i])
    # MTP layers not checkpointed are stored like a layer of the decoder's last layer's kind
    stored_mtp = mtp_stored_layers(cfg, s.last)
    s.full_layers += stored_mtp
    s.moe_full += stored_mtp if cfg.moe_layers[-1] else 0
    for name, term in (("layer_activations", _layer_activations), ("moe_dispatch", _moe_dispatch),
                       ("paged_stash", _paged_stash), ("vocab_projection", _vocab_projection),
                       ("recompute_working_set", _recompute_working_set)):
        terms[name], notes[name] = term(cfg, s)

    # with full recompute, phased: at the loss and in the layer's backward (recompute_phases)
    kept, kept_notes = kept_attention_terms(cfg, s.n_moe + s.n_dense, s.last)
    terms["kept_attention"], notes["kept_attention"] = 0, kept_notes["layer"]
    if kept["host"]:
        host["kept attention"] = kept["host"]
    peak, peak_phase, peak_terms, phase_peaks, first_iteration_peak = _phase_peak(
        cfg, s, terms, notes, n_boundaries, state_params)
    terms["cuda_context_fragmentation"] = CUDA_CONTEXT_BYTES + int(FRAGMENTATION_FRACTION * peak)
    notes["cuda_context_fragmentation"] = (
        f"fixed {CUDA_CONTEXT_BYTES / GiB:g} GiB (CUDA context, NCCL buffers; an allowance: the "
        f"allocator does not see it) + {FRAGMENTATION_FRACTION:.0%} of the peak allocated "
        f"(allocator fragmentation)"
    )
    details = {
        "tokens": cfg.tokens, "world": cfg.world, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
        "ep": cfg.ep, "dp": cfg.dp, "edp": cfg.edp, "stage": stage, "inflight": s.inflight,
        "layers": s.n_layers, "moe_layers": s.n_moe, "boundaries": n_boundaries,
        "params_dense": counts["dense"], "params_expert": counts["expert"],
        "params_ring_output": counts["ring_output"], "state_params": state_params,
        "moe_rows": s.rows, "vocab": cfg.vocab, "operators": _operators(cfg),
        "has_output": s.last, "has_embedding": stage == 0,
        "peak_phase": peak_phase, "peak_terms": peak_terms, "phases": phase_peaks,
        # with full recompute and OffloadStreamAdamW, before the staging exists (a
        # one-iteration job's peak); None: the same as the peak
        "first_iteration_peak": first_iteration_peak,
    }
    return Budget(
        terms={name: int(terms[name]) for name in TERM_ORDER}, notes=notes,
        hbm_bytes=cfg.hbm_bytes, host_terms=host, details=details, config=cfg, peak_bytes=peak,
    )


def stage_budgets(args_or_cfg) -> List[Budget]:
    """One budget per pipeline stage (stage s keeps PP - s micro-batches in flight), with
    ``--chunked-recompute-keep-attention auto`` resolved (:func:`place_kept_attention`)."""
    cfg = place_kept_attention(as_config(args_or_cfg))[0]
    return [_estimate_stage(cfg, stage) for stage in range(cfg.pp)]


# How to lower each pinned user's host memory, by its flag.
PINNED_HOST_FIXES = {
    "--sco-host-budget-gb": "lower --sco-host-budget-gb",
    "--offload-stream-optimizer": "shard the optimizer state over more ranks (data parallelism) "
    "or remove --offload-stream-optimizer",
    "--optimizer-cpu-offload": "lower --optimizer-offload-fraction",
    "--chunked-recompute-keep-attention": "use --chunked-recompute-keep-attention gpu or off",
}


def pinned_host_gib(budget: Budget) -> dict:
    """``{flag: GiB one GPU process pins}`` of a stage's budget: SCO's whole budget (its pool may
    grow to it), the attention kept on the host and the optimizer state the budget's host term
    puts on the host."""
    cfg = budget.config
    owner = "--offload-stream-optimizer" if cfg.offload_stream.enabled else "--optimizer-cpu-offload"
    pinned = {"--sco-host-budget-gb": cfg.sco.sco_host_budget_gb,
              "--chunked-recompute-keep-attention": budget.host_terms.get("kept attention", 0) / GiB,
              owner: budget.host_terms.get("optimizer state", 0) / GiB}
    return {flag: gib for flag, gib in pinned.items() if gib > 0}



class _PinnedHostTooLarge(Exception):
    pass


def place_kept_attention(cfg: BudgetConfig) -> Tuple[BudgetConfig, str]:
    """``cfg`` with ``--chunked-recompute-keep-attention auto`` replaced by where the budget
    puts the kept tensors, and why: ``gpu`` where that plan fits the GPU, else ``host`` where
    that plan fits and the pinned host memory of every pinned user together fits the host,
    else ``off``. Other values are returned as they are (why: "")."""
    if cfg.chunked_attention.chunked_recompute_keep_attention != "auto":
        return cfg, ""
    reasons = []
    for choice in ("gpu", "host"):
        candidate = cfg.with_flags(chunked_recompute_keep_attention=choice)
        budgets = [_estimate_stage(candidate, stage) for stage in range(candidate.pp)]
        if not all(budget.feasible for budget in budgets):
            peak = max(budget.total for budget in budgets)
            reasons.append(f"{choice}: {peak / GiB:.1f} GiB of {cfg.hbm_bytes / GiB:.1f} GiB "
                           f"per GPU")
            continue
        if choice == "host":
            pinned = max((pinned_host_gib(budget) for budget in budgets),
                         key=lambda users: sum(users.values()))
            try:
                check_pinned_host_memory(pinned, _PinnedHostTooLarge)
            except _PinnedHostTooLarge:
                reasons.append("host: the pinned host memory of "
                               + " + ".join(f"{flag} {gib:.1f} GiB" for flag, gib in pinned.items())
                               + " per GPU does not fit the host")
                continue
        fits = f"{max(budget.total for budget in budgets) / GiB:.1f} GiB per GPU fits"
        return candidate, "; ".join(reasons + [f"{choice}: {fits}"])
    return (cfg.with_flags(chunked_recompute_keep_attention="off"),
            "; ".join(reasons) + "; off: attention is recomputed")



def estimate_config(cfg: BudgetConfig) -> Budget:
    """The budget of ``cfg`` (the largest pipeline stage when PP > 1)."""
    return max(stage_budgets(cfg), key=lambda budget: budget.total)



def estimate(args, settings=None, ring_group=None) -> Budget:
    """Per-GPU memory budget of a parsed Megatron namespace: the layout and model from upstream's
    flags, the operators from their settings objects (``settings``: an object with the
    :class:`BudgetConfig` settings fields, e.g. the run settings of ``pretrain_gpt.py``; those it
    lacks are read from ``args`` by each operator's settings class). ``ring_group`` overrides
    the Ring-DTP ring's size (planning only)."""
    return estimate_config(BudgetConfig.from_args(args, settings, ring_group))



def max_seq_length(args_or_cfg, granularity: int = 1024, upper: int = 1 << 24) -> int:
    """Largest ``--seq-length`` (a multiple of ``granularity``, at most ``upper``) whose budget
    fits, by bisection (every term grows with N); 0 when not even ``granularity`` fits."""
    cfg = as_config(args_or_cfg)

    def fits(seq: int) -> bool:
        return estimate_config(cfg.replace(seq_length=seq)).feasible

    lo, hi = 0, upper // granularity
    if not fits(granularity):
        return 0
    lo = 1
    if fits(hi * granularity):
        return hi * granularity
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * granularity):
            lo = mid
        else:
            hi = mid
    return lo * granularity

