#!/usr/bin/env python
"""Pretrain a GPT (dense or Mixture-of-Experts) with megatron-core and megatron-bounded.

Drop-in for Megatron-LM's ``pretrain_gpt.py``: launch it with ``torchrun`` and the usual Megatron
flags, plus this project's flags (``--help-bounded`` lists only those; ``--help`` all, ours under
"megatron-bounded"). Without
Transformer Engine it runs on stock PyTorch: the defaults switch to the local implementation with
SDPA attention (see README.md).

Flow: parse and validate the flags (upstream's, then ours, before any GPU allocation; the data's
files, --save, --load and the shape of the checkpoint resumed from are checked too) → build
``BoundedTransformerConfig`` (``BoundedMLATransformerConfig`` with ``--multi-latent-attention``)
and a ``GPTModelConfig`` whose layer spec comes from
``megatron.bounded.model.specs`` → upstream ``pretrain()`` with the dataset provider and forward step
below.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from functools import partial

import torch

from megatron.bounded import budget
from megatron.bounded.training import cuda_graphs, progress
from megatron.bounded.upstream import patches
from megatron.bounded.launch import run_summary
from megatron.bounded.launch.arguments import (
    HELP_FLAG, BoundedArgumentError, RunSettings, add_bounded_args, bounded_help,
    check_flags_before_upstream, hand_over_optimizer, note_substitution, recheck, refuse,
    replace_refused_flags, validate_bounded_args, with_this_gpu_memory,
)

patches.apply_patches()

from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training import get_args, get_tokenizer, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from megatron.training.utils.common_utils import get_blend_and_blend_per_split  # noqa: E402

from megatron.bounded.training import checkpoint_integrity, resiliency  # noqa: E402
from megatron.bounded.training.resume_check import check_model_shape  # noqa: E402
from megatron.bounded.loss.ring_dtp import labels_for_loss  # noqa: E402
from megatron.bounded.launch.planning import plan_command_line, plan_for_stated_host  # noqa: E402
from megatron.bounded.activations.sco import CheckpointOffload, SCOSettings, allocator_advice  # noqa: E402
from megatron.bounded.attention.documents import document_source, documents_of_batch  # noqa: E402
from megatron.bounded.launch.model_config import build_model_config  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator, document_source=None):
    """Next micro-batch on this rank's GPU and its documents (``DocumentParams``, or None when
    attention spans the whole sequence). Every rank reads its own iterator (the dataset
    provider is distributed-aware), so tensor-parallel peers need no broadcast. With context
    parallelism, the ranks of a CP group read the same sequences and each keeps its zigzag
    share of the tokens (upstream's split; the attention exchanges the rest, and the documents
    are those of the whole sequences)."""
    batch = next(data_iterator)
    # from the loader's host tensors: the boundaries are found without waiting for the GPU
    documents = documents_of_batch(batch, document_source, get_tokenizer().eod)
    batch = {key: batch[key].cuda(non_blocking=True) for key in BATCH_KEYS}
    if documents is not None:
        documents = documents.to(batch["tokens"].device)
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(
            batch, False, cp_group=parallel_state.get_context_parallel_group()
        )
    return batch, documents


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses, the token count, and the report upstream averages."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.view(1).float()])
    return loss_sum, num_tokens, {"lm loss": report}


class ActivationOffload:
    """SCO around each micro-batch forward (``--sco-host-budget-gb``), or nothing.

    One ``CheckpointOffload`` serves every step, so its pinned buffers are reused. The first
    micro-batch's figures are printed once: when the next forward starts (its backward is done),
    or when training ends if there was no second forward (one micro-batch, one iteration).
    """

    def __init__(self, settings: SCOSettings):
        self.offload = CheckpointOffload(settings.host_budget_bytes) if settings.enabled else None
        self.forwards = 0
        self.reported = False
        advice = allocator_advice(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        if self.offload is not None and torch.cuda.is_available() and advice:
            print_rank_0(f"[bounded] note: {advice}")

    def context(self):
        if self.offload is None:
            return nullcontext()
        self.forwards += 1
        if self.forwards == 2:
            self.report_once()
        return self.offload

    def figures(self) -> dict:
        """SCO's counters for the TensorBoard log (handed to the progress meter:
        ``ThroughputMeter.add_figures``)."""
        stats = self.offload.stats
        return {
            "sco_offloaded_boundaries": stats["offloaded_boundaries"],
            "sco_offloaded_gib": stats["offloaded_bytes"] / 1024**3,
            "sco_max_restored_on_device": stats["max_restored_on_device"],
        }

    def report_once(self) -> None:
        if self.offload is None or self.forwards == 0 or self.reported:
            return
        self.reported = True
        stats = self.offload.stats
        print_rank_0(
            f"[bounded] SCO: {stats['offloaded_boundaries']} of {stats['boundaries_seen']} "
            f"checkpoint boundaries ({stats['offloaded_bytes'] / 1024**3:.2f} GiB) of one "
            f"micro-batch offloaded to host (budget "
            f"{self.offload.host_budget_bytes / 1024**3:.2f} GiB); at most "
            f"{stats['max_restored_on_device']} restored on the GPU at once in backward"
        )


class ForwardStep:
    """Upstream's forward-step contract, (per-token loss tensor, loss function), with this run's
    SCO (``activation_offload``), with --ring-dtp the ``output_processor`` that replaces the
    output layer + cross-entropy, and with packed documents where their boundaries come from
    (``document_source``)."""

    def __init__(self, activation_offload: ActivationOffload, output_processor=None,
                 document_source=None):
        self.activation_offload = activation_offload
        self.output_processor = output_processor
        self.document_source = document_source

    def __call__(self, data_iterator, model):
        batch, documents = get_batch(data_iterator, self.document_source)
        processor = self.output_processor
        extra = {} if processor is None else {"output_processor": processor}
        labels = batch["labels"]
        if processor is not None and processor.grad_in_forward:
            labels = labels_for_loss(labels, batch["loss_mask"])
        with self.activation_offload.context():
            output_tensor = model(
                batch["tokens"], batch["position_ids"], attention_mask=None, labels=labels,
                packed_seq_params=documents, **extra,
            )
        return output_tensor, partial(loss_func, batch["loss_mask"])


def gpt_dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        inter_document_masking=args.dataloader_inter_document_masking,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock data with ``--mock-data``, else indexed datasets from ``--data-path`` & co."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation, and test datasets ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, gpt_dataset_config(args)
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# every rank builds its own loader: no tensor-parallel broadcast of batches is needed
train_valid_test_datasets_provider.is_distributed = True


def print_at_launch(message: str) -> None:
    """Print once per job before torch.distributed is up (every rank runs this code)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def plan_memory(args, settings: RunSettings) -> RunSettings:
    """--memory-budget-check, before any GPU allocation; the run's settings (with
    --chunked-recompute-keep-attention auto placed). A plan that does not fit with
    --memory-budget-check error (the default) gets the refusal of a bad flag: one
    ``[bounded] error:`` with the table, exit status 2."""
    try:
        return _plan_memory(args, settings)
    except (BoundedArgumentError, budget.MemoryBudgetError) as error:
        refuse(error)


def _plan_memory(args, settings: RunSettings) -> RunSettings:
    settings = with_this_gpu_memory(settings)
    if settings.chunked_attention.chunked_recompute_keep_attention == "auto":
        placed, why = budget.place_kept_attention(budget.BudgetConfig.from_args(args, settings))
        print_at_launch(f"[bounded] {placed.chunked_attention.placed_text(why)}")
        settings = recheck(args, settings.replace(chunked_attention=placed.chunked_attention))
    plan = budget.launch_check(args, settings)
    first = plan.details.get("first_iteration_peak")
    first_note = (f"; the first iteration {first / 1024**3:.1f} GiB, before the streamed "
                  f"optimizer's staging exists" if first and first != plan.peak_allocated else "")
    print_at_launch(
        f"[bounded] memory budget: peak allocated {plan.peak_allocated / 1024**3:.1f} GiB "
        f"predicted ({plan.details.get('peak_phase') or 'sum of terms'}{first_note}); with the CUDA context "
        f"and fragmentation allowance {plan.total / 1024**3:.1f} GiB of "
        f"{plan.hbm_bytes / 1024**3:.1f} GiB per GPU "
        f"({'fits' if plan.feasible else 'DOES NOT FIT'}; dominant term: {plan.dominant})"
    )
    return settings


def parse_flags():
    """The parsed and validated flags and the run's settings. The command line is parsed once
    before upstream's parse: choices upstream refuses on every stack are replaced, the planner's
    flags are appended (``--bounded-plan auto``, the default: upstream then validates what will
    run; a plan that cannot fit is refused here), and a refused flag gets one message, before
    upstream's argument table."""
    if HELP_FLAG in sys.argv[1:]:
        print(bounded_help())
        raise SystemExit(0)
    argv, replaced = replace_refused_flags(sys.argv[1:])
    parsed = check_flags_before_upstream(argv)
    plan_for_stated_host(parsed, None)  # --budget-host-gb, else this host's RAM
    try:
        argv, plan_line = plan_command_line(argv, plan_off=parsed.bounded_plan == "off")
    except BoundedArgumentError as error:
        refuse(error)
    if plan_line:
        print_at_launch(plan_line)
    sys.argv = [sys.argv[0], *argv]
    args = parse_and_validate_args(extra_args_provider=add_bounded_args)
    for note in replaced:
        note_substitution(args, note)
    try:
        settings = validate_bounded_args(args)
        check_model_shape(args)  # the sizes upstream's validation and tokenizer derived
    except BoundedArgumentError as error:
        refuse(error)
    return args, settings


def main():
    args, settings = parse_flags()
    settings = plan_memory(args, settings)
    print_at_launch(run_summary.describe(settings.view_of(args)))
    activation_offload = ActivationOffload(settings.sco)
    hand_over_optimizer(args, settings)
    output_processor = settings.ring_dtp.loss() if settings.ring_dtp.enabled else None
    forward_step = ForwardStep(activation_offload, output_processor, document_source(args))
    model_config = build_model_config(args, settings)
    meter = progress.meter_from_args(args, settings.progress)
    if activation_offload.offload is not None:
        meter.add_figures(activation_offload.figures)
    progress.configure(meter)
    # Upstream leaves train() through sys.exit() for --exit-interval, --exit-duration-in-mins and
    # --exit-signal-handler (SystemExit), so the cleanup runs in `finally`: on those exits, on a
    # normal return and on an error alike; the SystemExit and its code then go on unchanged.
    run, run_kwargs = resiliency.wrap_for_inprocess_restart(pretrain, args)
    try:
        run(
            pretrain_cfg_container_from_args(args, model_config),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            **run_kwargs,
        )
    finally:
        finish_training(activation_offload)


def finish_training(activation_offload: ActivationOffload) -> None:
    """What must run however pretrain() ends, while the process group is still up."""
    checkpoint_integrity.wait()  # the last checkpoint's integrity manifest is on disk
    cuda_graphs.release_full_iteration_graphs()  # before NCCL's teardown, or the exit can hang
    activation_offload.report_once()  # a one-micro-batch run has had no second forward to print it


if __name__ == "__main__":
    main()
