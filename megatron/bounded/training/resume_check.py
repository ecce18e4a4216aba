"""``--save``, ``--load`` and the checkpoint a run resumes from, checked at start-up (before the
model is built and the GPUs taken), each refusal naming the flag, the path and the fix.

- ``--save`` must be a directory the job can write, or one it can create (the nearest existing
  directory above it is writable); upstream finds out at the first save, ``--save-interval``
  iterations in.
- ``--load``: upstream starts from random weights, with one line in its log, when the directory
  holds no checkpoint or does not exist. That is kept, and said at start-up, where it is the
  expected first run of a job that resumes itself (``--load`` is the ``--save`` directory) or a
  directory made ahead of the run. It is refused where it cannot be meant: a ``--load`` that
  does not exist and is not ``--save`` (a mistyped path would train from scratch), ``--finetune``
  with nothing to load, and a tracker file or ``--ckpt-step`` naming a checkpoint that is not
  there or is not a checkpoint.
- The model's shape (:func:`check_model_shape`): the flags that size the model's tensors
  (:data:`SHAPE_FLAGS`) against the arguments the checkpoint saved (torch_dist's common state;
  for a checkpoint ``tools/convert_hf.py import`` wrote, also the flags of its
  ``pretrain_args.txt``), each flag that differs named with both values. ``--finetune``,
  ``--no-load-optim`` and ``--no-load-rng`` load the same weights: the shapes must match with them
  too. (Upstream compares three of these flags, after the model is built and not with
  ``--finetune``; torch_dist's load then fails on the first tensor of another shape.)
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from megatron.bounded.settings import BoundedArgumentError
from megatron.bounded.training.checkpoint_manifest import (
    TORCH_DIST_METADATA, CheckpointIntegrityError, read_tracker,
)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # the checkpoint directory of a tracker file that says "release"
MEGATRON_CONFIG = "metadata.json"  # megatron-core's record of a torch_dist checkpoint's format
LEGACY_PREFIX = "mp_rank_"  # the legacy torch format's directory per model-parallel rank
CONVERTED_ARGS_FILE = "pretrain_args.txt"  # tools/convert_hf.py import: the architecture's flags


def _is_remote(path: Optional[str]) -> bool:
    return bool(path) and "://" in path  # object storage: read by upstream's own client


def _same_directory(first: Optional[str], second: Optional[str]) -> bool:
    return bool(first and second) and os.path.realpath(first) == os.path.realpath(second)


# --------------------------------------------------------------------------------------------
# What a checkpoint directory holds
# --------------------------------------------------------------------------------------------


def not_a_checkpoint(directory: str) -> Optional[str]:
    """Why ``directory`` is not one checkpoint (None: it is one): a torch_dist checkpoint holds
    ``.metadata`` and ``metadata.json`` (torch_dcp ``.metadata`` alone), a legacy one an
    ``mp_rank_*`` directory."""
    try:
        names = set(os.listdir(directory))
    except OSError as error:
        return f"{directory} cannot be listed ({error.strerror or error})"
    if names & {TORCH_DIST_METADATA, MEGATRON_CONFIG} or any(
            name.startswith(LEGACY_PREFIX) for name in names):
        return None
    held = f"its {len(names)} entries" if names else "it is empty"
    return (f"{directory} is not a checkpoint: it has no {TORCH_DIST_METADATA} or "
            f"{MEGATRON_CONFIG} (a torch_dist checkpoint has both) and no {LEGACY_PREFIX}* "
            f"directory (a legacy one) among {held}")


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run will load: the flag and directory it comes from, and the checkpoint
    directory itself (``iter_NNNNNNN`` or ``release``)."""

    flag: str
    directory: str
    checkpoint: str


def _checkpoint_of(flag: str, directory: str, ckpt_step: Optional[int]) -> Optional[Resume]:
    """The checkpoint of ``directory`` its tracker file (or ``--ckpt-step``) names, checked to be
    there (None: the directory holds no checkpoint)."""
    tracker = os.path.join(directory, TRACKER_FILE)
    if ckpt_step:
        iteration, release, named_by = ckpt_step, False, f"--ckpt-step {ckpt_step}"
    elif os.path.isfile(tracker):
        try:
            iteration, release = read_tracker(tracker)
        except CheckpointIntegrityError as error:
            raise BoundedArgumentError(f"{flag} {directory}: {error}") from None
        named_by = f"its {TRACKER_FILE} ({RELEASE if release else iteration})"
    else:
        return None
    checkpoint = os.path.join(directory, RELEASE if release else f"iter_{iteration:07d}")
    if not os.path.isdir(checkpoint):
        raise BoundedArgumentError(
            f"{flag} {directory}: {named_by} names the checkpoint {checkpoint}, which does not "
            "exist: restore it, write the iteration of a checkpoint that exists into the tracker "
            "file, or pass --ckpt-step N of one."
        )
    why = not_a_checkpoint(checkpoint)
    if why is not None:
        raise BoundedArgumentError(
            f"{flag} {directory}: {named_by} names {why}: restore it from a copy, or load an "
            "earlier checkpoint (--ckpt-step N)."
        )
    return Resume(flag, directory, checkpoint)


# --------------------------------------------------------------------------------------------
# --save and --load, before upstream's validation
# --------------------------------------------------------------------------------------------


def check_save_directory(args: argparse.Namespace) -> None:
    """Refuse a ``--save`` this job cannot write, or cannot create."""
    save = getattr(args, "save", None)
    if not save or _is_remote(save):
        return
    target = os.path.abspath(save)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise BoundedArgumentError(
            f"--save {save} cannot be created: {existing} is a file. Name a directory path."
        )
    if os.access(existing, os.W_OK | os.X_OK):
        return
    if existing == target:
        raise BoundedArgumentError(
            f"--save {save} is not writable by this job: make it writable, or save elsewhere."
        )
    raise BoundedArgumentError(
        f"--save {save} does not exist and cannot be created: {existing}, the nearest directory "
        "above it that exists, is not writable by this job. Create the directory writable first, "
        "or save elsewhere."
    )


def check_load_directory(args: argparse.Namespace) -> Optional[str]:
    """Refuse a ``--load`` (or ``--pretrained-checkpoint``) that cannot be meant; returns the note
    for rank 0 to print when the run starts from scratch (None: it resumes, or loads nothing)."""
    load, save = getattr(args, "load", None), getattr(args, "save", None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if getattr(args, "non_persistent_ckpt_type", None) or _is_remote(load) or _is_remote(
            pretrained):
        return None  # loads from elsewhere too: left to upstream's load
    resume, note = None, None
    if load:
        resume, note = _load_flag(load, save, getattr(args, "ckpt_step", None), pretrained)
    if resume is None and pretrained:  # upstream then fine-tunes from --pretrained-checkpoint
        if not os.path.isdir(pretrained):
            raise BoundedArgumentError(f"--pretrained-checkpoint {pretrained} does not exist or "
                                       "is not a directory: fix the path.")
        resume = _checkpoint_of("--pretrained-checkpoint", pretrained, None)
        if resume is None:
            raise BoundedArgumentError(
                f"--pretrained-checkpoint {pretrained} holds no checkpoint (no {TRACKER_FILE}): "
                "name the directory tools/convert_hf.py import or a --save of pretrain_gpt.py "
                "wrote.")
        return None
    if resume is None and load and getattr(args, "finetune", False):
        raise BoundedArgumentError(
            f"--finetune starts from the weights of --load, and --load {load} holds no "
            f"checkpoint (no {TRACKER_FILE}): name the directory tools/convert_hf.py import or "
            "a --save of pretrain_gpt.py wrote."
        )
    return note


def _load_flag(load: str, save: Optional[str], ckpt_step,
               pretrained: Optional[str]) -> Tuple[Optional[Resume], Optional[str]]:
    """(the checkpoint ``--load`` resumes from, or None with the note of a start from scratch)."""
    if not os.path.exists(load):
        if _same_directory(load, save):
            return None, (f"--load {load} does not exist yet: training starts from scratch, and "
                          "the first save creates it (--load is the --save directory)")
        if pretrained:
            return None, None
        raise BoundedArgumentError(
            f"--load {load} does not exist (upstream would train from random weights without "
            "stopping): fix the path. To train from scratch, leave --load out or give it the "
            "--save directory, as a job that resumes itself does."
        )
    if not os.access(load, os.R_OK | os.X_OK):
        raise BoundedArgumentError(f"--load {load} is not readable by this job: make it "
                                   "readable, or load a copy.")
    resume = _checkpoint_of("--load", load, ckpt_step)
    if resume is not None:
        return resume, None
    if _same_directory(load, save):
        return None, (f"--load {load} holds no checkpoint yet (no {TRACKER_FILE}): training "
                      "starts from scratch")
    return None, (f"WARNING: --load {load} holds no checkpoint (no {TRACKER_FILE}): training "
                  "starts from random weights, as upstream does")


def resume_of(args: argparse.Namespace) -> Optional[Resume]:
    """The checkpoint the run loads (None: it starts from scratch, or loads from elsewhere);
    the paths are those :func:`check_load_directory` accepted."""
    if getattr(args, "non_persistent_ckpt_type", None):
        return None
    for flag, directory, step in (("--load", getattr(args, "load", None),
                                   getattr(args, "ckpt_step", None)),
                                  ("--pretrained-checkpoint",
                                   getattr(args, "pretrained_checkpoint", None), None)):
        if directory and not _is_remote(directory) and os.path.isdir(directory):
            resume = _checkpoint_of(flag, directory, step)
            if resume is not None:
                return resume
    return None


# --------------------------------------------------------------------------------------------
# The model's shape, after upstream's validation (it derives some of these values)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShapeFlag:
    """A flag that sizes the model's tensors: how it reads in ``args`` (raises AttributeError
    where the namespace does not hold it: such a flag is not compared); ``inverted``: the flag
    turns the value off."""

    flag: str
    value: Callable[[Any], Any]
    inverted: bool = False

    def shown(self, value) -> str:
        if isinstance(value, bool):
            return "on" if value != self.inverted else "off"
        return "none" if value is None else str(value)


def _attribute(name: str) -> Callable[[Any], Any]:
    return lambda args: getattr(args, name)


def _query_groups(args):
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def _with_experts(name: str) -> Callable[[Any], Any]:
    return lambda args: getattr(args, name) if args.num_experts else None


def _with_mla(name: str) -> Callable[[Any], Any]:
    return lambda args: getattr(args, name) if args.multi_latent_attention else None


def _learned_positions(args):
    """The learned position embeddings' count (None: positions are not learned, e.g. rope)."""
    if args.position_embedding_type != "learned_absolute":
        return None
    return args.max_position_embeddings


def _moe_layers(args):
    """Which layers are MoE layers, from --moe-layer-freq (every k-th, or a list)."""
    if not args.num_experts:
        return None
    frequency = args.moe_layer_freq
    if isinstance(frequency, int):
        return tuple(int(layer % frequency == 0) for layer in range(args.num_layers))
    return tuple(frequency)


SHAPE_FLAGS = (
    ShapeFlag("--num-layers", _attribute("num_layers")),
    ShapeFlag("--hidden-size", _attribute("hidden_size")),
    ShapeFlag("--ffn-hidden-size", _attribute("ffn_hidden_size")),
    ShapeFlag("--num-attention-heads", _attribute("num_attention_heads")),
    ShapeFlag("--num-query-groups", _query_groups),
    ShapeFlag("--kv-channels", _attribute("kv_channels")),
    ShapeFlag("--num-experts", _attribute("num_experts")),
    ShapeFlag("--moe-ffn-hidden-size", _with_experts("moe_ffn_hidden_size")),
    ShapeFlag("--moe-shared-expert-intermediate-size",
              _with_experts("moe_shared_expert_intermediate_size")),
    ShapeFlag("--moe-layer-freq", _moe_layers),
    ShapeFlag("the padded vocabulary (the tokenizer's or --vocab-size, rounded up to a multiple "
              "of --make-vocab-size-divisible-by × --tensor-model-parallel-size)",
              _attribute("padded_vocab_size")),
    ShapeFlag("--swiglu", _attribute("swiglu")),
    ShapeFlag("--disable-bias-linear", _attribute("add_bias_linear"), inverted=True),
    ShapeFlag("--add-qkv-bias", _attribute("add_qkv_bias")),
    ShapeFlag("--qk-layernorm", _attribute("qk_layernorm")),
    ShapeFlag("--normalization", _attribute("normalization")),
    ShapeFlag("--untie-embeddings-and-output-weights",
              _attribute("untie_embeddings_and_output_weights")),
    ShapeFlag("--position-embedding-type learned_absolute: its --max-position-embeddings",
              _learned_positions),
    ShapeFlag("--multi-latent-attention", _attribute("multi_latent_attention")),
    ShapeFlag("--q-lora-rank", _with_mla("q_lora_rank")),
    ShapeFlag("--kv-lora-rank", _with_mla("kv_lora_rank")),
    ShapeFlag("--qk-head-dim", _with_mla("qk_head_dim")),
    ShapeFlag("--qk-pos-emb-head-dim", _with_mla("qk_pos_emb_head_dim")),
    ShapeFlag("--v-head-dim", _with_mla("v_head_dim")),
    ShapeFlag("--mtp-num-layers", _attribute("mtp_num_layers")),
)


def saved_arguments(checkpoint: str) -> Optional[argparse.Namespace]:
    """The arguments a torch_dist checkpoint saved in its common state (None: another format,
    whose arguments sit in the whole model file, or none saved)."""
    if not os.path.isfile(os.path.join(checkpoint, MEGATRON_CONFIG)):
        return None
    from megatron.core.dist_checkpointing import load_common_state_dict

    try:
        common = load_common_state_dict(checkpoint)
    except Exception:  # noqa: BLE001 - a damaged checkpoint: the load's integrity check names it
        return None
    saved = common.get("args") if isinstance(common, dict) else None
    return saved if isinstance(saved, argparse.Namespace) else None


def converted_arguments(directory: str) -> argparse.Namespace:
    """The numbers and switches of the ``pretrain_args.txt`` that ``tools/convert_hf.py import``
    wrote into ``directory`` (an empty namespace without one); text values are left out, as they
    are not read the way the parser reads them."""
    values = {}
    path = os.path.join(directory, CONVERTED_ARGS_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as stream:
            tokens = shlex.split(stream.read())
        for index, token in enumerate(tokens):
            if not token.startswith("--"):
                continue
            following = tokens[index + 1] if index + 1 < len(tokens) else "--"
            name = token[2:].replace("-", "_")
            if following.startswith("--"):
                values[name] = True
            elif following.lstrip("-").isdigit():
                values[name] = int(following)
    return argparse.Namespace(**values)


def shape_differences(saved: argparse.Namespace, args: argparse.Namespace) -> list:
    """``[(ShapeFlag, saved value, this run's value)]`` of every shape flag both namespaces
    hold and that differs."""
    found = []
    for shape_flag in SHAPE_FLAGS:
        try:
            before, now = shape_flag.value(saved), shape_flag.value(args)
        except AttributeError:
            continue
        if before != now:
            found.append((shape_flag, before, now))
    return found


def check_model_shape(args: argparse.Namespace) -> None:
    """Refuse a checkpoint to resume from whose saved model shape differs from this run's,
    naming each differing flag with both values."""
    resume = resume_of(args)
    if resume is None:
        return
    saved = saved_arguments(resume.checkpoint) or argparse.Namespace()
    converted = converted_arguments(resume.directory)
    for name, value in vars(converted).items():  # what the saving run recorded comes first
        if not hasattr(saved, name):
            setattr(saved, name, value)
    differences = shape_differences(saved, args)
    if not differences:
        return
    lines = "\n".join(f"  {shape_flag.flag}: {shape_flag.shown(before)} in the checkpoint, "
                      f"{shape_flag.shown(now)} in this run"
                      for shape_flag, before, now in differences)
    raise BoundedArgumentError(
        f"{resume.flag} {resume.directory}: the checkpoint {resume.checkpoint} holds a model of "
        f"another shape than these flags build:\n{lines}\nPass the checkpoint's values (or "
        "--use-checkpoint-args to take them from it), or start from another checkpoint. "
        "--finetune and --no-load-optim load the same tensors, so they need the same shape."
    )
