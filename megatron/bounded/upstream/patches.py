"""The only place where this project changes upstream megatron-core behaviour at run time.

Each patch names the upstream symbol it replaces, says why, and is written against exactly the
megatron-core release in :data:`megatron.bounded.UPSTREAM_VERSION`; :func:`apply_patches` refuses
to run on another release (the symbols may have moved or changed meaning). Every patch has a unit
test in ``tests/unit/test_patches.py`` that its target exists and one that the replacement
behaves (there, or beside the tests of the module it calls, e.g. ``tests/unit/test_linear.py``).

Patches:

``megatron.core.datasets.utils.compile_helpers``
    Upstream's start-up (``megatron.training.initialize._compile_dependencies``) runs ``make`` on
    the dataset index helpers on rank 0. The PyPI wheel ships the compiled extension
    (``helpers_cpp``) but no Makefile, so ``make`` fails and rank 0 exits. The replacement checks
    that the prebuilt extension imports and does nothing else; the caller's barrier is kept.

``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict``
    Without Apex or Transformer Engine the distributed optimizer wraps ``torch.optim.AdamW``,
    whose per-parameter state (including ``step``) only exists after the first step. Loading a
    distributed checkpoint builds the state-dict template from a fresh optimizer and upstream
    then asserts on the missing ``step`` (distrib_optimizer.py:839), so no run could resume. The
    replacement first gives a fresh optimizer the state it will have at step 0 (zero moments
    via upstream's own ``init_state_fn``, ``step`` 0 placed as torch places it); the loaded
    checkpoint then overwrites all of it.

``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__``
    The same step-0 state is given at construction, so the moments (8 bytes per parameter this
    rank updates) exist from the first iteration on instead of appearing in the first step: a
    plan whose steady state does not fit runs out of memory in its first iteration, and the first
    iteration's peak is the steady-state peak the memory budget predicts. Torch's Adam
    initializes exactly this state lazily, so training is bitwise unchanged.

``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict``
    On the same torch-AdamW path, loading gives every parameter's state the *same* ``step`` tensor
    object (distrib_optimizer.py:1028-1033). torch increments each parameter's ``step`` in place,
    so after a resume the shared counter advanced once per parameter per step and the bias
    corrections were wrong from the first step after loading (measured: a resumed run matched the
    uninterrupted one at the first iteration after the checkpoint and diverged from the second).
    The dp_reshardable load may also hand back a step tensor captured while its template was
    built (holding 0). The replacement gives each parameter a fresh counter holding the step
    upstream loaded into the param groups.

``megatron.core.optimizer.HybridDeviceOptimizer`` and
``megatron.core.optimizer.distrib_optimizer.HybridDeviceOptimizer`` (only with
``--offload-stream-optimizer``, through :func:`use_offload_stream_optimizer`)
    Upstream builds its host-offload optimizer from the first name and the distributed optimizer
    rebuilds it over its shards from the second (distrib_optimizer.py:778-781). Both are bound to
    :class:`megatron.bounded.optimizer.distributed.OffloadStreamHybridOptimizer`, a subclass, so
    every ``isinstance`` branch of the distributed optimizer and its checkpoint format still apply.

``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states``
    Loading a ``--dist-ckpt-optim-fully-reshardable`` checkpoint on the torch-AdamW path hands
    this method each parameter's saved tensors without ``step`` (upstream leaves it out on
    purpose, distrib_optimizer.py:2390, since the step is restored from the param groups), but
    the method then reads every tensor of the parameter's current state, ``step`` included
    (distrib_optimizer.py:1223), and raises ``KeyError: 'step'``: no such checkpoint could be
    resumed, and it is the format that resumes across expert classes. The replacement reads an
    absent key as "nothing saved", which the method already skips; the step is then restored as
    for every other checkpoint (``load_state_dict`` below and above).

``megatron.training.arguments.get_device_arch_version``
    Upstream's argument validation asks the first GPU for its architecture whenever tensor or
    context parallelism is on (before Blackwell it requires ``CUDA_DEVICE_MAX_CONNECTIONS=1``), so
    ``tools/memory_budget.py`` and the examples' ``DRY_RUN=1`` could not check such a plan on a
    machine without a GPU. Without CUDA the replacement answers :data:`PLANNING_DEVICE_ARCH`
    (Hopper, the H200 the budget assumes by default); with CUDA it asks the GPU as before.

``megatron.core.transformer.moe.paged_stash.PagedStashRunner.prepare_for_rerun``
    Upstream's runner logs that a step went over its dispatch budget ("Consider increasing
    moe_expert_rank_capacity_factor") but not by how much: only the dispatcher knows. Before the
    rerun clears the dispatchers' state, the wrapper reads the factor each of our static-capacity
    dispatchers needed (their ``slab_demand``), takes the largest over the layers and ranks
    (one all-reduce; every rank reruns, so every rank is here) and logs it on rank 0. Other
    dispatchers (upstream's HybridEP) are skipped; the rerun itself is upstream's. Each rerun is
    also counted (``paged_stash_reruns`` in :func:`megatron.bounded.training.progress.figures`).

``megatron.training.argument_utils.ArgumentGroupFactory._get_field_docstrings``
    Upstream turns the field docstrings of its config dataclasses into ``--help`` texts, which
    argparse then %-formats. megatron-core 0.19.2's docstring of
    ``moe_paged_stash_buffer_size_factor_cuda`` holds a bare "10%)", so ``pretrain_gpt.py --help``
    died with ``ValueError: unsupported format character ')'``. The replacement doubles every
    percent sign that is not already ``%%`` or a ``%(name)s`` field; the text shown is unchanged.

``megatron.training.arguments.validate_args``
    With ``--moe-grouped-gemm`` upstream asks the first GPU for its compute capability, so a
    script that passes the flag (Megatron-LM's Mixtral example does) could not be validated
    without a GPU (``tools/memory_budget.py``, the examples' ``DRY_RUN=1``). Without CUDA the
    replacement answers :data:`PLANNING_DEVICE_ARCH` for the duration of upstream's validation;
    with CUDA it is upstream's call unchanged.

``megatron.core.transformer.attention.apply_rotary_pos_emb`` (the attention module's binding)
    Without Transformer Engine upstream rotates queries and keys with its eager
    ``_apply_rotary_pos_emb_bshd``: about twelve small kernels forward and seven backward per
    tensor, in a launch-bound eager step a visible share of the host's time. Where
    :func:`megatron.bounded.attention.rotary.fused_rotary_supported` holds (CUDA with Triton, the
    non-interleaved rotation of the whole head dim, no packed sequences) and upstream's TE fusion
    is off, the replacement runs :func:`megatron.bounded.attention.rotary.apply_rotary`: one kernel each
    way, bitwise upstream's output and gradient. Every other call is upstream's, unchanged.

``megatron.core.optimizer.clip_grads.l2_norm_impl``,
``megatron.core.optimizer.clip_grads.multi_tensor_scale_impl`` and
``megatron.core.optimizer.optimizer.multi_tensor_scale_impl``
    Without Apex or Transformer Engine these are upstream's local fallbacks, which read each
    gradient's norm to the host separately (one device synchronization per parameter, every
    step) and scale gradients with two operations per parameter. They are replaced by
    :mod:`megatron.bounded.optimizer.multi_tensor`: one transfer for all the norms and one
    ``_foreach_mul_``, bitwise the same values. Where Apex or Transformer Engine provides the
    kernels they are kept (the replacement calls them).

``megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce``
    Upstream's linear layers run one autograd function for every kind of tensor parallelism; for
    a call with none (no tensor or sequence parallelism, no gradient-accumulation fusion, no
    deferred weight gradients, no autocast) the replacement runs
    :func:`megatron.bounded.model.linear.linear`: the same operations in the same order without the
    bookkeeping and the autocast contexts, bitwise upstream's outputs and gradients. Every other
    call is upstream's, unchanged.

``megatron.core.tensor_parallel.layers.copy_to_tensor_model_parallel_region`` and
``megatron.core.tensor_parallel.layers.reduce_from_tensor_model_parallel_region``
    The linear layers pass their input (column-parallel) or output (row-parallel) through an
    autograd function that all-reduces in one direction; with one tensor-parallel rank both
    directions are the identity, and the two functions cost an autograd node each per layer
    and micro-batch. The replacements return the tensor itself when the group has one rank
    (the values and gradients upstream's identity gives) and call upstream's otherwise.

``megatron.training.training.train_step``
    Wrapped to feed :class:`megatron.bounded.training.progress.ThroughputMeter` (tokens/s/GPU, TFLOP/s/GPU,
    peak memory, exact per-iteration loss in ``--metrics-jsonl``). Arguments and return values
    pass through unchanged.

``megatron.training.training.save_checkpoint`` (the training loop's binding)
    Upstream writes no record of what a checkpoint's files held. The wrapper first waits for the
    previous checkpoint's integrity manifest (:mod:`megatron.bounded.training.checkpoint_manifest`), then
    runs upstream's save; once a synchronous save has returned (every rank's files are written
    by then) it starts this rank's manifest part in a background thread. For an asynchronous
    save it leaves the directory to the next patch. The save itself is upstream's, unchanged.

``megatron.training.checkpointing.schedule_async_save`` (the checkpointing module's binding)
    Adds a last finalize step to the asynchronous save request of a checkpoint, which starts the
    manifest once every rank has written its files (upstream runs the finalize steps after its
    completion check, on every rank); the request is upstream's otherwise.

``megatron.training.checkpointing._load_base_checkpoint``
    Before upstream reads anything of a checkpoint, the directory it will read (the same tracker
    file, ``--ckpt-step`` and non-persistent rules) is verified against its manifest on every
    rank, once per directory; a file that does not match raises
    :class:`~megatron.bounded.training.checkpoint_manifest.CheckpointIntegrityError` naming it
    (``--no-verify-checkpoint`` skips the check). The load itself is upstream's. Once upstream
    has read the checkpoint's common state, a distributed-optimizer state in a bucket format saved
    with the other MoE expert class (torch-native grouped vs upstream's) is refused: it would
    load without error into the wrong parameters (the weights themselves load across classes).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
import time
from dataclasses import dataclass
from typing import Callable

from megatron.bounded import UPSTREAM_VERSION

PATCH_MARKER = "__megatron_bounded_patch__"


@dataclass(frozen=True)
class Patch:
    """One run-time replacement of an upstream module attribute."""

    name: str
    module: str
    attribute: str  # dotted path inside the module, e.g. "Class.method"
    make_replacement: Callable[[Callable], Callable]  # original -> replacement

    def owner(self):
        """The module or class that holds the patched attribute (raises if missing)."""
        owner = importlib.import_module(self.module)
        for part in self.attribute.split(".")[:-1]:
            owner = self._get(owner, part)
        return owner

    def target(self):
        """The upstream object currently bound at ``module.attribute`` (raises if missing)."""
        return self._get(self.owner(), self.attribute.split(".")[-1])

    def install(self, replacement: Callable) -> None:
        setattr(self.owner(), self.attribute.split(".")[-1], replacement)

    def _get(self, owner, name: str):
        if not hasattr(owner, name):
            raise RuntimeError(
                f"megatron-bounded patch '{self.name}': {self.module}.{self.attribute} does not "
                f"exist in the installed megatron-core; this patch was written for "
                f"megatron-core=={UPSTREAM_VERSION}."
            )
        return getattr(owner, name)


def installed_upstream_version() -> str:
    return importlib.metadata.version("megatron-core")


def check_upstream_version() -> None:
    """Fail loudly when the installed megatron-core is not the release the patches target."""
    installed = installed_upstream_version()
    if installed != UPSTREAM_VERSION:
        raise RuntimeError(
            f"megatron-bounded patches upstream megatron-core at run time and was written for "
            f"megatron-core=={UPSTREAM_VERSION}, but {installed} is installed. Install the "
            f"supported release: pip install megatron-core=={UPSTREAM_VERSION}"
        )


def _use_prebuilt_dataset_helpers(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_helpers() -> None:
        # Importing proves the wheel's compiled extension loads; a broken install fails here with
        # the real ImportError instead of a confusing `make` error.
        importlib.import_module("megatron.core.datasets.helpers_cpp")

    return compile_helpers


def _give_fresh_torch_adam_state(optimizer) -> None:
    """Give a distributed optimizer over torch's Adam the state it has at step 0 (zero moments
    via upstream's own ``init_state_fn``, ``step`` 0 placed as torch places it) unless it has
    state already or runs Apex/TE's optimizer."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    inner = optimizer.optimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or optimizer.init_state_fn is None:
        return
    if not isinstance(inner, torch.optim.Adam) and not isinstance(inner, torch.optim.AdamW):
        return
    if any("step" in state for state in inner.state.values()):
        return
    optimizer.init_state_fn(inner, optimizer.config)
    for group in inner.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            inner.state[param]["step"] = torch.tensor(
                0.0, dtype=torch.float32, device=param.device if on_device else "cpu"
            )


def _initialize_torch_adam_state_before_first_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def state_dict(self):
        _give_fresh_torch_adam_state(self)
        return original(self)

    return state_dict


def _allocate_torch_adam_state_at_construction(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _give_fresh_torch_adam_state(self)

    return __init__


def _separate_adam_step_counters_after_load(original: Callable) -> Callable:
    import torch
    from megatron.core.optimizer import distrib_optimizer

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if distrib_optimizer.HAVE_APEX_OR_TE:
            return result
        # The loaded step lives in the param groups (distrib_optimizer.py:1026); the parameter
        # state may also have been handed back a step tensor captured earlier (the dp_reshardable
        # template), so every parameter gets a fresh counter holding the loaded value.
        steps = {group["step"] for group in state_dict["optimizer"]["param_groups"] if "step" in group}
        if len(steps) != 1:
            return result
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32, device=state["step"].device)
        return result

    return load_state_dict


class _AbsentIsNothing(dict):
    """Saved tensors of one parameter in which an absent key reads as None (not a tensor)."""

    def __missing__(self, key):
        return None


def _skip_unsaved_optimizer_states(original: Callable) -> Callable:
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, _AbsentIsNothing(tensors))

    return _set_main_param_and_optimizer_states


# Compute-capability major version assumed when validating flags without a GPU (H200: 9).
PLANNING_DEVICE_ARCH = 9


def _device_arch_without_a_gpu(original: Callable) -> Callable:
    import torch

    @functools.wraps(original)
    def get_device_arch_version() -> int:
        return original() if torch.cuda.is_available() else PLANNING_DEVICE_ARCH

    return get_device_arch_version


def _escape_help_percent_signs(original: Callable) -> Callable:
    import re

    # a "%%" pair or a "%(name)s" field stays as it is; any other "%" is doubled
    pattern = re.compile(r"%%|%\([^)]*\)[a-zA-Z]|%")

    def escape(text):
        if not isinstance(text, str):
            return text
        return pattern.sub(lambda match: match.group(0) if len(match.group(0)) > 1 else "%%", text)

    @functools.wraps(original)
    def _get_field_docstrings(self, *args, **kwargs):
        docstrings = original(self, *args, **kwargs)
        return {name: escape(text) for name, text in docstrings.items()}

    return _get_field_docstrings


def _validate_grouped_gemm_without_a_gpu(original: Callable) -> Callable:
    import torch

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if torch.cuda.is_available() or not getattr(args, "moe_grouped_gemm", False):
            return original(args, *rest, **kwargs)
        asked = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: (PLANNING_DEVICE_ARCH, 0)
        try:
            return original(args, *rest, **kwargs)
        finally:
            torch.cuda.get_device_capability = asked

    return validate_args


def _fused_rotary_embedding(original: Callable) -> Callable:
    from megatron.bounded.attention.rotary import apply_rotary, fused_rotary_supported

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        # None: upstream reads the MLA setting from the config; leave that case to upstream
        if (not config.apply_rope_fusion and mla_rotary_interleaved is not None
                and fused_rotary_supported(t, freqs, config.rotary_interleaved,
                                           mla_rotary_interleaved, cu_seqlens)):
            return apply_rotary(t, freqs, mscale)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                        cp_group=cp_group, mla_rotary_interleaved=mla_rotary_interleaved)

    return apply_rotary_pos_emb


def _multi_tensor_fallback(ours_name: str) -> Callable[[Callable], Callable]:
    """Replace upstream's local multi-tensor fallback by ``multi_tensor.<ours_name>``; leave
    Apex's or Transformer Engine's kernel (any other original) in place."""

    def make_replacement(original: Callable) -> Callable:
        from megatron.core import utils as upstream_utils

        from megatron.bounded.optimizer import multi_tensor

        fallbacks = (upstream_utils.local_multi_tensor_l2_norm,
                     upstream_utils.local_multi_tensor_scale)
        chosen = getattr(multi_tensor, ours_name) if original in fallbacks else original

        def replacement(*args):
            return chosen(*args)

        return replacement

    return make_replacement


def _linear_without_tensor_parallelism(original: Callable) -> Callable:
    from megatron.bounded.model.linear import linear, runs_lean

    @functools.wraps(original)
    def linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1,
    ):
        if runs_lean(input, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                     grad_output_buffer, gtp_remat_size):
            return linear(input, weight, bias)
        return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                        sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group,
                        gtp_remat_size)

    return linear_with_grad_accumulation_and_async_allreduce


def _identity_without_tensor_parallelism(original: Callable) -> Callable:
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    @functools.wraps(original)
    def region(input_, group=None):
        resolved = group if group is not None else get_tensor_model_parallel_group_if_none(None)
        if resolved is not None and resolved.size() == 1:
            return input_
        return original(input_, group)

    return region


def _log_progress(original: Callable) -> Callable:
    from megatron.bounded.training.progress import record_train_step

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        outputs = original(*args, **kwargs)
        record_train_step(outputs, kwargs.get("iteration"))
        return outputs

    return train_step


def _report_needed_capacity_factor(original: Callable) -> Callable:
    import logging

    import torch

    from megatron.bounded.training.progress import count

    logger = logging.getLogger("megatron.bounded.moe")

    @functools.wraps(original)
    def prepare_for_rerun(self, *args, **kwargs):
        count("paged_stash_reruns")  # every rank reruns: the counter is the same on all
        demands = [
            layer.token_dispatcher.slab_demand
            for layer in getattr(self, "moe_layers", [])
            if getattr(getattr(layer, "token_dispatcher", None), "slab_demand", None) is not None
        ]
        if demands:
            # on the dispatchers' device, so the default group's backend (NCCL or gloo) takes it
            largest = torch.stack(demands).amax().reshape(1)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            # rounded up to the hundredth, so the factor printed really fits the slab
            needed = math.ceil(float(largest.item()) * 100 - 1e-6) / 100
            factor = self.config.moe_expert_rank_capacity_factor
            on_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
            # a rerun for a stash overflow alone has no drop to explain
            if on_rank_0 and factor is not None and needed > factor:
                logger.info(
                    "Paged stash: the fullest static dispatch slab held %.2fx its even share of "
                    "routed rows this step; --moe-expert-rank-capacity-factor %.2f or more "
                    "would have dropped nothing (it is %s)", needed, needed, factor,
                )
        return original(self, *args, **kwargs)

    return prepare_for_rerun


def _checkpoint_manifest_after_save(original: Callable) -> Callable:
    import inspect

    from megatron.bounded.training import checkpoint_manifest

    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        from megatron.training.global_vars import get_args

        checkpoint_manifest.wait()  # the previous checkpoint's manifest is on disk first
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        options = get_args()
        directory = checkpoint_manifest.directory_for_save(
            options, call.arguments["iteration"], call.arguments["non_persistent_ckpt"],
            call.arguments["release"],
        )
        asynchronous = bool(getattr(options, "async_save", False))
        checkpoint_manifest.expect_async_save(directory if asynchronous else None)
        started = time.monotonic()
        try:
            result = original(*args, **kwargs)
        finally:
            checkpoint_manifest.expect_async_save(None)
        if directory is not None and not asynchronous:
            checkpoint_manifest.writer.start(directory, save_seconds=time.monotonic() - started)
        return result

    return save_checkpoint


def _checkpoint_manifest_when_async_save_completes(original: Callable) -> Callable:
    from megatron.bounded.training import checkpoint_manifest

    @functools.wraps(original)
    def schedule_async_save(async_request):
        checkpoint_manifest.on_async_save_scheduled(async_request)
        return original(async_request)

    return schedule_async_save


def _verify_checkpoint_before_load(original: Callable) -> Callable:
    from megatron.bounded.training import checkpoint_manifest

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, *rest, **kwargs):
        directory = checkpoint_manifest.directory_for_load(load_dir, args)
        if directory is not None:
            checkpoint_manifest.verify_before_load(
                directory, enabled=getattr(args, "verify_checkpoint", True)
            )
        result = original(load_dir, args, *rest, **kwargs)
        state_dict = result[0] if isinstance(result, tuple) and result else None
        if isinstance(state_dict, dict) and "args" in state_dict:
            from megatron.bounded.moe.experts import check_expert_layout_on_resume

            check_expert_layout_on_resume(
                state_dict["args"], args, state_dict.get("content_metadata")
            )
        return result

    return _load_base_checkpoint


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers",
        module="megatron.core.datasets.utils",
        attribute="compile_helpers",
        make_replacement=_use_prebuilt_dataset_helpers,
    ),
    Patch(
        name="torch-adam-state-before-first-step",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.state_dict",
        make_replacement=_initialize_torch_adam_state_before_first_step,
    ),
    Patch(
        name="torch-adam-state-at-construction",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.__init__",
        make_replacement=_allocate_torch_adam_state_at_construction,
    ),
    Patch(
        name="separate-adam-step-counters-after-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.load_state_dict",
        make_replacement=_separate_adam_step_counters_after_load,
    ),
    Patch(
        name="unsaved-optimizer-states-on-fully-reshardable-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer._set_main_param_and_optimizer_states",
        make_replacement=_skip_unsaved_optimizer_states,
    ),
    Patch(
        name="device-arch-without-a-gpu",
        module="megatron.training.arguments",
        attribute="get_device_arch_version",
        make_replacement=_device_arch_without_a_gpu,
    ),
    Patch(
        name="needed-capacity-factor-on-rerun",
        module="megatron.core.transformer.moe.paged_stash",
        attribute="PagedStashRunner.prepare_for_rerun",
        make_replacement=_report_needed_capacity_factor,
    ),
    Patch(
        name="escaped-help-texts",
        module="megatron.training.argument_utils",
        attribute="ArgumentGroupFactory._get_field_docstrings",
        make_replacement=_escape_help_percent_signs,
    ),
    Patch(
        name="grouped-gemm-validation-without-a-gpu",
        module="megatron.training.arguments",
        attribute="validate_args",
        make_replacement=_validate_grouped_gemm_without_a_gpu,
    ),
    Patch(
        name="fused-rotary-embedding",
        module="megatron.core.transformer.attention",
        attribute="apply_rotary_pos_emb",
        make_replacement=_fused_rotary_embedding,
    ),
    Patch(
        name="grad-norm-in-one-transfer",
        module="megatron.core.optimizer.clip_grads",
        attribute="l2_norm_impl",
        make_replacement=_multi_tensor_fallback("l2_norm"),
    ),
    Patch(
        name="grad-clip-scale-foreach",
        module="megatron.core.optimizer.clip_grads",
        attribute="multi_tensor_scale_impl",
        make_replacement=_multi_tensor_fallback("scale"),
    ),
    Patch(
        name="optimizer-copy-scale-foreach",
        module="megatron.core.optimizer.optimizer",
        attribute="multi_tensor_scale_impl",
        make_replacement=_multi_tensor_fallback("scale"),
    ),
    Patch(
        name="linear-without-tensor-parallelism",
        module="megatron.core.tensor_parallel.layers",
        attribute="linear_with_grad_accumulation_and_async_allreduce",
        make_replacement=_linear_without_tensor_parallelism,
    ),
    Patch(
        name="copy-to-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="copy_to_tensor_model_parallel_region",
        make_replacement=_identity_without_tensor_parallelism,
    ),
    Patch(
        name="reduce-from-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="reduce_from_tensor_model_parallel_region",
        make_replacement=_identity_without_tensor_parallelism,
    ),
    Patch(
        name="progress-log",
        module="megatron.training.training",
        attribute="train_step",
        make_replacement=_log_progress,
    ),
    Patch(
        name="checkpoint-manifest-after-save",
        module="megatron.training.training",
        attribute="save_checkpoint",
        make_replacement=_checkpoint_manifest_after_save,
    ),
    Patch(
        name="checkpoint-manifest-after-async-save",
        module="megatron.training.checkpointing",
        attribute="schedule_async_save",
        make_replacement=_checkpoint_manifest_when_async_save_completes,
    ),
    Patch(
        name="verify-checkpoint-before-load",
        module="megatron.training.checkpointing",
        attribute="_load_base_checkpoint",
        make_replacement=_verify_checkpoint_before_load,
    ),
)


def apply_patches() -> None:
    """Install every patch once (idempotent) after checking the upstream release."""
    check_upstream_version()
    for patch in PATCHES:
        original = patch.target()
        if getattr(original, PATCH_MARKER, None) == patch.name:
            continue
        replacement = patch.make_replacement(original)
        setattr(replacement, PATCH_MARKER, patch.name)
        patch.install(replacement)


def use_offload_stream_optimizer(bucket_numel: int, num_slots: int) -> type:
    """Bind OffloadStreamAdamW (as a HybridDeviceOptimizer subclass) where upstream builds its
    host-offload optimizer; returns the bound class. Idempotent for the same bucket plan."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from megatron.bounded.optimizer.distributed import (
        HYBRID_DEVICE_OPTIMIZER_BINDINGS,
        offload_stream_hybrid_optimizer_class,
    )

    check_upstream_version()
    optimizer_class = offload_stream_hybrid_optimizer_class(bucket_numel, num_slots)
    for module, attribute in HYBRID_DEVICE_OPTIMIZER_BINDINGS:
        bound = Patch("offload-stream-optimizer", module, attribute, lambda original: original).target()
        if bound is not HybridDeviceOptimizer and bound is not optimizer_class:
            raise RuntimeError(
                f"{module}.{attribute} is already bound to {bound!r}; refusing to replace it"
            )
        setattr(importlib.import_module(module), attribute, optimizer_class)
    return optimizer_class


def is_applied(patch: Patch) -> bool:
    return getattr(patch.target(), PATCH_MARKER, None) == patch.name
