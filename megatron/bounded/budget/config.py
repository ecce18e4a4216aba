"""The launch configuration the memory budget reads: :class:`BudgetConfig` from the parsed flags,
and the units and defaults every part of the budget shares."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.bounded.activations.chunked_attention import ChunkedAttentionSettings
from megatron.bounded.activations.chunked_recompute import ChunkedRecomputeSettings
from megatron.bounded.activations.sco import SCOSettings
from megatron.bounded.activations.selective_recompute import selected_modules
from megatron.bounded.attention.documents import document_source
from megatron.bounded.loss.ring_dtp import RingDTPSettings
from megatron.bounded.moe.backend import (
    MoEBackendSettings, moe_layer_pattern, static_capacity_factor,
)
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPSettings
from megatron.bounded.optimizer.distributed import OffloadStreamSettings
from megatron.bounded.registry import settings_by_name
from megatron.bounded.settings import BoundedArgumentError, Settings, knob
from megatron.bounded.units import GB, ceil_div


# What torch.cuda.get_device_properties reports for one H200 (139.8 GiB; NVIDIA's nominal
# figure is "141 GB").
H200_HBM_BYTES = 150_109_880_320

DEFAULT_HBM_GB = H200_HBM_BYTES / GB

# Largest --hbm-gb taken: no accelerator has 10 TB of memory, so a larger value is a typo (and a
# value near the float range would overflow the byte count).
MAX_HBM_GB = 10_000.0

# Routing skew assumed for the unbounded (standard) dispatch: the hottest rank receives this
# many times its even share N·k. An assumption (override with --budget-routing-skew); the
# bounded dispatch paths do not use it.
DEFAULT_ROUTING_SKEW = 2.0

# The skew the refusal message offers for a router that keeps the load balanced.
BALANCED_ROUTING_SKEW = 1.1

HOST_STATE_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq

# Host memory per GPU that tools/memory_budget.py plans for without --budget-host-gb: a training
# node of 2 TB and 8 GPUs.
DEFAULT_PLANNED_HOST_GB = 250.0



@dataclass(frozen=True)
class BudgetSettings(Settings):
    """The launch-time memory budget's flags and the planning assumptions it makes."""

    memory_budget_check: str = knob(
        "error", "Per-GPU memory peak estimated before the model is built: error refuses to "
        "start a plan that does not fit (before any GPU allocation), warn prints the table and "
        "starts, off skips it.", choices=("off", "warn", "error"))
    bounded_plan: str = knob(
        "auto", "auto: the fastest predicted exact plan that fits, for every knob the command "
        "line leaves open (micro-batch, recompute, operators, MoE dispatch, CUDA graph); off: the "
        "flags as given.", choices=("auto", "off"))
    hbm_gb: Optional[float] = knob(
        None, "GPU memory per device for the budget, decimal GB. Default: the GPU's as torch "
        "reports it; without a visible GPU (tools/memory_budget.py) one H200's, 150.1.",
        metavar="GB")
    budget_routing_skew: float = knob(
        DEFAULT_ROUTING_SKEW, "Routing skew the budget assumes for the standard dispatch: the "
        "hottest rank receives this many times its even share of routed rows (an assumption).")
    budget_host_gb: Optional[float] = knob(
        None, "Host memory per GPU that pinned memory (SCO, kept attention, streamed optimizer) is "
        "planned and checked against, decimal GB. Default: this host's RAM per GPU process; "
        f"tools/memory_budget.py: {DEFAULT_PLANNED_HOST_GB:g}.", metavar="GB")

    @property
    def hbm_bytes(self) -> int:
        return H200_HBM_BYTES if self.hbm_gb is None else int(self.hbm_gb * GB)

    def check(self, args) -> None:
        hbm = self.hbm_gb
        if hbm is not None and not (hbm > 0 and math.isfinite(hbm)):
            raise BoundedArgumentError(
                f"--hbm-gb must be positive and finite (decimal GB per GPU, e.g. 150.1 for an "
                f"H200), got {hbm}."
            )
        if hbm is not None and hbm > MAX_HBM_GB:
            raise BoundedArgumentError(
                f"--hbm-gb {hbm:g} is more memory than any GPU has (at most {MAX_HBM_GB:g} decimal "
                "GB taken): give the GPU's memory in decimal GB, e.g. --hbm-gb 150.1 for an H200."
            )
        skew = self.budget_routing_skew
        if not (skew >= 1.0 and math.isfinite(skew)):
            raise BoundedArgumentError(
                f"--budget-routing-skew must be >= 1.0 and finite (the hottest rank receives at "
                f"least its even share of routed rows; e.g. 2.0), got {skew}."
            )
        ep = max(1, getattr(args, "expert_model_parallel_size", 1) or 1)
        if skew > max(ep, DEFAULT_ROUTING_SKEW):
            # every rank sending all its rows to one rank is EP times the even share
            raise BoundedArgumentError(
                f"--budget-routing-skew {skew:g} is more than the hottest rank can receive: at "
                f"most --expert-model-parallel-size ({ep}; every rank sends it all its rows), or "
                f"the default {DEFAULT_ROUTING_SKEW:g} at EP 1: lower --budget-routing-skew, "
                f"e.g. to {min(ep, DEFAULT_ROUTING_SKEW) if ep > 1 else DEFAULT_ROUTING_SKEW:g}."
            )
        host = self.budget_host_gb
        if host is not None and not (host > 0 and math.isfinite(host)):
            raise BoundedArgumentError(
                f"--budget-host-gb must be positive and finite (decimal GB of host memory per "
                f"GPU, e.g. 250 for a node of 2 TB and 8 GPUs), got {host}."
            )
        if self.bounded_plan == "auto" and self.memory_budget_check == "off":
            raise BoundedArgumentError(
                "the planner (--bounded-plan auto, the default) chooses from the memory budget, "
                "which --memory-budget-check off disables: pass --bounded-plan off with "
                "--memory-budget-check off, or use --memory-budget-check warn or error."
            )


# The settings of every operator the budget composes (the registry's), and the budget's own, by
# BudgetConfig field.
OPERATOR_SETTINGS = {**settings_by_name(), "budget": BudgetSettings}


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


def _runs_upstream_experts(args, settings) -> bool:
    """Whether the MoE layers run upstream's dispatcher and experts (``--bounded-moe-backend``):
    PipelinedLLEP and a static capacity always run the torch-native ones."""
    if settings["pipelined_llep"].enabled or getattr(args, "moe_expert_rank_capacity_factor", None):
        return False
    backend = settings["moe_backend"].bounded_moe_backend
    if backend == "auto":
        return not _get(args, "moe_grouped_gemm", False)
    return backend == "upstream"


def operator_settings(args, settings=None) -> dict:
    """``{BudgetConfig field: settings object}``: each from ``settings`` (an object with those
    attributes, e.g. the launch layer's run settings) where it has it, else read from ``args``."""
    return {
        name: getattr(settings, name, None) or cls.from_args(args, check=False)
        for name, cls in OPERATOR_SETTINGS.items()
    }


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's dimensions (``--multi-latent-attention``); ``q_lora_rank`` 0
    when the queries are projected from the hidden state directly."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    # DeepSeek sparse attention (--experimental-attention-variant dsa): 0 without
    dsa_topk: int = 0
    dsa_index_heads: int = 0
    dsa_index_dim: int = 0
    dsa_indexer_loss: bool = False

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @classmethod
    def from_args(cls, args) -> Optional["MLAShape"]:
        if not _get(args, "multi_latent_attention", False):
            return None
        # upstream's flag defaults (megatron/training/arguments.py)
        return cls(q_lora_rank=int(_get(args, "q_lora_rank", None) or 0),
                   kv_lora_rank=int(_get(args, "kv_lora_rank", 32)),
                   qk_head_dim=int(_get(args, "qk_head_dim", 128)),
                   qk_pos_emb_head_dim=int(_get(args, "qk_pos_emb_head_dim", 64)),
                   v_head_dim=int(_get(args, "v_head_dim", 128)),
                   **_dsa_shape(args))


def _dsa_shape(args) -> dict:
    """DeepSeek sparse attention's sizes for :class:`MLAShape` (none without it)."""
    if _get(args, "experimental_attention_variant", None) != "dsa":
        return {}
    return dict(dsa_topk=int(_get(args, "dsa_indexer_topk", 0) or 0),
                dsa_index_heads=int(_get(args, "dsa_indexer_n_heads", 0) or 0),
                dsa_index_dim=int(_get(args, "dsa_indexer_head_dim", 0) or 0),
                dsa_indexer_loss=(_get(args, "dsa_indexer_loss_coeff", None) or 0) > 0)


@dataclass(frozen=True)
class GDNShape:
    """The widths of gated DeltaNet layers (``--experimental-attention-variant gated_delta_net``),
    named as the config fields that :mod:`megatron.bounded.attention.gated_delta_net`'s byte and
    parameter counts read."""

    hidden_size: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_conv_kernel_dim: int

    @classmethod
    def from_args(cls, args) -> Optional["GDNShape"]:
        from megatron.bounded.attention.gated_delta_net import is_gated_delta_net

        if not is_gated_delta_net(args):
            return None
        return cls(*(int(getattr(args, field.name)) for field in dataclasses.fields(cls)))


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
    mtp_layers: int  # --mtp-num-layers (0: none), on the last pipeline stage
    vocab: int  # padded
    untied: bool
    learned_positions: int  # rows of a learned position table (0 with rope / none)
    rope: bool
    gated: bool
    layernorm: bool  # LayerNorm (weight + bias) rather than RMSNorm (weight)
    bias_linear: bool
    qkv_bias: bool
    qk_layernorm: bool
    mla: Optional[MLAShape]  # None without multi-latent attention
    output_gate: bool  # --attention-output-gate: a sigmoid gate per query channel
    gdn: Optional[GDNShape]  # None without gated DeltaNet layers
    linear_layers: Tuple[bool, ...]  # per layer: a gated DeltaNet layer (else full attention)
    fused_attention: bool  # --attention-backend fused: cuDNN's SDPA kernels first (else flash)
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
    recompute_modules: Tuple[str, ...]  # of selective recompute (upstream's reading)
    # MoE dispatch
    capacity_factor: Optional[float]
    paged_stash: bool
    stash_factor: float
    # attention within packed documents (--reset-attention-mask)
    packed_documents: bool
    # our operators' settings and the budget's own
    moe_backend: MoEBackendSettings
    pipelined_llep: PipelinedLLEPSettings
    chunked_recompute: ChunkedRecomputeSettings
    chunked_attention: ChunkedAttentionSettings
    sco: SCOSettings
    ring_dtp: RingDTPSettings
    offload_stream: OffloadStreamSettings
    budget: BudgetSettings
    ring_group: int  # ranks of the Ring-DTP ring
    upstream_experts: bool  # upstream's dispatcher and experts (else the torch-native ones)

    @property
    def hbm_bytes(self) -> int:
        return self.budget.hbm_bytes

    @property
    def routing_skew(self) -> float:
        return self.budget.budget_routing_skew

    @property
    def chunk_tokens(self) -> int:
        """--chunked-recompute-tokens (0: off)."""
        return self.chunked_recompute.chunked_recompute_tokens or 0

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
    def from_args(cls, args, settings=None, ring_group: Optional[int] = None) -> "BudgetConfig":
        """The budget's view of a launch: the layout and model from upstream's parsed flags,
        the operators from their settings objects (``settings``, or read from ``args``);
        ``ring_group`` overrides the Ring-DTP ring's size (planning only)."""
        ops = operator_settings(args, settings)
        layout = _layout_fields(args)
        ring = ring_group or layout["dp"] * layout["cp"]
        return cls(
            **layout, **_model_fields(args, layout["tp"]),
            **_state_fields(args, ops["offload_stream"]), **_step_fields(args),
            ring_group=int(ring), upstream_experts=_runs_upstream_experts(args, ops), **ops,
        )

    def replace(self, **changes) -> "BudgetConfig":
        return dataclasses.replace(self, **changes)

    def with_flags(self, **flags) -> "BudgetConfig":
        """``self`` with these settings fields (named as their flags' attributes) changed in the
        settings objects that own them."""
        changes, unknown = {}, dict(flags)
        for name in OPERATOR_SETTINGS:
            settings = getattr(self, name)
            own = {key: unknown.pop(key) for key in list(unknown) if key in settings.fields()}
            if own:
                changes[name] = dataclasses.replace(settings, **own)
        if unknown:
            raise TypeError(f"no operator settings field: {sorted(unknown)}")
        return dataclasses.replace(self, **changes)


def _layout_fields(args) -> dict:
    """The parallel layout: world, TP, PP, CP, EP, expert TP, DP."""
    tp = int(_get(args, "tensor_model_parallel_size", 1))
    pp = int(_get(args, "pipeline_model_parallel_size", 1))
    cp = int(_get(args, "context_parallel_size", 1))
    world = getattr(args, "world_size", None)
    if world is None:
        world = int(os.environ.get("WORLD_SIZE", "0")) or None
    dp = getattr(args, "data_parallel_size", None)
    if world is None:
        world = tp * pp * cp * int(dp or 1)
    world = int(world)
    if dp is None:
        dp = max(1, world // (tp * pp * cp))
    return dict(world=world, tp=tp, pp=pp, cp=cp, ep=int(_get(args, "expert_model_parallel_size", 1)),
                etp=int(_get(args, "expert_tensor_parallel_size", 1)), dp=int(dp))


def _padded_vocab(args, tp: int) -> int:
    vocab_size = getattr(args, "padded_vocab_size", None)
    if vocab_size is not None:
        return int(vocab_size)
    raw = getattr(args, "vocab_size", None)
    if raw is None:
        raise ValueError(
            "the memory budget needs the vocabulary size: pass --vocab-size (the tokenizer is "
            "not built at planning time)"
        )
    multiple = int(_get(args, "make_vocab_size_divisible_by", 128)) * tp
    return ceil_div(int(raw), multiple) * multiple


def _model_fields(args, tp: int) -> dict:
    """The model's shape and the micro-batch."""
    hidden = int(args.hidden_size)
    heads = int(args.num_attention_heads)
    groups = int(_get(args, "num_query_groups", heads)) if _get(args, "group_query_attention", False) \
        else heads
    ffn = int(_get(args, "ffn_hidden_size", 4 * hidden))
    experts = int(_get(args, "num_experts", 0))
    layers = int(args.num_layers)
    position = str(_get(args, "position_embedding_type", "learned_absolute"))
    return dict(
        micro_batch=int(_get(args, "micro_batch_size", 1)),
        seq_length=int(args.seq_length),
        hidden=hidden, heads=heads, groups=groups,
        kv_channels=int(_get(args, "kv_channels", hidden // heads)), ffn=ffn,
        moe_ffn=int(_get(args, "moe_ffn_hidden_size", ffn)),
        shared_ffn=int(_get(args, "moe_shared_expert_intermediate_size", 0)),
        experts=experts, topk=int(_get(args, "moe_router_topk", 2)) if experts else 0,
        layers=layers,
        moe_layers=moe_layer_pattern(_get(args, "moe_layer_freq", 1), layers, experts),
        mtp_layers=int(_get(args, "mtp_num_layers", 0)),
        vocab=_padded_vocab(args, tp),
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
        mla=MLAShape.from_args(args),
        output_gate=bool(_get(args, "attention_output_gate", False)),
        gdn=GDNShape.from_args(args),
        linear_layers=_linear_layers(args, layers),
        fused_attention=getattr(_get(args, "attention_backend", None), "name",
                                str(_get(args, "attention_backend", ""))) == "fused",
        shared_gate=bool(_get(args, "moe_shared_expert_gate", False)),
        sequence_parallel=bool(_get(args, "sequence_parallel", False)) and tp > 1,
    )


def _linear_layers(args, layers: int) -> Tuple[bool, ...]:
    """Per layer, whether it is a gated DeltaNet layer (upstream's reading of
    --linear-attention-freq)."""
    from megatron.bounded.attention.gated_delta_net import gated_delta_net_pattern, is_gated_delta_net

    if not is_gated_delta_net(args) or _get(args, "linear_attention_freq", None) is None:
        return (False,) * layers
    view = argparse.Namespace(num_layers=layers, linear_attention_freq=args.linear_attention_freq,
                              experimental_attention_variant=args.experimental_attention_variant)
    return tuple(bool(entry) for entry in gated_delta_net_pattern(view))


def _state_fields(args, offload: OffloadStreamSettings) -> dict:
    """Bytes per element of the activations, parameters, gradients and optimizer state, and how
    the optimizer state is sharded or offloaded."""

    def optimizer_flag(name: str):
        """An upstream optimizer flag, as the streamed optimizer sets it when it is on."""
        if offload.enabled and name in offload.UPSTREAM_OPTIMIZER_FLAGS:
            return offload.UPSTREAM_OPTIMIZER_FLAGS[name]
        return _get(args, name, False)

    bf16 = bool(_get(args, "bf16", False))
    fp16 = bool(_get(args, "fp16", False))
    half = bf16 or fp16
    # Gradient buffer: upstream turns --accumulate-allreduce-grads-in-fp32 on for bf16 unless
    # --grad-reduce-in-bf16 (or --main-grads-dtype bf16) is given (upstream's validate_args).
    if bf16:
        main_grads = _dtype_bytes(getattr(args, "main_grads_dtype", None), 4)
        fp32_grads = not _get(args, "grad_reduce_in_bf16", False) and (
            _get(args, "accumulate_allreduce_grads_in_fp32", False) or main_grads == 4
        )
    elif fp16:
        fp32_grads = bool(_get(args, "accumulate_allreduce_grads_in_fp32", False))
    else:
        fp32_grads = True
    if not half:
        master, moments = 0, 8  # fp32 training: the parameters are the master copy
    elif optimizer_flag("optimizer_cpu_offload"):
        master, moments = 4, 8  # the host optimizers keep fp32 state whatever the dtype flags
    else:
        # the dtype flags: Transformer Engine's FusedAdam, or this project's MomentDtypeAdamW
        master = _dtype_bytes(getattr(args, "main_params_dtype", None), 4)
        moments = _dtype_bytes(getattr(args, "exp_avg_dtype", None), 4) + _dtype_bytes(
            getattr(args, "exp_avg_sq_dtype", None), 4
        )
    fsdp = None
    if _get(args, "use_megatron_fsdp", False):
        fsdp = str(_get(args, "data_parallel_sharding_strategy", "optim_grads_params"))
    cpu_offload = 0.0
    if optimizer_flag("optimizer_cpu_offload"):
        cpu_offload = float(_get(args, "optimizer_offload_fraction", 1.0))
    return dict(
        act_bytes=2 if half else 4, param_bytes=2 if half else 4, grad_bytes=4 if fp32_grads else 2,
        master_bytes=master, moment_bytes=moments,
        distributed_optimizer=bool(_get(args, "use_distributed_optimizer", False)),
        fsdp_strategy=fsdp, cpu_offload_fraction=cpu_offload,
    )


def _step_fields(args) -> dict:
    """Recompute's, the MoE dispatch's and the data's upstream flags."""
    return dict(
        packed_documents=document_source(args) is not None,
        recompute=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_layers=int(_get(args, "recompute_num_layers", 1)),
        recompute_modules=selected_modules(args),
        # the rank capacity factor, or the experts' one where the dispatch pads to it
        capacity_factor=getattr(args, "moe_expert_rank_capacity_factor", None)
        or static_capacity_factor(args),
        paged_stash=bool(_get(args, "moe_paged_stash", False)),
        stash_factor=float(_get(args, "moe_paged_stash_buffer_size_factor_cuda", 1.10)),
    )


def as_config(args_or_cfg) -> BudgetConfig:
    if isinstance(args_or_cfg, BudgetConfig):
        return args_or_cfg
    return BudgetConfig.from_args(args_or_cfg)


def stage_layers(cfg: BudgetConfig) -> List[Tuple[int, ...]]:
    """Layer indices of each pipeline stage: contiguous, as even as possible (earlier stages
    get the extra layer when L is not a multiple of PP)."""
    base, extra = divmod(cfg.layers, cfg.pp)
    stages, start = [], 0
    for s in range(cfg.pp):
        n = base + (1 if s < extra else 0)
        stages.append(tuple(range(start, start + n)))
        start += n
    return stages
