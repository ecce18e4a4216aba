"""The registry of every run-time change this project makes to upstream megatron-core.

Each :class:`Patch` names the upstream attribute it replaces and is written against exactly the
release in :data:`megatron.bounded.UPSTREAM_VERSION`; :func:`apply_patches` refuses any other. Each
also records its provenance: its kind, why it exists, the line of that release it changes, the
upstream report or fix where one is known, and when it can be removed. The replacements live
beside this module, grouped by what they patch; docs/architecture.md ("Run-time changes to
upstream objects") holds the table ``python tools/patch_table.py`` renders from this registry.
Changes made to single upstream objects (an instance's method, a config's fields around one
call) are the other half of the registry, :data:`megatron.bounded.object_changes.OBJECT_CHANGES`,
which every layer can reach; its :class:`PatchKind` is the kinds of both.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable

from megatron.bounded import UPSTREAM_VERSION
from megatron.bounded.object_changes import PatchKind, object_change
from megatron.bounded.upstream.arguments import (
    device_arch_without_a_gpu,
    escape_help_percent_signs,
    validate_grouped_gemm_without_a_gpu,
)
from megatron.bounded.upstream.checkpointing import (
    checkpoint_manifest_after_save,
    checkpoint_manifest_when_async_save_completes,
    verify_checkpoint_before_load,
)
from megatron.bounded.upstream.datasets import use_prebuilt_dataset_helpers
from megatron.bounded.upstream.layers import (
    fused_rotary_embedding,
    identity_without_tensor_parallelism,
    linear_without_tensor_parallelism,
)
from megatron.bounded.upstream.models import mtp_block_from_bounded_spec
from megatron.bounded.upstream.recompute import fp8_off_without_transformer_engine
from megatron.bounded.upstream.optimizer import (
    allocate_torch_adam_state_at_construction,
    initialize_torch_adam_state_before_first_step,
    multi_tensor_fallback,
    separate_adam_step_counters_after_load,
    skip_unsaved_optimizer_states,
)
from megatron.bounded.upstream.training_loop import log_progress, report_needed_capacity_factor

PATCH_MARKER = "__megatron_bounded_patch__"


@dataclass(frozen=True)
class Patch:
    """One run-time replacement of an upstream module attribute, with its provenance."""

    name: str
    module: str
    attribute: str  # dotted path inside the module, e.g. "Class.method"
    make_replacement: Callable[[Callable], Callable]  # original -> replacement
    kind: PatchKind
    why: str  # one sentence
    # "megatron/...py:LINE" in the installed release UPSTREAM_VERSION: the def of the function or
    # method when ``module`` defines it, else the import or assignment that binds the name there.
    location: str
    upstream_link: str  # the upstream issue or pull request, "" where none is known
    removable_when: str

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


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers",
        module="megatron.core.datasets.utils",
        attribute="compile_helpers",
        make_replacement=use_prebuilt_dataset_helpers,
        kind=PatchKind.BUG_FIX,
        why=(
            "Upstream runs `make` in the installed package to build the dataset index helpers, but "
            "the wheel ships them compiled and without a Makefile, so the step only checks that "
            "the compiled extension imports."
        ),
        location="megatron/core/datasets/utils.py:20",
        upstream_link="",
        removable_when=(
            "when megatron-core's `compile_helpers` uses the compiled `helpers_cpp` a wheel ships "
            "instead of running `make`"
        ),
    ),
    Patch(
        name="torch-adam-state-before-first-step",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.state_dict",
        make_replacement=initialize_torch_adam_state_before_first_step,
        kind=PatchKind.BUG_FIX,
        why=(
            "Without Apex or Transformer Engine the inner optimizer is torch's AdamW, which has no "
            "`step` before its first step, and upstream asserts on it while building a "
            "checkpoint's template (no run could resume), so the state of step 0 is given first."
        ),
        location="megatron/core/optimizer/distrib_optimizer.py:825",
        upstream_link="",
        removable_when=(
            "when megatron-core's `DistributedOptimizer.state_dict` takes a torch AdamW that has "
            "not stepped yet"
        ),
    ),
    Patch(
        name="torch-adam-state-at-construction",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.__init__",
        make_replacement=allocate_torch_adam_state_at_construction,
        kind=PatchKind.HOOK,
        why=(
            "The distributed optimizer's construction is where this project completes its inner "
            "optimizer: torch AdamW's state of step 0 (the first iteration's peak is the steady "
            "state's), the moment dtypes of `--exp-avg-dtype` / `--exp-avg-sq-dtype` "
            "(`MomentDtypeAdamW`) and OffloadStreamAdamW's page-locked host state (not seconds of "
            "the first step)."
        ),
        location="megatron/core/optimizer/distrib_optimizer.py:633",
        upstream_link="",
        removable_when=(
            "when megatron-core's `DistributedOptimizer` allocates torch AdamW's state at "
            "construction and takes the inner optimizer's moment dtypes and host-state allocation "
            "from its caller"
        ),
    ),
    Patch(
        name="separate-adam-step-counters-after-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.load_state_dict",
        make_replacement=separate_adam_step_counters_after_load,
        kind=PatchKind.BUG_FIX,
        why=(
            "Upstream's load gives every parameter's torch AdamW state one shared `step` tensor, "
            "which torch increments in place once per parameter, so the bias corrections went "
            "wrong after a resume; each parameter gets its own counter holding the loaded step."
        ),
        location="megatron/core/optimizer/distrib_optimizer.py:887",
        upstream_link="",
        removable_when=(
            "when the pinned megatron-core's `DistributedOptimizer.load_state_dict` gives each "
            "parameter its own `step` tensor"
        ),
    ),
    Patch(
        name="unsaved-optimizer-states-on-fully-reshardable-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer._set_main_param_and_optimizer_states",
        make_replacement=skip_unsaved_optimizer_states,
        kind=PatchKind.BUG_FIX,
        why=(
            "A fully-reshardable checkpoint leaves `step` out of each parameter's saved tensors "
            "but upstream reads it (`KeyError: 'step'`), so an absent tensor reads as nothing "
            "saved, which the method already skips."
        ),
        location="megatron/core/optimizer/distrib_optimizer.py:1193",
        upstream_link="",
        removable_when=(
            "when the pinned megatron-core's `_set_main_param_and_optimizer_states` skips the "
            "states a fully-reshardable checkpoint does not save"
        ),
    ),
    Patch(
        name="device-arch-without-a-gpu",
        module="megatron.training.arguments",
        attribute="get_device_arch_version",
        make_replacement=device_arch_without_a_gpu,
        kind=PatchKind.BUG_FIX,
        why=(
            "With tensor or context parallelism upstream's flag validation asks the GPU for its "
            "architecture, so the memory budget and `DRY_RUN=1` could not check such flags on a "
            "machine without one; without CUDA the answer is the planning architecture (9)."
        ),
        location="megatron/training/arguments.py:34",
        upstream_link="",
        removable_when=(
            "when megatron-core's `validate_args` validates tensor- and context-parallel flags "
            "without a GPU"
        ),
    ),
    Patch(
        name="needed-capacity-factor-on-rerun",
        module="megatron.core.transformer.moe.paged_stash",
        attribute="PagedStashRunner.prepare_for_rerun",
        make_replacement=report_needed_capacity_factor,
        kind=PatchKind.HOOK,
        why=(
            "Upstream logs that a paged-stash step went over its dispatch budget but not by how "
            "much; before the rerun the largest slab demand of this project's dispatchers is "
            "logged as the capacity factor that would have dropped nothing."
        ),
        location="megatron/core/transformer/moe/paged_stash.py:1087",
        upstream_link="",
        removable_when=(
            "when megatron-core's paged-stash rerun reports the capacity factor a step needed"
        ),
    ),
    Patch(
        name="escaped-help-texts",
        module="megatron.training.argument_utils",
        attribute="ArgumentGroupFactory._get_field_docstrings",
        make_replacement=escape_help_percent_signs,
        kind=PatchKind.BUG_FIX,
        why=(
            "argparse %-formats the help texts upstream takes from config-field docstrings, and "
            'the bare `%` of `moe_paged_stash_buffer_size_factor_cuda`\'s ("10%)") made `--help` '
            "fail, so every bare `%` is doubled."
        ),
        location="megatron/training/argument_utils.py:233",
        upstream_link="https://github.com/NVIDIA/Megatron-LM/pull/6211",
        removable_when=(
            "when the pinned megatron-core has that docstring escaped and no config-field docstring "
            "has a bare `%`"
        ),
    ),
    Patch(
        name="grouped-gemm-validation-without-a-gpu",
        module="megatron.training.arguments",
        attribute="validate_args",
        make_replacement=validate_grouped_gemm_without_a_gpu,
        kind=PatchKind.BUG_FIX,
        why=(
            "With `--moe-grouped-gemm` upstream's validation reads the GPU's compute capability, "
            "so such flags could not be checked on a machine without one; without CUDA the "
            "validation reads the planning architecture (9)."
        ),
        location="megatron/training/arguments.py:388",
        upstream_link="",
        removable_when=(
            "when megatron-core's `validate_args` validates `--moe-grouped-gemm` without a GPU"
        ),
    ),
    Patch(
        name="fused-rotary-embedding",
        module="megatron.core.transformer.attention",
        attribute="apply_rotary_pos_emb",
        make_replacement=fused_rotary_embedding,
        kind=PatchKind.SPEED,
        why=(
            "Without Transformer Engine's fusion upstream rotates with a dozen small eager "
            "kernels; where `fused_rotary_supported` holds it takes one kernel each way, bitwise "
            "upstream's."
        ),
        location="megatron/core/transformer/attention.py:19",
        upstream_link="",
        removable_when="when megatron-core fuses the rotary embedding without Transformer Engine",
    ),
    Patch(
        name="grad-norm-in-one-transfer",
        module="megatron.core.optimizer.clip_grads",
        attribute="l2_norm_impl",
        make_replacement=multi_tensor_fallback("l2_norm"),
        kind=PatchKind.SPEED,
        why=(
            "Without Apex or Transformer Engine upstream's gradient norm copies each gradient's "
            "norm to the host on its own (a device synchronization per parameter, every step); the "
            "same norms come over in one transfer."
        ),
        location="megatron/core/optimizer/clip_grads.py:45",
        upstream_link="",
        removable_when=(
            "when megatron-core's `local_multi_tensor_l2_norm` reads the norms to the host in one "
            "transfer"
        ),
    ),
    Patch(
        name="grad-clip-scale-foreach",
        module="megatron.core.optimizer.clip_grads",
        attribute="multi_tensor_scale_impl",
        make_replacement=multi_tensor_fallback("scale"),
        kind=PatchKind.SPEED,
        why=(
            "Without Apex or Transformer Engine upstream's gradient clipping scales each gradient "
            "with two operations; the same products come from torch's foreach operations."
        ),
        location="megatron/core/optimizer/clip_grads.py:46",
        upstream_link="",
        removable_when=(
            "when megatron-core's `local_multi_tensor_scale` uses torch's foreach operations"
        ),
    ),
    Patch(
        name="optimizer-copy-scale-foreach",
        module="megatron.core.optimizer.optimizer",
        attribute="multi_tensor_scale_impl",
        make_replacement=multi_tensor_fallback("scale"),
        kind=PatchKind.SPEED,
        why=(
            "Without Apex or Transformer Engine the optimizer's tensor copies scale each tensor "
            "with two operations; the same values come from torch's foreach operations."
        ),
        location="megatron/core/optimizer/optimizer.py:38",
        upstream_link="",
        removable_when=(
            "when megatron-core's `local_multi_tensor_scale` uses torch's foreach operations"
        ),
    ),
    Patch(
        name="linear-without-tensor-parallelism",
        module="megatron.core.tensor_parallel.layers",
        attribute="linear_with_grad_accumulation_and_async_allreduce",
        make_replacement=linear_without_tensor_parallelism,
        kind=PatchKind.SPEED,
        why=(
            "A call with no tensor or sequence parallelism, fusion, deferred weight gradients or "
            "autocast runs the same matrix products without upstream's autograd bookkeeping, "
            "bitwise upstream's."
        ),
        location="megatron/core/tensor_parallel/layers.py:755",
        upstream_link="",
        removable_when=(
            "when megatron-core's linear function skips its tensor-parallel bookkeeping for such "
            "calls"
        ),
    ),
    Patch(
        name="copy-to-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="copy_to_tensor_model_parallel_region",
        make_replacement=identity_without_tensor_parallelism,
        kind=PatchKind.SPEED,
        why=(
            "With one tensor-parallel rank the region is the identity, so the tensor itself is "
            "returned instead of an autograd node per layer and micro-batch."
        ),
        location="megatron/core/tensor_parallel/layers.py:39",
        upstream_link="",
        removable_when=(
            "when megatron-core's tensor-parallel regions return their input for a group of one "
            "rank"
        ),
    ),
    Patch(
        name="reduce-from-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="reduce_from_tensor_model_parallel_region",
        make_replacement=identity_without_tensor_parallelism,
        kind=PatchKind.SPEED,
        why=(
            "With one tensor-parallel rank the region is the identity, so the tensor itself is "
            "returned instead of an autograd node per layer and micro-batch."
        ),
        location="megatron/core/tensor_parallel/layers.py:42",
        upstream_link="",
        removable_when=(
            "when megatron-core's tensor-parallel regions return their input for a group of one "
            "rank"
        ),
    ),
    Patch(
        name="checkpoint-without-output-fp8-off-without-te",
        module="megatron.core.tensor_parallel.random",
        attribute="CheckpointWithoutOutput.__init__",
        make_replacement=fp8_off_without_transformer_engine,
        kind=PatchKind.TE_FREE_PATH,
        why=(
            "Upstream's output-discarding checkpoint (selective recompute of `layernorm` and "
            "`moe_act`) reads its default `fp8=False` as on and then asks Transformer Engine for "
            "the fp8 state (`NameError` without it), so without Transformer Engine it runs its "
            "plain path."
        ),
        location="megatron/core/tensor_parallel/random.py:739",
        upstream_link="",
        removable_when=(
            "when megatron-core's `CheckpointWithoutOutput` runs without Transformer Engine"
        ),
    ),
    Patch(
        name="mtp-block-from-bounded-spec",
        module="megatron.training.models.gpt",
        attribute="mtp_block_spec",
        make_replacement=mtp_block_from_bounded_spec,
        kind=PatchKind.HOOK,
        why=(
            "Upstream builds the multi-token-prediction layers from its own layer specs whatever "
            "the model's spec is, which would give this project's local-implementation models "
            "upstream's s × s attention and MoE layer there, so they are built from "
            "`bounded_mtp_block_spec`."
        ),
        location="megatron/training/models/gpt.py:387",
        upstream_link="",
        removable_when=(
            "when megatron-core builds the multi-token-prediction block from the model config's "
            "layer spec"
        ),
    ),
    Patch(
        name="progress-log",
        module="megatron.training.training",
        attribute="train_step",
        make_replacement=log_progress,
        kind=PatchKind.HOOK,
        why=(
            "Each training step feeds the throughput meter of the progress line "
            "(`training.progress`); arguments and results pass through unchanged."
        ),
        location="megatron/training/training.py:2336",
        upstream_link="",
        removable_when=(
            "when megatron-core's training loop calls back after each step with its results"
        ),
    ),
    Patch(
        name="checkpoint-manifest-after-save",
        module="megatron.training.training",
        attribute="save_checkpoint",
        make_replacement=checkpoint_manifest_after_save,
        kind=PatchKind.HOOK,
        why=(
            "After upstream's synchronous save each rank hashes its files into its part of the "
            "checkpoint's checksum manifest in a background thread (an asynchronous save starts it "
            "when it completes)."
        ),
        location="megatron/training/training.py:142",
        upstream_link="",
        removable_when=(
            "when megatron-core's checkpoint save calls back once every rank's files are written"
        ),
    ),
    Patch(
        name="checkpoint-manifest-after-async-save",
        module="megatron.training.checkpointing",
        attribute="schedule_async_save",
        make_replacement=checkpoint_manifest_when_async_save_completes,
        kind=PatchKind.HOOK,
        why=(
            "An asynchronous save gets a last finalize step that starts the checksum manifest once "
            "every rank has written its files."
        ),
        location="megatron/training/checkpointing.py:47",
        upstream_link="",
        removable_when=(
            "when megatron-core's checkpoint save calls back once every rank's files are written"
        ),
    ),
    Patch(
        name="verify-checkpoint-before-load",
        module="megatron.training.checkpointing",
        attribute="_load_base_checkpoint",
        make_replacement=verify_checkpoint_before_load,
        kind=PatchKind.HOOK,
        why=(
            "The checkpoint directory is verified against its manifest before upstream reads it "
            "(unless `--no-verify-checkpoint`), the ranks agree on whether the load failed, and an "
            "optimizer state saved with the other MoE expert class is refused."
        ),
        location="megatron/training/checkpointing.py:1633",
        upstream_link="",
        removable_when=(
            "when megatron-core's checkpoint load calls back before it reads a checkpoint and "
            "fails on every rank together"
        ),
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
    change = object_change("offload-stream-host-optimizer")
    optimizer_class = offload_stream_hybrid_optimizer_class(bucket_numel, num_slots)
    for module, attribute in HYBRID_DEVICE_OPTIMIZER_BINDINGS:
        owner = importlib.import_module(module)
        bound = getattr(owner, attribute)  # present in the release checked above
        if bound is not HybridDeviceOptimizer and bound is not optimizer_class:
            raise RuntimeError(
                f"{module}.{attribute} is already bound to {bound!r}; refusing to replace it"
            )
        change.set(owner, **{attribute: optimizer_class})
    return optimizer_class


def is_applied(patch: Patch) -> bool:
    return getattr(patch.target(), PATCH_MARKER, None) == patch.name
