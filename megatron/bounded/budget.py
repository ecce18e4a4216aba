"""Launch-time per-GPU memory budget: the paper's Eq. (6), term by term, from the flags alone.

"Flattening Every Memory Peak in Long-Context MoE Training" writes the per-GPU peak as a sum of
live sets, each fixed by the model and the launch configuration (Eq. 6)::

    M_peak = 4Θ/W + O(sβ) + O(NHb) + O(E_p q H b) + O(NVb/P) + O(NHb)

:func:`estimate` evaluates every term of that sum for a parsed Megatron argument namespace
(upstream flags plus ours), adds the terms the paper leaves implicit (the working set of one layer
during recompute and backward, the CUDA context and allocator fragmentation), and compares the
total with the HBM of one GPU. It runs on the CPU, reads nothing but ``args`` (and the
``WORLD_SIZE`` environment variable when ``args.world_size`` is unset), and never initializes
``torch.distributed`` or CUDA. :func:`choose_bounds` searches the operators' knobs for the cheapest
set that fits (``--auto-bounds``); :func:`max_seq_length` bisects the longest sequence that fits.

Notation (per rank): N = micro_batch_size × seq_length / context_parallel_size tokens (one
micro-batch live per stage with pipeline size 1; with pipeline parallelism, stage s of PP keeps
PP - s micro-batches in flight, 1F1B), H hidden, V the padded vocabulary (vocab_size rounded up to
a multiple of make_vocab_size_divisible_by × TP), k top-k, E experts, E_p expert-parallel size,
F / F_m / F_s dense / expert / shared-expert FFN widths, L layers of the stage, b bytes per
activation element (2 for bf16/fp16, 4 for fp32), W the data-parallel size sharding dense state
(DP × CP), W_e = world / (E_p × expert TP × PP) for expert state.

Terms (bytes per GPU; ``Budget.notes`` repeats each with the numbers filled in):

* model state: Θ_dense·(p + g + o/W) + Θ_expert·(p + g + o/W_e), with p = 2 (bf16 param),
  g = 4 (fp32 gradient buffer, upstream's default for bf16), o = 12 (fp32 master + two moments),
  divided only with the distributed optimizer; Megatron-FSDP also shards g (and p). With
  OffloadStreamAdamW the GPU keeps p + g per parameter and o moves to the host. Ring-DTP shards
  the output layer to ceil(V/P)·H.
* optimizer staging: min(slots, buckets) × largest bucket × 16 B (OffloadStreamAdamW only).
* checkpoint boundaries (full recompute): N·H·b × ceil(L/recompute_num_layers) × micro-batches
  in flight (+ one shared rotary table); with SCO (B - k) + min(k, 2) boundaries stay on the
  device, k = min(B, floor(host budget / N·H·b)).
* layer activations (layers not checkpointed): per layer N·(attention + MLP token widths) +
  routed rows kept × row width (see :func:`_activation_widths`).
* MoE dispatch (one layer in flight): standard 2·k·N·H·b × skew; static capacity
  2·E_p·ceil(cf·N·k/E_p)·H·b; PipelinedLLEP 2·E_p·k·c_eff·H·b.
* paged stash: factor × N·k × (H + fc1 width)·b × layers whose expert activations are paged.
* vocabulary projection: standard 12·N·V/TP (three fp32 N×V tensors); Ring-DTP 4 strips of
  n × ceil(V/P) × 4 B (n = chunk tokens or N) plus its accumulators; + N·H·b input.
* recompute working set: the activations one recomputed chunk saves + the largest backward
  transient of a sub-block (attention, or MLP/MoE with its routed rows) + 2·N·H·b.
* CUDA context + fragmentation: 1 GiB + 3% of the peak allocated (an allowance the allocator does
  not see); the verdict compares the peak allocated plus this allowance with the HBM.

With full recompute (uniform) the terms do not all peak at once, and the peak allocated
(:attr:`Budget.peak_allocated`, what ``torch.cuda.max_memory_allocated`` reports) is the model
state plus the largest of three phases (:func:`_recompute_phases`), each counted tensor by tensor
from the allocator's memory snapshot of the small example at 131K-524K tokens
(``megatron.bounded.memory_snapshot``): the loss (boundaries, last layer and final norm outputs,
output layer and loss), the first layer's recompute and backward (boundaries, the recomputed
layer's saved activations, its gradients, its MoE working set) and the optimizer step. Each term
shows its own phase's value; the table marks the peak phase. Without full recompute the total
adds the terms, which peak at different moments: an upper estimate. Each term's formula is in
``Budget.notes``.

Units: ``--hbm-gb`` (and the planner's ``--budget-host-gb``) are decimal gigabytes (10⁹ bytes);
``--sco-host-budget-gb`` is GiB (2³⁰ bytes), as pretrain_gpt.py hands it to SCO; the table prints
GiB. The default HBM is one H200 as torch reports it (150,109,880,320 bytes = 139.8 GiB).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.bounded.moe.pipelined_llep import DEFAULT_MAX_CHUNKS
from megatron.bounded.offload.sco import host_budget_bytes
from megatron.bounded.optimizer.offload_stream_adamw import DEFAULT_BUCKET_NUMEL, DEFAULT_NUM_SLOTS
from megatron.bounded.ulysses import expanded_query_groups

__all__ = [
    "Budget",
    "BudgetConfig",
    "estimate",
    "estimate_config",
    "stage_budgets",
    "choose_bounds",
    "max_seq_length",
    "parameter_counts",
    "apply_bounds",
    "launch_check",
    "MemoryBudgetError",
    "H200_HBM_BYTES",
    "DEFAULT_HBM_GB",
    "GB",
    "GiB",
    "TERM_LABELS",
]

GB = 10**9  # decimal gigabyte: the unit of --hbm-gb and --budget-host-gb
GiB = 2**30  # the unit the table prints, and of --sco-host-budget-gb (as pretrain_gpt.py reads it)

# What torch.cuda.get_device_properties reports for one H200 (139.8 GiB; NVIDIA's nominal
# figure is "141 GB").
H200_HBM_BYTES = 150_109_880_320
DEFAULT_HBM_GB = H200_HBM_BYTES / GB

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

# Routing skew assumed for the unbounded (standard) dispatch: the hottest rank receives this
# many times its even share N·k. An assumption (override with --budget-routing-skew); the
# bounded dispatch paths do not use it.
DEFAULT_ROUTING_SKEW = 2.0
# The skew the refusal message offers for a router that keeps the load balanced.
BALANCED_ROUTING_SKEW = 1.1

HOST_STATE_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq


# ---- cost model of choose_bounds (seconds per training step, per rank) ----------------------
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
# Host memory per GPU the planner may fill with SCO boundaries and optimizer state: the paper's
# nodes have 2 TB for 8 GPUs. Override with --budget-host-gb.
DEFAULT_HOST_BYTES_PER_GPU = 250 * GB
# Token-chunk sizes choose_bounds tries for Ring-DTP.
RING_DTP_CHUNK_CANDIDATES = (65536, 32768, 16384, 8192, 4096, 2048, 1024)

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


def _ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _get(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def _dtype_bytes(value, default: int) -> int:
    """Bytes per element of a torch dtype or a dtype name ('fp32', 'bf16', ...)."""
    if value is None:
        return default
    itemsize = getattr(value, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(value).lower().replace("torch.", "")
    table = {
        "fp32": 4, "float32": 4, "float": 4, "fp16": 2, "float16": 2, "half": 2,
        "bf16": 2, "bfloat16": 2, "fp8": 1, "uint8": 1, "int8": 1,
    }
    return table.get(name, default)


def _runs_upstream_experts(args) -> bool:
    """Whether the MoE layers run upstream's dispatcher and experts (``--bounded-moe-backend``):
    PipelinedLLEP and a static capacity always run the torch-native ones."""
    if _get(args, "pipelined_llep", False) or getattr(args, "moe_expert_rank_capacity_factor", None):
        return False
    backend = str(_get(args, "bounded_moe_backend", "auto"))
    if backend == "auto":
        return not _get(args, "moe_grouped_gemm", False)
    return backend == "upstream"


def _moe_pattern(freq, num_layers: int, num_experts: int) -> Tuple[bool, ...]:
    """Which layers are MoE: ``--moe-layer-freq`` as an int (every freq-th layer, starting with
    layer 0, as upstream) or a list of 0/1 per layer."""
    if not num_experts:
        return (False,) * num_layers
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers:
            raise ValueError(
                f"--moe-layer-freq pattern has {len(freq)} entries for {num_layers} layers"
            )
        return tuple(bool(x) for x in freq)
    freq = int(freq)
    if freq < 1:
        raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
    return tuple(i % freq == 0 for i in range(num_layers))


# ------------------------------------------------------------------------------------------
# Configuration: everything the budget reads, taken from args once
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetConfig:
    """The launch configuration the budget depends on (built by :meth:`from_args`)."""

    # layout
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    # shape
    micro_batch: int
    seq_length: int
    hidden: int
    heads: int
    groups: int
    kv_channels: int
    ffn: int
    moe_ffn: int
    shared_ffn: int
    experts: int
    topk: int
    layers: int
    moe_layers: Tuple[bool, ...]
    vocab: int  # padded
    untied: bool
    learned_positions: int  # rows of a learned position table (0 with rope / none)
    rope: bool
    gated: bool
    layernorm: bool  # LayerNorm (weight + bias) rather than RMSNorm (weight)
    bias_linear: bool
    qkv_bias: bool
    qk_layernorm: bool
    shared_gate: bool
    sequence_parallel: bool
    # precision and optimizer
    act_bytes: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    moment_bytes: int
    distributed_optimizer: bool
    fsdp_strategy: Optional[str]
    cpu_offload_fraction: float
    # recompute
    recompute: Optional[str]
    recompute_method: Optional[str]
    recompute_layers: int
    # MoE dispatch
    capacity_factor: Optional[float]
    paged_stash: bool
    stash_factor: float
    routing_skew: float
    # our operators
    offload_stream: bool
    stream_slots: int
    stream_bucket: int
    sco_host_bytes: int
    ring_dtp: bool
    ring_group: int
    ring_chunk: Optional[int]
    ring_mode: str
    ring_grad_in_forward: bool
    pllep: bool
    pllep_budget: Optional[int]
    pllep_max_chunks: int
    upstream_experts: bool  # upstream's dispatcher and experts (else the torch-native ones)
    # machine
    hbm_bytes: int
    host_bytes_per_gpu: int

    @property
    def tokens(self) -> int:
        """N: tokens of one micro-batch on this rank."""
        return self.micro_batch * self.seq_length // max(1, self.cp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ranks holding a replica of the same expert shard."""
        return max(1, self.world // (self.ep * self.etp * self.pp))

    @property
    def dense_shard(self) -> int:
        """W for dense parameters: the distributed optimizer shards over DP × CP."""
        return max(1, self.dp * self.cp)

    @classmethod
    def from_args(cls, args) -> "BudgetConfig":
        tp = int(_get(args, "tensor_model_parallel_size", 1))
        pp = int(_get(args, "pipeline_model_parallel_size", 1))
        cp = int(_get(args, "context_parallel_size", 1))
        ep = int(_get(args, "expert_model_parallel_size", 1))
        etp = int(_get(args, "expert_tensor_parallel_size", 1))
        world = getattr(args, "world_size", None)
        if world is None:
            world = int(os.environ.get("WORLD_SIZE", "0")) or None
        dp = getattr(args, "data_parallel_size", None)
        if world is None:
            world = tp * pp * cp * int(dp or 1)
        world = int(world)
        if dp is None:
            dp = max(1, world // (tp * pp * cp))
        hidden = int(args.hidden_size)
        heads = int(args.num_attention_heads)
        if _get(args, "group_query_attention", False):
            groups = int(_get(args, "num_query_groups", heads))
        else:
            groups = heads
        kv = int(_get(args, "kv_channels", hidden // heads))
        ffn = int(_get(args, "ffn_hidden_size", 4 * hidden))
        experts = int(_get(args, "num_experts", 0))
        layers = int(args.num_layers)
        vocab_size = getattr(args, "padded_vocab_size", None)
        if vocab_size is None:
            raw = getattr(args, "vocab_size", None)
            if raw is None:
                raise ValueError(
                    "the memory budget needs the vocabulary size: pass --vocab-size (the "
                    "tokenizer is not built at planning time)"
                )
            multiple = int(_get(args, "make_vocab_size_divisible_by", 128)) * tp
            vocab_size = _ceil_div(int(raw), multiple) * multiple
        bf16 = bool(_get(args, "bf16", False))
        fp16 = bool(_get(args, "fp16", False))
        half = bf16 or fp16
        act_bytes = 2 if half else 4
        # Gradient buffer: upstream turns --accumulate-allreduce-grads-in-fp32 on for bf16
        # unless --grad-reduce-in-bf16 (or --main-grads-dtype bf16) is given
        # (megatron/training/arguments.py, validate_args).
        if bf16:
            main_grads = _dtype_bytes(getattr(args, "main_grads_dtype", None), 4)
            fp32_grads = not _get(args, "grad_reduce_in_bf16", False) and (
                _get(args, "accumulate_allreduce_grads_in_fp32", False) or main_grads == 4
            )
        elif fp16:
            fp32_grads = bool(_get(args, "accumulate_allreduce_grads_in_fp32", False))
        else:
            fp32_grads = True
        grad_bytes = 4 if fp32_grads else 2
        if half:
            if _get(args, "use_precision_aware_optimizer", False):
                master = _dtype_bytes(getattr(args, "main_params_dtype", None), 4)
                moments = _dtype_bytes(getattr(args, "exp_avg_dtype", None), 4) + _dtype_bytes(
                    getattr(args, "exp_avg_sq_dtype", None), 4
                )
            else:
                master, moments = 4, 8
        else:
            master, moments = 0, 8  # fp32 training: the parameters are the master copy
        fsdp = None
        if _get(args, "use_megatron_fsdp", False):
            fsdp = str(_get(args, "data_parallel_sharding_strategy", "optim_grads_params"))
        cpu_offload = 0.0
        if _get(args, "optimizer_cpu_offload", False):
            cpu_offload = float(_get(args, "optimizer_offload_fraction", 1.0))
        granularity = getattr(args, "recompute_granularity", None)
        hbm_gb = getattr(args, "hbm_gb", None)
        hbm = H200_HBM_BYTES if hbm_gb is None else int(float(hbm_gb) * GB)
        host_gb = getattr(args, "budget_host_gb", None)
        host = DEFAULT_HOST_BYTES_PER_GPU if host_gb is None else int(float(host_gb) * GB)
        ring_group = getattr(args, "ring_dtp_group_size", None)
        pllep_budget = getattr(args, "pipelined_llep_token_budget", None)
        ring_chunk = getattr(args, "ring_dtp_chunk_tokens", None)
        position = str(_get(args, "position_embedding_type", "learned_absolute"))
        return cls(
            world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=int(dp),
            micro_batch=int(_get(args, "micro_batch_size", 1)),
            seq_length=int(args.seq_length),
            hidden=hidden, heads=heads, groups=groups, kv_channels=kv, ffn=ffn,
            moe_ffn=int(_get(args, "moe_ffn_hidden_size", ffn)),
            shared_ffn=int(_get(args, "moe_shared_expert_intermediate_size", 0)),
            experts=experts, topk=int(_get(args, "moe_router_topk", 2)) if experts else 0,
            layers=layers,
            moe_layers=_moe_pattern(_get(args, "moe_layer_freq", 1), layers, experts),
            vocab=int(vocab_size),
            untied=bool(_get(args, "untie_embeddings_and_output_weights", False)),
            learned_positions=(
                int(_get(args, "max_position_embeddings", args.seq_length))
                if position == "learned_absolute" else 0
            ),
            rope=position in ("rope", "yarn", "mrope"),
            gated=bool(_get(args, "swiglu", False) or _get(args, "quick_geglu", False)),
            layernorm=str(_get(args, "normalization", "LayerNorm")) == "LayerNorm",
            bias_linear=bool(_get(args, "add_bias_linear", True)),
            qkv_bias=bool(_get(args, "add_qkv_bias", False)),
            qk_layernorm=bool(_get(args, "qk_layernorm", False)),
            shared_gate=bool(_get(args, "moe_shared_expert_gate", False)),
            sequence_parallel=bool(_get(args, "sequence_parallel", False)) and tp > 1,
            act_bytes=act_bytes,
            param_bytes=2 if half else 4,
            grad_bytes=grad_bytes,
            master_bytes=master,
            moment_bytes=moments,
            distributed_optimizer=bool(_get(args, "use_distributed_optimizer", False)),
            fsdp_strategy=fsdp,
            cpu_offload_fraction=cpu_offload,
            recompute=granularity,
            recompute_method=getattr(args, "recompute_method", None),
            recompute_layers=int(_get(args, "recompute_num_layers", 1)),
            capacity_factor=getattr(args, "moe_expert_rank_capacity_factor", None),
            paged_stash=bool(_get(args, "moe_paged_stash", False)),
            stash_factor=float(_get(args, "moe_paged_stash_buffer_size_factor_cuda", 1.10)),
            routing_skew=float(_get(args, "budget_routing_skew", DEFAULT_ROUTING_SKEW)),
            offload_stream=bool(_get(args, "offload_stream_optimizer", False)),
            stream_slots=int(_get(args, "offload_stream_slots", DEFAULT_NUM_SLOTS)),
            stream_bucket=int(
                _get(args, "offload_stream_bucket_numel", DEFAULT_BUCKET_NUMEL)
            ),
            # GiB, truncated to bytes exactly as pretrain_gpt.py builds CheckpointOffload
            sco_host_bytes=host_budget_bytes(float(_get(args, "sco_host_budget_gb", 0.0))),
            ring_dtp=bool(_get(args, "ring_dtp", False)),
            ring_group=int(ring_group) if ring_group else int(dp) * cp,
            ring_chunk=int(ring_chunk) if ring_chunk else None,
            ring_mode=str(_get(args, "ring_dtp_mode", "auto")),
            ring_grad_in_forward=bool(_get(args, "ring_dtp_grad_in_forward", False)),
            pllep=bool(_get(args, "pipelined_llep", False)),
            pllep_budget=int(pllep_budget) if pllep_budget else None,
            pllep_max_chunks=int(
                _get(args, "pipelined_llep_max_chunks", DEFAULT_MAX_CHUNKS)
            ),
            upstream_experts=_runs_upstream_experts(args),
            hbm_bytes=hbm,
            host_bytes_per_gpu=host,
        )

    def replace(self, **changes) -> "BudgetConfig":
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------
# Parameter counts
# ------------------------------------------------------------------------------------------


def _stage_layers(cfg: BudgetConfig) -> List[Tuple[int, ...]]:
    """Layer indices of each pipeline stage: contiguous, as even as possible (earlier stages
    get the extra layer when L is not a multiple of PP)."""
    base, extra = divmod(cfg.layers, cfg.pp)
    stages, start = [], 0
    for s in range(cfg.pp):
        n = base + (1 if s < extra else 0)
        stages.append(tuple(range(start, start + n)))
        start += n
    return stages


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
        if cfg.ring_dtp and (cfg.untied or not first):
            counts["ring_output"] = _ceil_div(cfg.vocab, cfg.ring_group) * h
        elif cfg.untied or not first:
            counts["output_layer"] = cfg.vocab * h // tp
    counts["dense"] = (
        counts["attention"] + counts["dense_mlp"] + counts["moe_router_shared"]
        + counts["embedding"] + counts["output_layer"] + counts["final_norm"]
    )
    counts["expert"] = counts["experts"]
    return counts


# ------------------------------------------------------------------------------------------
# Per-token / per-row activation widths (bytes)
# ------------------------------------------------------------------------------------------


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

    With context parallelism (the sequence-to-head all-to-all of ``megatron.bounded.ulysses``)
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
    h_tok = cfg.hidden // tp if cfg.sequence_parallel else cfg.hidden
    hq = cfg.heads * cfg.kv_channels // tp
    groups = cfg.groups // tp
    if cfg.cp > 1:
        groups = expanded_query_groups(groups, cfg.cp)
    hkv = groups * cfg.kv_channels
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


# ------------------------------------------------------------------------------------------
# MoE row counts
# ------------------------------------------------------------------------------------------


def pipelined_llep_chunks(cfg: BudgetConfig) -> Tuple[int, int]:
    """(K, c_eff) of PipelinedLLEP for this configuration: K from the operator's ``num_chunks``
    (c = N without a budget) and c_eff = ceil(N / K)."""
    from megatron.bounded.moe.pipelined_llep import num_chunks

    n = cfg.tokens
    k_chunks = num_chunks(n, max(1, cfg.pllep_budget or n), max(1, cfg.pllep_max_chunks))
    return k_chunks, _ceil_div(n, k_chunks)


def _moe_rows(cfg: BudgetConfig) -> Dict[str, int]:
    """Routed rows of one MoE layer on this rank.

    ``buffer``: rows of the dispatch (and combine) buffer of the layer in flight.
    ``active``: rows whose expert activations are live during that layer's recompute/backward.
    ``kept``: rows a MoE layer keeps for backward after its forward (without recompute).
    """
    n, k = cfg.tokens, cfg.topk
    # with one rank in the expert-parallel group every routed row lands here: no skew
    skewed = math.ceil((cfg.routing_skew if cfg.ep > 1 else 1.0) * n * k)
    if cfg.pllep:
        _, c_eff = pipelined_llep_chunks(cfg)
        chunk = cfg.ep * k * c_eff  # worst case: every source sends its whole chunk here
        return {"buffer": chunk, "active": chunk, "kept": skewed}
    if cfg.capacity_factor:
        from megatron.bounded.moe.token_dispatcher import capacity_rows

        cap = cfg.ep * capacity_rows(n, k, cfg.ep, float(cfg.capacity_factor))
        return {"buffer": cap, "active": cap, "kept": cap}
    return {"buffer": skewed, "active": skewed, "kept": skewed}


# ------------------------------------------------------------------------------------------
# The budget
# ------------------------------------------------------------------------------------------


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
        return max(self.terms, key=self.terms.get)

    @property
    def headroom(self) -> int:
        """HBM left over (negative: the overshoot)."""
        return self.hbm_bytes - self.total

    def fixes(self) -> List[str]:
        """For an infeasible plan, the flags that would make it fit (empty when feasible)."""
        if self.feasible or self.config is None:
            return []
        if self._fixes is None:
            self._fixes = _suggest_fixes(self)
        return self._fixes

    def to_dict(self) -> dict:
        return {
            "terms": dict(self.terms),
            "total": self.total,
            "peak_allocated": self.peak_allocated,
            "hbm_bytes": self.hbm_bytes,
            "feasible": self.feasible,
            "dominant": self.dominant,
            "notes": dict(self.notes),
            "host_terms": dict(self.host_terms),
            "details": {k: v for k, v in self.details.items() if _jsonable(v)},
            "fixes": self.fixes(),
        }

    def render(self, with_notes: bool = True) -> str:
        """The table: GiB and % of HBM per term, the dominant term, the verdict and fixes."""
        gib = lambda x: x / GiB  # noqa: E731
        hbm = self.hbm_bytes
        d = self.details
        lines = [
            f"Per-GPU memory budget (Eq. 6){_stage_text(d)}: HBM {hbm / GB:g} GB "
            f"(= {gib(hbm):.2f} GiB; decimal GB, H200 nominal by default)",
            f"  N = {d.get('tokens', '?'):,} tokens/rank, world {d.get('world')}, "
            f"TP {d.get('tp')} PP {d.get('pp')} CP {d.get('cp')} EP {d.get('ep')} "
            f"DP {d.get('dp')}, expert-DP {d.get('edp')}",
            f"  operators: {d.get('operators') or 'none'}",
            "",
            f"  {'term':<30}{'GiB':>10}{'% HBM':>9}",
            "  " + "-" * 49,
        ]
        for name, value in self.terms.items():
            lines.append(f"  {TERM_LABELS.get(name, name):<30}{gib(value):>10.2f}"
                         f"{100 * value / hbm:>8.1f}%")
        lines.append("  " + "-" * 49)
        if d.get("peak_phase"):
            lines.append(f"  peak phase: {d['peak_phase']} (terms of other phases are live at "
                         f"other moments and not added)")
        lines.append(f"  peak allocated  {gib(self.peak_allocated):.2f} GiB "
                     f"(what torch.cuda.max_memory_allocated will report)")
        lines.append(f"  {'total':<30}{gib(self.total):>10.2f}{100 * self.total / hbm:>8.1f}%")
        lines.append("")
        lines.append(f"  dominant term: {TERM_LABELS.get(self.dominant, self.dominant)}")
        if self.feasible:
            lines.append(f"  verdict: FITS, {gib(self.headroom):.2f} GiB to spare")
        else:
            lines.append(f"  verdict: DOES NOT FIT, over by {gib(-self.headroom):.2f} GiB")
            fixes = self.fixes()
            if fixes:
                lines.append("  to make it fit:")
                lines.extend(f"    - {fix}" for fix in fixes)
        if self.host_terms:
            lines.append("")
            lines.append("  host (pinned) memory per GPU, not in the total:")
            for name, value in self.host_terms.items():
                lines.append(f"    {name:<28}{gib(value):>10.2f} GiB")
            if self.config is not None:
                host_total = sum(self.host_terms.values())
                limit = self.config.host_bytes_per_gpu
                lines.append(
                    f"    {'total':<28}{gib(host_total):>10.2f} GiB "
                    + ("(within" if host_total <= limit else "(EXCEEDS")
                    + f" the {limit / GB:g} GB per GPU assumed; --budget-host-gb)"
                )
        if with_notes:
            lines.append("")
            lines.append("  formulas:")
            for name in self.terms:
                lines.append(f"    {TERM_LABELS.get(name, name)}: {self.notes.get(name, '')}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


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


def _operators(cfg: BudgetConfig) -> str:
    ops = []
    if cfg.offload_stream:
        ops.append(f"OffloadStreamAdamW ({cfg.stream_slots} slots × {cfg.stream_bucket:,})")
    if cfg.sco_host_bytes > 0:
        ops.append(f"SCO (host budget {cfg.sco_host_bytes / GiB:g} GiB)")
    if cfg.ring_dtp:
        chunk = f", chunk {cfg.ring_chunk:,}" if cfg.ring_chunk else ""
        ops.append(f"Ring-DTP (P={cfg.ring_group}{chunk})")
    if cfg.pllep:
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
        if cfg.offload_stream:
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
    if cfg.offload_stream:
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
    if not cfg.offload_stream:
        return 0, "0: OffloadStreamAdamW off"
    from megatron.bounded.optimizer.offload_stream_adamw import staging_bound_bytes

    buckets = max(1, _ceil_div(state_params, cfg.stream_bucket))
    note = (
        f"staging_bound_bytes: min(slots, buckets) × largest bucket × 16 B with {cfg.stream_slots} "
        f"slots, {buckets} buckets of ≤ {cfg.stream_bucket:,} over {state_params:,} params"
    )
    return staging_bound_bytes(state_params, cfg.stream_bucket, cfg.stream_slots), note


def _checkpoint_boundaries(
    cfg: BudgetConfig, n_layers: int, inflight: int
) -> Tuple[int, int, int, str, int]:
    """(device bytes, host bytes, boundaries in total, note, layers stored in full)."""
    if cfg.recompute != "full" or n_layers == 0:
        return 0, 0, 0, "0: no full recompute (see layer activations)", n_layers
    b = cfg.act_bytes
    h_tok = cfg.hidden // cfg.tp if cfg.sequence_parallel else cfg.hidden
    per = cfg.tokens * h_tok * b
    rnl = max(1, cfg.recompute_layers)
    if cfg.recompute_method == "block":
        chunks = min(rnl, n_layers)
        full_layers = n_layers - chunks
        how = f"block: {chunks} checkpointed layers"
    else:
        chunks = _ceil_div(n_layers, rnl)
        full_layers = 0
        how = f"uniform: ceil({n_layers}/{rnl}) = {chunks} chunks"
    count = chunks * inflight
    rope = cfg.seq_length // max(1, cfg.cp) * cfg.kv_channels * 4 if cfg.rope else 0
    offloaded = 0
    if cfg.sco_host_bytes > 0:
        from megatron.bounded.offload.sco import boundaries_on_device

        offloaded, on_device = boundaries_on_device(count, per, cfg.sco_host_bytes)
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
    n, b = cfg.tokens, cfg.act_bytes
    h_tok = cfg.hidden // cfg.tp if cfg.sequence_parallel else cfg.hidden
    per = n * h_tok * b
    from megatron.bounded.offload.sco import boundaries_on_device

    offloaded, on_device = boundaries_on_device(n_boundaries, per, cfg.sco_host_bytes)
    restored = on_device - (n_boundaries - offloaded)
    rope = cfg.seq_length // max(1, cfg.cp) * cfg.kv_channels * 4 if cfg.rope else 0
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

    saved = _recomputed_layer_bytes_per_token(cfg, moe=n_moe > 0)
    dispatch, experts, moe_note = _moe_layer_working_set(cfg, n_moe)
    # upstream's MoE layer under full recompute: the snapshot shows one further N·H·b block per
    # other layer, allocated inside the checkpoint's backward, alive during the recompute
    upstream_extra = (cfg.layers - 1) * per if (n_moe and cfg.upstream_experts) else 0
    terms = {
        "checkpoint_boundaries": on_device * per + rope,
        "recompute_working_set": (n * saved + 2 * per + upstream_extra + experts
                                  + KERNEL_WORKSPACE_BYTES),
        "moe_dispatch": dispatch,
    }
    notes = {
        "checkpoint_boundaries": (
            f"in the first layer's backward: {on_device} of {n_boundaries} boundaries on the "
            f"GPU{sco_note}, N·H·b = {per:,} B each; rotary table {rope:,} B"),
        "recompute_working_set": (
            f"the recomputed layer's saved activations N·{saved} B + its input and output "
            f"gradients 2·N·H·b"
            + (f" + {cfg.layers - 1} further N·H·b blocks (upstream's MoE layer)"
               if upstream_extra else "")
            + (f" + the experts' working set {experts:,} B" if experts else "")
            + f" + {KERNEL_WORKSPACE_BYTES >> 20} MiB kernel workspaces"),
        "moe_dispatch": moe_note,
    }
    phases["layer"] = (terms, notes)

    step, step_note = _optimizer_step_bytes(cfg, state_params)
    name = "optimizer_staging" if cfg.offload_stream else "optimizer_step"
    phases["step"] = ({name: step}, {name: step_note})
    return phases


# int64 tokens, labels and positions, fp32 loss mask
BATCH_BYTES_PER_TOKEN = 28


def _output_layer_bytes(cfg: BudgetConfig) -> Tuple[int, str]:
    """Live bytes of the output layer and its loss at their peak (the loss forward)."""
    n, h, v, b = cfg.tokens, cfg.hidden, cfg.vocab, cfg.act_bytes
    if cfg.ring_dtp:
        from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes

        work = ring_dtp_workspace_bytes(
            n, h, v, world_size=max(1, cfg.ring_group), mode=cfg.ring_mode,
            chunk_tokens=cfg.ring_chunk, input_bytes=b, grad_in_forward=cfg.ring_grad_in_forward,
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
    h_tok = cfg.hidden // tp if cfg.sequence_parallel else cfg.hidden
    hq = cfg.heads * cfg.kv_channels // tp
    groups = cfg.groups // tp
    if cfg.cp > 1:
        groups = expanded_query_groups(groups, cfg.cp)
    hkv = groups * cfg.kv_channels
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
    if cfg.pllep:
        from megatron.bounded.moe.pipelined_llep import pipelined_llep_live_bytes

        parts = pipelined_llep_live_bytes(
            cfg.tokens, h, f, cfg.topk, cfg.ep, _ceil_div(cfg.experts, cfg.ep),
            cfg.pllep_budget or cfg.tokens, cfg.pllep_max_chunks, act_bytes=b, gated=cfg.gated,
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
    return 2 * rows * h * b, rows * b * (2 * fc1 + 2 * f + h), (
        f"torch-native dispatch: send and receive buffers 2·{rows:,}{skew}·H·b; the grouped "
        f"experts' backward rows·b·(2·fc1 + 2F + H)")


def _optimizer_step_bytes(cfg: BudgetConfig, state_params: int) -> Tuple[int, str]:
    """The optimizer step's transient on the GPU."""
    if cfg.offload_stream:
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
    terms["optimizer_step"] = 0
    notes["optimizer_step"] = "0: counted with full recompute only (the step is its own phase)"

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
    if cfg.pllep:
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
            + (" (PipelinedLLEP: chunk inputs only)" if cfg.pllep else "")
            + (" (paged: see paged stash)" if stash_on and not cfg.pllep else "")
        )
    else:
        terms["layer_activations"] = 0
        notes["layer_activations"] = "0: every layer is checkpointed (boundaries only)"

    # MoE dispatch: the buffers of the layer in flight
    if n_moe:
        terms["moe_dispatch"] = 2 * rows["buffer"] * h * b
        if cfg.pllep:
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
        if cfg.ring_dtp:
            from megatron.bounded.loss.ring_dtp import ring_dtp_workspace_bytes

            p = max(1, cfg.ring_group)
            rows_v = min(cfg.ring_chunk, n) if cfg.ring_chunk else n
            work = ring_dtp_workspace_bytes(
                n, h, v, world_size=p, mode=cfg.ring_mode, chunk_tokens=cfg.ring_chunk,
                input_bytes=b, grad_in_forward=cfg.ring_grad_in_forward,
            )
            terms["vocab_projection"] = work + n * h * b
            notes["vocab_projection"] = (
                f"Ring-DTP over P={p}, {rows_v:,}-token strips × ceil(V/P)={_ceil_div(v, p):,} "
                f"fp32 (mode {cfg.ring_mode}"
                f"{', gradients in forward' if cfg.ring_grad_in_forward else ''}): strips, "
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
               "backward too)" if cfg.pllep and n_moe else "")
        )
    else:
        terms["recompute_working_set"] = transient
        notes["recompute_working_set"] = (
            "no recompute: saved activations are in 'layer activations'; " + transient_note
        )

    phases = None
    if cfg.recompute == "full" and n_layers and not full_layers:
        phases = _recompute_phases(cfg, n_moe, n_boundaries, last, state_params)
        peak_phase = max(phases, key=lambda name: sum(phases[name][0].values()))
        phase_terms, phase_notes = phases[peak_phase]
        # every term at its own phase's value; the peak adds only the largest phase's terms
        for phase, (phase_terms, phase_notes) in phases.items():
            for name, value in phase_terms.items():
                if phase == peak_phase or name not in phases[peak_phase][0]:
                    terms[name] = value
                    notes[name] = f"[{phase}{', the peak' if phase == peak_phase else ''}] " + (
                        phase_notes[name])
        peak = terms["model_state"] + sum(phases[peak_phase][0].values())
    else:
        peak = sum(terms.values())

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
        "peak_phase": None if phases is None else peak_phase,
        "phases": None if phases is None else {
            name: sum(parts[0].values()) + terms["model_state"] for name, parts in phases.items()
        },
    }
    return Budget(
        terms=ordered, notes=notes, hbm_bytes=cfg.hbm_bytes, host_terms=host,
        details=details, config=cfg, peak_bytes=peak,
    )


def estimate(args) -> Budget:
    """Per-GPU memory budget of a parsed Megatron namespace (upstream flags + ours).

    Flags of ours that may not be registered yet are read with ``getattr`` and a default:
    ``hbm_gb`` (one H200), ``offload_stream_optimizer``, ``offload_stream_slots`` (2),
    ``offload_stream_bucket_numel`` (1e8), ``sco_host_budget_gb`` (0), ``ring_dtp``,
    ``ring_dtp_group_size`` (DP × CP), ``ring_dtp_chunk_tokens``, ``ring_dtp_mode`` (auto),
    ``ring_dtp_grad_in_forward``, ``pipelined_llep``, ``pipelined_llep_token_budget``,
    ``pipelined_llep_max_chunks`` (10),
    ``budget_routing_skew`` (2.0), ``budget_host_gb`` (250, planner only).
    """
    return estimate_config(BudgetConfig.from_args(args))


# ------------------------------------------------------------------------------------------
# Longest sequence that fits
# ------------------------------------------------------------------------------------------


def _as_config(args_or_cfg) -> BudgetConfig:
    if isinstance(args_or_cfg, BudgetConfig):
        return args_or_cfg
    return BudgetConfig.from_args(args_or_cfg)


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


# ------------------------------------------------------------------------------------------
# Knob selection (--auto-bounds)
# ------------------------------------------------------------------------------------------


def _boundary_count(cfg: BudgetConfig) -> int:
    """Checkpoint boundaries alive at the end of forward on the largest stage (full recompute)."""
    if cfg.recompute != "full":
        return 0
    best = 0
    for stage, layers in enumerate(_stage_layers(cfg)):
        if not layers:
            continue
        if cfg.recompute_method == "block":
            chunks = min(max(1, cfg.recompute_layers), len(layers))
        else:
            chunks = _ceil_div(len(layers), max(1, cfg.recompute_layers))
        best = max(best, chunks * (cfg.pp - stage))
    return best


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


def _sco_flag_for(nbytes: int) -> float:
    """The smallest --sco-host-budget-gb value with 3 decimals (GiB) whose byte count, truncated
    as pretrain_gpt.py truncates it, holds ``nbytes``."""
    value = math.ceil(nbytes * 1000 / GiB) / 1000
    while int(value * GiB) < nbytes:
        value = round(value + 0.001, 3)
    return value


def _knob_flags(cfg: BudgetConfig) -> Dict[str, object]:
    return {
        "offload_stream_optimizer": cfg.offload_stream,
        "sco_host_budget_gb": round(cfg.sco_host_bytes / GiB, 3),
        "ring_dtp": cfg.ring_dtp,
        "ring_dtp_chunk_tokens": cfg.ring_chunk if cfg.ring_dtp else None,
        "pipelined_llep": cfg.pllep,
        "pipelined_llep_token_budget": cfg.pllep_budget if cfg.pllep else None,
    }


def knob_command_line(flags: Dict[str, object]) -> str:
    """The pretrain_gpt.py flags for a knob set from :func:`choose_bounds`."""
    parts = []
    if flags.get("offload_stream_optimizer"):
        parts.append("--offload-stream-optimizer")
    if flags.get("sco_host_budget_gb"):
        parts.append(f"--sco-host-budget-gb {flags['sco_host_budget_gb']:g}")
    if flags.get("ring_dtp"):
        parts.append("--ring-dtp")
        if flags.get("ring_dtp_chunk_tokens"):
            parts.append(f"--ring-dtp-chunk-tokens {flags['ring_dtp_chunk_tokens']}")
    if flags.get("pipelined_llep"):
        parts.append(f"--pipelined-llep --pipelined-llep-token-budget "
                     f"{flags['pipelined_llep_token_budget']}")
    return " ".join(parts)


# The operators choose_bounds may switch on, by name.
ALL_OPERATORS = ("offload_stream_optimizer", "sco", "ring_dtp", "pipelined_llep")
# Those pretrain_gpt.py runs; --auto-bounds chooses among these only.
OPERATORS_IN_PRETRAIN = ALL_OPERATORS


def _candidates(cfg: BudgetConfig, operators=ALL_OPERATORS) -> List[BudgetConfig]:
    """Every knob combination choose_bounds considers (``operators`` only; layout untouched)."""
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes
    base = cfg.replace(
        offload_stream=False, sco_host_bytes=0, ring_dtp=False, ring_chunk=None,
        pllep=False, pllep_budget=None,
    )
    has_moe = any(cfg.moe_layers)
    # SCO: offload the first k boundaries; host budget = k · N·H·b (rounded up to 1 MB)
    sco_options = [0]
    if cfg.recompute == "full" and "sco" in operators:
        boundaries = _boundary_count(base)
        per = n * h * b
        for k in range(1, boundaries + 1):
            sco_options.append(int(_sco_flag_for(k * per) * GiB))
    ring_options: List[Tuple[bool, Optional[int]]] = [(False, None)]
    if "ring_dtp" in operators:
        ring_options += [(True, None)] + [(True, c) for c in RING_DTP_CHUNK_CANDIDATES if c < n]
    pllep_options: List[Optional[int]] = [None]
    # PipelinedLLEP replaces the static-capacity dispatch and cannot run with paged stash
    static_dispatch = bool(cfg.capacity_factor) or cfg.paged_stash
    if has_moe and "pipelined_llep" in operators and not static_dispatch:
        for k_chunks in range(2, max(2, cfg.pllep_max_chunks) + 1):
            pllep_options.append(_ceil_div(n, k_chunks))
    host_state = HOST_STATE_BYTES_PER_ELEMENT * _state_params_fast(base)
    out = []
    offload_options = (False, True) if "offload_stream_optimizer" in operators else (False,)
    for offload in offload_options:
        for host in sco_options:
            # the pinned host memory per GPU must hold the boundaries (and the optimizer state)
            if host + (host_state if offload else 0) > cfg.host_bytes_per_gpu:
                continue
            for ring, chunk in ring_options:
                for budget in pllep_options:
                    out.append(base.replace(
                        offload_stream=offload, sco_host_bytes=host, ring_dtp=ring,
                        ring_chunk=chunk, pllep=budget is not None, pllep_budget=budget,
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

    Returns ``{"feasible", "flags", "command_line", "cost_s", "cost_breakdown", "budget",
    "tried"}``; when nothing fits, ``flags`` is the cheapest plan among those with the smallest
    total and ``feasible`` is False.
    """
    cfg = _as_config(args_or_cfg)
    ranked = []
    for cand in _candidates(cfg, operators):
        cost = bounds_cost(cand)
        n_ops = sum((cand.offload_stream, cand.sco_host_bytes > 0, cand.ring_dtp, cand.pllep))
        ranked.append((sum(cost.values()), n_ops, -(cand.ring_chunk or 0), cand, cost))
    ranked.sort(key=lambda item: item[:3])
    best_infeasible = None
    tried = 0
    for total_cost, _, _, cand, cost in ranked:
        tried += 1
        budget = estimate_config(cand)
        host_used = sum(budget.host_terms.values())
        if budget.feasible and host_used <= cand.host_bytes_per_gpu:
            return {
                "feasible": True, "flags": _knob_flags(cand),
                "command_line": knob_command_line(_knob_flags(cand)),
                "cost_s": total_cost, "cost_breakdown": cost, "budget": budget, "tried": tried,
            }
        if best_infeasible is None or budget.total < best_infeasible[0].total:
            best_infeasible = (budget, cand, total_cost, cost)
    budget, cand, total_cost, cost = best_infeasible
    return {
        "feasible": False, "flags": _knob_flags(cand),
        "command_line": knob_command_line(_knob_flags(cand)),
        "cost_s": total_cost, "cost_breakdown": cost, "budget": budget, "tried": tried,
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
    if cfg.offload_stream:
        state = _state_params_fast(cfg)
        cost["offload_stream_optimizer"] = (
            HOST_STATE_BYTES_PER_ELEMENT * state / HOST_LINK_EACH_WAY_DUPLEX_BYTES_PER_S
        )
    if cfg.sco_host_bytes > 0 and cfg.recompute == "full":
        per = n * h * b
        k = min(_boundary_count(cfg), cfg.sco_host_bytes // per)
        copy = per / HOST_LINK_ONE_WAY_BYTES_PER_S
        t_fwd = _layer_forward_flops(cfg, any(cfg.moe_layers)) / ASSUMED_ACHIEVED_FLOPS
        t_fwd *= max(1, cfg.recompute_layers)
        cost["sco"] = k * (max(0.0, copy - t_fwd) + max(0.0, copy - 3 * t_fwd))
    if cfg.ring_dtp:
        t_vocab = 6.0 * n * h * cfg.vocab / ASSUMED_ACHIEVED_FLOPS
        chunks = _ceil_div(n, cfg.ring_chunk) if cfg.ring_chunk else 1
        cost["ring_dtp"] = (RING_DTP_TIME_FACTOR - 1.0) * t_vocab + (
            (chunks - 1) * max(1, cfg.ring_group) * 2 * RING_DTP_CHUNK_LATENCY_S
        )
    if cfg.pllep:
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


# ------------------------------------------------------------------------------------------
# Suggested fixes for an infeasible plan
# ------------------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _suggest_fixes(budget: Budget) -> List[str]:
    cfg = budget.config
    t = budget.terms
    over = -budget.headroom
    fixes: List[str] = []
    n, h, b = cfg.tokens, cfg.hidden, cfg.act_bytes

    if not cfg.offload_stream and t["model_state"] > 0:
        on = estimate_config(cfg.replace(offload_stream=True))
        saved = budget.total - on.total
        if saved > 0:
            fixes.append(
                f"--offload-stream-optimizer (model state {_gib(t['model_state'])} -> "
                f"{_gib(on.terms['model_state'])} + {_gib(on.terms['optimizer_staging'])} "
                f"staging)"
            )
    if cfg.recompute != "full" and t["layer_activations"] > 0:
        fixes.append(
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            f"(layer activations {_gib(t['layer_activations'])} -> one boundary per layer)"
        )
    elif cfg.recompute == "full" and cfg.sco_host_bytes == 0 and budget.details["boundaries"] > 2:
        per = n * h * b
        need = min(budget.details["boundaries"], max(3, _ceil_div(over, per) + 2))
        gb = _sco_flag_for(need * per)
        fixes.append(
            f"--sco-host-budget-gb {gb:g} (offloads {need} of {budget.details['boundaries']} "
            f"boundaries of {_gib(per)}; pinned host memory per GPU)"
        )
    if t["moe_dispatch"] > 0 and not cfg.pllep:
        best = None
        for k_chunks in range(2, max(2, cfg.pllep_max_chunks) + 1):
            c = _ceil_div(n, k_chunks)
            alt = estimate_config(cfg.replace(pllep=True, pllep_budget=c))
            if alt.total < budget.total and (best is None or alt.total < best[1].total):
                best = (c, alt)
        if best is not None:
            fixes.append(
                f"--pipelined-llep --pipelined-llep-token-budget {best[0]} (dispatch "
                f"{_gib(t['moe_dispatch'])} -> {_gib(best[1].terms['moe_dispatch'])}, "
                f"routing-independent)"
            )
        else:
            fixes.append(
                f"PipelinedLLEP's worst case 2·E_p·k·c·H·b at E_p={cfg.ep} exceeds the "
                f"standard estimate for every c >= N/K_max: raise --pipelined-llep-max-chunks "
                f"or use a static capacity (--moe-expert-rank-capacity-factor)"
            )
    if (t["moe_dispatch"] > 0 and not cfg.pllep and not cfg.capacity_factor
            and cfg.routing_skew > BALANCED_ROUTING_SKEW):
        # Measured on 2 GPUs at 737,280 tokens: 173 GiB estimated at skew 2, 86 GiB peak
        # allocated on rank 0 (the small example's router kept each rank near its even share).
        alt = estimate_config(cfg.replace(routing_skew=BALANCED_ROUTING_SKEW))
        fixes.append(
            f"--budget-routing-skew {BALANCED_ROUTING_SKEW:g} if the router keeps the load "
            f"balanced (the estimate assumes the hottest rank receives {cfg.routing_skew:g}× "
            f"its even share of routed rows: {_gib(budget.total)} -> {_gib(alt.total)}"
            f"{', which fits' if alt.feasible else ''}; not a bound: a step "
            f"routed above it can still run out of memory)"
        )
    if t["vocab_projection"] > 0 and not cfg.ring_dtp:
        alt = estimate_config(cfg.replace(ring_dtp=True, ring_chunk=min(8192, n)))
        fixes.append(
            f"--ring-dtp --ring-dtp-chunk-tokens {min(8192, n)} (vocabulary projection "
            f"{_gib(t['vocab_projection'])} -> {_gib(alt.terms['vocab_projection'])})"
        )
    auto = choose_bounds(cfg)
    if auto["feasible"]:
        fixes.append(f"all at once, cheapest (--auto-bounds): {auto['command_line']}")
    else:
        fixes.append(
            "no setting of the four operators fits this layout; "
            f"the best reaches {_gib(auto['budget'].total)} ("
            f"dominant: {TERM_LABELS[auto['budget'].dominant]})"
        )
        if budget.details["params_expert"] and cfg.experts:
            fixes.append(
                "increase --expert-model-parallel-size (more GPUs: expert state "
                f"{budget.details['params_expert']:,} params per rank)"
            )
        if cfg.fsdp_strategy is None and budget.details["params_dense"] > 0:
            fixes.append(
                "shard dense parameters and gradients too (--use-megatron-fsdp "
                "--data-parallel-sharding-strategy optim_grads_params)"
            )
        longest = max_seq_length(_strong_config(cfg))
        if longest:
            fixes.append(
                f"shorter sequences: the longest --seq-length that fits is {longest:,} (at "
                f"--micro-batch-size {cfg.micro_batch}, with --offload-stream-optimizer, every "
                f"boundary offloaded by SCO, --ring-dtp --ring-dtp-chunk-tokens 4096 and "
                f"{'static-capacity' if cfg.capacity_factor else 'standard'} dispatch)"
            )
        else:
            fixes.append("not even 1,024 tokens fit: the model state alone is too large")
        if cfg.cp == 1:
            fixes.append(
                "split each sequence over ranks (context parallelism: N = S/CP per rank; needs "
                "Transformer Engine here)"
            )
    return fixes


def _strong_config(cfg: BudgetConfig) -> BudgetConfig:
    """``cfg`` with the streamed optimizer, SCO with whatever host memory is left and Ring-DTP
    with 4,096-token chunks, and the dispatch as configured except PipelinedLLEP, whose absolute
    token budget would not follow a shorter sequence (standard dispatch at the assumed skew)."""
    host_left = cfg.host_bytes_per_gpu - HOST_STATE_BYTES_PER_ELEMENT * _state_params_fast(
        cfg.replace(offload_stream=True)
    )
    return cfg.replace(
        offload_stream=True, sco_host_bytes=max(0, host_left), ring_dtp=True, ring_chunk=4096,
        pllep=False, pllep_budget=None,
    )


def auto_config(result: dict, cfg: BudgetConfig) -> BudgetConfig:
    """``cfg`` with the knobs of a :func:`choose_bounds` result applied."""
    flags = result["flags"]
    return cfg.replace(
        offload_stream=bool(flags["offload_stream_optimizer"]),
        sco_host_bytes=host_budget_bytes(float(flags["sco_host_budget_gb"] or 0)),
        ring_dtp=bool(flags["ring_dtp"]),
        ring_chunk=flags["ring_dtp_chunk_tokens"],
        pllep=bool(flags["pipelined_llep"]),
        pllep_budget=flags["pipelined_llep_token_budget"],
    )


# ------------------------------------------------------------------------------------------
# Launch-time hooks for pretrain_gpt.py (--auto-bounds, --memory-budget-check)
# ------------------------------------------------------------------------------------------


class MemoryBudgetError(RuntimeError):
    """The launch configuration does not fit the HBM (``--memory-budget-check error``)."""


def apply_bounds(args, result: dict) -> None:
    """Write the knobs of a :func:`choose_bounds` result into ``args`` (for ``--auto-bounds``)."""
    for name, value in result["flags"].items():
        setattr(args, name, value)


def launch_check(args, mode: Optional[str] = None) -> Budget:
    """Evaluate the budget before any allocation: ``off`` only returns it, ``warn`` prints the
    table when the plan does not fit, ``error`` raises :class:`MemoryBudgetError` with the table.
    ``mode`` defaults to ``args.memory_budget_check`` (or ``warn``)."""
    mode = mode or getattr(args, "memory_budget_check", None) or "warn"
    budget = estimate(args)
    if mode == "off" or budget.feasible:
        return budget
    if mode == "error":
        raise MemoryBudgetError(
            "the launch configuration does not fit the GPU memory (--memory-budget-check "
            "error; pass --memory-budget-check warn to launch anyway):\n" + budget.render()
        )
    if os.environ.get("RANK", "0") == "0":  # before distributed init: one table per job
        print(budget.render(with_notes=False), flush=True)
    return budget
