"""The torch_dist checkpoint a converted model lives in, written and read one tensor at a time.

The directory is what megatron-core's ``dist_checkpointing`` reads: torch.distributed.checkpoint
files (``.metadata``, ``__0_0.distcp``) holding each sharded key's global tensor as one chunk and
each sharded object (the layers' ``_extra_state``, the common state) as bytes under its unique
key, and ``metadata.json`` naming the backend. A load at any TP/EP/CP layout reads its shards out
of the global tensors. Tensors are produced while they are written (``LazyTensorPlanner``), so
writing holds about one tensor in memory; reading asks for one key at a time.
"""

from __future__ import annotations

import dataclasses
import io
import re
from argparse import Namespace
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.bounded.convert.core import ConversionError

COMMON_STATE_KEY = "common_state"  # megatron-core's key of the non-tensor state
# The checkpoint's content metadata, which megatron's load hands to the model's
# sharded_state_dict: every layer under its own keys (decoder.layers.<i>.*), whatever the layer
# pattern, so that each tensor is one layer's and converts alone.
CONTENT_METADATA = {"non_homogeneous_layers": True, "singleton_local_shards": False}
_STACKED_LAYER = re.compile(r"^(.*\.layers\.)(\d+)\.(.*)$")
RELEASE = "release"  # the checkpoint's directory name; the tracker file says "release"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def shard_key(key: str, offset: tuple, shape: tuple) -> str:
    """The key a sharded object is stored under (megatron-core's ``ShardedObject.unique_key``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, None, shape, offset).unique_key


class LazyTensorPlanner(DefaultSavePlanner):
    """Plans from meta tensors (shape and dtype only) and asks ``produce(key)`` for each tensor
    when the writer reaches it; the produced tensor must have the planned shape and dtype. A key
    of ``chunks`` ({key: [(global offset, shape)]}) is stored as those pieces, each its own
    chunk, cut from the one produced tensor."""

    def __init__(self, produce: Callable[[str], torch.Tensor], chunks: Optional[dict] = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.produce, self.chunks = produce, chunks or {}
        self._made = (None, None)  # the last produced (key, tensor): its pieces come in a row

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            pieces = self.chunks.get(item.index.fqn) if item.type != WriteItemType.BYTE_IO else None
            items.extend([_piece(item, offset, shape) for offset, shape in pieces] if pieces
                         else [item])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:  # already serialized (_as_bytes)
            return self.lookup_object(write_item.index)
        key = write_item.index.fqn
        if self._made[0] != key:
            self._made = (key, None)  # the previous key's tensor is freed before the next is made
            self._made = (key, self._checked(key, self.produce(key), write_item.tensor_data))
        tensor = self._made[1]
        chunk = write_item.tensor_data.chunk
        for axis, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            tensor = tensor.narrow(axis, start, length)
        return tensor.contiguous()

    @staticmethod
    def _checked(key: str, tensor: torch.Tensor, planned) -> torch.Tensor:
        if tuple(tensor.shape) != tuple(planned.size) or tensor.dtype != planned.properties.dtype:
            raise ConversionError(
                f"{key}: made as {tuple(tensor.shape)} {tensor.dtype}, but the model built from "
                f"the flags has {tuple(planned.size)} {planned.properties.dtype} (the family's "
                "mapping and its flags disagree)")
        return tensor


def _piece(item: WriteItem, offset: tuple, shape: tuple) -> WriteItem:
    """``item`` (a whole tensor's write) narrowed to the piece at ``offset`` of ``shape``."""
    chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
    return WriteItem(index=MetadataIndex(item.index.fqn, chunk.offsets), type=WriteItemType.SHARD,
                     tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk))


def common_state(num_layers: int) -> dict:
    """What megatron's ``load_checkpoint`` reads beside the tensors: the saving run's layout
    (TP = PP = 1), the checkpoint format version, the iteration (0: a release checkpoint)."""
    args = Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     num_layers=num_layers, no_save_optim=True, no_save_rng=True)
    return {"args": args, "checkpoint_version": 3.0, "iteration": 0,
            "content_metadata": dict(CONTENT_METADATA)}


def _as_bytes(value) -> io.BytesIO:
    stream = io.BytesIO()
    torch.save([value], stream)  # megatron-core stores an object as the list of its copies
    stream.seek(0)
    return stream


def write(directory: str, tensors: dict, produce: Callable[[str], torch.Tensor], objects: dict,
          common: dict, chunks: Optional[dict] = None) -> None:
    """Write ``tensors`` ({key: meta tensor of the global shape and dtype}, each made by
    ``produce(key)`` when written), ``objects`` ({stored key: value}) and ``common``."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    state = dict(tensors)
    state.update({key: _as_bytes(value) for key, value in objects.items()})
    state[shard_key(COMMON_STATE_KEY, (0,), (1,))] = _as_bytes(common)
    # one file, one thread: the writer resolves (produces) one tensor at a time
    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=1,
                              sync_files=True, overwrite=True)
    dcp.save(state, storage_writer=writer, planner=LazyTensorPlanner(produce, chunks), no_dist=True)
    save_config(CheckpointingConfig("torch_dist"), directory)


class TensorReader:
    """Reads global tensors of a torch_dist checkpoint by key, one at a time. A checkpoint that
    training saved may hold the layers stacked (``decoder.layers.X`` of shape [layers, ...], what
    megatron-core saves for a model of identical layers): ``decoder.layers.<i>.X`` is then read
    as layer i's slice alone."""

    def __init__(self, directory: str):
        self.directory = directory
        self.metadata = FileSystemReader(directory).read_metadata().state_dict_metadata

    def keys(self) -> set:
        return {k for k, v in self.metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read(self, key: str) -> torch.Tensor:
        entry = self.metadata.get(key)
        stacked = _STACKED_LAYER.match(key)
        if entry is None and stacked:
            return self._read_layer(stacked.group(1) + stacked.group(3), int(stacked.group(2)))
        if not isinstance(entry, TensorStorageMetadata):
            raise ConversionError(f"{self.directory} has no tensor {key!r}; was it saved from a "
                                  "model of the architecture the conversion records?")
        tensor = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        dcp.load({key: tensor}, storage_reader=FileSystemReader(self.directory), no_dist=True)
        return tensor

    def _read_layer(self, key: str, layer: int) -> torch.Tensor:
        entry = self.metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise ConversionError(f"{self.directory} has neither layer {layer}'s tensor nor the "
                                  f"stacked {key!r}")
        size = tuple(entry.size)
        local = torch.empty((1, *size[1:]), dtype=entry.properties.dtype)
        dcp.load({key: local}, storage_reader=FileSystemReader(self.directory),
                 planner=_LayerOfStackPlanner(key, layer), no_dist=True)
        return local[0]


class _LayerOfStackPlanner(DefaultLoadPlanner):
    """Reads layer ``layer`` of the stacked tensor ``key`` (its [1, ...] slice at that offset of
    the first axis) into the state dict's tensor of that shape, from whichever stored chunks
    hold it: the stack itself is never in memory."""

    def __init__(self, key: str, layer: int):
        super().__init__()
        self.key, self.layer = key, layer

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata[self.key]
        rest = tuple(stored.size)[1:]
        wanted = ChunkStorageMetadata(offsets=torch.Size((self.layer, *[0] * len(rest))),
                                      sizes=torch.Size((1, *rest)))
        return LoadPlan(create_read_items_for_chunk_list(self.key, stored, [wanted]))

    def lookup_tensor(self, index):
        # the read items' destination offsets are within the slice, which is the whole tensor
        return self.state_dict[index.fqn]
