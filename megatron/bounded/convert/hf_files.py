"""A Hugging Face model directory: ``config.json``, the ``*.safetensors`` files (with
``model.safetensors.index.json`` when sharded) read one tensor at a time through
``safetensors.safe_open`` (quantized ones dequantized: :mod:`megatron.bounded.convert.quantized`),
the tokenizer files; and the writer of such a directory, which streams each tensor to its file
as it comes (the header is written first, from the shapes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from contextlib import ExitStack
from typing import Iterable

import torch

from megatron.bounded.convert import quantized
from megatron.bounded.convert.core import ConversionError, and_more, refuse

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of a tokenizer, and those that go with a model beside its config: copied at import and
# given back at export.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
COMPANION_FILES = ("generation_config.json",)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")


def check_model_directory(path: str) -> None:
    """Refuse what is not a local model directory (a hub name is not fetched: no network)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise refuse(f"{path} has no config.json", "pass the directory of a Hugging Face "
                         "model (config.json and *.safetensors)")
        return
    if _HUB_NAME.match(path) and not os.path.exists(path):
        raise refuse(f"{path!r} is not a directory; it looks like a Hugging Face hub name, and "
                     "this tool does not download", "download it first (e.g. `hf download "
                     f"{path} --local-dir DIR`) and pass --hf-dir DIR")
    raise refuse(f"{path}: no such directory", "pass the directory of a Hugging Face model")


def read_json(path: str, fix: str):
    """The JSON of ``path``; a file that is not JSON is refused naming it."""
    try:
        with open(path, encoding="utf-8") as stream:
            return json.load(stream)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise refuse(f"{path} is not valid JSON ({error})", fix) from None


class HFDirectory:
    """Reads a model directory's config and tensors; use as a context manager (open files).
    ``files`` names the tensors the model is made of (tensor name -> file): a quantized tensor's
    stored parts (FP8 weight and scale, MXFP4 blocks and scales) read as the one tensor they
    stand for, dequantized (``dequantized``: {name: quantized.Dequantized})."""

    def __init__(self, path: str):
        check_model_directory(path)
        self.path = path
        self.config = read_json(os.path.join(path, "config.json"),
                                "restore the model's own config.json")
        if not isinstance(self.config, dict):
            raise refuse(f"{path}/config.json is not a JSON object",
                         "restore the model's own config.json")
        self._stack = ExitStack()
        self._open = {}
        try:
            self.stored = self._tensor_files()
            self.listing = INDEX_FILE if os.path.isfile(os.path.join(path, INDEX_FILE)) else \
                next(iter(self.stored.values()), SINGLE_FILE)  # where the tensors are listed
            self.dequantized = quantized.dequantized_tensors(self.config, self.stored,
                                                             self._describe_stored)
        except BaseException:
            self._stack.close()
            raise
        parts = {part for entry in self.dequantized.values() for part in entry.parts}
        self.files = {name: file for name, file in self.stored.items() if name not in parts}
        self.files.update({name: self.stored[entry.parts[0]]
                           for name, entry in self.dequantized.items()})

    def _tensor_files(self) -> dict:
        """Stored tensor name -> file name."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            listed = read_json(index, "restore the index file that came with the model")
            if not isinstance(listed, dict) or not isinstance(listed.get("weight_map"), dict):
                raise refuse(f"{index} has no weight_map", "restore the index file that came "
                             "with the model")
            return dict(listed["weight_map"])
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise refuse(f"{self.path} has no *.safetensors file", "convert a model saved as "
                         "safetensors (PyTorch .bin files are not read)")
        if len(names) > 1:
            raise refuse(f"{self.path} has {len(names)} safetensors files but no {INDEX_FILE}",
                         "restore the index file that came with the model")
        return {name: names[0] for name in self._handle(names[0]).keys()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _handle(self, file_name: str):
        if file_name not in self._open:
            from safetensors import SafetensorError, safe_open

            path = os.path.join(self.path, file_name)
            if not os.path.isfile(path):
                raise refuse(f"{path}, which {INDEX_FILE} lists tensors in, is missing",
                             "restore the file (the model's files are incomplete)")
            try:
                self._open[file_name] = self._stack.enter_context(safe_open(path, "pt"))
            except (SafetensorError, OSError) as error:
                raise refuse(f"{path} is not a readable safetensors file ({error})",
                             "restore the file from the model's release") from None
        return self._open[file_name]

    def check_complete(self) -> None:
        """Refuse a file that lacks a tensor the index lists in it (before any is converted)."""
        by_file = {}
        for name, file_name in self.stored.items():
            by_file.setdefault(file_name, []).append(name)
        for file_name, names in sorted(by_file.items()):
            held = set(self._handle(file_name).keys())
            absent = [name for name in names if name not in held]
            if absent:
                raise refuse(f"{os.path.join(self.path, file_name)} lacks the tensor "
                             f"{absent[0]!r}{and_more(len(absent) - 1)}, which {INDEX_FILE} "
                             "lists in it", "restore the file (the model's files are incomplete)")

    def _stored_tensor(self, name: str) -> torch.Tensor:
        return self._handle(self.stored[name]).get_tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` of ``files`` (a dequantized one as ``describe`` says)."""
        if name not in self.files:
            raise refuse(f"the model has no tensor {name!r} ({self.listing} does not list it)",
                         "check that the safetensors files are complete")
        if name in self.dequantized:
            return quantized.decoded(self.dequantized[name], self._stored_tensor)
        return self._stored_tensor(name)

    def _describe_stored(self, name: str) -> tuple:
        view = self._handle(self.stored[name]).get_slice(name)
        return view.get_dtype(), list(view.get_shape())

    def describe(self, name: str) -> tuple:
        """(safetensors dtype name, shape) of a tensor of ``files``, without reading it (a
        dequantized one: the dtype that holds its values exactly)."""
        if name in self.dequantized:
            entry = self.dequantized[name]
            return DTYPE_NAMES[entry.dtype], list(entry.shape)
        return self._describe_stored(name)

    def present(self, names: Iterable[str]) -> list:
        """Those of ``names`` the directory holds (e.g. TOKENIZER_FILES)."""
        return [n for n in names if os.path.isfile(os.path.join(self.path, n))]


def copy_files(source: str, target: str, names: Iterable[str]) -> None:
    os.makedirs(target, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


def _header(entries: list) -> bytes:
    """safetensors header for [(name, dtype name, shape)], data in this order, 8-byte aligned."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        size = SAFETENSORS_DTYPES[dtype].itemsize
        for extent in shape:
            size *= extent
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order of ``entries``."""

    def __init__(self, path: str, entries: list):
        self.entries = list(entries)
        self.written = 0
        self.stream = open(path, "wb")
        header = _header(self.entries)
        self.stream.write(struct.pack("<Q", len(header)) + header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self.entries[self.written]
        if name != expected_name or list(tensor.shape) != list(shape) or \
                tensor.dtype != SAFETENSORS_DTYPES[dtype]:
            raise ConversionError(f"internal: {name} {tuple(tensor.shape)} {tensor.dtype} written "
                                  f"where {expected_name} {shape} {dtype} belongs")
        if tensor.numel():
            self.stream.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.written += 1

    def close(self) -> None:
        self.stream.close()
        if self.written != len(self.entries):
            raise ConversionError(f"internal: {self.written} of {len(self.entries)} tensors written")
