"""The budget's terms: parameters, the live sets of each phase of a step, and the peak
(:func:`estimate`, :class:`Budget`); the package docstring writes them out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.bounded.budget.config import (
    GiB, BudgetConfig, _as_config, _ceil_div, _stage_layers,
)
from megatron.bounded.activations.chunked_attention import (
    backward_bytes_per_token,
    chunk_backward_bytes_per_token,
    saved_bytes_per_token,
)
from megatron.bounded.activations.chunked_recompute import released_bytes_per_token
from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes
from megatron.bounded.moe.pipelined_llep import agree_num_chunks, pipelined_llep_live_bytes
from megatron.bounded.moe.dispatch.token_dispatcher import capacity_rows
from megatron.bounded.activations.sco import boundaries_on_device
from megatron.bounded.optimizer.offload_stream_adamw import staging_bound_bytes
from megatron.bounded.attention.context_parallel import expanded_query_groups

# Fixed allowance for what the caching allocator does not count: the CUDA context and the
# libraries' own buffers (one H200 job at 132.4 GiB allocated trained in 139.8 GiB). NCCL with
# many communicators can take more.
CUDA_CONTEXT_BYTES = 1 * GiB

# Allocator fragmentation, a fraction of the predicted peak allocated: near the GPU's capacity
# (expandable segments) the reserved peak was 0.9% above the allocated one.
FRAGMENTATION_FRACTION = 0.03

# Kernel workspaces taken from PyTorch's caching allocator (cuDNN attention, cuBLAS): a 192 MiB
# block live at the layer peak at every length measured.
KERNEL_WORKSPACE_BYTES = 192 * 2**20

# int64 tokens, labels and positions, fp32 loss mask
BATCH_BYTES_PER_TOKEN = 28

TERM_LABELS = {
    "model_state": "model state",
    "optimizer_staging": "optimizer staging",
    "optimizer_step": "optimizer step temporaries",
    "checkpoint_boundaries": "checkpoint boundaries",
    "layer_activations": "layer activations",
    "moe_dispatch": "MoE dispatch",
    "paged_stash": "paged stash pages",
    "vocab_projection": "vocabulary projection",
    "recompute_working_set": "recompute working set",
    "cuda_context_fragmentation": "CUDA context + fragmentation",
}

TERM_ORDER = tuple(TERM_LABELS)


def _norm_params(cfg: BudgetConfig, width: int) -> int:
    return 2 * width if cfg.layernorm else width


def parameter_counts(args_or_cfg, stage: int = 0) -> Dict[str, int]:
    """Parameters held by one rank of ``stage``, by kind (after TP / EP / Ring-DTP sharding).

    * attention per layer: QKV H·(heads + 2·groups)·kv/TP + proj heads·kv·H/TP (+ biases),
      input norm, qk norms;
    * dense MLP per layer: H·F·(2 if gated else 1)/TP + F·H/TP (+ biases), pre-MLP norm;
    * MoE layer: router E·H; E/E_p local experts of H·F_m·(2 if gated else 1) + F_m·H, divided by
      expert TP; shared expert H·F_s·(2 if gated else 1)/TP + F_s·H/TP (+ gate H); pre-MLP norm;
    * embedding V·H/TP (+ learned positions) on the first stage; final norm and output layer
      V·H/TP on the last (ceil(V/P)·H with Ring-DTP; a copy of the embedding when tied and
      PP > 1).

    Returns ``dense`` (replicated over DP: state sharded by W = DP × CP), ``expert`` (sharded by
    W_e), ``ring_output`` (the Ring-DTP output shard: unique per rank of the ring) and
    a breakdown.
    """
    cfg = _as_config(args_or_cfg)
    layers = _stage_layers(cfg)[stage]
    h, tp, g = cfg.hidden, cfg.tp, (2 if cfg.gated else 1)
    q_width = cfg.heads * cfg.kv_channels
    qkv_width = (cfg.heads + 2 * cfg.groups) * cfg.kv_channels
    attn = h * qkv_width // tp + q_width * h // tp + _norm_params(cfg, h)
    if cfg.bias_linear or cfg.qkv_bias:
        attn += qkv_width // tp
    if cfg.bias_linear:
        attn += h
    if cfg.qk_layernorm:
        attn += 2 * _norm_params(cfg, cfg.kv_channels)
    dense_mlp = h * cfg.ffn * g // tp + cfg.ffn * h // tp + _norm_params(cfg, h)
    if cfg.bias_linear:
        dense_mlp += cfg.ffn * g // tp + h
    moe_dense = cfg.experts * h + _norm_params(cfg, h)
    if cfg.shared_ffn:
        moe_dense += h * cfg.shared_ffn * g // tp + cfg.shared_ffn * h // tp
        if cfg.bias_linear:
            moe_dense += cfg.shared_ffn * g // tp + h
        if cfg.shared_gate:
            moe_dense += h
    expert_one = h * cfg.moe_ffn * g + cfg.moe_ffn * h
    if cfg.bias_linear:
        expert_one += cfg.moe_ffn * g + h
    local_experts = _ceil_div(cfg.experts, cfg.ep) if cfg.experts else 0
    expert_layer = local_experts * expert_one // cfg.etp

    n_moe = sum(1 for i in layers if cfg.moe_layers[i])
    n_dense = len(layers) - n_moe
    counts = {
        "attention": len(layers) * attn,
        "dense_mlp": n_dense * dense_mlp,
        "moe_router_shared": n_moe * moe_dense,
        "experts": n_moe * expert_layer,
        "embedding": 0,
        "output_layer": 0,
        "ring_output": 0,
        "final_norm": 0,
    }
    first, last = stage == 0, stage == cfg.pp - 1
    if first:
        counts["embedding"] = cfg.vocab * h // tp + cfg.learned_positions * h
    if last:
        counts["final_norm"] = _norm_params(cfg, h)
        if cfg.ring_dtp.enabled and (cfg.untied or not first):
            counts["ring_output"] = _ceil_div(cfg.vocab, cfg.ring_group) * h
        elif cfg.untied or not first:
            counts["output_layer"] = cfg.vocab * h // tp
    counts["dense"] = (
        counts["attention"] + counts["dense_mlp"] + counts["moe_router_shared"]
        + counts["embedding"] + counts["output_layer"] + counts["final_norm"]
    )
    counts["expert"] = counts["experts"]
    return counts


def _token_widths(cfg: BudgetConfig) -> Tuple[int, int, int]:
    """Elements per token on this rank: (hidden, heads·kv, groups·kv). The hidden is divided by
    TP with sequence parallelism; with context parallelism (the sequence-to-head all-to-all of
    ``megatron.bounded.attention.context_parallel``) groups not divisible by CP are repeated to lcm(groups, CP)."""
    tp = cfg.tp
    h_tok = cfg.hidden // tp if cfg.sequence_parallel else cfg.hidden
    groups = cfg.groups // tp
    if cfg.cp > 1:
        groups = expanded_query_groups(groups, cfg.cp)
    return h_tok, cfg.heads * cfg.kv_channels // tp, groups * cfg.kv_channels


def _boundary_and_rope_bytes(cfg: BudgetConfig) -> Tuple[int, int]:
    """(one checkpoint boundary N·H·b, the rotary table (S/CP)·kv·4 shared by every layer)."""
    per = cfg.tokens * _token_widths(cfg)[0] * cfg.act_bytes
    rope = cfg.seq_length // max(1, cfg.cp) * cfg.kv_channels * 4 if cfg.rope else 0
    return per, rope


def _activation_widths(cfg: BudgetConfig) -> Dict[str, int]:
    """Bytes saved for backward, per token or per routed row, counted tensor by tensor from the
    local (TE-free) layer of this project.

    Attention, per token: input-norm input (H) and output = QKV input (H); q (heads·kv), k, v
    (groups·kv each) as SDPA saves them; SDPA output (heads·kv) and its [s, b, heads·kv] copy
    that linear_proj saves (heads·kv); pre-MLP-norm input (H) and output = MLP input (H): that is
    b·(4H + 3·heads·kv + 2·groups·kv), plus the flash log-sum-exp (4 bytes × heads). Head-sized
    widths are divided by TP; H-sized ones too with sequence parallelism.

    MoE, per token: router logits and probabilities, fp32 (2·E·4); shared expert fc1 output and
    activation (b·(2F_s + F_s) gated, b·2F_s otherwise). Per routed row, as the grouped experts
    save them: input row (H) and fc1 output (2F_m gated, F_m otherwise). Dense MLP per token:
    fc1 output and activation, b·(2F + F) gated.

    With context parallelism (the sequence-to-head all-to-all of ``megatron.bounded.attention.context_parallel``)
    the kernel holds the exchanged q, k, v, the same count per token as the local ones except
    that groups not divisible by CP are repeated to lcm(groups, CP) (``groups'``): the formulas
    use groups' for k and v, and the backward transient adds two more copies of the exchanged
    b·(heads + 2·groups')·kv on their way back through the exchange.

    Backward transients (one sub-block at a time): attention dq, dk, dv, d_out and the proj-input
    gradient, b·(3·heads·kv + 2·groups·kv), plus the kernel's fp32 dq accumulator (4·heads·kv);
    per routed row, as the grouped experts' backward holds them together: the masked fc1 copy
    and the fc1 gradient (2 × fc1 width), the recomputed scaled activation and its gradient
    (2F_m) and the row gradient (H), b·(H + 2·fc1 + 2F_m); per token the MLP/MoE token-side
    tensors once more.
    """
    b, tp = cfg.act_bytes, cfg.tp
    h_tok, hq, hkv = _token_widths(cfg)
    exchange_copies = 2 * b * (hq + 2 * hkv) if cfg.cp > 1 else 0
    g = 2 if cfg.gated else 1
    fc1_m = g * cfg.moe_ffn // cfg.etp
    f_m = cfg.moe_ffn // cfg.etp
    fc1_s = g * cfg.shared_ffn // tp
    fc1_d = g * cfg.ffn // tp
    # gated or not, the activation output has the FFN width: fc1 out + activation out per token
    shared_saved = b * (fc1_s + cfg.shared_ffn // tp) if cfg.shared_ffn else 0
    widths = {
        "attn_saved": b * (4 * h_tok + 3 * hq + 2 * hkv) + 4 * (cfg.heads // tp),
        "attn_grad": b * (3 * hq + 2 * hkv) + 4 * hq + exchange_copies,
        "moe_token_saved": 2 * cfg.experts * 4 + shared_saved,
        "dense_mlp_saved": b * (fc1_d + cfg.ffn // tp),
        "row_saved": b * (cfg.hidden + fc1_m),
        "row_inputs": b * cfg.hidden,
        "row_grad": b * (cfg.hidden + 2 * fc1_m + 2 * f_m),
    }
    widths["moe_token_grad"] = widths["moe_token_saved"]
    widths["dense_mlp_grad"] = widths["dense_mlp_saved"]
    return widths


def pipelined_llep_chunks(cfg: BudgetConfig) -> Tuple[int, int]:
    """(K, c_eff) of PipelinedLLEP for this configuration, as the operator's ``agree_num_chunks``
    gives them when every rank has this rank's N (c = N without a budget)."""
    n = cfg.tokens
    return agree_num_chunks(n, max(1, cfg.pipelined_llep.pipelined_llep_token_budget or n), max(1, cfg.pipelined_llep.pipelined_llep_max_chunks))


def _moe_rows(cfg: BudgetConfig) -> Dict[str, int]:
    """Routed rows of one MoE layer on this rank.

    ``buffer``: rows of the dispatch (and combine) buffer of the layer in flight.
    ``active``: rows whose expert activations are live during that layer's recompute/backward.
    ``kept``: rows a MoE layer keeps for backward after its forward (without recompute).
    """
    n, k = cfg.tokens, cfg.topk
    # with one rank in the expert-parallel group every routed row lands here: no skew
    skewed = math.ceil((cfg.routing_skew if cfg.ep > 1 else 1.0) * n * k)
    if cfg.pipelined_llep.enabled:
        _, c_eff = pipelined_llep_chunks(cfg)
        chunk = cfg.ep * k * c_eff  # worst case: every source sends its whole chunk here
        return {"buffer": chunk, "active": chunk, "kept": skewed}
    if cfg.capacity_factor:
        cap = cfg.ep * capacity_rows(n, k, cfg.ep, float(cfg.capacity_factor))
        return {"buffer": cap, "active": cap, "kept": cap}
    return {"buffer": skewed, "active": skewed, "kept": skewed}


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
        ops.append(f"OffloadStreamAdamW ({cfg.offload_stream.offload_stream_slots} slots × {cfg.offload_stream.offload_stream_bucket_numel:,})")
    if cfg.sco.host_budget_bytes > 0:
        ops.append(f"SCO (host budget {cfg.sco.host_budget_bytes / GiB:g} GiB)")
    if cfg.ring_dtp.enabled:
        chunk = f", chunk {cfg.ring_dtp.ring_dtp_chunk_tokens:,}" if cfg.ring_dtp.ring_dtp_chunk_tokens else ""
        ops.append(f"Ring-DTP (P={cfg.ring_group}{chunk})")
    if cfg.pipelined_llep.enabled:
        k_chunks, c_eff = pipelined_llep_chunks(cfg)
        ops.append(f"PipelinedLLEP (K={k_chunks}, c_eff={c_eff:,})")
    if cfg.capacity_factor:
        ops.append(f"static capacity cf={cfg.capacity_factor:g}")
    if cfg.paged_stash:
        ops.append("paged stash")
    return ", ".join(ops)


def _model_state(cfg: BudgetConfig, counts: Dict[str, int]) -> Tuple[int, int, int, str]:
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
    buckets = max(1, _ceil_div(state_params, cfg.offload_stream.offload_stream_bucket_numel))
    note = (
        f"staging_bound_bytes: min(slots, buckets) × largest bucket × 16 B with {cfg.offload_stream.offload_stream_slots} "
        f"slots, {buckets} buckets of ≤ {cfg.offload_stream.offload_stream_bucket_numel:,} over {state_params:,} params"
    )
    return staging_bound_bytes(state_params, cfg.offload_stream.offload_stream_bucket_numel, cfg.offload_stream.offload_stream_slots), note


def checkpointed_chunks(cfg: BudgetConfig, n_layers: int) -> int:
    """Checkpointed chunks of ``n_layers`` layers under full recompute, one boundary each per
    micro-batch: ``block`` checkpoints min(R, layers) single layers, ``uniform`` groups the
    layers by R (``--recompute-num-layers``)."""
    rnl = max(1, cfg.recompute_layers)
    if cfg.recompute_method == "block":
        return min(rnl, n_layers)
    return _ceil_div(n_layers, rnl)


def _checkpoint_boundaries(
    cfg: BudgetConfig, n_layers: int, inflight: int
) -> Tuple[int, int, int, str, int]:
    """(device bytes, host bytes, boundaries in total, note, layers stored in full)."""
    if cfg.recompute != "full" or n_layers == 0:
        return 0, 0, 0, "0: no full recompute (see layer activations)", n_layers
    per, rope = _boundary_and_rope_bytes(cfg)
    chunks = checkpointed_chunks(cfg, n_layers)
    if cfg.recompute_method == "block":
        full_layers = n_layers - chunks
        how = f"block: {chunks} checkpointed layers"
    else:
        full_layers = 0
        how = f"uniform: ceil({n_layers}/{max(1, cfg.recompute_layers)}) = {chunks} chunks"
    count = chunks * inflight
    offloaded = 0
    if cfg.sco.host_budget_bytes > 0:
        offloaded, on_device = boundaries_on_device(count, per, cfg.sco.host_budget_bytes)
        note = (
            f"N·H·b = {per:,} B per boundary; {how} × {inflight} micro-batch(es) = {count}; "
            f"SCO offloads {offloaded} (host budget / N·H·b), device keeps (B - k) + min(k, 2) = "
            f"{on_device}"
        )
    else:
        on_device = count
        note = f"N·H·b = {per:,} B per boundary; {how} × {inflight} micro-batch(es) = {count}"
    if rope:
        note += f"; + one shared rotary table (S/CP)·kv·4 B = {rope:,} B"
    return on_device * per + rope, offloaded * per, count, note, full_layers


def _recompute_phases(cfg: BudgetConfig, n_moe: int, n_boundaries: int, last: bool,
                      state_params: int) -> Dict[str, Tuple[Dict[str, int], Dict[str, str]]]:
    """What is live besides the model state in each phase of a step with full recompute.

    The phases do not overlap, so the peak is the model state plus the largest phase (measured
    with the allocator's memory snapshot at 131K-524K tokens: the plain stack peaks at the loss,
    the other operators in the first layer's recompute and backward, or in the optimizer step):

    * ``loss``: the boundaries kept on the GPU, the last layer's output and the final norm's,
      and the output layer with its loss;
    * ``layer``: the boundaries, the recomputed layer's saved activations, the gradients of its
      input and output, and its MoE working set;
    * ``step``: the optimizer step's transient.
    """
    n = cfg.tokens
    per, rope = _boundary_and_rope_bytes(cfg)
    offloaded, on_device = boundaries_on_device(n_boundaries, per, cfg.sco.host_budget_bytes)
    restored = on_device - (n_boundaries - offloaded)
    sco_note = f" (SCO offloads {offloaded}; at most {restored} back at once)" if offloaded else ""
    phases: Dict[str, Tuple[Dict[str, int], Dict[str, str]]] = {}

    if last:
        vocab, vocab_note = _output_layer_bytes(cfg)
        terms = {
            "checkpoint_boundaries": (on_device + 2) * per + rope,
            "vocab_projection": vocab + n * (4 + BATCH_BYTES_PER_TOKEN),
        }
        notes = {
            "checkpoint_boundaries": (
                f"at the loss: {on_device} of {n_boundaries} boundaries on the GPU{sco_note} + the "
                f"last layer's output + the final norm's output, N·H·b = {per:,} B each; rotary "
                f"table {rope:,} B"),
            "vocab_projection": vocab_note + f"; batch tensors N·{BATCH_BYTES_PER_TOKEN} B",
        }
        phases["loss"] = (terms, notes)

    chunked = cfg.chunk_tokens and cfg.chunk_tokens < n
    if chunked and cfg.chunked_attention.chunked_recompute_attention:
        terms, notes = _chunked_attention_layer_phase(cfg, n_moe, per)
    else:
        terms, notes = (_chunked_layer_phase if chunked else _layer_phase)(cfg, n_moe, per)
    terms["checkpoint_boundaries"] = on_device * per + rope
    notes["checkpoint_boundaries"] = (
        f"in the first layer's backward: {on_device} of {n_boundaries} boundaries on the "
        f"GPU{sco_note}, N·H·b = {per:,} B each; rotary table {rope:,} B")
    phases["layer"] = (terms, notes)

    step, step_note = _optimizer_step_bytes(cfg, state_params)
    name = "optimizer_staging" if cfg.offload_stream.enabled else "optimizer_step"
    phases["step"] = ({name: step}, {name: step_note})
    return phases


def _layer_phase(cfg: BudgetConfig, n_moe: int, per: int):
    """The layer phase less the boundaries: the recomputed layer's saved activations, gradients
    and MoE work."""
    n = cfg.tokens
    saved = _recomputed_layer_bytes_per_token(cfg, moe=n_moe > 0)
    dispatch, experts, moe_note = _moe_layer_working_set(cfg, n_moe)
    # upstream's MoE layer under full recompute: the snapshot shows one further N·H·b block per
    # other layer, allocated inside the checkpoint's backward, alive during the recompute
    upstream_extra = (cfg.layers - 1) * per if (n_moe and cfg.upstream_experts) else 0
    terms = {
        "recompute_working_set": (n * saved + 2 * per + upstream_extra + experts
                                  + KERNEL_WORKSPACE_BYTES),
        "moe_dispatch": dispatch,
    }
    notes = {
        "recompute_working_set": (
            f"the recomputed layer's saved activations N·{saved} B + its input and output "
            f"gradients 2·N·H·b"
            + (f" + {cfg.layers - 1} further N·H·b blocks (upstream's MoE layer)"
               if upstream_extra else "")
            + (f" + the experts' working set {experts:,} B" if experts else "")
            + f" + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": moe_note,
    }
    return terms, notes


def _chunked_layer_phase(cfg: BudgetConfig, n_moe: int, per: int):
    """The layer phase less the boundaries with chunked recompute
    (``megatron.bounded.activations.chunked_recompute``): the layer keeps its saved activations less
    ``released_bytes_per_token`` per token; its peak is the larger of attention's backward (read
    from the allocator snapshot) and one MLP chunk's backward (the MLP block's working set at T
    tokens)."""
    n, b = cfg.tokens, cfg.act_bytes
    h_tok, hq, hkv = _token_widths(cfg)
    saved = _recomputed_layer_bytes_per_token(cfg, moe=n_moe > 0)
    kept = saved - released_bytes_per_token(h_tok, hq, hkv, cfg.experts if n_moe else 0, b)
    # attention's backward: its gradients plus the output projection's input gradient N·H·b;
    # the MLP node has returned by then, so its saved input (the residual after attention, H·b
    # per token, counted in ``kept``) is gone: the two cancel
    attention_backward = n * _activation_widths(cfg)["attn_grad"]
    mlp_chunk = _mlp_chunk_bytes(cfg, n_moe)
    work = max(attention_backward, mlp_chunk)
    terms = {
        "recompute_working_set": n * kept + 2 * per + work + KERNEL_WORKSPACE_BYTES,
        "moe_dispatch": 0,
    }
    notes = {
        "recompute_working_set": (
            f"chunked recompute ({cfg.chunk_tokens:,}-token chunks): the recomputed layer keeps "
            f"N·{kept} B (N·{saved} B less released_bytes_per_token) + its input and output "
            f"gradients 2·N·H·b + the larger of attention's backward N·{attention_backward // n} B "
            f"and one MLP chunk's backward {mlp_chunk:,} B + "
            f"{KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": "0: inside the MLP chunk's working set (recompute working set)",
    }
    return terms, notes


def _mlp_chunk_bytes(cfg: BudgetConfig, n_moe: int) -> int:
    """One MLP chunk's backward under chunked recompute: the MLP block's saved activations and
    MoE working set at T tokens."""
    chunk = cfg.replace(seq_length=cfg.chunk_tokens * max(1, cfg.cp) // max(1, cfg.micro_batch))
    dispatch, experts, _ = _moe_layer_working_set(chunk, n_moe)
    return chunk.tokens * _recomputed_layer_bytes_per_token(chunk, moe=n_moe > 0) + dispatch \
        + experts


def _chunked_attention_layer_phase(cfg: BudgetConfig, n_moe: int, per: int):
    """The layer phase less the boundaries with the attention sublayer recomputed in chunks too
    (``megatron.bounded.activations.chunked_attention``). The layer's input is a boundary; the attention node
    keeps ``saved_bytes_per_token`` for the sequence. The peak is the larger of

    * attention's backward: its ``backward_bytes_per_token`` and one chunk's
      ``chunk_backward_bytes_per_token``, with the gradients of the layer's output and of the
      attention output (2·N·H·b);
    * the MLP block's backward: its saved input (the residual after attention, N·H·b) and one
      MLP chunk, with the gradients of the layer's output and of the MLP input (2·N·H·b)."""
    n, b, t = cfg.tokens, cfg.act_bytes, cfg.chunk_tokens
    h_tok, hq, hkv = _token_widths(cfg)
    saved = saved_bytes_per_token(hq, hkv, cfg.heads // cfg.tp, b)
    attention = n * backward_bytes_per_token(h_tok, hkv, b) \
        + t * chunk_backward_bytes_per_token(h_tok, hq, hkv, b)
    mlp = n * h_tok * b + _mlp_chunk_bytes(cfg, n_moe)
    terms = {
        "recompute_working_set": n * saved + 2 * per + max(attention, mlp)
        + KERNEL_WORKSPACE_BYTES,
        "moe_dispatch": 0,
    }
    notes = {
        "recompute_working_set": (
            f"chunked recompute with the attention sublayer ({t:,}-token chunks): K, V, "
            f"attention's output and log-sum-exp N·{saved} B (saved_bytes_per_token) + two "
            f"gradients 2·N·H·b + the larger of attention's backward {attention:,} B "
            f"(backward_bytes_per_token, chunk_backward_bytes_per_token) and the MLP block's "
            f"{mlp:,} B (its input and one chunk) + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel "
            f"workspaces"),
        "moe_dispatch": "0: inside the MLP chunk's working set (recompute working set)",
    }
    return terms, notes


def _output_layer_bytes(cfg: BudgetConfig) -> Tuple[int, str]:
    """Live bytes of the output layer and its loss at their peak (the loss forward)."""
    n, h, v, b = cfg.tokens, cfg.hidden, cfg.vocab, cfg.act_bytes
    if cfg.ring_dtp.enabled:
        work = ring_dtp_workspace_bytes(
            n, h, v, world_size=max(1, cfg.ring_group), mode=cfg.ring_dtp.ring_dtp_mode,
            chunk_tokens=cfg.ring_dtp.ring_dtp_chunk_tokens, input_bytes=b, grad_in_forward=cfg.ring_dtp.ring_dtp_grad_in_forward,
            gradient_rows=cfg.ring_dtp.ring_dtp_gradient_rows,
        )
        return work, f"Ring-DTP workspace (ring_dtp_workspace_bytes) {work:,} B"
    local = v // cfg.tp
    return n * local * (b + 4), (
        f"upstream's output layer: the N×V/TP logits in the activation dtype and their fp32 "
        f"copy in the cross entropy, N·{local:,}·({b} + 4) B")


def _recomputed_layer_bytes_per_token(cfg: BudgetConfig, moe: bool) -> int:
    """Bytes per token a recomputed layer keeps for its backward (read from the allocator's
    snapshot of the layer): the residual after attention and the layer output (2·H·b), the two
    norm outputs with their fp32 inverse RMS (2·(H·b + 4)), QKV ((heads + 2·groups)·kv·b), the
    rotated q and k ((heads + groups)·kv·b), the attention output and its fp32 log-sum-exp
    (heads·kv·b + 4·heads), the rotary cos/sin (2·kv·4) and, in a MoE layer, the fp32 router
    logits and load-balancing scores (2·E·4)."""
    b, tp = cfg.act_bytes, cfg.tp
    h_tok, hq, hkv = _token_widths(cfg)
    width = 2 * h_tok * b + 2 * (h_tok * b + 4) + (hq + 2 * hkv) * b + (hq + hkv) * b
    width += hq * b + 4 * (cfg.heads // tp)
    if cfg.rope:
        width += 2 * cfg.kv_channels * 4
    if moe:
        width += 2 * cfg.experts * 4
    return width


def _moe_layer_working_set(cfg: BudgetConfig, n_moe: int) -> Tuple[int, int, str]:
    """(dispatch buffers, expert working set, note): the MoE part of the layer in recompute and
    backward."""
    if not n_moe:
        return 0, 0, "0: no MoE layer on this stage"
    h, b = cfg.hidden, cfg.act_bytes
    f = cfg.moe_ffn // cfg.etp
    fc1 = (2 if cfg.gated else 1) * f
    if cfg.pipelined_llep.enabled:
        parts = pipelined_llep_live_bytes(
            cfg.tokens, h, f, cfg.topk, cfg.ep, _ceil_div(cfg.experts, cfg.ep),
            cfg.pipelined_llep.pipelined_llep_token_budget or cfg.tokens, cfg.pipelined_llep.pipelined_llep_max_chunks, act_bytes=b, gated=cfg.gated,
        )
        k_chunks, c_eff = pipelined_llep_chunks(cfg)
        return parts["dispatch"], parts["expert_backward"] + parts["weight_grads"], (
            f"PipelinedLLEP (pipelined_llep_live_bytes, K = {k_chunks}, c_eff = {c_eff:,}): "
            f"send and receive rows of two chunks 2·(k + E_p·k)·c_eff·H·b; one chunk's expert "
            f"backward E_p·k·c_eff·b·(2·fc1 + 2F + H) and the expert weight gradients")
    rows = _moe_rows(cfg)["active"]
    skew = f" (assumed skew {cfg.routing_skew:g})" if cfg.ep > 1 else ""
    if cfg.upstream_experts:
        return 4 * rows * h * b, rows * b * (fc1 + f), (
            f"upstream's dispatcher and SequentialMLP in recompute: {rows:,} rows{skew} × 4·H·b "
            f"(permuted, sorted, expert output, combine-sorted rows); fc1 output and activation "
            f"rows·b·(fc1 + F)")
    return 2 * rows * h * b, rows * _activation_widths(cfg)["row_grad"], (
        f"torch-native dispatch: send and receive buffers 2·{rows:,}{skew}·H·b; the grouped "
        f"experts' backward rows·b·(2·fc1 + 2F + H)")


def _optimizer_step_bytes(cfg: BudgetConfig, state_params: int) -> Tuple[int, str]:
    """The optimizer step's transient on the GPU."""
    if cfg.offload_stream.enabled:
        staging, note = _staging(cfg, state_params)
        return staging, "OffloadStreamAdamW staging: " + note
    # torch's multi-tensor Adam makes one fp32 temporary per parameter of the step
    return 4 * state_params, f"Adam step temporaries 4 B × {state_params:,} params"


def stage_budgets(args_or_cfg) -> List[Budget]:
    """One budget per pipeline stage (stage s keeps PP - s micro-batches in flight)."""
    cfg = _as_config(args_or_cfg)
    return [_estimate_stage(cfg, stage) for stage in range(cfg.pp)]


def estimate_config(cfg: BudgetConfig) -> Budget:
    """The budget of ``cfg`` (the largest pipeline stage when PP > 1)."""
    return max(stage_budgets(cfg), key=lambda budget: budget.total)


def _estimate_stage(cfg: BudgetConfig, stage: int) -> Budget:
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    counts = parameter_counts(cfg, stage)
    layer_ids = _stage_layers(cfg)[stage]
    n_layers = len(layer_ids)
    n_moe = sum(1 for i in layer_ids if cfg.moe_layers[i])
    n_dense = n_layers - n_moe
    inflight = cfg.pp - stage  # 1F1B: micro-batches in flight on this stage
    first, last = stage == 0, stage == cfg.pp - 1
    w = _activation_widths(cfg)
    rows = _moe_rows(cfg) if n_moe else {"buffer": 0, "active": 0, "kept": 0}
    terms: Dict[str, int] = {}
    notes: Dict[str, str] = {}
    host: Dict[str, int] = {}

    # model state and optimizer staging
    gpu_state, host_state, state_params, note = _model_state(cfg, counts)
    terms["model_state"], notes["model_state"] = gpu_state, note
    if host_state:
        host["optimizer state"] = host_state
    terms["optimizer_staging"], notes["optimizer_staging"] = _staging(cfg, state_params)
    # the step's phase sets it below, except with the streamed optimizer
    terms["optimizer_step"] = 0
    notes["optimizer_step"] = "0: the streamed optimizer steps through its staging buffers"

    # checkpoint boundaries (full recompute) or per-layer activations
    ckpt, sco_host, n_boundaries, note, full_layers = _checkpoint_boundaries(
        cfg, n_layers, inflight
    )
    terms["checkpoint_boundaries"], notes["checkpoint_boundaries"] = ckpt, note
    if sco_host:
        host["SCO boundaries"] = sco_host

    stash_on = cfg.paged_stash and n_moe > 0
    # What a MoE layer keeps for its routed rows from its forward to its backward: the grouped
    # experts' input rows and fc1 output; only the input rows with PipelinedLLEP (each chunk's
    # expert GEMM is a reentrant checkpoint); nothing on the device when paged (paged-stash term).
    if cfg.pipelined_llep.enabled:
        kept_width = w["row_inputs"]
    elif stash_on:
        kept_width = 0
    else:
        kept_width = w["row_saved"]
    attn_tok = n * w["attn_saved"]
    moe_layer = attn_tok + n * w["moe_token_saved"] + rows["kept"] * kept_width
    dense_layer = attn_tok + n * w["dense_mlp_saved"]
    stored_ids = layer_ids[n_layers - full_layers:] if full_layers else ()
    moe_full = sum(1 for i in stored_ids if cfg.moe_layers[i])
    if full_layers:
        # layers not checkpointed: everything they save stays until their backward
        dense_full = full_layers - moe_full
        terms["layer_activations"] = (moe_full * moe_layer + dense_full * dense_layer) * inflight
        notes["layer_activations"] = (
            f"{full_layers} layer(s) not checkpointed × {inflight} micro-batch(es): per layer "
            f"N·{w['attn_saved']} B attention (b·(4H + 3·heads·kv + 2·groups·kv) + 4·heads) + "
            f"N·{w['moe_token_saved']} B router/shared expert (MoE layer) or "
            f"N·{w['dense_mlp_saved']} B (dense MLP) + routed rows kept {rows['kept']:,} × "
            f"{kept_width} B"
            + (" (PipelinedLLEP: chunk inputs only)" if cfg.pipelined_llep.enabled else "")
            + (" (paged: see paged stash)" if stash_on and not cfg.pipelined_llep.enabled else "")
        )
    else:
        terms["layer_activations"] = 0
        notes["layer_activations"] = "0: every layer is checkpointed (boundaries only)"

    # MoE dispatch: the buffers of the layer in flight
    if n_moe:
        terms["moe_dispatch"] = 2 * rows["buffer"] * h * b
        if cfg.pipelined_llep.enabled:
            k_chunks, c_eff = pipelined_llep_chunks(cfg)
            notes["moe_dispatch"] = (
                f"PipelinedLLEP: 2·E_p·k·c_eff·H·b = 2·{cfg.ep}·{cfg.topk}·{c_eff:,}·{h}·{b} "
                f"(K = min(ceil(N/c), K_max) = {k_chunks}; worst case, independent of routing)"
            )
        elif cfg.capacity_factor:
            notes["moe_dispatch"] = (
                f"static capacity: 2 (dispatch + combine) × E_p·ceil(cf·N·k/E_p) rows × H·b = "
                f"2·{rows['buffer']:,}·{h}·{b} (cf = {cfg.capacity_factor:g})"
            )
        else:
            notes["moe_dispatch"] = (
                f"standard (unbounded): 2·k·N·H·b × skew = 2·{cfg.topk}·{n:,}·{h}·{b} × "
                f"{cfg.routing_skew:g} (assumed routing skew: the hottest rank receives "
                f"{cfg.routing_skew:g}× its even share; not a bound)"
            )
    else:
        terms["moe_dispatch"] = 0
        notes["moe_dispatch"] = "0: no MoE layer on this stage"

    # paged stash
    if stash_on:
        if cfg.recompute == "full":
            # a recomputed layer's backward follows at once (its stash is cancelled); earlier
            # layers of the same chunk and non-checkpointed layers are paged
            chunk = 1 if cfg.recompute_method == "block" else max(1, cfg.recompute_layers)
            stashed_layers = min(chunk, n_moe) + moe_full * inflight
        else:
            stashed_layers = n_moe * inflight
        avg_rows = n * cfg.topk
        terms["paged_stash"] = int(
            math.ceil(cfg.stash_factor * avg_rows * w["row_saved"] * stashed_layers)
        )
        notes["paged_stash"] = (
            f"factor × N·k × (H + fc1 width)·b × layers stashed = {cfg.stash_factor:g} × "
            f"{avg_rows:,} × {w['row_saved']} B × {stashed_layers} (pages hold the grouped "
            f"experts' saved input rows and fc1 output at the average, not the capacity, row "
            f"count; with full recompute only the layers of one recomputed chunk and "
            f"non-checkpointed layers are paged)"
        )
    else:
        terms["paged_stash"] = 0
        notes["paged_stash"] = "0: --moe-paged-stash off"

    # vocabulary projection (last stage)
    if last:
        v = cfg.vocab
        if cfg.ring_dtp.enabled:
            p = max(1, cfg.ring_group)
            rows_v = min(cfg.ring_dtp.ring_dtp_chunk_tokens, n) if cfg.ring_dtp.ring_dtp_chunk_tokens else n
            work = ring_dtp_workspace_bytes(
                n, h, v, world_size=p, mode=cfg.ring_dtp.ring_dtp_mode, chunk_tokens=cfg.ring_dtp.ring_dtp_chunk_tokens,
                input_bytes=b, grad_in_forward=cfg.ring_dtp.ring_dtp_grad_in_forward,
                gradient_rows=cfg.ring_dtp.ring_dtp_gradient_rows,
            )
            terms["vocab_projection"] = work + n * h * b
            notes["vocab_projection"] = (
                f"Ring-DTP over P={p}, {rows_v:,}-token strips × ceil(V/P)={_ceil_div(v, p):,} "
                f"fp32 (mode {cfg.ring_dtp.ring_dtp_mode}"
                f"{', gradients in forward' if cfg.ring_dtp.ring_dtp_grad_in_forward else ''}): strips, "
                f"accumulators and travelling buffers (ring_dtp_workspace_bytes) = {work:,} B, "
                f"plus the hidden fed to it N·H·b"
            )
        else:
            terms["vocab_projection"] = 12 * n * v // cfg.tp + n * h * b
            notes["vocab_projection"] = (
                f"standard: three N×V/TP fp32 tensors (logits, softmax, gradient) = "
                f"12·{n:,}·{v:,}/{cfg.tp} B, plus the hidden fed to it N·H·b"
            )
    else:
        terms["vocab_projection"] = 0
        notes["vocab_projection"] = "0: no output layer on this pipeline stage"

    # recompute working set: one checkpointed chunk during its recompute + backward
    fc1_rows = rows["active"] * (w["row_saved"] - w["row_inputs"]) if n_moe else 0
    grad_attn = n * w["attn_grad"]
    grad_moe = n * w["moe_token_grad"] + rows["active"] * w["row_grad"] if n_moe else 0
    grad_dense = n * w["dense_mlp_grad"] if n_dense else 0
    transient = max(grad_attn, grad_moe, grad_dense) + 2 * n * h * b
    transient_note = (
        f"backward transient max(attention N·{w['attn_grad']} B"
        + (f", MoE N·{w['moe_token_grad']} B + {rows['active']:,} rows × {w['row_grad']} B"
           if n_moe else "")
        + (f", dense MLP N·{w['dense_mlp_grad']} B" if n_dense else "")
        + ") + 2·N·H·b (hidden gradient in and out)"
    )
    if cfg.recompute == "full" and n_layers:
        chunk_layers = 1 if cfg.recompute_method == "block" else min(
            max(1, cfg.recompute_layers), n_layers
        )
        # the layer being differentiated: its input rows are in the dispatch term
        one_layer = max(
            attn_tok + n * w["moe_token_saved"] + fc1_rows if n_moe else 0,
            dense_layer if n_dense else 0,
        )
        # earlier layers of the same chunk keep what they saved
        earlier = (chunk_layers - 1) * max(moe_layer if n_moe else 0, dense_layer if n_dense else 0)
        terms["recompute_working_set"] = one_layer + earlier + transient
        notes["recompute_working_set"] = (
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
    else:
        terms["recompute_working_set"] = transient
        notes["recompute_working_set"] = (
            "no recompute: saved activations are in 'layer activations'; " + transient_note
        )

    # peak_phase / peak_terms / phase_peaks: what is live at the peak (None: every term at once)
    peak_phase = peak_terms = phase_peaks = None
    if cfg.recompute == "full" and n_layers and not full_layers:
        phases = _recompute_phases(cfg, n_moe, n_boundaries, last, state_params)
        peak_phase = max(phases, key=lambda name: sum(phases[name][0].values()))
        # every term at its own phase's value; the peak adds only the largest phase's terms
        for phase, (phase_terms, phase_notes) in phases.items():
            for name, value in phase_terms.items():
                if phase == peak_phase or name not in phases[peak_phase][0]:
                    terms[name] = value
                    notes[name] = f"[{phase}{', the peak' if phase == peak_phase else ''}] " + (
                        phase_notes[name])
        peak_terms = ["model_state", *phases[peak_phase][0]]
        phase_peaks = {name: sum(parts[0].values()) + terms["model_state"]
                       for name, parts in phases.items()}
        peak = phase_peaks[peak_phase]
    elif cfg.offload_stream.enabled:
        peak = sum(terms.values())  # the streamed optimizer's staging is live throughout
    else:
        # without full recompute the step is a phase of its own: the activations are freed by
        # then, the model state and the step's temporaries are live
        step, step_note = _optimizer_step_bytes(cfg, state_params)
        phase_peaks = {"forward and backward": sum(terms.values()),
                       "step": terms["model_state"] + step}
        peak_phase = max(phase_peaks, key=phase_peaks.get)
        peak_terms = (["model_state", "optimizer_step"] if peak_phase == "step"
                      else [name for name in terms if name != "optimizer_step"])
        terms["optimizer_step"] = step
        notes["optimizer_step"] = (
            f"[step{', the peak' if peak_phase == 'step' else ''}] {step_note}; the forward and "
            f"backward terms are not live then")
        peak = phase_peaks[peak_phase]

    rest = peak
    terms["cuda_context_fragmentation"] = CUDA_CONTEXT_BYTES + int(FRAGMENTATION_FRACTION * rest)
    notes["cuda_context_fragmentation"] = (
        f"fixed {CUDA_CONTEXT_BYTES / GiB:g} GiB (CUDA context, NCCL buffers; an allowance: the "
        f"allocator does not see it) + {FRAGMENTATION_FRACTION:.0%} of the peak allocated "
        f"(allocator fragmentation)"
    )
    ordered = {name: int(terms[name]) for name in TERM_ORDER}
    details = {
        "tokens": n, "world": cfg.world, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
        "ep": cfg.ep, "dp": cfg.dp, "edp": cfg.edp, "stage": stage, "inflight": inflight,
        "layers": n_layers, "moe_layers": n_moe, "boundaries": n_boundaries,
        "params_dense": counts["dense"], "params_expert": counts["expert"],
        "params_ring_output": counts["ring_output"], "state_params": state_params,
        "moe_rows": rows, "vocab": cfg.vocab, "operators": _operators(cfg),
        "has_output": last, "has_embedding": first,
        "peak_phase": peak_phase, "peak_terms": peak_terms, "phases": phase_peaks,
    }
    return Budget(
        terms=ordered, notes=notes, hbm_bytes=cfg.hbm_bytes, host_terms=host,
        details=details, config=cfg, peak_bytes=peak,
    )


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
    cfg = _as_config(args_or_cfg)

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
