"""Predicted seconds per training step of a launch configuration, for the planner to rank plans.

One step is ``microbatches`` forward-backward passes of one micro-batch per rank plus one
optimizer step. A micro-batch costs its FLOPs at the rates measured on Hopper GPUs (H100 80 GB
and H200; their step times agree within a few percent on the records, so one set of rates
serves both), plus the host time the eager step spends per layer and per chunk, which the
whole-iteration CUDA graph removes. The rates and per-call times are fitted to the step times
recorded under ``docs/results/`` (the predicted-vs-measured table is in ``docs/planner.md``);
each constant says where it comes from.

Terms (seconds; :func:`step_cost` returns each):

* attention: causal attention's forward N·S·h·(d_qk + d_v) FLOPs per layer at
  :data:`ATTENTION_FORWARD_FLOPS_PER_S`, its backward 2.5× the forward's FLOPs at
  :data:`ATTENTION_BACKWARD_FLOPS_PER_S` (cuDNN's kernels, ``--attention-backend fused``; flash's
  at :data:`FLASH_ATTENTION_FLOPS_PER_S`), and the forward once more when full recompute runs
  attention again (not when the chunked sublayer keeps it).
* gemm: the layers' projections, experts and router, three passes (four with recompute), at
  :data:`GEMM_FLOPS_PER_S`.
* output_layer: 6·N·H·V/TP FLOPs at the same rate, × :data:`RING_DTP_TIME_FACTOR` with Ring-DTP,
  plus :data:`RING_DTP_CHUNK_S` per extra token chunk, hop and pass.
* launches: :data:`EAGER_LAYER_PASS_S` per layer and pass in an eager step, or
  :data:`GRAPH_LAYER_PASS_S` under the whole-iteration graph; :data:`MICRO_BATCH_S` per
  micro-batch (data, loss, schedule).
* chunks: :data:`CHUNK_PASS_S` per token chunk of the chunked recompute per layer and pass
  (recompute, backward), twice with the chunked attention sublayer.
* pipelined_llep: :data:`PIPELINED_LLEP_CHUNK_S` per extra dispatch chunk per MoE layer and pass.
* upstream_experts: :data:`UPSTREAM_EXPERT_PASS_S` per local expert, MoE layer and pass when
  upstream's SequentialMLP runs the experts.
* optimizer: Adam on the GPU reads and writes 16 B per local state element at
  :data:`DEVICE_COPY_BYTES_PER_S`; OffloadStreamAdamW moves 12 B each way over the host link.
* sco: the part of each offloaded boundary's copy (out in forward, back in backward) that outlasts
  one layer's compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megatron.bounded.budget.config import BudgetConfig, stage_layers
from megatron.bounded.units import ceil_div

# cuDNN SDPA (--attention-backend fused; causal, bf16, head dim 64) measured at 524,288 and
# 1,048,576 tokens: forward 412 and backward 445 TFLOP/s (H200 profile at 52dd4a7; H100
# block-backward runs: 430-452).
ATTENTION_FORWARD_FLOPS_PER_S = 412e12
ATTENTION_BACKWARD_FLOPS_PER_S = 445e12
# The flash backend SDPA tries first otherwise: 290 TFLOP/s forward + backward at 131,072 tokens
# (H200 kernel table); the small example's 2M-token step with it (H100) agrees.
FLASH_ATTENTION_FLOPS_PER_S = 290e12
ATTENTION_BACKWARD_FLOP_RATIO = 2.5  # five N×S products against the forward's two

# Achieved rate of the projections, grouped experts and output layer (fitted: the small
# example's steps at 4,096 tokens under the graph and at 262K-1M tokens).
GEMM_FLOPS_PER_S = 230e12

# Host time per layer and pass of an eager step (launches, the dropless dispatch's size sync),
# and what is left of it under the whole-iteration graph (fitted).
EAGER_LAYER_PASS_S = 4e-3
GRAPH_LAYER_PASS_S = 0.3e-3

# Fixed time per micro-batch: batch copy, loss, schedule (fitted to micro-batch 1 against 8 at
# 4,096 tokens under the graph).
MICRO_BATCH_S = 8e-3

# Host time per token chunk of the chunked recompute, per layer and pass (fitted to 262K-1M).
CHUNK_PASS_S = 8e-3

# Ring-DTP: the output layer takes about this many times the materialized one (strips
# recomputed in backward), plus a fixed time per extra chunk per ring hop and pass.
RING_DTP_TIME_FACTOR = 1.35
RING_DTP_CHUNK_S = 50e-6

# Upstream's SequentialMLP experts: host time per local expert, MoE layer and pass (fitted to
# upstream's path on the small example, one H200: 73,822 tokens/s at micro-batch 8 against the
# torch-native path's 218,034).
UPSTREAM_EXPERT_PASS_S = 0.35e-3

# PipelinedLLEP: launch and synchronization per extra chunk, per MoE layer and pass (an
# assumption).
PIPELINED_LLEP_CHUNK_S = 0.5e-3

# Device memory bandwidth achieved by the fused Adam step (H100 3.35 TB/s nominal).
DEVICE_COPY_BYTES_PER_S = 2.5e12

# Pinned host<->device copies (1 GiB): 55 GB/s one way, 43.7 GB/s each way in both directions
# at once (measured on the GPU machines).
HOST_LINK_ONE_WAY_BYTES_PER_S = 55e9
HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S = 43.7e9

HOST_STATE_BYTES = 12  # fp32 master + two moments per element, each way


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step, and the terms they add up from."""

    seconds: float
    terms: Dict[str, float]


def _attention_forward_flops(cfg: BudgetConfig) -> float:
    """One layer's causal attention forward on this rank: QKᵀ and PV over half of the S² pairs,
    2·S²·h·(d_qk + d_v)/2 per sequence, shared by the TP × CP ranks of its heads and tokens
    (windows and document boundaries are not counted: an upper estimate)."""
    if cfg.mla is not None:
        d_qk, d_v = cfg.mla.q_head_dim, cfg.mla.v_head_dim
    else:
        d_qk = d_v = cfg.kv_channels
    return float(cfg.tokens) * cfg.seq_length * (cfg.heads / cfg.tp) * (d_qk + d_v)


def _gemm_forward_flops(cfg: BudgetConfig, moe: bool) -> float:
    """One layer's projections (and experts or MLP) forward on this rank."""
    n, h = cfg.tokens, cfg.hidden
    if cfg.mla is not None:
        m = cfg.mla
        q_out = cfg.heads * m.q_head_dim
        attn = h * (m.q_lora_rank or q_out) + (m.q_lora_rank * q_out if m.q_lora_rank else 0)
        attn += h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
        attn += m.kv_lora_rank * cfg.heads * (m.qk_head_dim + m.v_head_dim)
        attn += cfg.heads * m.v_head_dim * h
    else:
        attn = h * (cfg.heads + 2 * cfg.groups) * cfg.kv_channels + cfg.heads * cfg.kv_channels * h
    flops = 2.0 * n * attn / cfg.tp
    g = 3 if cfg.gated else 2
    if moe:
        flops += 2.0 * n * cfg.topk * g * h * cfg.moe_ffn / cfg.etp
        flops += 2.0 * n * g * h * cfg.shared_ffn / cfg.tp + 2.0 * n * h * cfg.experts
    else:
        flops += 2.0 * n * g * h * cfg.ffn / cfg.tp
    return flops


def _largest_stage(cfg: BudgetConfig):
    """(MoE layers, dense layers) of the pipeline stage with the most layers."""
    layers = max(stage_layers(cfg), key=len)
    n_moe = sum(1 for i in layers if cfg.moe_layers[i])
    return n_moe, len(layers) - n_moe


def _recomputes_attention(cfg: BudgetConfig) -> bool:
    keep = cfg.chunked_attention.chunked_recompute_keep_attention
    return cfg.recompute == "full" and not (cfg.chunked_attention.enabled and keep in ("gpu", "host"))


def micro_batch_terms(cfg: BudgetConfig, graph: bool) -> Dict[str, float]:
    """Seconds of one micro-batch's forward and backward, by term."""
    n_moe, n_dense = _largest_stage(cfg)
    layers = n_moe + n_dense
    recompute = cfg.recompute == "full"
    attention_forward = _attention_forward_flops(cfg)
    forward_rate, backward_rate = (
        (ATTENTION_FORWARD_FLOPS_PER_S, ATTENTION_BACKWARD_FLOPS_PER_S) if cfg.fused_attention
        else (FLASH_ATTENTION_FLOPS_PER_S, FLASH_ATTENTION_FLOPS_PER_S))
    attention = layers * (
        attention_forward * (1 + int(_recomputes_attention(cfg))) / forward_rate
        + ATTENTION_BACKWARD_FLOP_RATIO * attention_forward / backward_rate
    )
    passes = 3 + int(recompute)
    gemm_flops = n_moe * _gemm_forward_flops(cfg, True) + n_dense * _gemm_forward_flops(cfg, False)
    terms = {
        "attention": attention,
        "gemm": gemm_flops * passes / GEMM_FLOPS_PER_S,
        "output_layer": _output_layer_seconds(cfg),
        "launches": layers * passes * (GRAPH_LAYER_PASS_S if graph else EAGER_LAYER_PASS_S)
        + MICRO_BATCH_S,
    }
    if cfg.chunked_recompute.enabled and recompute:
        chunks = ceil_div(cfg.tokens, cfg.chunk_tokens)
        sublayers = 2 if cfg.chunked_attention.enabled else 1
        terms["chunks"] = layers * chunks * 2 * sublayers * CHUNK_PASS_S
    if cfg.pipelined_llep.enabled and n_moe:
        from megatron.bounded.budget.widths import pipelined_llep_chunks

        k_chunks, _ = pipelined_llep_chunks(cfg)
        terms["pipelined_llep"] = (k_chunks - 1) * PIPELINED_LLEP_CHUNK_S * passes * n_moe
    if cfg.upstream_experts and n_moe:
        local_experts = max(1, cfg.experts // max(1, cfg.ep))
        terms["upstream_experts"] = n_moe * passes * local_experts * UPSTREAM_EXPERT_PASS_S
    if cfg.sco.enabled and recompute:
        terms["sco"] = _sco_exposed_seconds(cfg, layers, gemm_flops / max(1, layers))
    return terms


def _output_layer_seconds(cfg: BudgetConfig) -> float:
    seconds = 6.0 * cfg.tokens * cfg.hidden * cfg.vocab / cfg.tp / GEMM_FLOPS_PER_S
    if not cfg.ring_dtp.enabled:
        return seconds
    chunk = cfg.ring_dtp.ring_dtp_chunk_tokens
    chunks = ceil_div(cfg.tokens, chunk) if chunk else 1
    return RING_DTP_TIME_FACTOR * seconds + (chunks - 1) * max(1, cfg.ring_group) * 2 * RING_DTP_CHUNK_S


def _sco_exposed_seconds(cfg: BudgetConfig, layers: int, layer_gemm_flops: float) -> float:
    per = cfg.tokens * cfg.hidden * cfg.act_bytes
    offloaded = min(layers, cfg.sco.host_budget_bytes // per)
    copy = per / HOST_LINK_ONE_WAY_BYTES_PER_S
    layer_forward = layer_gemm_flops / GEMM_FLOPS_PER_S + (
        _attention_forward_flops(cfg) / ATTENTION_FORWARD_FLOPS_PER_S)
    return offloaded * (max(0.0, copy - layer_forward) + max(0.0, copy - 3 * layer_forward))


def optimizer_seconds(cfg: BudgetConfig, state_elements: int) -> float:
    """One optimizer step over ``state_elements`` local elements of optimizer state."""
    if cfg.offload_stream.enabled:
        return HOST_STATE_BYTES * state_elements / HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S
    return 16.0 * state_elements / DEVICE_COPY_BYTES_PER_S


def step_cost(cfg: BudgetConfig, microbatches: int, graph: bool, state_elements: int) -> StepCost:
    """Predicted seconds of one step: ``microbatches`` micro-batches per rank, then the
    optimizer over ``state_elements`` local state elements."""
    terms = {name: value * microbatches for name, value in micro_batch_terms(cfg, graph).items()}
    terms["optimizer"] = optimizer_seconds(cfg, state_elements)
    return StepCost(seconds=sum(terms.values()), terms=terms)
