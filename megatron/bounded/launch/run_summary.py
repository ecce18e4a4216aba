"""The start-up line that says what runs.

``pretrain_gpt.py`` prints :func:`describe` once (rank 0) after the flags are validated and
before the model is built::

    [bounded] run: MoE torch-native all-to-all dispatcher (static, rank capacity factor 1, EP=1)
    + GroupedExperts (torch._grouped_mm) | attention SDPA (flash first) | CUDA graph whole
    iteration (NaN/inf checked on the host every 5 iterations) | operators paged stash
    | instead of what was asked: ...

With recompute, a part between attention (or the MTP layers) and the CUDA graph names it:
``recompute full (uniform, 1 layer per checkpoint)``, or the modules of selective recompute,
``recompute selective: layernorm, moe_act``.

Then the defaults this project set because upstream has none (``args.bounded_defaults``, e.g.
``--eval-interval``). The last part names each choice the command line asked for that cannot run here, what runs
instead and why: the ones the argument layer replaced (recorded in
``args.bounded_substitutions`` by :func:`megatron.bounded.launch.arguments.note_substitution`) and the
MoE dispatcher and experts that :func:`megatron.bounded.moe.backend.explain_moe_backend` picks
instead of upstream's. Everything here reads parsed flags only: no GPU, no distributed start-up.
"""

from __future__ import annotations

from typing import List, Tuple

from megatron.bounded.activations.chunked_attention import ChunkedAttentionSettings
from megatron.bounded.activations.selective_recompute import selected_modules
from megatron.bounded.attention.documents import document_source
from megatron.bounded.moe.backend import (
    explain_moe_backend,
    missing_flex_dispatcher_backend,
    static_dispatch,
    upstream_static_capacity_available,
)
from megatron.bounded.moe.pipelined_llep import PipelinedLLEPSettings

UPSTREAM_DISPATCHERS = {
    "alltoall": "MoEAlltoAllTokenDispatcher",
    "allgather": "MoEAllGatherTokenDispatcher",
    "flex": "MoEFlexTokenDispatcher",
}


def _te_installed() -> bool:
    from megatron.bounded.launch.arguments import transformer_engine_available

    return transformer_engine_available()


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def moe_part(args) -> Tuple[str, List[str]]:
    """(what the MoE layers run, substitutions of MoE choices that cannot run here)."""
    if getattr(args, "num_experts", None) is None:
        return "dense (no MoE)", []
    backend, why = explain_moe_backend(args)
    if args.transformer_impl != "local":
        backend = "upstream"  # Transformer Engine's layer spec builds upstream's MoE layer
    ep = args.expert_model_parallel_size
    if backend == "torch":
        pipelined_llep = PipelinedLLEPSettings.of(args)
        if pipelined_llep.enabled:
            dispatcher = pipelined_llep.dispatcher_text(ep)
        elif args.moe_expert_rank_capacity_factor is not None:
            dispatcher = (
                "torch-native all-to-all dispatcher (static, rank capacity factor "
                f"{_number(args.moe_expert_rank_capacity_factor)}, EP={ep})"
            )
        elif static_dispatch(args):
            dispatcher = (
                "torch-native all-to-all dispatcher (static, padded to the experts' capacity, "
                f"capacity factor {_number(args.moe_expert_capacity_factor)}, EP={ep})"
            )
        else:
            dispatcher = f"torch-native all-to-all dispatcher (dropless, EP={ep})"
        experts = "GroupedExperts (torch._grouped_mm)"
    else:
        kind = args.moe_token_dispatcher_type
        dispatcher = f"upstream {UPSTREAM_DISPATCHERS.get(kind, kind)}"
        if kind == "flex":
            dispatcher += f" ({args.moe_flex_dispatcher_backend})"
        dispatcher += f" (EP={ep})"
        te_grouped = args.transformer_impl == "transformer_engine" and (
            args.moe_grouped_gemm or upstream_static_capacity_available(args)
        )
        experts = "TEGroupedMLP" if te_grouped else "SequentialMLP"
    text = f"MoE {dispatcher} + {experts}"
    return text, _moe_substitutions(args, backend, why, dispatcher)


def _moe_substitutions(args, backend: str, why: str, dispatcher: str) -> List[str]:
    notes = []
    if backend == "torch" and args.moe_shared_expert_overlap and \
            args.moe_shared_expert_intermediate_size:
        notes.append(
            "--moe-shared-expert-overlap -> the shared experts on a side CUDA stream beside the "
            "routing, dispatch and routed experts (upstream's overlap hooks live in its own "
            "dispatchers)")
    if backend != "torch" or args.bounded_moe_backend == "torch" \
            or PipelinedLLEPSettings.of(args).enabled:
        return notes
    if args.moe_token_dispatcher_type == "flex":
        reasons = [missing_flex_dispatcher_backend(args)]
        if not _te_installed():
            reasons.append("Transformer Engine is not installed")
        reasons = [reason for reason in reasons if reason] or [why]
        notes.append(
            f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "
            f"{args.moe_flex_dispatcher_backend} -> {dispatcher}: " + "; ".join(reasons)
        )
    if getattr(args, "moe_grouped_gemm", False):
        notes.append(
            "--moe-grouped-gemm -> GroupedExperts on torch._grouped_mm: the local implementation "
            "has no grouped GEMM of its own (upstream's local spec would build SequentialMLP)"
        )
    return notes


def attention_part(args) -> str:
    if args.transformer_impl != "local":
        return f"attention Transformer Engine DotProductAttention ({_enum_name(args.attention_backend)})"
    from megatron.bounded.attention.core import sdpa_backends

    first = sdpa_backends(args.attention_backend)[0].name.split("_")[0].lower()
    first = "cuDNN" if first == "cudnn" else first
    text = f"attention SDPA ({first} first)"
    chunked_attention = ChunkedAttentionSettings.of(args)
    source = document_source(args)
    if source is not None:
        boundaries = "EOD tokens" if source == "eod" else "the dataset's document lengths"
        kernel = ("flash kernels per document and block pair" if chunked_attention.enabled
                  else "flash variable-length kernel")
        text = f"attention within documents ({kernel}; boundaries at {boundaries})"
    if args.context_parallel_size > 1:
        text += f", sequence-to-head all-to-all over CP={args.context_parallel_size}"
    return text + chunked_attention.kept_text()


def mtp_part(args) -> str:
    """The multi-token-prediction layers (``--mtp-num-layers``), or "" without them: built with
    the decoder's layer spec (``megatron.bounded.model.specs.bounded_mtp_block_spec``) unless
    ``--spec`` or another implementation than local makes upstream's spec build them."""
    layers = getattr(args, "mtp_num_layers", None)
    if not layers:
        return ""
    ours = args.spec is None and args.transformer_impl == "local"
    spec = "the decoder's layer spec" if ours else "upstream's MTP spec"
    return f"MTP {layers} layer{'s' if layers > 1 else ''} ({spec})"


def recompute_part(args) -> str:
    """Full recompute and its checkpoints, or the modules selective recompute runs (upstream's
    default core_attn included); "" without recompute."""
    if args.recompute_granularity == "full":
        layers = args.recompute_num_layers
        return (f"recompute full ({args.recompute_method}, {layers} layer"
                f"{'s' if layers != 1 else ''} per checkpoint)")
    modules = selected_modules(args)
    return f"recompute selective: {', '.join(modules)}" if modules else ""


def _enum_name(value) -> str:
    return getattr(value, "name", str(value))


def graph_part(args) -> str:
    impl = args.cuda_graph_impl
    if impl == "none":
        text = "CUDA graph none"
    elif impl == "full_iteration":
        text = "CUDA graph whole iteration"
    else:
        modules = " ".join(getattr(scope, "name", str(scope))
                           for scope in getattr(args, "cuda_graph_modules", None) or [])
        text = f"CUDA graph per layer ({impl}{': ' + modules if modules else ''})"
    if not args.check_for_nan_in_loss_and_grad:
        text += f" (NaN/inf checked on the host every {args.log_interval} iterations)"
    return text


def operators_part(args) -> str:
    on = []
    if args.sco_host_budget_gb > 0:
        on.append(f"SCO ({_number(args.sco_host_budget_gb)} GiB host budget)")
    if args.ring_dtp:
        on.append(f"Ring-DTP ({args.ring_dtp_mode})")
    on += PipelinedLLEPSettings.of(args).operators_text()
    if args.offload_stream_optimizer:
        on.append("OffloadStreamAdamW")
    if getattr(args, "num_experts", None) is not None and args.moe_paged_stash:
        on.append("paged stash")
    return "operators " + (", ".join(on) if on else "none")


def describe(args) -> str:
    """The one start-up line for validated ``args``."""
    moe, moe_notes = moe_part(args)
    parts = [moe, attention_part(args), mtp_part(args), recompute_part(args), graph_part(args),
             operators_part(args)]
    parts = [part for part in parts if part]
    line = "[bounded] run: " + " | ".join(parts)
    defaults = getattr(args, "bounded_defaults", None) or []
    if defaults:
        line += " | defaults set: " + "; ".join(defaults)
    notes = list(getattr(args, "bounded_substitutions", None) or []) + moe_notes
    if notes:
        line += " | instead of what was asked: " + "; ".join(notes)
    return line
