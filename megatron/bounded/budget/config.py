"""The launch configuration the memory budget reads: :class:`BudgetConfig` from the parsed flags,
and the units and defaults every part of the budget shares."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.bounded.activations.chunked_attention import DEFAULT_CHUNKED_ATTENTION
from megatron.bounded.activations.chunked_recompute import DEFAULT_CHUNK_TOKENS
from megatron.bounded.moe.pipelined_llep import DEFAULT_MAX_CHUNKS
from megatron.bounded.activations.sco import host_budget_bytes
from megatron.bounded.optimizer.offload_stream_adamw import DEFAULT_BUCKET_NUMEL, DEFAULT_NUM_SLOTS

GB = 10**9  # decimal gigabyte: the unit of --hbm-gb and --budget-host-gb

GiB = 2**30  # the unit the table prints, and of --sco-host-budget-gb (as pretrain_gpt.py reads it)

# What torch.cuda.get_device_properties reports for one H200 (139.8 GiB; NVIDIA's nominal
# figure is "141 GB").
H200_HBM_BYTES = 150_109_880_320

DEFAULT_HBM_GB = H200_HBM_BYTES / GB

# Routing skew assumed for the unbounded (standard) dispatch: the hottest rank receives this
# many times its even share N·k. An assumption (override with --budget-routing-skew); the
# bounded dispatch paths do not use it.
DEFAULT_ROUTING_SKEW = 2.0

# The skew the refusal message offers for a router that keeps the load balanced.
BALANCED_ROUTING_SKEW = 1.1

HOST_STATE_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq

# Host memory per GPU the planner may fill with SCO boundaries and optimizer state: the paper's
# nodes have 2 TB for 8 GPUs. Override with --budget-host-gb.
DEFAULT_HOST_BYTES_PER_GPU = 250 * GB


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
    ring_gradient_rows: Optional[int]  # --ring-dtp-gradient-rows (None: the default rule)
    pllep: bool
    pllep_budget: Optional[int]
    pllep_max_chunks: int
    upstream_experts: bool  # upstream's dispatcher and experts (else the torch-native ones)
    chunk_tokens: int  # --chunked-recompute-tokens (0: off)
    chunked_attention: bool  # --chunked-recompute-attention
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
        ring_rows = getattr(args, "ring_dtp_gradient_rows", None)
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
            ring_gradient_rows=int(ring_rows) if ring_rows else None,
            pllep=bool(_get(args, "pipelined_llep", False)),
            pllep_budget=int(pllep_budget) if pllep_budget else None,
            pllep_max_chunks=int(
                _get(args, "pipelined_llep_max_chunks", DEFAULT_MAX_CHUNKS)
            ),
            upstream_experts=_runs_upstream_experts(args),
            chunk_tokens=int(_get(args, "chunked_recompute_tokens", DEFAULT_CHUNK_TOKENS) or 0),
            chunked_attention=bool(_get(args, "chunked_recompute_attention",
                                        DEFAULT_CHUNKED_ATTENTION)),
            hbm_bytes=hbm,
            host_bytes_per_gpu=host,
        )

    def replace(self, **changes) -> "BudgetConfig":
        return dataclasses.replace(self, **changes)


def _as_config(args_or_cfg) -> BudgetConfig:
    if isinstance(args_or_cfg, BudgetConfig):
        return args_or_cfg
    return BudgetConfig.from_args(args_or_cfg)


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
