"""Ring-DTP's ring: the layout every rank gathers first (token counts, shard sizes, dtypes, label
ranges), the schedule ``auto`` picks, the P2P exchange with the ring's neighbours and the
accumulator that travels one hop behind it. Derivation: docs/operators/ring_dtp.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.bounded.loss.ring_dtp.strips import STATS
from megatron.bounded.units import log_once

# the operator's one log, under the name of its package
logger = logging.getLogger(__package__)


MODES = ("auto", "weights", "activations")

# Dtypes that may be exchanged; the index is sent in the metadata all-gather.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# P2P tags (gloo matches on them; NCCL matches on posting order, which is identical on every rank).
TAG_MAIN = 0  # shard (weights mode) or hidden / labels / per-token pack (activations mode)
TAG_CHAIN = 8  # travelling state (forward) or gradient accumulator (backward)


def vocab_shard_range(vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rows [start, end) of the vocabulary held by ``rank`` of ``world_size``.

    Shards are contiguous, cover [0, vocab_size) in rank order and differ in size by at most one
    row (the first ``vocab_size % world_size`` ranks hold one extra row).
    """
    vocab_size, rank, world_size = int(vocab_size), int(rank), int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return start, end


def choose_ring_mode(max_tokens: int, vocab_size: int, world_size: int,
                     grad_in_forward: bool = False) -> str:
    """The ``auto`` choice: move weights when max N > V / P, else move activations; with
    ``grad_in_forward``, always activations.

    A hop moves (V/P) x H elements as a shard or N x H elements as a batch, so the smaller of the
    two travels. Ties go to ``activations``. With gradients in forward only the activations
    schedule forms each strip once; the GEMM it saves (N x V x H per rank) outweighs the larger
    hops (N x H per hop), whose count does not grow with V.
    """
    if grad_in_forward:
        return "activations"
    return "weights" if int(max_tokens) * int(world_size) > int(vocab_size) else "activations"


@dataclass
class Ring:
    group: Optional[dist.ProcessGroup]
    rank: int  # rank inside ``group``
    world: int
    prev: int  # global rank of the ring predecessor
    next: int  # global rank of the ring successor
    num_tokens: List[int]  # N of every rank of the ring
    shard_sizes: List[int]  # V_r of every rank
    shard_offsets: List[int]
    vocab_size: int
    hidden_size: int
    mode: str  # "single", "weights" or "activations"

    def exchange(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], tag: int):
        """Post sends to the successor and receives from the predecessor; return their works.

        Empty tensors are skipped; both ends know every size, so they skip the same messages.
        """
        ops = []
        for i, tensor in enumerate(sends):
            if tensor.numel() > 0:
                ops.append(dist.P2POp(dist.isend, tensor, self.next, self.group, tag + i))
                STATS["bytes_sent"] += tensor.numel() * tensor.element_size()
        for i, tensor in enumerate(recvs):
            if tensor.numel() > 0:
                ops.append(dist.P2POp(dist.irecv, tensor, self.prev, self.group, tag + i))
        if not ops:
            return []
        STATS["hops"] += 1
        return dist.batch_isend_irecv(ops)


def wait(works) -> None:
    for work in works:
        work.wait()


# the label range of a rank without valid labels: (max, -max), which every check accepts
_NO_LABEL = torch.iinfo(torch.int64).max


def _label_range(labels: torch.Tensor, ignore_index: int):
    """The smallest and largest valid label as int64 tensors (``_NO_LABEL`` sentinels if none)."""
    valid = labels != ignore_index
    sentinel_lo = torch.full((1,), _NO_LABEL, dtype=torch.int64, device=labels.device)
    sentinel_hi = torch.full((1,), -_NO_LABEL, dtype=torch.int64, device=labels.device)
    lab_min = torch.cat([torch.where(valid, labels, _NO_LABEL), sentinel_lo]).amin()
    lab_max = torch.cat([torch.where(valid, labels, -_NO_LABEL), sentinel_hi]).amax()
    return lab_min, lab_max


def _check_label_range(lo: int, hi: int, vocab_size: int, ignore_index: int,
                       where: str = "") -> None:
    if hi >= vocab_size or (lo < 0 and lo != _NO_LABEL):
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"found values in [{lo}, {hi}]{where}"
        )


def _gather_layout(hidden, weight_shard, lab_min, lab_max, group, world: int) -> List[List[int]]:
    """Every rank's (N, V_r, H, label min, label max, hidden dtype, weight dtype): one small
    all-gather, the one host sync of a call."""
    n_local, v_local, h_local = hidden.shape[0], weight_shard.shape[0], hidden.shape[1]
    meta_device = hidden.device
    meta = torch.stack(
        [
            torch.tensor(n_local, dtype=torch.int64, device=meta_device),
            torch.tensor(v_local, dtype=torch.int64, device=meta_device),
            torch.tensor(h_local, dtype=torch.int64, device=meta_device),
            lab_min.to(meta_device),
            lab_max.to(meta_device),
            torch.tensor(DTYPES.index(hidden.dtype), dtype=torch.int64, device=meta_device),
            torch.tensor(DTYPES.index(weight_shard.dtype), dtype=torch.int64, device=meta_device),
        ]
    )
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    return torch.stack(gathered).cpu().tolist()


def _check_layout(rows, h_local: int, world: int, ignore_index: int):
    """The vocabulary size and every rank's shard range, after checking the gathered layout.
    The checks use gathered values only, so every rank raises the same error (no hang)."""
    shard_sizes = [r[1] for r in rows]
    vocab_size = sum(shard_sizes)
    if any(r[2] != h_local for r in rows):
        raise ValueError(f"hidden sizes differ across the ring: {[r[2] for r in rows]}")
    if any(r[5] != rows[0][5] or r[6] != rows[0][6] for r in rows):
        raise ValueError("hidden / weight_shard dtypes differ across the ring")
    expected = [vocab_shard_range(vocab_size, r, world) for r in range(world)]
    if shard_sizes != [e - s for s, e in expected]:
        raise ValueError(
            f"weight shard rows {shard_sizes} do not match "
            f"vocab_shard_range({vocab_size}, r, {world})"
        )
    lo = min(r[3] for r in rows)
    hi = max(r[4] for r in rows)
    _check_label_range(lo, hi, vocab_size, ignore_index, " across the ring")
    return vocab_size, expected


def build_ring(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group,
    mode: str,
    ignore_index: int,
    grad_in_forward: bool = False,
) -> Ring:
    """The ring of ``group`` (None: one rank) with every rank's layout, checked, and its mode."""
    world = 1 if group is None else dist.get_world_size(group)
    n_local, v_local, h_local = hidden.shape[0], weight_shard.shape[0], hidden.shape[1]
    labels = labels.to(torch.int64)
    lab_min, lab_max = _label_range(labels, ignore_index)

    if world == 1:
        _check_label_range(int(lab_min), int(lab_max), v_local, ignore_index)
        STATS["last_mode"] = "single"
        return Ring(None, 0, 1, 0, 0, [n_local], [v_local], [0], v_local, h_local, "single")

    rank = dist.get_rank(group)
    rows = _gather_layout(hidden, weight_shard, lab_min, lab_max, group, world)
    vocab_size, expected = _check_layout(rows, h_local, world, ignore_index)
    num_tokens = [r[0] for r in rows]
    resolved = resolve_mode(mode, max(num_tokens), vocab_size, world, grad_in_forward)
    STATS["last_mode"] = resolved
    return Ring(
        group=group,
        rank=rank,
        world=world,
        prev=dist.get_global_rank(group, (rank - 1) % world),
        next=dist.get_global_rank(group, (rank + 1) % world),
        num_tokens=num_tokens,
        shard_sizes=[r[1] for r in rows],
        shard_offsets=[s for s, _ in expected],
        vocab_size=vocab_size,
        hidden_size=h_local,
        mode=resolved,
    )


def resolve_mode(mode: str, max_tokens: int, vocab_size: int, world: int,
                  grad_in_forward: bool) -> str:
    if mode != "auto":
        return mode
    choice = choose_ring_mode(max_tokens, vocab_size, world, grad_in_forward)
    log_once(  # once per choice in this process, whatever the sizes that led to it
        logger,
        "Ring-DTP auto mode: max tokens per rank N=%d, V/P=%.1f (V=%d, P=%d) -> move %s",
        max_tokens,
        vocab_size / world,
        vocab_size,
        world,
        choice,
        key=("Ring-DTP auto mode", choice),
    )
    return choice


class Chain:
    """The accumulator that travels one hop per ring step behind the main exchange: each rank
    adds its part to what arrived from its predecessor and sends the sum on; the wait for a hop
    happens only after the next step's strips are computed, so the transfer is hidden."""

    def __init__(self, ring: "Ring", combine=torch.Tensor.add_):
        self.ring, self.combine = ring, combine
        self.works, self.incoming, self.outgoing = [], None, None

    def pass_on(self, part: torch.Tensor, new_receive_buffer) -> None:
        """Fold in what arrived (after the first step), then send ``part`` on and receive into
        ``new_receive_buffer()``, allocated only once the previous hop's buffers are released."""
        if self.incoming is not None:
            wait(self.works)
            self.combine(part, self.incoming)
            self.incoming = self.outgoing = None
        self.incoming, self.outgoing = new_receive_buffer(), part
        self.works = self.ring.exchange([part], [self.incoming], TAG_CHAIN)

    def finish(self) -> torch.Tensor:
        """The total that arrived with the last hop."""
        wait(self.works)
        self.outgoing = None
        return self.incoming
