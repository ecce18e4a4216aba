"""Import (Hugging Face directory -> torch_dist checkpoint) and export (the reverse).

A converted checkpoint directory holds::

    latest_checkpointed_iteration.txt   "release"
    release/                            the torch_dist checkpoint, with its integrity manifest
    pretrain_args.txt                   the pretrain_gpt.py flags of this architecture
    conversion.json                     family, dtype, every Hugging Face tensor's dtype and shape
    hf/                                 config.json and the tokenizer files, as imported

The model's own layout (every key, global shape and dtype, every sharded object) comes from the
caller, which builds the model from the flags (``tools/convert_hf.py``): the family's rules must
make exactly those tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron.bounded.convert import quantized, torch_dist
from megatron.bounded.convert.core import ConversionError, and_more, refuse
from megatron.bounded.convert.families import ALIASES, alias_note, family_for, family_type
from megatron.bounded.convert.hf_files import (
    COMPANION_FILES, DTYPE_NAMES, INDEX_FILE, SAFETENSORS_DTYPES, TOKENIZER_FILES, HFDirectory,
    SafetensorsWriter, copy_files, read_json,
)
from megatron.bounded.training import checkpoint_manifest
from megatron.bounded.units import GiB

ARGS_FILE = "pretrain_args.txt"
RECORD_FILE = "conversion.json"
HF_FILES_DIR = "hf"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHARD_BYTES = 5 * GiB  # the largest exported safetensors file


@dataclass
class ModelLayout:
    """What the model built from the flags saves: {key: (global shape, dtype)} and {stored key:
    value} of its sharded objects; ``chunks``: {key: [(global offset, shape)]} of the keys the
    model asks for in several pieces (one per expert, the gate and up halves), which the
    checkpoint stores as those pieces so that a load reads each once."""

    tensors: dict
    objects: dict
    chunks: dict = field(default_factory=dict)


def require_directories(**paths: Optional[str]) -> None:
    """Refuse a flag's directory that does not exist (``load=...`` is ``--load``), before any
    model is read: without it the first missing file inside would be named instead."""
    for name, path in paths.items():
        if path is not None and not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise refuse(f"--{name} {path} {what}", "pass the directory `convert_hf.py import` "
                         "wrote, or a --save directory of pretrain_gpt.py")


def read_args_file(checkpoint: str) -> list:
    path = os.path.join(checkpoint, ARGS_FILE)
    if not os.path.isfile(path):
        raise refuse(f"{checkpoint} has no {ARGS_FILE}", "pass --imported DIR, the directory "
                     "`convert_hf.py import` wrote for this model")
    with open(path, encoding="utf-8") as stream:
        return shlex.split(stream.read())


def _checked_rules(hf: HFDirectory, family, config) -> tuple:
    """The family's rules and {what the family skips: the names of its tensors}, after checking
    that the rules use every other tensor of the files and that every tensor they need is
    there."""
    rules = family.rules(config)
    used = {name for rule in rules for name in rule.hf_names}
    missing = sorted(used - set(hf.files))
    if missing:
        raise refuse(f"the {family.MODEL_TYPE} mapping needs the tensor {missing[0]!r}"
                     f"{and_more(len(missing) - 1)}, which {os.path.join(hf.path, hf.listing)} "
                     "does not list", "check that the files are complete and config.json "
                     "matches them")
    skipped = getattr(family, "skipped", lambda config, name: None)
    unmapped, left_out = [], {}
    for name in sorted(set(hf.files) - used):
        part = skipped(config, name)
        if part:
            left_out.setdefault(part, []).append(name)
        else:
            unmapped.append(name)
    if unmapped:
        raise refuse(f"tensor {unmapped[0]!r}{and_more(len(unmapped) - 1)} of the files is not "
                     f"mapped by the {family.MODEL_TYPE} mapping (a bias or option it does not "
                     "convert)", "convert a model without it, or add it to the family's module")
    return rules, left_out


def _check_layout(rules: list, layout: ModelLayout) -> None:
    made, expected = {rule.key for rule in rules}, set(layout.tensors)
    if made != expected:
        extra, absent = sorted(made - expected), sorted(expected - made)
        raise ConversionError(f"the mapping and the model built from the flags disagree: made "
                              f"but not in the model {extra[:3]}, in the model but not made "
                              f"{absent[:3]}")


def _check_output(output: str, fix: str, overwrite: bool = False) -> None:
    """Refuse an ``--output`` that is a file, or a directory with files in it unless
    ``overwrite`` (the export's --overwrite): nothing of the user's is written over."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise refuse(f"--output {output} is a file", "pass a directory")
    if not overwrite and os.path.isdir(output) and os.listdir(output):
        raise refuse(f"--output {output} is not empty", fix)


@contextlib.contextmanager
def _staged(output: str):
    """A new directory beside ``output`` to write into; it takes ``output``'s place only when the
    block succeeds (what was there is removed then) and is removed when it fails, so a failed
    conversion leaves neither a partial directory that blocks the rerun nor old files mixed with
    new ones. A directory beside, not in /tmp: the rename stays on one file system."""
    parent, name = os.path.split(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)  # not mkdtemp: its mode 0700 would become the output's
    try:
        yield staging
        replaced = None
        if os.path.isdir(output):
            replaced = staging + ".replaced"
            os.rename(output, replaced)
        try:
            os.rename(staging, output)
        except OSError:
            if replaced:
                os.rename(replaced, output)
            raise
        if replaced:
            shutil.rmtree(replaced)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as stream:
        stream.write(text)


class _Progress:
    """One line every few seconds (and at the end) while tensors are converted."""

    def __init__(self, total: int, log: Callable[[str], None], every_s: float = 5.0):
        self.total, self.log, self.every_s = total, log, every_s
        self.done, self.bytes, self.started = 0, 0, time.monotonic()
        self.last = self.started

    def step(self, key: str, tensor: torch.Tensor) -> None:
        self.done += 1
        self.bytes += tensor.numel() * tensor.element_size()
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.log(f"[convert] {self.done}/{self.total} tensors, {self.bytes / GiB:.2f} GiB, "
                     f"{now - self.started:.0f} s ({key})")


# long: one pass in order (check, write, record); each step is a call already
def import_model(hf_dir: str, output: str, dtype: str,
                 layout_of: Callable[[list, torch.dtype], ModelLayout],
                 log: Callable[[str], None] = print) -> list:
    """Convert ``hf_dir`` into the checkpoint directory ``output``; returns the flags.
    ``layout_of(flags, dtype)`` builds the model from the flags and returns its layout."""
    if dtype not in DTYPES:
        raise refuse(f"--dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    if any(character.isspace() for character in os.path.abspath(output)):
        raise refuse(f"--output {output!r} has whitespace in its path, which `$(cat "
                     f"{ARGS_FILE})` would split", "choose a path without whitespace")
    _check_output(output, "pass a new directory as --output")
    with HFDirectory(hf_dir) as hf:
        family, config = family_for(hf.config, hf.files)
        flags = family.flags(config)
        rules, left_out = _checked_rules(hf, family, config)
        hf.check_complete()
        if alias_note(hf.config):
            log(alias_note(hf.config))
        for part, names in left_out.items():
            log(f"[convert] not converted: the {len(names)} tensors of {part}")
        if hf.dequantized:
            log(f"[convert] {len(hf.dequantized)} tensors stored as "
                f"{quantized.method(hf.config).upper()} are dequantized to {dtype}")
        layout = layout_of(flags, DTYPES[dtype])
        _check_layout(rules, layout)
        for rule in rules:
            if rule.check:
                rule.check([hf.tensor(name) for name in rule.hf_names])
        by_key = {rule.key: rule for rule in rules}
        progress = _Progress(len(rules), log)

        def produce(key: str) -> torch.Tensor:
            rule = by_key[key]
            tensor = rule.join([hf.tensor(name) for name in rule.hf_names])
            tensor = tensor.to(layout.tensors[key][1])
            progress.step(key, tensor)
            return tensor

        with _staged(output) as staging:
            checkpoint = os.path.join(staging, torch_dist.RELEASE)
            os.makedirs(checkpoint)
            meta = {key: torch.empty(shape, dtype=dt, device="meta")
                    for key, (shape, dt) in layout.tensors.items()}
            torch_dist.write(checkpoint, meta, produce, layout.objects,
                             torch_dist.common_state(config["num_hidden_layers"]), layout.chunks)
            checkpoint_manifest.write_part(checkpoint)
            tokenizer = hf.present(TOKENIZER_FILES)
            hf_copy = os.path.join(staging, HF_FILES_DIR)
            copy_files(hf_dir, hf_copy, ["config.json", *tokenizer, *hf.present(COMPANION_FILES)])
            if quantized.method(hf.config):  # the checkpoint holds the dequantized weights
                _write_text(os.path.join(hf_copy, "config.json"), json.dumps(
                    unquantized_config(hf.config), indent=2) + "\n")
            if tokenizer:  # the path the directory will have, not the staging one
                flags = flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                 os.path.join(os.path.abspath(output), HF_FILES_DIR)]
            record = {"model_type": family.MODEL_TYPE, "dtype": dtype, "tensors": {
                name: _recorded(hf, name, dtype) for rule in rules for name in rule.hf_names}}
            if hf.dequantized:
                record["dequantized"] = quantized.method(hf.config)
            _write_text(os.path.join(staging, torch_dist.TRACKER_FILE), torch_dist.RELEASE)
            _write_text(os.path.join(staging, RECORD_FILE), json.dumps(record, indent=1))
            # plain words: `$(cat pretrain_args.txt)` splits on spaces and removes no quotes
            _write_text(os.path.join(staging, ARGS_FILE), " ".join(flags) + "\n")
    return flags


def unquantized_config(config: dict) -> dict:
    """``config.json`` of the dequantized model: without its ``quantization_config``."""
    return {key: value for key, value in config.items() if key != "quantization_config"}


def _recorded(hf: HFDirectory, name: str, dtype: str) -> list:
    """(dtype, shape) the export writes ``name`` with: as the files hold it, or, dequantized, in
    the import's dtype."""
    stored, shape = hf.describe(name)
    return [DTYPE_NAMES[DTYPES[dtype]] if name in hf.dequantized else stored, shape]


def checkpoint_to_read(load: str) -> str:
    """The checkpoint of the directory ``load`` (the tracker file's), checked against its
    integrity manifest."""
    tracker = os.path.join(load, torch_dist.TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise refuse(f"{load} has no {torch_dist.TRACKER_FILE}", "pass a directory written by "
                     "`convert_hf.py import` or a --save directory of pretrain_gpt.py")
    try:
        iteration, release = checkpoint_manifest.read_tracker(tracker)
    except checkpoint_manifest.CheckpointIntegrityError as error:
        raise refuse(str(error), "pass a directory written by `convert_hf.py import` or a --save "
                     "directory of pretrain_gpt.py") from None
    checkpoint = os.path.join(load, torch_dist.RELEASE if release else f"iter_{iteration:07d}")
    if not os.path.isdir(checkpoint):
        raise refuse(f"{tracker} names {checkpoint}, which is missing", "restore it or pass "
                     "another directory")
    report = checkpoint_manifest.verify_share(checkpoint,
                                              checkpoint_manifest.read_manifest(checkpoint))
    if report.mismatches:
        (first, reason), more = report.mismatches[0], len(report.mismatches) - 1
        raise refuse(f"checkpoint {checkpoint} does not match its integrity manifest: {first} "
                     f"{reason}{and_more(more)}", "re-import, or restore the files from a copy")
    return checkpoint


def _shards(rules: list, tensors: dict) -> list:
    """Rules grouped into files of at most ``SHARD_BYTES`` (a rule's tensors share a file)."""
    shards, size = [[]], 0
    for rule in rules:
        nbytes = sum(SAFETENSORS_DTYPES[tensors[n][0]].itemsize * _numel(tensors[n][1])
                     for n in rule.hf_names)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(rule)
        size += nbytes
    return shards


def _numel(shape) -> int:
    count = 1
    for extent in shape:
        count *= extent
    return count


def export_model(load: str, output: str, imported: Optional[str] = None,
                 log: Callable[[str], None] = print, overwrite: bool = False) -> None:
    """Write the Hugging Face directory ``output`` from the checkpoint of ``load``; ``imported``
    is the directory the import wrote, when ``load`` is another (a fine-tuning run's --save);
    ``overwrite``: replace a directory with files in it (whole, once the export succeeded)."""
    require_directories(load=load, imported=imported)
    imported = imported or load
    _check_output(output, "pass a new directory as --output, or --overwrite to replace it",
                  overwrite)
    target = os.path.realpath(output)
    for flag, source in (("--load", load), ("--imported", imported)):
        if os.path.commonpath([target, os.path.realpath(source)]) == target:
            raise refuse(f"--output {output} holds {flag} {source}, which the export reads",
                         "pass another directory as --output")
    record = read_record(imported)
    hf_copy = os.path.join(imported, HF_FILES_DIR)
    if not os.path.isfile(os.path.join(hf_copy, "config.json")):
        raise refuse(f"{hf_copy} has no config.json", "re-import the model (the import copies "
                     "it there)")
    tensors = record["tensors"]
    family, config = family_for(read_json(os.path.join(hf_copy, "config.json"),
                                          "re-import the model"), tensors)
    rules = family.rules(config)
    reader = torch_dist.TensorReader(checkpoint_to_read(load))
    shards = _shards(rules, tensors)
    names = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    progress, weight_map = _Progress(len(rules), log), {}
    with _staged(output) as staging:
        for name, shard in zip(names, shards):
            entries = [(n, *tensors[n]) for rule in shard for n in rule.hf_names]
            writer = SafetensorsWriter(os.path.join(staging, name), entries)
            for rule in shard:
                ours = reader.read(rule.key)
                for hf_name, part in zip(rule.hf_names, rule.split(ours)):
                    writer.write(hf_name, part.to(SAFETENSORS_DTYPES[tensors[hf_name][0]]))
                    weight_map[hf_name] = name
                progress.step(rule.key, ours)
            writer.close()
        if len(shards) > 1:
            total = sum(SAFETENSORS_DTYPES[d].itemsize * _numel(s) for d, s in tensors.values())
            _write_text(os.path.join(staging, INDEX_FILE), json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        copy_files(hf_copy, staging, sorted(os.listdir(hf_copy)))


def read_record(imported: str) -> dict:
    """``conversion.json`` of the directory the import wrote."""
    path = os.path.join(imported, RECORD_FILE)
    if not os.path.isfile(path):
        raise refuse(f"{imported} has no {RECORD_FILE}", "pass --imported DIR, the directory "
                     "`convert_hf.py import` wrote for this model")
    return read_json(path, "re-import the model")


# significant bits of each safetensors dtype (round to nearest: unit roundoff 2 ** -bits)
SIGNIFICANT_BITS = {"F64": 53, "F32": 24, "F16": 11, "BF16": 8, "F8_E4M3": 4, "F8_E5M2": 3}


def weights_dtype(hf_dir: str) -> str:
    """The finest floating dtype of a model's weights (a dequantized weight: the dtype that
    holds its values exactly)."""
    with HFDirectory(hf_dir) as hf:
        found = {hf.describe(name)[0] for name in hf.files}
    return max((d for d in found if d in SIGNIFICANT_BITS), key=SIGNIFICANT_BITS.get,
               default="F32")


def first_beyond_rounding(hf_dir: str, exported: str, dtype: str) -> Optional[str]:
    """The first tensor of the export ``exported`` (of an import in ``dtype``) that is neither
    ``hf_dir``'s (dequantized) tensor nor that tensor rounded to ``dtype``; None when all are
    (the model keeps some, norms for one, in fp32)."""
    with HFDirectory(hf_dir) as reference, HFDirectory(exported) as ours:
        for name in sorted(ours.files):
            if name not in reference.files:
                return name
            theirs, mine = reference.tensor(name), ours.tensor(name)
            if theirs.shape != mine.shape or not any(torch.equal(candidate.to(mine.dtype), mine)
                                                     for candidate in (theirs,
                                                                       theirs.to(DTYPES[dtype]))):
                return name
    return None


@contextlib.contextmanager
def transformers_directory(hf_dir: str, log: Callable[[str], None] = print):
    """The directory transformers' reference model of ``hf_dir`` is loaded from: ``hf_dir``, or,
    when its config.json names an alias (transformers knows the family's ``model_type``) or its
    weights are quantized, a temporary directory with config.json in the family's terms (no
    ``quantization_config``) and the tensors linked, or written dequantized. Dequantized here, not
    by transformers: its CPU path needs ``accelerate`` and takes FP8's block size from the scale
    grid (rows / scale rows), which is wrong where a dimension is not a multiple of 128."""
    with HFDirectory(hf_dir) as hf:
        if hf.config.get("model_type") not in ALIASES and not quantized.method(hf.config):
            yield hf_dir
            return
        config = unquantized_config(hf.config)
        config["model_type"] = family_type(hf.config)
        config.pop("auto_map", None)  # transformers' own class, not the release's code
        with tempfile.TemporaryDirectory(prefix="convert_hf_reference-") as directory:
            _write_text(os.path.join(directory, "config.json"), json.dumps(config, indent=2))
            if not hf.dequantized:
                for name in sorted({*hf.stored.values(), *hf.present([INDEX_FILE])}):
                    os.symlink(os.path.abspath(os.path.join(hf_dir, name)),
                               os.path.join(directory, name))
            else:
                log(f"[convert] verify: the reference is transformers' model of {hf_dir}'s "
                    f"{quantized.method(hf.config).upper()} weights dequantized by the converter")
                names = sorted(hf.files)
                writer = SafetensorsWriter(os.path.join(directory, "model.safetensors"),
                                           [(n, *hf.describe(n)) for n in names])
                for name in names:
                    writer.write(name, hf.tensor(name))
                writer.close()
            yield directory
