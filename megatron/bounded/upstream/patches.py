"""The registry of every run-time change this project makes to upstream megatron-core.

Each :class:`Patch` names the upstream attribute it replaces and is written against exactly the
release in :data:`megatron.bounded.UPSTREAM_VERSION`; :func:`apply_patches` refuses any other. The
replacements live beside this module, grouped by what they patch; docs/architecture.md ("Run-time
changes to upstream objects") tabulates them with their reasons, guards and tests.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable

from megatron.bounded import UPSTREAM_VERSION
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


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="prebuilt-dataset-helpers",
        module="megatron.core.datasets.utils",
        attribute="compile_helpers",
        make_replacement=use_prebuilt_dataset_helpers,
    ),
    Patch(
        name="torch-adam-state-before-first-step",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.state_dict",
        make_replacement=initialize_torch_adam_state_before_first_step,
    ),
    Patch(
        name="torch-adam-state-at-construction",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.__init__",
        make_replacement=allocate_torch_adam_state_at_construction,
    ),
    Patch(
        name="separate-adam-step-counters-after-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.load_state_dict",
        make_replacement=separate_adam_step_counters_after_load,
    ),
    Patch(
        name="unsaved-optimizer-states-on-fully-reshardable-load",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer._set_main_param_and_optimizer_states",
        make_replacement=skip_unsaved_optimizer_states,
    ),
    Patch(
        name="device-arch-without-a-gpu",
        module="megatron.training.arguments",
        attribute="get_device_arch_version",
        make_replacement=device_arch_without_a_gpu,
    ),
    Patch(
        name="needed-capacity-factor-on-rerun",
        module="megatron.core.transformer.moe.paged_stash",
        attribute="PagedStashRunner.prepare_for_rerun",
        make_replacement=report_needed_capacity_factor,
    ),
    Patch(
        name="escaped-help-texts",
        module="megatron.training.argument_utils",
        attribute="ArgumentGroupFactory._get_field_docstrings",
        make_replacement=escape_help_percent_signs,
    ),
    Patch(
        name="grouped-gemm-validation-without-a-gpu",
        module="megatron.training.arguments",
        attribute="validate_args",
        make_replacement=validate_grouped_gemm_without_a_gpu,
    ),
    Patch(
        name="fused-rotary-embedding",
        module="megatron.core.transformer.attention",
        attribute="apply_rotary_pos_emb",
        make_replacement=fused_rotary_embedding,
    ),
    Patch(
        name="grad-norm-in-one-transfer",
        module="megatron.core.optimizer.clip_grads",
        attribute="l2_norm_impl",
        make_replacement=multi_tensor_fallback("l2_norm"),
    ),
    Patch(
        name="grad-clip-scale-foreach",
        module="megatron.core.optimizer.clip_grads",
        attribute="multi_tensor_scale_impl",
        make_replacement=multi_tensor_fallback("scale"),
    ),
    Patch(
        name="optimizer-copy-scale-foreach",
        module="megatron.core.optimizer.optimizer",
        attribute="multi_tensor_scale_impl",
        make_replacement=multi_tensor_fallback("scale"),
    ),
    Patch(
        name="linear-without-tensor-parallelism",
        module="megatron.core.tensor_parallel.layers",
        attribute="linear_with_grad_accumulation_and_async_allreduce",
        make_replacement=linear_without_tensor_parallelism,
    ),
    Patch(
        name="copy-to-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="copy_to_tensor_model_parallel_region",
        make_replacement=identity_without_tensor_parallelism,
    ),
    Patch(
        name="reduce-from-one-rank-region-is-identity",
        module="megatron.core.tensor_parallel.layers",
        attribute="reduce_from_tensor_model_parallel_region",
        make_replacement=identity_without_tensor_parallelism,
    ),
    Patch(
        name="checkpoint-without-output-fp8-off-without-te",
        module="megatron.core.tensor_parallel.random",
        attribute="CheckpointWithoutOutput.__init__",
        make_replacement=fp8_off_without_transformer_engine,
    ),
    Patch(
        name="mtp-block-from-bounded-spec",
        module="megatron.training.models.gpt",
        attribute="mtp_block_spec",
        make_replacement=mtp_block_from_bounded_spec,
    ),
    Patch(
        name="progress-log",
        module="megatron.training.training",
        attribute="train_step",
        make_replacement=log_progress,
    ),
    Patch(
        name="checkpoint-manifest-after-save",
        module="megatron.training.training",
        attribute="save_checkpoint",
        make_replacement=checkpoint_manifest_after_save,
    ),
    Patch(
        name="checkpoint-manifest-after-async-save",
        module="megatron.training.checkpointing",
        attribute="schedule_async_save",
        make_replacement=checkpoint_manifest_when_async_save_completes,
    ),
    Patch(
        name="verify-checkpoint-before-load",
        module="megatron.training.checkpointing",
        attribute="_load_base_checkpoint",
        make_replacement=verify_checkpoint_before_load,
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
