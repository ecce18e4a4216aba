"""The registry of run-time changes this project makes to single upstream objects.

The patches of :mod:`megatron.bounded.upstream.patches` replace an attribute of an upstream
module or class for the whole process. The changes here are made by our code to one object at a
time, where it builds or meets that object: a method rebound on one instance, a config's fields
set around one upstream call, a copy of a config handed to upstream with a field changed, a
class swapped on one instance. Each :class:`ObjectChange` records the same provenance as a
``Patch`` (kind, why, the upstream line it is about, the upstream issue or fix, when it can be
removed) and the function of this package that applies it.

The applying code goes through its entry (``object_change(name).set(...)``, ``.hidden(...)``,
``.copy_with(...)``, or ``object_change(name)`` where it only reads the entry), so an entry
without its code, or code without its entry, fails ``tests/unit/upstream/test_patches.py``, which also
checks each ``location`` against the installed release. docs/architecture.md holds the table
``python tools/patch_table.py`` renders from :data:`OBJECT_CHANGES`. This module imports nothing
of the package, so every layer may use it.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum


class PatchKind(Enum):
    BUG_FIX = "bug fix"
    SPEED = "speed"
    TE_FREE_PATH = "TE-free path"  # a path megatron-core offers only with Transformer Engine
    HOOK = "hook"  # this project's behaviour attached where upstream has no extension point


@dataclass(frozen=True)
class ObjectChange:
    """One run-time change of single upstream objects, with its provenance."""

    name: str
    # "module:Qualname": the upstream function or class whose objects are changed, or which
    # reads what is changed
    upstream: str
    change: str  # what is changed, in a few words
    kind: PatchKind
    why: str  # one sentence
    # "megatron/...py:LINE" in the installed release UPSTREAM_VERSION: the def of ``upstream``
    location: str
    # "megatron/bounded/...py:Qualname" (or "pretrain_gpt.py:..."): the one function that applies it
    applied_in: str
    upstream_link: str  # the upstream issue or pull request, "" where none is known
    removable_when: str

    def set(self, obj, **attributes):
        """Set ``attributes`` on ``obj``; returns ``obj``."""
        for name, value in attributes.items():
            setattr(obj, name, value)
        return obj

    def copy_with(self, obj, **attributes):
        """A shallow copy of ``obj`` with ``attributes`` set (``obj`` is left as it is)."""
        return self.set(copy.copy(obj), **attributes)

    @contextmanager
    def hidden(self, obj, **attributes):
        """``attributes`` set on ``obj`` inside the block, its own values again after it (also
        when the block raises)."""
        given = {name: getattr(obj, name) for name in attributes}
        self.set(obj, **attributes)
        try:
            yield obj
        finally:
            self.set(obj, **given)


OBJECT_CHANGES: tuple[ObjectChange, ...] = (
    ObjectChange(
        name="local-spec-without-attention-variant",
        upstream="megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_layer_specs",
        change="a copy of the config with `experimental_attention_variant=None`",
        kind=PatchKind.TE_FREE_PATH,
        why=(
            "Upstream's local layer-spec builders assert that no experimental attention variant "
            "is set (its variants' specs are Transformer Engine's), so they are handed a copy "
            "without it and DSA's core attention and the gated DeltaNet mixers are put into the "
            "built spec afterwards."
        ),
        location="megatron/core/models/gpt/gpt_layer_specs.py:563",
        applied_in="megatron/bounded/model/specs.py:upstream_spec_config",
        upstream_link="",
        removable_when=(
            "when megatron-core's local layer specs take an experimental attention variant"
        ),
    ),
    ObjectChange(
        name="moe-layer-built-with-allgather-dispatcher",
        upstream="megatron.core.transformer.moe.moe_layer:MoELayer.__init__",
        change="the shared config's `moe_token_dispatcher_type` is `allgather` while upstream's "
               "constructor runs",
        kind=PatchKind.HOOK,
        why=(
            "Upstream's MoE layer builds its dispatcher from the config and has no slot for "
            "another, so on the torch-native backend it builds the cheapest one (allgather: no "
            "streams, no CUDA calls, where a flex type would build HybridEP) and "
            "`BoundedMoELayer` then puts the static-capacity dispatcher in its place."
        ),
        location="megatron/core/transformer/moe/moe_layer.py:221",
        applied_in="megatron/bounded/moe/moe_layer.py:BoundedMoELayer.__init__",
        upstream_link="",
        removable_when=(
            "when megatron-core's `MoESubmodules` takes the token dispatcher as a spec slot"
        ),
    ),
    ObjectChange(
        name="moe-layer-built-without-upstream-shared-expert-overlap",
        upstream="megatron.core.transformer.moe.moe_layer:MoELayer.__init__",
        change="the shared config's `moe_shared_expert_overlap` is False while upstream's "
               "constructor runs",
        kind=PatchKind.HOOK,
        why=(
            "Upstream's shared-expert overlap is a schedule of hooks inside its own dispatchers, "
            "which the static-capacity dispatcher does not have, so it is off while the layer is "
            "built and `BoundedMoELayer` runs the shared experts on a side stream itself."
        ),
        location="megatron/core/transformer/moe/moe_layer.py:221",
        applied_in="megatron/bounded/moe/moe_layer.py:BoundedMoELayer.__init__",
        upstream_link="",
        removable_when=(
            "when megatron-core's shared-expert overlap works with any `MoETokenDispatcher`"
        ),
    ),
    ObjectChange(
        name="hybridep-only-moe-checks-hidden",
        upstream="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
        change="`moe_expert_rank_capacity_factor`, `moe_paged_stash` and "
               "`moe_shared_expert_overlap` unset while upstream's checks run",
        kind=PatchKind.HOOK,
        why=(
            "Upstream ties the rank capacity factor to HybridEP/NCCL-EP, paged stash to that "
            "factor and the shared-expert overlap to its own dispatchers, which the torch-native "
            "backend replaces, so on that backend the three are hidden from upstream's checks "
            "(which all still run) and checked by `check_moe_capacity_and_paged_stash` instead."
        ),
        location="megatron/core/transformer/transformer_config.py:1294",
        applied_in="megatron/bounded/model/config.py:BoundedConfigChecks.__post_init__",
        upstream_link="",
        removable_when=(
            "when megatron-core's config checks accept the rank capacity factor, paged stash and "
            "shared-expert overlap for a dispatcher of its caller's choosing"
        ),
    ),
    ObjectChange(
        name="router-padding-left-to-the-dispatcher",
        upstream="megatron.core.transformer.moe.router:TopKRouter.routing",
        change="the model config's `moe_pad_expert_input_to_capacity` is False during one "
               "routing call",
        kind=PatchKind.HOOK,
        why=(
            "With the static-capacity dispatcher the padding to the experts' capacity is done "
            "by the dispatcher, so upstream's routing (which would add padding pairs) runs with "
            "the flag off in `ChunkedRoutingTopKRouter.routing`'s uncommon cases."
        ),
        location="megatron/core/transformer/moe/router.py:741",
        applied_in="megatron/bounded/moe/chunk_routing.py:ChunkedRoutingTopKRouter.routing",
        upstream_link="",
        removable_when=(
            "when megatron-core's router takes whether it pads from its caller instead of the "
            "shared config"
        ),
    ),
    ObjectChange(
        name="chunked-recompute-input-norm-in-qkv",
        upstream="megatron.core.transformer.transformer_layer:TransformerLayer._forward_attention",
        change="`forward` of the layer's `input_layernorm` and `self_attention.linear_qkv` "
               "instances rebound",
        kind=PatchKind.HOOK,
        why=(
            "Upstream's layer normalizes the whole sequence before the attention's QKV "
            "projection, so with `--chunked-recompute-tokens` the norm passes its input through "
            "while training and the projection applies it chunk by chunk, keeping upstream's "
            "parameter names and checkpoints."
        ),
        location="megatron/core/transformer/transformer_layer.py:583",
        applied_in=("megatron/bounded/activations/chunked_recompute.py:"
                    "ChunkedRecomputeTransformerLayer._fold_input_norm_into_qkv"),
        upstream_link="",
        removable_when=(
            "when megatron-core's layer offers a fused norm and QKV projection without "
            "Transformer Engine under upstream's parameter names"
        ),
    ),
    ObjectChange(
        name="chunked-attention-forward",
        upstream="megatron.core.transformer.attention:Attention.forward",
        change="`forward` of the layer's `self_attention` instance rebound",
        kind=PatchKind.HOOK,
        why=(
            "With `--chunked-recompute-attention` the attention sublayer of a training layer "
            "runs as one chunked node (`chunked_self_attention`) whose backward goes block by "
            "block; inference and evaluation call upstream's forward."
        ),
        location="megatron/core/transformer/attention.py:1278",
        applied_in=("megatron/bounded/activations/chunked_recompute.py:"
                    "ChunkedRecomputeTransformerLayer._chunk_attention"),
        upstream_link="",
        removable_when=(
            "when megatron-core's attention takes its forward schedule from the layer spec"
        ),
    ),
    ObjectChange(
        name="dsa-indexer-rotation-in-torch",
        upstream=("megatron.core.transformer.experimental_attention_variant.dsa:"
                  "DSAIndexer.forward_before_topk"),
        change="the indexer's own copy of the config with `dsa_indexer_rotate_activation=False`",
        kind=PatchKind.HOOK,
        why=(
            "Upstream's indexer rotates q and k with the `fast_hadamard_transform` package "
            "(bf16 only) when its config says so, so `BoundedDSAIndexer` hides the flag from it "
            "and rotates in PyTorch after upstream's step."
        ),
        location="megatron/core/transformer/experimental_attention_variant/dsa.py:1248",
        applied_in="megatron/bounded/model/dsa.py:BoundedDSAIndexer.__init__",
        upstream_link="",
        removable_when=(
            "when megatron-core's DSA indexer rotates without `fast_hadamard_transform`"
        ),
    ),
    ObjectChange(
        name="moment-dtype-adamw",
        upstream="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        change="the class of the distributed optimizer's torch AdamW set to `MomentDtypeAdamW`",
        kind=PatchKind.TE_FREE_PATH,
        why=(
            "Upstream keeps Adam's moments below fp32 (`--exp-avg-dtype`, `--exp-avg-sq-dtype`) "
            "only with Transformer Engine's FusedAdam, so without it the torch AdamW the "
            "distributed optimizer holds becomes a `MomentDtypeAdamW` in place (the object "
            "upstream holds stays the same one)."
        ),
        location="megatron/core/optimizer/distrib_optimizer.py:633",
        applied_in="megatron/bounded/optimizer/moment_dtype_adamw.py:use_moment_dtypes",
        upstream_link="",
        removable_when=(
            "when megatron-core keeps the moments in the dtypes of `--exp-avg-dtype` / "
            "`--exp-avg-sq-dtype` without Transformer Engine"
        ),
    ),
    ObjectChange(
        name="offload-stream-host-optimizer",
        upstream="megatron.core.optimizer.cpu_offloading.hybrid_optimizer:HybridDeviceOptimizer",
        change="the names `HybridDeviceOptimizer` of `megatron.core.optimizer` and "
               "`distrib_optimizer` bound to an `OffloadStreamHybridOptimizer` subclass",
        kind=PatchKind.HOOK,
        why=(
            "Upstream builds its host-offload optimizer from these two names and takes no class "
            "from its caller, so with `--offload-stream-optimizer` they name OffloadStreamAdamW "
            "as a `HybridDeviceOptimizer` subclass (refusing any other binding)."
        ),
        location="megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py:14",
        applied_in="megatron/bounded/upstream/patches.py:use_offload_stream_optimizer",
        upstream_link="",
        removable_when=(
            "when megatron-core's optimizer builder takes the host-offload optimizer class from "
            "its caller"
        ),
    ),
    ObjectChange(
        name="offload-stream-upstream-flags",
        upstream="megatron.training.training:get_megatron_optimizer_config",
        change="`optimizer_cpu_offload` and `use_precision_aware_optimizer` set on the parsed "
               "arguments after upstream's validation",
        kind=PatchKind.HOOK,
        why=(
            "Upstream selects its host-offload optimizer path (where "
            "`offload-stream-host-optimizer` binds our class) from these flags alone, so with "
            "`--offload-stream-optimizer` they are set, after `OffloadStreamSettings.check`, on "
            "the arguments its optimizer config is built from."
        ),
        location="megatron/training/training.py:1962",
        applied_in="megatron/bounded/launch/arguments.py:hand_over_optimizer",
        upstream_link="",
        removable_when=(
            "when megatron-core's optimizer builder takes the host-offload optimizer class from "
            "its caller"
        ),
    ),
    ObjectChange(
        name="ring-dtp-output-layer-shard",
        upstream="megatron.core.tensor_parallel.layers:ColumnParallelLinear.sharded_state_dict",
        change="the output layer's `weight` replaced by this rank's vocabulary rows and its "
               "`sharded_state_dict` rebound",
        kind=PatchKind.HOOK,
        why=(
            "With `--ring-dtp` each rank of the data × context-parallel ring keeps one "
            "vocabulary shard of the output layer, which upstream's layer cannot hold, and its "
            "checkpoint entry names that shard's place in the full weight."
        ),
        location="megatron/core/tensor_parallel/layers.py:1217",
        applied_in="megatron/bounded/loss/ring_dtp/output.py:shard_output_layer",
        upstream_link="",
        removable_when=(
            "when megatron-core's output layer can be sharded over the data-parallel ranks"
        ),
    ),
)


def object_change(name: str) -> ObjectChange:
    """The entry ``name`` of :data:`OBJECT_CHANGES` (KeyError naming the registry if none)."""
    for change in OBJECT_CHANGES:
        if change.name == name:
            return change
    raise KeyError(f"no run-time change '{name}' in megatron.bounded.object_changes.OBJECT_CHANGES")
