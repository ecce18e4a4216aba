"""The choices that need Transformer Engine, and what runs here instead without it.

:func:`substitute` replaces each TE-only choice of parsed flags by the torch-native path with the
same values and returns one note per replacement for the start-up line:

* :data:`TE_SUBSTITUTIONS`: fusions, fp8, and the schedules only Transformer Engine has (deferred
  weight gradients, routed tokens padded for fp8 GEMMs), each turned off;
* ``--dsa-kernel-backend tilelang`` / ``cudnn`` (DeepSeek sparse attention's fused kernels):
  ``none``, our indexer and sparse attention, Triton kernels on CUDA
  (:mod:`megatron.bounded.model.dsa`);
* ``--cuda-graph-impl transformer_engine``: megatron-core's own per-layer graphs (``local``) with
  the asked scopes they capture on this project's layers, or none (:func:`local_graphs`);
* ``--use-precision-aware-optimizer`` with fp32 master weights and gradients: the distributed
  optimizer's own fp32 master weights, with Adam's moments in fp32 (the same values) or, for
  ``--exp-avg-dtype bf16`` / ``--exp-avg-sq-dtype bf16``, stored in bf16 by
  :class:`~megatron.bounded.optimizer.moment_dtype_adamw.MomentDtypeAdamW` (FusedAdam's
  arithmetic); other dtypes are refused by :func:`check_optimizer_dtypes`, before upstream's
  validation;
* ``--async-save`` with megatron-core's default writer, nvidia-resiliency-ext's (an optional
  package, like Transformer Engine): megatron-core's own asynchronous writer
  (``--async-strategy mcore``, the same checkpoint) where that package is not installed.

``megatron.bounded.launch.arguments`` runs :func:`substitute` on the command line before upstream
parses it (upstream's validation asserts on some of these choices; :func:`set_on_command_line`
writes the replacements back as flags) and again on the validated flags.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Dict, List, Sequence, Tuple

from megatron.bounded.attention.documents import document_source
from megatron.bounded.model.dsa import dsa_kernel_note
from megatron.bounded.moe.backend import static_dispatch
from megatron.bounded.optimizer.moment_dtype_adamw import moment_dtype
from megatron.bounded.settings import BoundedArgumentError, flag_name

__all__ = ["TE_SUBSTITUTIONS", "substitute", "local_graphs", "check_optimizer_dtypes",
           "moment_dtypes", "set_on_command_line"]

# Choices that need Transformer Engine, and what runs instead without it: (attribute, the value
# that turns it off, the note). The replacements compute the same values, except fp8, which
# trains in the model's 16-bit precision.
TE_SUBSTITUTIONS = (
    ("transformer_impl", "local", "--transformer-impl transformer_engine -> local (SDPA "
     "attention, local linears)"),
    ("use_transformer_engine_op_fuser", False, "--use-transformer-engine-op-fuser -> local linears"),
    ("moe_permute_fusion", False, "--moe-permute-fusion -> the unfused token permutation (the "
     "same rows)"),
    ("moe_router_fusion", False, "--moe-router-fusion -> the unfused router top-k (the same "
     "values)"),
    ("fp8", None, "--fp8-format -> no fp8: the model's --bf16/--fp16 precision"),
    ("fp8_param_gather", False, "--fp8-param-gather -> the parameters gathered in the model's "
     "precision (no fp8 parameters)"),
    ("moe_router_padding_for_quantization", False, "--moe-router-padding-for-quantization -> "
     "the experts' token counts unpadded (the padding aligns them for fp8/fp4 GEMMs; padded rows "
     "carry probability 0)"),
    ("moe_router_padding_for_fp8", False, "--moe-router-padding-for-fp8 -> the experts' token "
     "counts unpadded (the padding aligns them for fp8 GEMMs; padded rows carry probability 0)"),
    ("delay_wgrad_compute", False, "--delay-wgrad-compute -> each weight gradient computed with "
     "its input gradient (the same values; deferring it past the expert-parallel exchange is "
     "Transformer Engine's)"),
    ("overlap_moe_expert_parallel_comm", False, "--overlap-moe-expert-parallel-comm -> the "
     "expert-parallel exchange in order, not overlapped with another micro-batch's computation "
     "(the same values; megatron-core's overlapped schedule splits its own MoE layers)"),
)

# The optimizer's dtype flags: master weights and gradients only Transformer Engine's FusedAdam
# keeps below fp32; the moments MomentDtypeAdamW keeps in bf16 too.
FUSED_ADAM_ONLY_DTYPES = ("main_grads_dtype", "main_params_dtype")
MOMENT_DTYPE_FLAGS = ("exp_avg_dtype", "exp_avg_sq_dtype")

# The scopes megatron-core's local graphs honour in a TransformerLayer (the layer of this
# project's specs and of upstream's local spec): either puts the whole layer in one graph.
LOCAL_LAYER_SCOPES = ("attn", "mlp")


def substitute(args: argparse.Namespace) -> List[str]:
    """Replace every TE-only choice of ``args`` (in place); the notes, one per replacement."""
    notes = []
    for name, off, note in TE_SUBSTITUTIONS:
        value = getattr(args, name, off)
        if value in (off, None) or (name == "transformer_impl" and value != "transformer_engine"):
            continue
        setattr(args, name, off)
        notes.append(note)
    if getattr(args, "cuda_graph_impl", "none") == "transformer_engine":
        impl, scopes, note = local_graphs(args)
        args.cuda_graph_impl, args.cuda_graph_modules = impl, scopes
        args.cuda_graph_scope_deprecated = None  # given as --cuda-graph-scope: now the modules
        notes.append(note)
    if _precision_aware_here(args):
        args.use_precision_aware_optimizer = False
        lower = _lower_moments(args)
        notes.append(
            "--use-precision-aware-optimizer -> the distributed optimizer's fp32 master weights "
            + (f"with Adam's moments stored in bf16 ({', '.join(lower)}; updated in fp32, as "
               "FusedAdam does)" if lower else
               "and moments (the same values: every optimizer dtype is fp32)"))
    notes = [f"{note}: Transformer Engine is not installed" for note in notes]
    kernels = dsa_kernel_note(args)  # on the local implementation DSA runs our kernels
    return notes + [note for note in (kernels, _async_writer(args)) if note]


def _async_writer(args) -> str:
    """Switch ``--async-save`` to megatron-core's own writer where nvidia-resiliency-ext's, the
    default, is not installed (megatron-core fails at start-up otherwise); the note, or ""."""
    if not getattr(args, "async_save", False) or getattr(args, "async_strategy", "nvrx") != "nvrx" \
            or importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return ""
    args.async_strategy = "mcore"
    return ("--async-save -> megatron-core's own asynchronous checkpoint writer (--async-strategy "
            "mcore; the same checkpoint): nvidia-resiliency-ext is not installed")


def _scope_names(args) -> List[str]:
    """The per-layer graph scopes asked for (strings before upstream's validation, enums after);
    empty: the whole layer."""
    scopes = getattr(args, "cuda_graph_scope_deprecated", None) or getattr(
        args, "cuda_graph_modules", None) or []
    if not isinstance(scopes, (list, tuple)):
        scopes = [scopes]
    names = [getattr(scope, "name", str(scope)) for scope in scopes]
    return [] if names == ["full"] else names


def _every_layer_moe(args) -> bool:
    if getattr(args, "num_experts", None) is None:
        return False
    pattern = getattr(args, "moe_layer_freq", 1)
    return 0 not in pattern if isinstance(pattern, list) else pattern == 1


def _graph_blocker(args) -> str:
    """Why no layer of this run can be captured by a per-layer graph ("" when some can)."""
    if getattr(args, "recompute_granularity", None) == "full":
        return "--recompute-granularity full (megatron-core graphs a recomputed layer only in " \
               "--cuda-graph-impl full_iteration)"
    if (getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        return "--cpu-offloading-num-layers (megatron-core graphs no offloaded layer)"
    if getattr(args, "moe_paged_stash", False):
        return "--moe-paged-stash (its stash manager reads a token count on the host)"
    if document_source(args) is not None:
        return "attention within documents (its kernel calls follow each batch's documents)"
    if getattr(args, "recompute_granularity", None) == "selective":
        modules = set(getattr(args, "recompute_modules", None) or ["core_attn"])
        if (getattr(args, "attention_dropout", 0) and "core_attn" in modules) or (
                getattr(args, "hidden_dropout", 0) and modules & {"mlp", "moe"}):
            return "--recompute-modules with dropout (megatron-core replays no recomputed " \
                   "dropout in a graph)"
    if getattr(args, "num_experts", None) is not None and not static_dispatch(args):
        return "the MoE layers' dispatch reads token counts on the host, which no graph " \
               "captures (a static dispatch, --moe-expert-rank-capacity-factor or " \
               "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity, does not)"
    return ""


def local_graphs(args) -> Tuple[str, List[str], str]:
    """``(--cuda-graph-impl, --cuda-graph-modules, the note)`` that replace Transformer Engine's
    per-layer graphs: megatron-core's ``local`` graphs where they capture this run's layers,
    with the asked scopes they honour, else none."""
    asked = _scope_names(args)
    given = "--cuda-graph-impl transformer_engine" + (f" (scopes {' '.join(asked)})" if asked else "")
    blocker = _graph_blocker(args)
    if blocker:
        return "none", [], f"{given} -> none: {blocker}"
    why_not = {scope: _why_not_local(args, scope, asked) for scope in asked}
    why_not = {scope: why for scope, why in why_not.items() if why}
    kept = [scope for scope in asked if scope not in why_not]
    scopes_by_reason = {}
    for scope, why in why_not.items():
        scopes_by_reason.setdefault(why, []).append(scope)
    reasons = "; ".join(f"{', '.join(scopes)}: {why}" for why, scopes in scopes_by_reason.items())
    if asked and not kept:
        return "none", [], f"{given} -> none ({reasons})"
    note = f"{given} -> local (megatron-core's per-layer graphs, each captured layer whole"
    note += f"; scopes {' '.join(kept)})" if kept else ")"
    if why_not:
        note += f", without {', '.join(why_not)} ({reasons})"
    return "local", kept, note


def _why_not_local(args, scope: str, asked: List[str]) -> str:
    """Why megatron-core's local graphs cannot take ``scope`` here ("" when they can)."""
    if scope not in LOCAL_LAYER_SCOPES:
        return "local graphs capture no part of a layer"
    if scope == "mlp" and getattr(args, "num_experts", None) is not None:
        if _every_layer_moe(args):
            return "megatron-core takes scope mlp only where a layer is dense"
        if "attn" not in asked:
            return "local graphs take an MoE layer's MLP only with its attention"
    return ""


def _is_fp32(value) -> bool:
    return str(value) in ("fp32", "torch.float32")


def _dtype_flag(name: str, value) -> str:
    return f"{flag_name(name)} {str(value).replace('torch.', '')}"


def _host_optimizer(args) -> bool:
    """Upstream's host-offload optimizer path (also OffloadStreamAdamW's): not Transformer
    Engine's FusedAdam, and checked by its own rules."""
    return bool(getattr(args, "optimizer_cpu_offload", False)
                or getattr(args, "offload_stream_optimizer", False))


def _lower_moments(args) -> List[str]:
    """The moment dtype flags below fp32, as given."""
    return [_dtype_flag(name, getattr(args, name)) for name in MOMENT_DTYPE_FLAGS
            if not _is_fp32(getattr(args, name, "fp32"))]


def _precision_aware_here(args) -> bool:
    """Whether ``--use-precision-aware-optimizer`` asks for what runs without Transformer
    Engine: fp32 master weights and gradients, moments in fp32 or bf16, not on the host."""
    return (bool(getattr(args, "use_precision_aware_optimizer", False)) and not _host_optimizer(args)
            and all(_is_fp32(getattr(args, name, "fp32")) for name in FUSED_ADAM_ONLY_DTYPES)
            and all(moment_dtype(getattr(args, name, "fp32")) is not None
                    for name in MOMENT_DTYPE_FLAGS))


def moment_dtypes(args):
    """``(exp_avg dtype, exp_avg_sq dtype)`` that MomentDtypeAdamW keeps for this run, or None
    (moments in fp32, or kept by the host optimizers)."""
    if _host_optimizer(args) or not _lower_moments(args):
        return None
    return tuple(moment_dtype(getattr(args, name)) for name in MOMENT_DTYPE_FLAGS)


def check_optimizer_dtypes(args) -> None:
    """Refuse the optimizer dtypes only Transformer Engine's FusedAdam keeps: master weights and
    gradients below fp32, moments other than fp32 and bf16 (torch's optimizers keep the state in
    the parameters' dtype; MomentDtypeAdamW keeps bf16 moments inside the distributed
    optimizer)."""
    if _host_optimizer(args):
        return
    lower = [_dtype_flag(name, getattr(args, name)) for name in FUSED_ADAM_ONLY_DTYPES
             if not _is_fp32(getattr(args, name, "fp32"))]
    lower += [_dtype_flag(name, getattr(args, name)) for name in MOMENT_DTYPE_FLAGS
              if moment_dtype(getattr(args, name, "fp32")) is None]
    if lower:
        raise BoundedArgumentError(
            f"{', '.join(lower)} needs Transformer Engine's FusedAdam (--use-precision-aware-"
            "optimizer), which is not installed: keep --main-grads-dtype and --main-params-dtype "
            "at fp32 and give --exp-avg-dtype / --exp-avg-sq-dtype as fp32 or bf16 (bf16 moments "
            "run here, inside the distributed optimizer).")
    lower = _lower_moments(args)
    if lower and getattr(args, "optimizer", "adam") != "adam":
        raise BoundedArgumentError(
            f"{', '.join(lower)} sets Adam's moments: --optimizer {args.optimizer} has none; "
            "remove the flags or use --optimizer adam.")
    if lower and getattr(args, "optimizer_cuda_graph", False):
        raise BoundedArgumentError(
            f"{', '.join(lower)} with --optimizer-cuda-graph: the bf16 moments' AdamW reads its "
            "step count on the host, which no graph captures; remove --optimizer-cuda-graph.")
    if lower and not getattr(args, "use_distributed_optimizer", False):
        raise BoundedArgumentError(
            f"{', '.join(lower)} keeps Adam's moments in bf16 inside the distributed optimizer: "
            "add --use-distributed-optimizer (or leave the moments at fp32).")


def set_on_command_line(argv: Sequence[str], parser: argparse.ArgumentParser,
                        values: Dict[str, object]) -> List[str]:
    """``argv`` with every flag that sets an attribute of ``values`` taken off (each spelling,
    with its values), then the flags that give it that value appended: a switch only when on, a
    value unless None or empty."""
    actions = {}
    for action in parser._actions:  # argparse keeps no public table of the flags by attribute
        if action.dest in values and action.option_strings:
            actions.setdefault(action.dest, []).append(action)
    argv = list(argv)
    for dest_actions in actions.values():
        for action in dest_actions:
            argv = _without(argv, action)
    for dest, value in values.items():
        if dest in actions:
            argv += _flag_tokens(actions[dest][0], value)
    return argv


def _is_value(token: str) -> bool:
    if not token.startswith("-"):
        return True
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return False
    return True


def _without(argv: List[str], action: argparse.Action) -> List[str]:
    kept, index = [], 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token.split("=", 1)[0] not in action.option_strings:
            kept.append(token)
            continue
        if "=" in token or action.nargs == 0:
            continue
        if action.nargs in ("*", "+"):
            while index < len(argv) and _is_value(argv[index]):
                index += 1
        else:
            index += 1 if action.nargs is None else int(action.nargs)
    return kept


def _flag_tokens(action: argparse.Action, value) -> List[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag] if value and value != action.default else []
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [flag, *(str(item) for item in values)]
