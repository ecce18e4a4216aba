"""Which MoE backend runs, and the MoE settings that cannot run.

:func:`select_moe_backend` picks the dispatcher and experts from a config (or parsed flags):

* ``bounded_moe_backend`` (optional field, default ``"auto"``): ``"torch"`` forces the
  torch-native static-capacity dispatcher, ``"upstream"`` forces upstream's dispatcher;
* ``"auto"``: torch-native when PipelinedLLEP is on, or when ``moe_expert_rank_capacity_factor``
  is set and upstream's own static-capacity backend cannot run (it needs
  ``moe_token_dispatcher_type == "flex"`` with ``moe_flex_dispatcher_backend`` ``"hybridep"`` /
  ``"ncclep"``, Transformer Engine, and for HybridEP DeepEP's ``HybridEPBuffer``), or, with the
  local implementation, when a flex dispatcher's backend is not installed or
  ``moe_grouped_gemm`` is set (:func:`explain_moe_backend` says which case applies).

:func:`check_moe_capacity_and_paged_stash` is the one home of the capacity-factor and
paged-stash checks. ``BoundedTransformerConfig.__post_init__`` runs it on every model config and
``validate_bounded_args`` on the parsed flags, so a bad combination fails before any GPU
allocation with the flag to change.

This module imports megatron-core only inside :func:`upstream_static_capacity_available`, so the
argument and config layers can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.bounded.settings import BoundedArgumentError, Settings, flag_name, knob

__all__ = [
    "BACKEND_FIELD",
    "MoEBackendSettings",
    "explain_moe_backend",
    "missing_flex_dispatcher_backend",
    "select_moe_backend",
    "static_capacity_factor",
    "static_dispatch",
    "upstream_static_capacity_available",
    "check_moe_capacity_and_paged_stash",
    "moe_layer_pattern",
]

# Optional config field that overrides the automatic backend choice.
BACKEND_FIELD = "bounded_moe_backend"
_VALID_BACKENDS = ("auto", "torch", "upstream")


@dataclass
class MoEBackendSettings(Settings):
    """Which MoE dispatcher and experts run. Not frozen: the model config inherits the field."""

    EARLY = False  # after the Transformer Engine substitutions of validate_bounded_args

    bounded_moe_backend: str = knob(
        "auto", "MoE dispatcher and experts: torch (static-capacity all-to-all, grouped experts), "
        "upstream (megatron-core's), or auto (torch where upstream's path cannot run).",
        choices=_VALID_BACKENDS)

    def check(self, args) -> None:
        """The capacity-factor and paged-stash settings (upstream's flags) that cannot run."""
        from megatron.bounded.moe.dispatch.token_dispatcher import check_capacity_flags

        check_capacity_flags(args, BoundedArgumentError)
        check_moe_capacity_and_paged_stash(args)
        check_deterministic_experts(args)


def upstream_static_capacity_available(config) -> bool:
    """Whether upstream's own static-capacity MoE path (HybridEP / NCCL-EP + TE) can run."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return False
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError:  # pragma: no cover - the module exists in megatron-core 0.19.2
        HAVE_TE = False
    if not HAVE_TE:
        return False
    if backend == "hybridep":
        from megatron.core.transformer.moe.fused_a2a import HAVE_HYBRIDEP

        return bool(HAVE_HYBRIDEP)
    return backend == "ncclep"


def missing_flex_dispatcher_backend(config) -> Optional[str]:
    """Why the flex dispatcher's backend cannot be built here; None when it can, or when no flex
    dispatcher is asked for."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return None
    from megatron.core.transformer.moe import fused_a2a

    needs = {
        "deepep": ("HAVE_DEEP_EP", "DeepEP (deep_ep) is not installed"),
        "hybridep": ("HAVE_HYBRIDEP", "DeepEP's HybridEPBuffer (deep_ep) is not installed"),
        "ncclep": ("HAVE_TE_EP", "Transformer Engine's EP module is not installed"),
    }
    backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
    if backend not in needs:
        return None
    available, why = needs[backend]
    return None if getattr(fused_a2a, available, False) else why


def explain_moe_backend(config) -> Tuple[str, str]:
    """(``"torch"`` or ``"upstream"``, why): the backend :func:`select_moe_backend` picks."""
    choice = getattr(config, BACKEND_FIELD, "auto") or "auto"
    if choice not in _VALID_BACKENDS:
        raise ValueError(f"{BACKEND_FIELD} must be one of {_VALID_BACKENDS}, got {choice!r}")
    if choice != "auto":
        return choice, f"{BACKEND_FIELD} {choice}"
    if getattr(config, "pipelined_llep", False):
        # PipelinedLLEP is built on the torch-native slabs and grouped experts
        return "torch", "PipelinedLLEP runs on the torch-native dispatcher"
    factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if factor is not None and not upstream_static_capacity_available(config):
        return "torch", "a rank capacity factor without upstream's HybridEP/NCCL-EP + TE path"
    if getattr(config, "transformer_impl", "local") == "local":
        # What upstream's local implementation cannot run itself: a flex dispatcher whose
        # backend is not installed fails when the layer is built, and --moe-grouped-gemm is
        # ignored (its local spec builds SequentialMLP).
        missing = missing_flex_dispatcher_backend(config)
        if missing is not None:
            return "torch", f"the flex dispatcher cannot run: {missing}"
        if getattr(config, "moe_grouped_gemm", False):
            return "torch", "grouped GEMM with the local implementation"
    return "upstream", "upstream's default"


def select_moe_backend(config) -> str:
    """``"torch"`` (our static-capacity dispatcher) or ``"upstream"``."""
    return explain_moe_backend(config)[0]


def moe_layer_pattern(freq, num_layers: int, num_experts) -> Tuple[bool, ...]:
    """Which decoder layers are MoE layers, as upstream's layer specs read ``--moe-layer-freq``:
    an int (every freq-th layer, starting with layer 0) or a list of 0/1 per layer; none
    without experts."""
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


def static_capacity_factor(config) -> Optional[float]:
    """The factor that sizes the torch-native dispatcher's static slabs: the rank capacity factor,
    else, padded to the experts' capacity, ``moe_expert_capacity_factor``; None where the MoE
    layers do not dispatch with sizes fixed before the step (no token count read on the host)."""
    if select_moe_backend(config) != "torch" or getattr(config, "pipelined_llep", False):
        return None
    from megatron.bounded.moe.dispatch.token_dispatcher import pads_to_expert_capacity

    factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if factor is None and pads_to_expert_capacity(config):
        factor = config.moe_expert_capacity_factor
    return factor


def static_dispatch(config) -> bool:
    """Whether the MoE layers dispatch with sizes fixed before the step."""
    return static_capacity_factor(config) is not None


def check_moe_capacity_and_paged_stash(config) -> None:
    """Capacity-factor and paged-stash settings that cannot run; ``config`` is args or a config.

    Upstream validates some of these only for its HybridEP path and others not at all; with the
    torch-native backend they are checked here. ``validate_bounded_args`` calls it on the parsed
    flags and ``BoundedTransformerConfig.__post_init__`` on the config; the messages name the
    flags.
    """
    factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    paged_stash = getattr(config, "moe_paged_stash", False)
    factor_flag = flag_name("moe_expert_rank_capacity_factor")
    stash_flag = flag_name("moe_paged_stash")
    if factor is not None and not factor > 0:
        raise BoundedArgumentError(
            f"{factor_flag} must be a positive number of expected loads per expert rank "
            f"(e.g. 1.5), got {factor}; omit it for dropless MoE."
        )
    page_size = getattr(config, "moe_paged_stash_page_size", 64)
    if paged_stash and not page_size > 0:
        raise BoundedArgumentError(
            f"{flag_name('moe_paged_stash_page_size')} must be a positive number of tokens "
            f"(default 64), got {page_size}."
        )
    if paged_stash and factor is None:
        raise BoundedArgumentError(
            f"{stash_flag} needs {factor_flag}: pages are sized from the static per-rank token "
            f"budget. Add e.g. {factor_flag} 1.5, or drop {stash_flag}."
        )
    if paged_stash and getattr(config, "cpu_offloading", False):
        # upstream's validation turns cpu_offloading on from --cpu-offloading-num-layers
        raise BoundedArgumentError(
            f"{stash_flag} cannot be combined with --cpu-offloading-num-layers (CPU offloading): "
            "remove one of them."
        )
    if paged_stash and getattr(config, "recompute_granularity", None) == "full":
        raise BoundedArgumentError(
            f"{stash_flag} cannot be combined with {flag_name('recompute_granularity')} full: the "
            "expert forward would run twice per micro-batch, which the stash schedule does not "
            "support. Use selective recompute (without 'moe') or drop the stash."
        )
    recompute_modules = getattr(config, "recompute_modules", None) or []
    if (
        paged_stash
        and getattr(config, "recompute_granularity", None) == "selective"
        and "moe" in recompute_modules
    ):
        raise BoundedArgumentError(
            f"{stash_flag} cannot be combined with {flag_name('recompute_modules')} moe (the expert "
            "forward would run twice): remove 'moe' from the recompute modules."
        )
    if getattr(config, "num_moe_experts", getattr(config, "num_experts", None)) is None:
        return
    backend = getattr(config, "bounded_moe_backend", "auto")
    if backend == "upstream" and factor is not None and not upstream_static_capacity_available(config):
        raise BoundedArgumentError(
            f"{flag_name('bounded_moe_backend')} upstream with {factor_flag} needs upstream's "
            "HybridEP (DeepEP) or NCCL-EP backend with Transformer Engine, which is not available "
            f"here. Use {flag_name('bounded_moe_backend')} torch (or auto)."
        )
    if select_moe_backend(config) == "torch":
        from megatron.bounded.moe.dispatch.token_dispatcher import check_expert_tensor_parallel

        # an unset expert TP is the tensor-parallel size (upstream's validation and config)
        check_expert_tensor_parallel(
            getattr(config, "expert_tensor_parallel_size", None)
            or getattr(config, "tensor_model_parallel_size", 1), BoundedArgumentError)
    _check_padding_and_shared_overlap(config)
    _check_no_expert_biases(config)


def _check_padding_and_shared_overlap(config) -> None:
    """Upstream's drop-and-pad and shared-expert overlap flags that cannot run: the padding
    without a capacity to pad to, upstream's overlap without the dispatchers that hold it."""
    if getattr(config, "moe_pad_expert_input_to_capacity", False) and getattr(
            config, "moe_expert_capacity_factor", None) is None:
        raise BoundedArgumentError(
            f"{flag_name('moe_pad_expert_input_to_capacity')} pads each expert's input to its "
            f"capacity, which {flag_name('moe_expert_capacity_factor')} sets: add e.g. "
            f"{flag_name('moe_expert_capacity_factor')} 1.0, or drop the padding."
        )
    overlap_dispatchers = ("alltoall", "flex")
    if (select_moe_backend(config) == "upstream" and getattr(config, "moe_shared_expert_overlap", False)
            and getattr(config, "moe_token_dispatcher_type", None) not in overlap_dispatchers):
        raise BoundedArgumentError(
            f"{flag_name('moe_shared_expert_overlap')} with upstream's MoE backend needs "
            f"{flag_name('moe_token_dispatcher_type')} alltoall or flex (its overlap hooks live in "
            f"those dispatchers), not {config.moe_token_dispatcher_type}: pass "
            f"{flag_name('moe_token_dispatcher_type')} alltoall, or {flag_name('bounded_moe_backend')} torch "
            "(shared experts on a side stream)."
        )


def _check_no_expert_biases(config) -> None:
    """The torch-native backend's grouped experts have no biases (their build would raise)."""
    if select_moe_backend(config) == "torch" and getattr(config, "add_bias_linear", False):
        raise BoundedArgumentError(
            "the torch-native MoE backend's grouped experts have no biases, and linear layers "
            "have biases (megatron-core's default; --disable-bias-linear turns them off): pass "
            "--disable-bias-linear, or --bounded-moe-backend upstream without the options that "
            "need the torch-native backend (--pipelined-llep, --moe-expert-rank-capacity-factor)."
        )


def check_deterministic_experts(args) -> None:
    """Upstream's experts (``SequentialMLP``) with ``--bias-swiglu-fusion`` run a torch.compile'd
    weighted SwiGLU that Inductor compiles once per shape seen first and once dynamically, and the
    two kernels sum in different orders: a resumed run would then differ from the uninterrupted
    one in the last bits. Like upstream's deterministic-mode checks, refuse rather than change
    the flag."""
    if not (args.deterministic_mode and args.num_experts and args.swiglu and args.bias_swiglu_fusion):
        return
    if select_moe_backend(args) == "upstream":
        raise BoundedArgumentError(
            "--deterministic-mode with upstream's MoE experts needs --no-bias-swiglu-fusion: the "
            "compiled fused weighted SwiGLU reduces in an order that depends on the shapes compiled "
            "earlier in the process, so a resumed run would not reproduce the uninterrupted one bit "
            "for bit. Pass --no-bias-swiglu-fusion (our torch-native experts, selected by "
            "--moe-expert-rank-capacity-factor, are not affected)."
        )
