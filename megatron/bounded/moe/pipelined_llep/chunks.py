"""Chunk count and membership: K from the token budget, agreed over the EP group, the tokens of
each chunk, the per-chunk pair counts that size every chunk's all-to-all, and the closed-form
chunk buffer sizes."""

from __future__ import annotations

import operator
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import utils as mcore_utils

from megatron.bounded.units import ceil_div

CHUNKINGS = ("strided", "contiguous")


def as_int(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def num_chunks(num_tokens: int, budget: int, max_chunks: int) -> int:
    """K = min(ceil(num_tokens / budget), max_chunks), at least 1 (Eq. 1 of the paper).

    ``budget`` is the per-rank token budget c of one chunk (> 0), ``max_chunks`` the cap K_max
    (>= 1): values ``PipelinedLLEPSettings.check_values`` accepts.
    """
    num_tokens = as_int(num_tokens, "num_tokens")
    budget = as_int(budget, "budget")
    max_chunks = as_int(max_chunks, "max_chunks")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return max(1, min(ceil_div(num_tokens, budget), max_chunks))


def agree_num_chunks(
    num_tokens: int, budget: int, max_chunks: int, group=None, device=None
) -> Tuple[int, int]:
    """``(K, c_eff)`` agreed over ``group``: the chunk count of the largest rank and its chunk size.

    One all-reduce MAX of ``[K_local, N_local]`` (a host sync).  ``c_eff = ceil(N_max / K)`` is the
    most tokens any rank has in any chunk; it sets the receive bound, so it must agree too.
    ``device``: where the reduced tensor lives (CUDA for NCCL groups; CPU by default).
    """
    local_k = num_chunks(num_tokens, budget, max_chunks)
    values = [local_k, num_tokens]
    if group is not None and mcore_utils.get_pg_size(group) > 1:
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        values = t.tolist()
    k, n_max = values
    return k, max(1, ceil_div(n_max, k))


def _chunk_arguments(num_tokens, K, i) -> Tuple[int, int, int]:  # noqa: N803
    """Validated ``(num_tokens, K, i)`` of a chunk request."""
    num_tokens, K, i = as_int(num_tokens, "num_tokens"), as_int(K, "K"), as_int(i, "i")
    if K < 1:
        raise ValueError(f"the number of chunks must be >= 1, got {K}")
    if not 0 <= i < K:
        raise ValueError(f"chunk index {i} outside [0, {K})")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens, K, i


def strided_chunk(num_tokens: int, K: int, i: int, device=None) -> torch.Tensor:  # noqa: N803
    """Positions i, i+K, i+2K, ... below ``num_tokens`` (int64); chunk sizes differ by <= 1."""
    num_tokens, K, i = _chunk_arguments(num_tokens, K, i)
    return torch.arange(min(i, num_tokens), num_tokens, K, dtype=torch.int64, device=device)


def contiguous_chunk(num_tokens: int, K: int, i: int, device=None) -> torch.Tensor:  # noqa: N803
    """Positions [i * s, (i + 1) * s) below ``num_tokens`` with s = ceil(num_tokens / K)."""
    num_tokens, K, i = _chunk_arguments(num_tokens, K, i)
    size = ceil_div(num_tokens, K)
    return torch.arange(
        min(i * size, num_tokens), min((i + 1) * size, num_tokens), dtype=torch.int64, device=device
    )


def chunk_index(
    num_tokens: int, K: int, i: int, chunking: str, device  # noqa: N803
) -> Optional[torch.Tensor]:
    """Token positions of chunk ``i`` (None when K = 1: the whole batch, no gather)."""
    if K == 1:
        return None
    fn = strided_chunk if chunking == "strided" else contiguous_chunk
    return fn(num_tokens, K, i, device=device)


def dispatch_live_bytes_bound(
    ep_size: int,
    topk: int,
    chunk_tokens: int,
    hidden_size: int,
    ffn_width: int,
    bytes_per_element: int,
) -> Dict[str, int]:
    """Closed-form sizes of the chunk buffers, in bytes, from the launch configuration alone.

    ``receive``: the double-buffered receive rows, 2 * E_p * k * c * H * b (the paper's bound).
    ``chunk_working_set``: everything the layer allocates for chunks in flight (send and receive
    slabs, the expert-grouped copies, the fc1 output ``ffn_width`` = 2F for gated units, the
    combine rows, and in backward the gradient rows); an upper bound of the measured live set
    beyond the layer's inputs, outputs, gradients and O(N * k) routing metadata.
    """
    rows = ep_size * topk * chunk_tokens
    row_bytes = hidden_size * bytes_per_element
    return {
        "receive": 2 * rows * row_bytes,
        # Two chunks' dispatch rows (send, receive, grouped) plus one chunk's expert working set
        # (grouped input, fc1, activation, output, their gradients) and its combine rows.
        "chunk_working_set": rows * (10 * row_bytes + 4 * ffn_width * bytes_per_element),
    }



def chunk_pair_counts(routing_map: torch.Tensor, slot_virtual: Optional[torch.Tensor], slots: int,
                      ep_size: int, num_chunks: int, chunking: str) -> torch.Tensor:
    """[K, E_p, slots] int64 (device): the (token, expert) pairs this rank sends each EP rank's
    expert slots in each chunk: the owners' experts, or the LLEP virtual experts when
    ``slot_virtual`` is given. Summed over the slots: the sizes of each chunk's all-to-all."""
    num_tokens = routing_map.shape[0]
    device = routing_map.device
    width = ep_size * slots
    counts = []
    for i in range(num_chunks):
        idx = chunk_index(num_tokens, num_chunks, i, chunking, device)
        if slot_virtual is None:  # a rank's experts are one contiguous block of the routing map
            rows = routing_map if idx is None else routing_map.index_select(0, idx)
            counts.append(rows.sum(dim=0, dtype=torch.int64))
        else:  # the sentinel of invalid slots (E_p * slots) lands in the dropped last bin
            virt = (slot_virtual if idx is None else slot_virtual.index_select(0, idx)).reshape(-1)
            bins = torch.zeros(width + 1, dtype=torch.int64, device=device)
            counts.append(bins.scatter_add_(0, virt, torch.ones_like(virt))[:width])
    return torch.stack(counts).view(num_chunks, ep_size, slots)


def exchange_chunk_counts(counts: torch.Tensor, group, ep_rank: int, ep_size: int):
    """Every rank's [K, E_p, slots] pair counts, gathered (one collective and one host sync).

    Returns the exact send and receive sizes ``[K][E_p]`` of every chunk's all-to-all on this
    rank, and the rows it receives per chunk, source and expert slot ``[K, E_p, slots]`` (device),
    which group the received rows by expert: no chunk exchanges counts of its own.
    """
    if group is None:
        table = counts.unsqueeze(0)
    else:
        gathered = [torch.empty_like(counts) for _ in range(ep_size)]
        dist.all_gather(gathered, counts.contiguous(), group=group)
        table = torch.stack(gathered)  # [source, chunk, destination, slot]
    host = table.sum(dim=3).tolist()
    sends = [host[ep_rank][i] for i in range(counts.shape[0])]
    receives = [[host[source][i][ep_rank] for source in range(ep_size)] for i in range(counts.shape[0])]
    return sends, receives, table[:, :, ep_rank].transpose(0, 1)

