"""Attention within the documents of packed sequences (``--reset-attention-mask``).

Packed training data puts documents end to end in one sequence; with ``--reset-attention-mask``
(or upstream's ``--dataloader-inter-document-masking``) a token attends only to the earlier
tokens of its own document. Upstream says so with a [b, 1, s, s] mask from the dataloader; here
each micro-batch carries its documents' cumulative lengths instead (:class:`DocumentParams`,
upstream's ``PackedSeqParams`` in the ``sbhd`` layout, which upstream's model hands unchanged to
the core attention), and attention runs document by document: its time and memory follow the
sum of the squared document lengths, and nothing is s × s.

Boundaries: with ``--reset-attention-mask`` a document ends at its EOD token (inclusive) or at
the end of the sequence, as in upstream's ``_get_ltor_masks_and_position_ids``; with
``--dataloader-inter-document-masking`` they are the dataset's document lengths. Kernels: flash
attention's variable-length kernel for 16-bit CUDA tensors, every document through the
plain-PyTorch reference otherwise (:mod:`megatron.bounded.attention.windows`); a sliding window
applies within each document and a sink to every row (:mod:`megatron.bounded.attention.sinks`). Exact: each document's
tokens get the numbers of that document alone (rotary angles depend only on distances).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import List, Optional, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.bounded.attention.head_dims import with_value_padded
from megatron.bounded.attention.sinks import KernelAttention
from megatron.bounded.attention.windows import (
    causal_band,
    flash_varlen_kernels,
    reference_block_backward,
    reference_forward,
)
from megatron.bounded.settings import BoundedArgumentError

__all__ = [
    "DocumentParams",
    "check_document_attention",
    "check_document_sources",
    "cumulative_lengths_bytes",
    "document_attention",
    "document_source",
    "documents_of_batch",
    "ends_from_dataset_lengths",
    "ends_from_eod",
    "to_device",
]

# qkv_format of our parameters: upstream's attention treats every format but "thd" as dense
LAYOUT = "sbhd"
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def cumulative_lengths_bytes(tokens: int) -> int:
    """GPU bytes of one micro-batch's document boundaries (``tokens``: its sequences' tokens,
    whole sequences under context parallelism): int32 cumulative lengths, at most one document
    per token. The kernels' workspaces are those of the whole sequence's, or less."""
    return 4 * (tokens + 1)


@dataclasses.dataclass
class DocumentParams(PackedSeqParams):
    """Document boundaries of one micro-batch of ``batch`` sequences of ``seq_length`` tokens.

    ``cu_seqlens_q`` (= ``cu_seqlens_kv``): int32 cumulative lengths over the sequences' tokens
    flattened sequence after sequence, on the batch's device; ``sequences``: per sequence, the
    same boundaries on the host, relative to the sequence's first token; ``longest``: the longest
    document. ``max_seqlen_q``/``_kv`` are the sequence length: upstream's model sizes its
    rotary table by them."""

    sequences: Tuple[Tuple[int, ...], ...] = ()
    seq_length: int = 0
    longest: int = 0

    @classmethod
    def from_ends(cls, ends: torch.Tensor, batch: int, seq_length: int) -> "DocumentParams":
        """From the flattened positions just past each document's last token (every sequence's
        end among them), ascending."""
        cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        flat = cu_seqlens.tolist()  # (a wait for the device when ``ends`` is on one)
        sequences = []
        for index in range(batch):
            first = bisect.bisect_left(flat, index * seq_length)
            last = bisect.bisect_left(flat, (index + 1) * seq_length)
            sequences.append(tuple(b - index * seq_length for b in flat[first:last + 1]))
        longest = max(e - s for bounds in sequences for s, e in zip(bounds, bounds[1:]))
        return cls(qkv_format=LAYOUT, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                   max_seqlen_q=seq_length, max_seqlen_kv=seq_length, sequences=tuple(sequences),
                   seq_length=seq_length, longest=longest)

    def to(self, device) -> "DocumentParams":
        """These documents with their cumulative lengths on ``device`` (:func:`to_device`)."""
        cu_seqlens = to_device(self.cu_seqlens_q, device)
        return dataclasses.replace(self, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)

    @property
    def count(self) -> int:
        return sum(len(bounds) - 1 for bounds in self.sequences)

    def host_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens_q`` on the host (int64), from ``sequences``: read without waiting for
        the device."""
        return torch.tensor([0] + [index * self.seq_length + end
                                   for index, bounds in enumerate(self.sequences)
                                   for end in bounds[1:]])

    def check_shape(self, tokens: int, batch: int) -> None:
        """Refuse a layer input of ``tokens`` × ``batch`` that these documents do not cover."""
        if tokens != self.seq_length or batch != len(self.sequences):
            raise ValueError(f"a layer over ({tokens}, {batch}) (tokens, sequences) with "
                             f"documents of {len(self.sequences)} sequences of "
                             f"{self.seq_length} tokens")


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``: from the host to a GPU through pinned memory, without waiting
    for the GPU's queued work."""
    if torch.device(device).type == "cuda" and not tensor.is_cuda:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def ends_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``tokens`` [b, s] -> flattened positions past each document's end: after every EOD token
    and at every sequence's end."""
    ends = tokens == eod
    ends[:, -1] = True
    return torch.nonzero(ends.reshape(-1)).squeeze(1) + 1


def ends_from_dataset_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Upstream's inter-document ``cu_seqlens`` [b, s + 1] (each row padded with s) ->
    flattened positions past each document's end."""
    seq_length = cu_seqlens.shape[1] - 1
    offsets = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device) * seq_length
    real = cu_seqlens[:, 1:] > cu_seqlens[:, :-1]
    return (cu_seqlens[:, 1:].long() + offsets[:, None])[real]


def document_source(args) -> Optional[str]:
    """Where a run's document boundaries come from: ``"eod"``, ``"dataset"`` or None."""
    if getattr(args, "reset_attention_mask", False):
        return "eod"
    if getattr(args, "dataloader_inter_document_masking", False):
        return "dataset"
    return None


def check_document_sources(args) -> None:
    """Refuse two sources of document boundaries (parsed flags): they disagree wherever a
    document of the dataset does not end with its end-of-document token."""
    if getattr(args, "reset_attention_mask", False) and getattr(
            args, "dataloader_inter_document_masking", False):
        raise BoundedArgumentError(
            "--reset-attention-mask (documents end at each end-of-document token) and "
            "--dataloader-inter-document-masking (documents are the dataset's document lengths) "
            "each say where documents end: keep one of them (--reset-attention-mask when every "
            "document of the data ends with the end-of-document token).")


def documents_of_batch(batch: dict, source: Optional[str], eod: int) -> Optional[DocumentParams]:
    """The micro-batch's documents (whole sequences: before any context-parallel split), on the
    batch's device: given the data loader's host tensors, found without waiting for the GPU."""
    if source is None:
        return None
    tokens = batch["tokens"]
    if source == "eod":
        ends = ends_from_eod(tokens, eod)
    else:
        ends = ends_from_dataset_lengths(batch["cu_seqlens"].to(tokens.device))
    return DocumentParams.from_ends(ends, tokens.shape[0], tokens.shape[1])


def check_document_attention(args) -> None:
    """Refuse what would attend across documents, or cannot run per document (parsed flags)."""
    source = document_source(args)
    if source is None:
        return
    flag = "--reset-attention-mask" if source == "eod" else "--dataloader-inter-document-masking"
    problems = []
    if args.transformer_impl != "local":
        problems.append(f"--transformer-impl {args.transformer_impl} (per-document attention "
                        "runs in the local implementation's SDPA attention: --transformer-impl local)")
    if getattr(args, "cuda_graph_impl", "none") != "none":
        problems.append(f"--cuda-graph-impl {args.cuda_graph_impl} (the kernel calls follow "
                        "each micro-batch's documents, which a captured graph cannot: "
                        "--cuda-graph-impl none)")
    if getattr(args, "attention_dropout", 0.0):
        problems.append(f"--attention-dropout {args.attention_dropout} (the per-document "
                        "kernels run without dropout: --attention-dropout 0)")
    if getattr(args, "create_attention_mask_in_dataloader", False):
        problems.append("--create-attention-mask-in-dataloader (an s × s mask per sample that "
                        "attention never reads: --no-create-attention-mask-in-dataloader)")
    if getattr(args, "mtp_num_layers", None):
        problems.append("--mtp-num-layers (upstream's multi-token-prediction layers would "
                        "attend across documents)")
    if getattr(args, "spec", None) is not None:
        problems.append("--spec (only the project's layer spec attends per document)")
    if problems:
        raise BoundedArgumentError(
            f"{flag} (attention within each packed document) cannot be used with: "
            + "; ".join(problems) + ".")


def _flattened(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b·s, n, d], sequence after sequence (a view when b = 1)."""
    return t.transpose(0, 1).reshape(-1, t.shape[2], t.shape[3])


def _varlen(query, key, value, documents: DocumentParams, scale: float, band, sink):
    seq, batch = query.shape[:2]
    kernels = flash_varlen_kernels(documents.cu_seqlens_q, documents.longest)
    q, k, v = (_flattened(t).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    # flash's variable-length kernel takes one head dimension for q, k and v
    output = with_value_padded(  # [1, h, b·s, d_v]
        lambda q, k, v: KernelAttention.apply(kernels, scale, band, q, k, v, sink), q, k, v)
    return output[0].transpose(0, 1).reshape(batch, seq, output.shape[1], -1).transpose(0, 1)


def _each_document(query, key, value, documents: DocumentParams, scale: float, band, sink):
    kernels = (reference_forward, reference_block_backward)
    sequences: List[torch.Tensor] = []
    for index, bounds in enumerate(documents.sequences):
        pieces = []
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (t[start:end, index].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            out = KernelAttention.apply(kernels, scale, band, q, k, v, sink)
            pieces.append(out.squeeze(0).transpose(0, 1))
        sequences.append(torch.cat(pieces))
    return torch.stack(sequences, dim=1)


def document_attention(query, key, value, documents: DocumentParams, scale: float,
                       window: Optional[int] = None,
                       sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention within each document, without dropout: ``[s, b, heads or groups, d]``
    in, ``[s, b, heads, d]`` out; differentiable. ``window``: the causal window's left extent
    within each document; ``sink``: per-head sink logits (one more key of every row)."""
    documents.check_shape(*query.shape[:2])
    band = causal_band(window)
    if query.is_cuda and query.dtype in VARLEN_DTYPES:
        return _varlen(query, key, value, documents, scale, band, sink)
    return _each_document(query, key, value, documents, scale, band, sink)
