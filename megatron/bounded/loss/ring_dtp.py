"""Ring-DTP: exact ring vocabulary-parallel linear + cross-entropy.

Each of the P ranks of ``group`` keeps its OWN batch of tokens (``hidden`` [N_r, H], ``labels``
[N_r]) and one contiguous slice of the output-projection weight, ``weight_shard`` [V_r, H] holding
rows ``vocab_shard_range(V, r, P)`` of the full weight W [V, H]. The loss of a token is the ordinary
full-vocabulary cross-entropy ``logsumexp(x W^T) - (x W^T)[target]``, yet no rank ever forms the
N x V logits: every token meets every vocabulary shard once around the ring, one strip
``x W_o^T`` (N x V/P, fp32) at a time, and each strip is folded into a three-scalar running
state per token (running max m, rescaled sum of exponentials z, target logit y_t) and released at
once; for a strip of logits l_v::

    m' = max(m, max_v l_v)      z' = exp(m - m') z + sum_v exp(l_v - m')      loss = m + log z - y_t

Two ring schedules give identical results (up to fp32 summation order):

* ``weights``: the weight shards travel (P - 1 hops of V/P x H elements); every rank folds its local
  tokens against each visiting shard. In backward the ring is replayed strip by strip from the saved
  log-sum-exp (softmax = exp(logit - lse), minus one at the target, times the incoming gradient);
  dX accumulates at home and the shard's dW accumulator travels behind the shard, ending at the
  owner after P hops.
* ``activations``: the tokens travel instead (hidden, labels, and the state; P - 1 hops of N x H);
  each owner multiplies the visiting batch by its own shard. In backward the dX accumulator travels
  with the batch and returns home; dW stays with its owner.
* ``auto`` picks ``weights`` when max_r N_r > V / P (a hop then moves fewer bytes as a shard than as
  a batch), else ``activations``; with gradients in forward (below) it picks ``activations``.
  Every rank decides from the same gathered values, so all agree.

Gradients in forward (``grad_in_forward=True``): the backward above forms every strip a second
time, four GEMMs per strip where a materialized output layer needs three. When the loss
gradient is one value c on every valid token of every rank (a sum or mean of the losses), the
gradients for c = 1 can be computed in the forward and scaled in the backward, so each strip is
formed once. One rank: each chunk's full-vocabulary strip is folded, its log-sum-exp is then
final, and the same strip becomes G at once. The ``activations`` schedule works in rounds of one
row chunk per rank: lap 1 moves the chunks around the ring as above, and every rank KEEPS the
strip it formed for each visiting chunk (with that chunk's hidden rows and labels); lap 2 moves
each chunk's final log-sum-exp around, and each rank turns its kept strip into G, adds G · W_r to
the chunk's dX on its way home and G^T · h to its own dW. The backward checks c (one small
all-gather, so every rank decides alike) and scales the kept gradients; if the gradient is not
uniform it replays the strips as above (exact either way, with a warning). The ``weights``
schedule does not take it: a token's strips arrive one shard per hop, so the strips of all its
rounds would have to be kept for a whole lap; ``auto`` therefore picks ``activations`` with it
(the GEMM saved, N x V x H per rank, outweighs the larger hops).

One rank, with or without gradients in forward: each chunk's G is written into a buffer of
``gradient_group_rows`` rows, and one GEMM per full buffer gives those rows' dX and one adds
G^T · h into the fp32 dW. A GEMM adding into the fp32 dW reads and writes all V x H of it
whatever its token count, so fewer, longer GEMMs move less: the buffer holds as many chunks of G
(in the GEMM dtype) as fit, with the fp32 strip being formed when that is separate (16-bit G), in
the bytes of the returned weight gradient (H input-dtype elements per vocabulary row): with bf16
inputs on CUDA, rows * 2 + chunk * 4 <= H * 2 (chunk 512, H = 4096: 3,072 rows). For fp32 GEMMs
the strips are formed in the buffer itself. The replay groups alike, so its GEMMs are the same.
``gradient_rows`` sets the buffer's rows instead (a multiple of the chunk), trading
(rows - default) x V x g bytes for fewer GEMMs into the accumulator.

Communication overlaps computation: the P2P exchange of the next hop (``batch_isend_irecv``) is
posted before the current strip is computed, into the other half of a double buffer. The small
state / accumulator hop is posted right after a hop's local contribution is finished and is waited
for only after the next hop's strips are computed, so it is hidden too. With NCCL the transfers run
on NCCL's own stream (a side stream) while compute stays on the current stream; with gloo on CPU
they run on gloo's threads.

Ranks may hold different N, including N = 0: token counts, shard sizes, hidden size, dtypes and
label ranges are gathered first (one small all-gather), every rank takes part in every hop, and
empty messages are skipped on both ends consistently. ``group=None`` (or a group of one rank) is the
single-rank case: a fused chunked linear + cross-entropy with no communication at all.

On CUDA with Triton, folding a strip into the state and forming the backward's gradient strip are
one kernel each (``megatron.bounded.loss.strip_softmax``), reading the strip once; elsewhere the
eager reference of the same module runs.

Precision: strips, states and gradient accumulators are fp32 whatever the input dtype (fp64 when an
input is fp64). For hidden and weight of one 16-bit dtype on CUDA the strip GEMMs take the 16-bit
operands and write fp32 (``torch.mm(..., out_dtype=torch.float32)``): the same fp32 logits as the
upcast computation, at tensor-core speed; the backward's gradient strip is rounded to that dtype for
its two GEMMs, as a 16-bit output layer's backward is. Elsewhere 16-bit inputs are upcast chunk by
chunk. The per-token loss is returned in the accumulation dtype (fp32 for fp32 / bf16 / fp16
inputs); gradients are returned in the input dtypes. With gradients in forward each chunk's dX
(one rank: each group's) is accumulated in fp32 and rounded to the input dtype at once, before the
backward multiplies it by the loss gradient c: the replayed gradient when c = 1 (a summed per-token
loss, bitwise: one rank groups the GEMMs alike in both), one more rounding of the input dtype
otherwise.

Memory bound (per rank, transient, on top of the inputs and the returned gradients). With
s = ceil(V / P), n = min(chunk_tokens, N_max) (N_max without chunking; N_max = the largest N on the
ring), a = 4 bytes (8 for fp64), b = input element bytes::

    strips   : 4 * n * s * a                      (an allowance of four strips; the code keeps
                                                  one strip live at a time, updated in place)
    weights  : 2 * s * H * b                      (double-buffered visiting shards)
               + 3 * s * H * a                    (travelling dW accumulator: compute/send/recv)
               + N * H * a                        (local dX accumulator)
    activations: 2 * N_max * (H * b + 8 + 2 * a)  (double-buffered hidden, labels, lse/scale)
               + 3 * N_max * H * a                (travelling dX accumulator)
               + V_r * H * a                      (local dW accumulator)
    16-bit inputs add s * H * a + n * H * a (fp32 copies of the shard and of one hidden chunk,
    or the fp32 partial products of dW and dX; an upper bound: on CUDA, where a 16-bit GEMM
    adds into an fp32 accumulator in place, neither is formed) + n * s * b (the 16-bit gradient
    strip);
    per-token vectors add O(N_max * a).

    P = 1 (replaces the above), R = gradient_rows (by default gradient_group_rows) rows of G of
    g bytes (g = b with a separate fp32 strip, 16-bit GEMMs; g = a with the strips formed in the
    buffer; the larger of the two for 16-bit inputs):
               R * V * g + [g = b] n * V * a      (kept G rows, the separate fp32 strip)
               + 2 * n * V * a                    (the eager fold's temporaries)
               + R * H * a + V * H * a            (one group's fp32 dX product; fp32 dW)
               + N * H * a                        (the replay's fp32 dX; not with gradients in
                                                  forward, whose dX is kept in the input dtype)
               + 16-bit: V * H * a + R * H * a    (upcast copies, or fp32 products; none on CUDA)
               + 8 * N * a                        (per-token vectors)

    gradients in forward (activations), n = rows of one round's chunk:
               P * n * s * a + n * s * a          (the kept strips of a round, one temporary)
               + s * H * a                        (dW for c = 1, kept until backward; dX for
                                                  c = 1 is kept in the input dtype and becomes
                                                  the returned gradient)
               + P * n * (H * b + 8)              (kept hidden rows and labels)
               + 3 * n * H * a + O(n * a)         (dX, (lse, scale) and state hops)
               + 16-bit: s * H * a + n * H * a    (fp32 products of the 16-bit GEMMs; none on CUDA)

``ring_dtp_workspace_bytes`` evaluates this formula. Once ``chunk_tokens`` is set it grows with N
only through the O(N * H) activation-sized terms. Tests (tests/unit/test_ring_dtp.py):
``test_strip_bound_single_rank`` and, on 2 / 3 / 4 gloo ranks in every mode,
``test_ring_{two,three,four}_ranks_all_modes`` check that the largest strip materialized (recorded
by this module in ``ring_dtp_stats()["max_strip_elements"]``) is at most n * s elements (and equals
the strip the schedule should form); ``test_no_tensor_exceeds_bound_single_rank`` watches every
tensor any operator produces during forward and backward; on CUDA
``test_gpu_peak_memory_within_bound`` checks the measured ``torch.cuda.max_memory_allocated``
increase against ``ring_dtp_workspace_bytes`` plus the returned gradients.

``reference_cross_entropy`` is the plain materialized computation used by the tests and the
benchmark as ground truth.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron.bounded.loss.strip_softmax import (
    fold_strip, gradient_strip, gradient_strip_after_fold, rescale_running_sum,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MODES",
    "check_gradient_rows",
    "choose_ring_mode",
    "gradient_group_rows",
    "reference_cross_entropy",
    "reset_ring_dtp_stats",
    "ring_dtp_cross_entropy",
    "ring_dtp_stats",
    "ring_dtp_workspace_bytes",
    "vocab_shard_range",
]

MODES = ("auto", "weights", "activations")

# Dtypes that may be exchanged; the index is sent in the metadata all-gather.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# P2P tags (gloo matches on them; NCCL matches on posting order, which is identical on every rank).
_TAG_MAIN = 0  # shard (weights mode) or hidden / labels / per-token pack (activations mode)
_TAG_CHAIN = 8  # travelling state (forward) or gradient accumulator (backward)

_STATS = {}
_LOGGED_AUTO_CHOICE: Optional[str] = None


def reset_ring_dtp_stats() -> None:
    """Reset the instrumentation counters returned by :func:`ring_dtp_stats`."""
    _STATS.clear()
    _STATS.update(
        max_strip_elements=0,  # largest logits strip (elements) formed since the last reset
        num_strips=0,  # strips formed (forward and backward replay)
        bytes_sent=0,  # payload bytes this rank posted to its ring successor
        hops=0,  # batched P2P exchanges posted
        last_mode=None,  # schedule used by the last call: "weights", "activations" or "single"
        weight_grad_gemms=0,  # single rank: GEMMs adding into the fp32 weight gradient
    )


reset_ring_dtp_stats()


def ring_dtp_stats() -> dict:
    """A copy of this process's Ring-DTP counters (see :func:`reset_ring_dtp_stats`)."""
    return dict(_STATS)


def _note_strip(strip: torch.Tensor) -> None:
    _STATS["num_strips"] += 1
    if strip.numel() > _STATS["max_strip_elements"]:
        _STATS["max_strip_elements"] = strip.numel()


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


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


def reference_cross_entropy(
    hidden: torch.Tensor, full_weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Materialized per-token cross-entropy of ``hidden @ full_weight^T`` (fp32; fp64 for fp64)."""
    acc = _acc_dtype(hidden.dtype, full_weight.dtype)
    logits = hidden.to(acc) @ full_weight.to(acc).T
    return F.cross_entropy(logits, labels.long(), reduction="none", ignore_index=ignore_index)


def ring_dtp_workspace_bytes(
    num_tokens: int,
    hidden_size: int,
    vocab_size: int,
    world_size: int = 1,
    mode: str = "auto",
    chunk_tokens: Optional[int] = None,
    input_bytes: int = 4,
    max_tokens: Optional[int] = None,
    acc_bytes: int = 4,
    grad_in_forward: bool = False,
    gradient_rows: Optional[int] = None,
) -> int:
    """Upper bound (bytes) of Ring-DTP's transient working set on one rank (module docstring).

    Inputs and the returned gradients are not included. ``num_tokens`` is this rank's N,
    ``max_tokens`` the largest N on the ring (defaults to ``num_tokens``); ``mode="auto"`` is
    resolved with :func:`choose_ring_mode`.
    """
    n_local = int(num_tokens)
    n_max = int(max_tokens) if max_tokens is not None else n_local
    h, v, p = int(hidden_size), int(vocab_size), int(world_size)
    a, b = int(acc_bytes), int(input_bytes)
    s = -(-v // p)
    rows = n_max if chunk_tokens is None else min(int(chunk_tokens), n_max)
    if p == 1:
        return _single_rank_workspace_bytes(n_local, rows, h, v, a, b, grad_in_forward,
                                            gradient_rows)
    if mode == "auto":
        mode = choose_ring_mode(n_max, v, p, grad_in_forward)
    if grad_in_forward and mode == "activations":
        return _with_grads_workspace_bytes(n_local, n_max, rows, h, v, p, a, b)
    total = 4 * rows * s * a  # strips
    total += 8 * n_max * a  # per-token vectors (state, lse, grad scale, masks, temporaries)
    if b != a:
        # either upcast copies of the shard in use and of one chunk (s·H·a + n·H·a), or, with
        # 16-bit GEMMs writing fp32, the 16-bit gradient strip and the fp32 partial products of
        # dW and dX (n·s·b + s·H·a + n·H·a): the larger of the two
        total += s * h * a + rows * h * a + rows * s * b
    if mode == "weights":
        total += 2 * s * h * b + 3 * s * h * a + n_local * h * a
    elif mode == "activations":
        total += 2 * n_max * (h * b + 8 + 2 * a) + 3 * n_max * h * a + s * h * a
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return total


def _single_rank_workspace_bytes(n, rows, h, v, a, b, grad_in_forward, gradient_rows) -> int:
    """The bound on one rank (module docstring), the larger over the two GEMM dtypes the strips'
    gradient may take: the accumulation dtype (strips formed in the kept buffer) or, for 16-bit
    inputs, the input dtype (a separate fp32 strip, rounded into the buffer)."""
    if n == 0 or v == 0:
        return 8 * n * a
    kinds = [(a, False)] + ([(b, True)] if b != a else [])
    best = 0
    for g, separate in kinds:
        group = gradient_rows or gradient_group_rows(rows, h, b, g, a, separate)
        group = min(group, -(-n // rows) * rows)
        total = group * v * g  # the kept rows of G (the strips are formed in them when g = a)
        total += rows * v * a if separate else 0  # the fp32 strip, rounded into G
        total += 2 * rows * v * a  # the eager fold's two temporaries of a strip's size
        total += group * h * a  # one group's fp32 dX product
        total += v * h * a  # the fp32 dW accumulator (with gradients in forward: kept until backward)
        total += 8 * n * a  # per-token vectors
        if not grad_in_forward:
            total += n * h * a  # the replay's fp32 dX (in forward dX is kept in the input dtype)
        if b != a:
            # fp32 copies of the weight and of a group's hidden rows (upcast GEMMs), or the fp32
            # products of 16-bit GEMMs that cannot add into fp32 in place
            total += v * h * a + group * h * a
        best = max(best, total)
    return best


def _with_grads_workspace_bytes(n_local, n_max, rows, h, v, p, a, b) -> int:
    """The bound with ``grad_in_forward`` in the activations schedule (module docstring)."""
    s = -(-v // p)
    total = p * rows * s * a  # the kept strips of one round (every chunk visiting this shard)
    total += rows * s * a  # one temporary: the eager fold's exponentials, or the 16-bit G
    # the unit dW, kept from forward to backward (the unit dX is kept in the input dtype: it
    # becomes the returned gradient)
    total += s * h * a
    total += 8 * n_max * a  # per-token vectors
    total += p * rows * (h * b + 8)  # the kept hidden rows and labels of the visiting chunks
    total += 3 * rows * h * a + 3 * rows * 2 * a + 9 * rows * a  # dX, pack and state hops
    if b != a:
        total += s * h * a + rows * h * a  # fp32 products of the 16-bit dW and dX GEMMs
    return total


# --------------------------------------------------------------------------------------------
# Ring plumbing
# --------------------------------------------------------------------------------------------


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if any(d == torch.float64 for d in dtypes) else torch.float32


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
_PROBED: dict = {}


def _probed(name: str, device: torch.device, dtype: torch.dtype, probe) -> bool:
    """``probe(device, dtype)`` once per (name, device type, dtype); an error counts as False."""
    key = (name, device.type, dtype)
    if key not in _PROBED:
        try:
            _PROBED[key] = bool(probe(device, dtype))
        except (RuntimeError, TypeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


def _mixed_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=fp32)`` runs for 16-bit ``a``, ``b`` here."""

    def probe(device, dtype):
        a = torch.zeros(16, 16, dtype=dtype, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32

    return _probed("mm", device, dtype, probe)


def _gemm_operand(w: torch.Tensor, h: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """The weight in the dtype the strip GEMMs take. Hidden and weight of one 16-bit dtype stay
    16-bit where a 16-bit GEMM can write an fp32 result (CUDA): fp32 strips at tensor-core speed
    with no fp32 copy of the shard. Elsewhere (and for mixed dtypes) both are upcast to ``acc``."""
    if w.dtype in _SIXTEEN_BIT and h.dtype == w.dtype and acc == torch.float32:
        if _mixed_gemm_supported(w.device, w.dtype):
            return w
    return w.to(acc)


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with an ``acc`` result (a 16-bit GEMM writes fp32 directly)."""
    return a @ b if a.dtype == acc else torch.mm(a, b, out_dtype=acc)


def _mixed_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=fp32, out=c)`` adds a 16-bit product into an fp32
    ``c`` in place here, for a plain and a transposed ``a`` (checked against the unfused sum)."""

    def probe(device, dtype):
        a = (torch.arange(256, device=device, dtype=torch.float32).view(16, 16) / 64).to(dtype)
        for left in (a, a.t()):
            c = torch.ones(16, 16, device=device)
            expected = c + torch.mm(left, a, out_dtype=torch.float32)
            torch.addmm(c, left, a, out_dtype=torch.float32, out=c)
            if not torch.allclose(c, expected, rtol=1e-6, atol=0):
                return False
        return True

    return _probed("addmm", device, dtype, probe)


def _accumulate_mm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for 16-bit ``a``, ``b`` and an fp32 ``total``: in place where the GEMM
    can add into fp32 (CUDA), else through an fp32 product (``_mm``) of ``total``'s size."""
    if _mixed_addmm_supported(a.device, a.dtype):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(_mm(a, b, total.dtype))


@dataclass
class _Ring:
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
                _STATS["bytes_sent"] += tensor.numel() * tensor.element_size()
        for i, tensor in enumerate(recvs):
            if tensor.numel() > 0:
                ops.append(dist.P2POp(dist.irecv, tensor, self.prev, self.group, tag + i))
        if not ops:
            return []
        _STATS["hops"] += 1
        return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _build_ring(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group,
    mode: str,
    ignore_index: int,
    grad_in_forward: bool = False,
) -> _Ring:
    world = 1 if group is None else dist.get_world_size(group)
    n_local, v_local, h_local = hidden.shape[0], weight_shard.shape[0], hidden.shape[1]
    labels = labels.to(torch.int64)

    valid = labels != ignore_index
    big = torch.iinfo(torch.int64).max
    sentinel_lo = torch.full((1,), big, dtype=torch.int64, device=labels.device)
    sentinel_hi = torch.full((1,), -big, dtype=torch.int64, device=labels.device)
    lab_min = torch.cat([torch.where(valid, labels, big), sentinel_lo]).amin()
    lab_max = torch.cat([torch.where(valid, labels, -big), sentinel_hi]).amax()

    if world == 1:
        lo, hi = int(lab_min), int(lab_max)
        if hi >= v_local or (lo < 0 and lo != big):
            raise ValueError(
                f"labels must lie in [0, {v_local}) or equal ignore_index={ignore_index}; "
                f"found values in [{lo}, {hi}]"
            )
        _STATS["last_mode"] = "single"
        return _Ring(None, 0, 1, 0, 0, [n_local], [v_local], [0], v_local, h_local, "single")

    rank = dist.get_rank(group)
    meta_device = hidden.device
    meta = torch.stack(
        [
            torch.tensor(n_local, dtype=torch.int64, device=meta_device),
            torch.tensor(v_local, dtype=torch.int64, device=meta_device),
            torch.tensor(h_local, dtype=torch.int64, device=meta_device),
            lab_min.to(meta_device),
            lab_max.to(meta_device),
            torch.tensor(_DTYPES.index(hidden.dtype), dtype=torch.int64, device=meta_device),
            torch.tensor(_DTYPES.index(weight_shard.dtype), dtype=torch.int64, device=meta_device),
        ]
    )
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    rows = torch.stack(gathered).cpu().tolist()  # the one host sync of a call

    num_tokens = [r[0] for r in rows]
    shard_sizes = [r[1] for r in rows]
    vocab_size = sum(shard_sizes)
    # Every check below uses gathered values only, so every rank raises the same error (no hang).
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
    if hi >= vocab_size or (lo < 0 and lo != big):
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"found values in [{lo}, {hi}] across the ring"
        )

    resolved = _resolve_mode(mode, max(num_tokens), vocab_size, world, grad_in_forward)
    _STATS["last_mode"] = resolved
    return _Ring(
        group=group,
        rank=rank,
        world=world,
        prev=dist.get_global_rank(group, (rank - 1) % world),
        next=dist.get_global_rank(group, (rank + 1) % world),
        num_tokens=num_tokens,
        shard_sizes=shard_sizes,
        shard_offsets=[s for s, _ in expected],
        vocab_size=vocab_size,
        hidden_size=h_local,
        mode=resolved,
    )


def _resolve_mode(mode: str, max_tokens: int, vocab_size: int, world: int,
                  grad_in_forward: bool) -> str:
    global _LOGGED_AUTO_CHOICE
    if mode != "auto":
        return mode
    choice = choose_ring_mode(max_tokens, vocab_size, world, grad_in_forward)
    if choice != _LOGGED_AUTO_CHOICE:  # once per process (and again only if the choice changes)
        _LOGGED_AUTO_CHOICE = choice
        logger.info(
            "Ring-DTP auto mode: max tokens per rank N=%d, V/P=%.1f (V=%d, P=%d) -> move %s",
            max_tokens,
            vocab_size / world,
            vocab_size,
            world,
            choice,
        )
    return choice


# --------------------------------------------------------------------------------------------
# Strip kernels (pure PyTorch, device-agnostic)
# --------------------------------------------------------------------------------------------


def _new_state(n: int, acc: torch.dtype, device) -> torch.Tensor:
    """A (3, n) state (m, z, y) equal to the identity of the fold: m = -inf, z = 0, y = 0."""
    state = torch.zeros(3, n, dtype=acc, device=device)
    state[0].fill_(-math.inf)
    return state


def _strips(h, w_op, chunk: Optional[int], acc):
    """Yield ``(a, b, h_chunk, strip)`` for the row chunks [a, b) of ``h``: ``strip`` is the fp32
    ``h[a:b] . w_op^T`` [rows, V_shard], the only strip alive; ``h_chunk`` is in ``w_op``'s dtype.
    Nothing is yielded for an empty batch or shard."""
    n, vo = h.shape[0], w_op.shape[0]
    if n == 0 or vo == 0:
        return
    step = chunk or n
    w_t = w_op.T
    for a in range(0, n, step):
        b = min(n, a + step)
        h_chunk = h[a:b].to(w_op.dtype)
        strip = _mm(h_chunk, w_t, acc)
        _note_strip(strip)
        yield a, b, h_chunk, strip
        del h_chunk, strip  # the caller has dropped them too: one strip alive at a time


def _local_targets(t: torch.Tensor, offset: int, shard_rows: int) -> torch.Tensor:
    """Each label as a column of the shard starting at ``offset``, or -1 outside it (other
    shards' labels and ``ignore_index``)."""
    local = t - offset
    return torch.where((local >= 0) & (local < shard_rows), local, torch.full_like(local, -1))


def _fold_shard(h, t, w_op, offset: int, state: torch.Tensor, chunk: Optional[int], acc) -> None:
    """Fold the strips ``h . w_op^T`` (rows chunked) into ``state`` in place; ``w_op`` is in the
    GEMM dtype (:func:`_gemm_operand`), the strips and the state in ``acc``."""
    targets = _local_targets(t, offset, w_op.shape[0])
    for a, b, _, strip in _strips(h, w_op, chunk, acc):
        fold_strip(strip, targets[a:b], state[:, a:b])
        del strip  # before the next strip is formed


def _merge_state(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- dst (+) src for two fold states over disjoint vocabulary parts."""
    m = torch.maximum(dst[0], src[0])
    z = dst[1] * rescale_running_sum(dst[0], m) + src[1] * rescale_running_sum(src[0], m)
    dst[2].add_(src[2])
    dst[1].copy_(z)
    dst[0].copy_(m)


def _grad_from_strip(strip, lse, targets, gscale, w_op, h_c, dx_acc, dw_acc, acc) -> None:
    """G = (softmax - onehot) * gscale from one strip (overwritten); dx_acc += G . w and
    dw_acc += G^T . h_c. The GEMMs run in ``w_op``'s dtype (:func:`_gemm_operand`); the
    accumulators are in ``acc``, and so is G for ``acc`` GEMMs (written over the strip) while
    16-bit GEMMs take G rounded to 16 bits, as a 16-bit output layer's backward does."""
    grad_strip = gradient_strip(strip, lse, targets, gscale, w_op.dtype)
    del strip
    if w_op.dtype == acc:
        dx_acc.addmm_(grad_strip, w_op)
        dw_acc.addmm_(grad_strip.T, h_c)
    else:  # 16-bit GEMMs with fp32 results, accumulated across chunks and shards
        _accumulate_mm(dx_acc, grad_strip, w_op)
        _accumulate_mm(dw_acc, grad_strip.T, h_c)


def _grad_shard(h, t, w_op, offset: int, lse, gscale, dx_acc, dw_acc, chunk: Optional[int], acc):
    """Replay the strips of one shard: dx_acc += G . w, dw_acc += G^T . h with G recomputed
    from the saved log-sum-exp (:func:`_grad_from_strip`)."""
    targets = _local_targets(t, offset, w_op.shape[0])
    for a, b, h_c, strip in _strips(h, w_op, chunk, acc):
        _grad_from_strip(strip, lse[a:b], targets[a:b], gscale[a:b], w_op, h_c, dx_acc[a:b],
                         dw_acc, acc)
        del strip, h_c


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


class _Chain:
    """The accumulator that travels one hop per ring step behind the main exchange: each rank
    adds its part to what arrived from its predecessor and sends the sum on; the wait for a hop
    happens only after the next step's strips are computed, so the transfer is hidden."""

    def __init__(self, ring: "_Ring", combine=torch.Tensor.add_):
        self.ring, self.combine = ring, combine
        self.works, self.incoming, self.outgoing = [], None, None

    def pass_on(self, part: torch.Tensor, new_receive_buffer) -> None:
        """Fold in what arrived (after the first step), then send ``part`` on and receive into
        ``new_receive_buffer()``, allocated only once the previous hop's buffers are released."""
        if self.incoming is not None:
            _wait(self.works)
            self.combine(part, self.incoming)
            self.incoming = self.outgoing = None
        self.incoming, self.outgoing = new_receive_buffer(), part
        self.works = self.ring.exchange([part], [self.incoming], _TAG_CHAIN)

    def finish(self) -> torch.Tensor:
        """The total that arrived with the last hop."""
        _wait(self.works)
        self.outgoing = None
        return self.incoming


def _single_forward(h, t, w, acc, chunk):
    state = _new_state(h.shape[0], acc, h.device)
    _fold_shard(h, t, _gemm_operand(w, h, acc), 0, state, chunk, acc)
    return state


def _single_backward(h, t, w, lse, gscale, acc, chunk, group_rows):
    dx = torch.zeros(h.shape[0], h.shape[1], dtype=acc, device=h.device)
    dw = torch.zeros(w.shape[0], w.shape[1], dtype=acc, device=w.device)
    _single_grouped(h, t, w, _gemm_operand(w, h, acc), acc, chunk, group_rows, gscale, dx, dw,
                    lse=lse)
    return dx, dw


def gradient_group_rows(chunk_rows: int, hidden_size: int, weight_bytes: int, grad_bytes: int,
                        acc_bytes: int = 4, separate_strip: bool = True) -> int:
    """Rows of the gradient strip G that one rank keeps for one weight-gradient GEMM (a multiple
    of ``chunk_rows``, at least one chunk).

    The weight gradient is accumulated in ``acc`` (fp32); every GEMM that adds into it reads and
    writes the whole s x H accumulator, whatever its token count K. G is therefore kept for as
    many chunks as fit, together with the fp32 strip being formed when that is a separate tensor
    (16-bit G), in the bytes of H input-dtype elements per vocabulary row: the size of the
    returned weight gradient, which the backward's rounding of the accumulator forms anyway.
    Per vocabulary row: rows * grad_bytes + (chunk_rows * acc_bytes if separate_strip) <=
    hidden_size * weight_bytes.
    """
    chunk_rows = max(1, int(chunk_rows))
    budget = int(hidden_size) * int(weight_bytes) - (chunk_rows * int(acc_bytes) if separate_strip else 0)
    return max(1, budget // (int(grad_bytes) * chunk_rows)) * chunk_rows


def check_gradient_rows(gradient_rows: Optional[int], chunk_tokens: Optional[int],
                        names=("gradient_rows", "chunk_tokens"), error_class=ValueError) -> None:
    """``gradient_rows`` is None or a positive multiple of ``chunk_tokens`` (which it needs);
    ``names`` are the two as the caller's user knows them (arguments, or flags)."""
    if gradient_rows is None:
        return
    rows_name, chunk_name = names
    if chunk_tokens is None:
        raise error_class(f"{rows_name} needs {chunk_name}: without chunks the whole batch is "
                          f"one strip and one group; add {chunk_name} or remove {rows_name}.")
    if int(gradient_rows) < 1 or int(gradient_rows) % int(chunk_tokens):
        raise error_class(f"{rows_name} must be a positive multiple of {chunk_name} "
                          f"({chunk_tokens}), got {gradient_rows}.")


def _single_grouped(h, t, w, w_op, acc, chunk, group_rows, gscale, dx, dw, state=None,
                    lse=None) -> None:
    """One rank's gradients, strip by strip; shared by the replay (``lse`` given) and gradients in
    forward (``state`` given: each strip is folded first, and its rows' log-sum-exp is then final).

    Each chunk's strip becomes its rows of G in a buffer of ``group_rows`` rows (None:
    ``gradient_group_rows``), in the GEMM dtype (for fp32 GEMMs the strip is formed in the buffer
    itself); once the buffer is full one GEMM gives the group's fp32 dX (written into ``dx``,
    rounded when ``dx`` is 16-bit) and one adds G^T . h into ``dw``: the fp32 accumulator is read
    and written once per group instead of once per chunk. Both callers group alike, so their GEMMs
    are the same."""
    n, hidden = h.shape
    vo = w_op.shape[0]
    if n == 0 or vo == 0:
        return
    step = chunk or n
    g_dtype = w_op.dtype
    separate = g_dtype != acc  # 16-bit G: the fp32 strip is formed apart, then rounded into G
    group = group_rows or gradient_group_rows(step, hidden, w.element_size(), g_dtype.itemsize,
                                              acc.itemsize, separate)
    group = min(group, -(-n // step) * step)
    buf = torch.empty(group, vo, dtype=g_dtype, device=h.device)
    targets = _local_targets(t, 0, vo)
    w_t = w_op.T
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        for a in range(g0, g1, step):
            b = min(g1, a + step)
            rows = buf[a - g0:b - g0]
            h_c = h[a:b].to(g_dtype)
            strip = _mm(h_c, w_t, acc) if separate else torch.mm(h_c, w_t, out=rows)
            _note_strip(strip)
            del h_c
            if state is not None:
                fold_strip(strip, targets[a:b], state[:, a:b])
                gradient_strip_after_fold(strip, state[:, a:b], targets[a:b], gscale[a:b],
                                          g_dtype, out=rows)
            else:
                gradient_strip(strip, lse[a:b], targets[a:b], gscale[a:b], g_dtype, out=rows)
            del strip, rows
        grad = buf[:g1 - g0]
        h_g = h[g0:g1].to(g_dtype)
        dx[g0:g1] = _mm(grad, w_op, acc)
        if g_dtype == acc:
            dw.addmm_(grad.T, h_g)
        else:
            _accumulate_mm(dw, grad.T, h_g)
        _STATS["weight_grad_gemms"] += 1
        del grad, h_g


def _weights_forward(ring: _Ring, h, t, w, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    state = _new_state(h.shape[0], acc, h.device)
    bufs = [None, None]
    cur = w
    for s in range(P):
        owner = (r - s) % P
        works, nxt = [], None
        if s < P - 1:  # post the next hop before computing this one
            if bufs[s % 2] is None:
                bufs[s % 2] = torch.empty(max(ring.shard_sizes), H, dtype=w.dtype, device=w.device)
            nxt = bufs[s % 2][: ring.shard_sizes[(r - s - 1) % P]]
            works = ring.exchange([cur], [nxt], _TAG_MAIN)
        if h.shape[0] > 0 and cur.shape[0] > 0:
            _fold_shard(h, t, _gemm_operand(cur, h, acc), ring.shard_offsets[owner], state, chunk, acc)
        _wait(works)
        cur = nxt
    return state


def _weights_backward(ring: _Ring, h, t, w, lse, gscale, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    dx = torch.zeros(h.shape[0], H, dtype=acc, device=h.device)
    bufs = [None, None]
    cur = w
    chain = _Chain(ring)
    for s in range(P):
        owner = (r - s) % P
        works, nxt = [], None
        if s < P - 1:
            if bufs[s % 2] is None:
                bufs[s % 2] = torch.empty(max(ring.shard_sizes), H, dtype=w.dtype, device=w.device)
            nxt = bufs[s % 2][: ring.shard_sizes[(r - s - 1) % P]]
            works = ring.exchange([cur], [nxt], _TAG_MAIN)
        contrib = torch.zeros(ring.shard_sizes[owner], H, dtype=acc, device=w.device)
        if h.shape[0] > 0 and cur.shape[0] > 0:
            offset = ring.shard_offsets[owner]
            _grad_shard(h, t, _gemm_operand(cur, h, acc), offset, lse, gscale, dx, contrib, chunk, acc)
        # Add the accumulator of shard ``owner`` from the ranks before us and pass it on; at
        # s = P - 1 the successor is the owner, and we receive our own shard's total.
        next_rows = ring.shard_sizes[(r - s - 1) % P]
        chain.pass_on(contrib, lambda: torch.empty(next_rows, H, dtype=acc, device=w.device))
        _wait(works)
        cur = nxt
    return dx, chain.finish()


def _activations_forward(ring: _Ring, h, t, w, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    w_op = _gemm_operand(w, h, acc)
    offset = ring.shard_offsets[r]
    hbufs, tbufs = [None, None], [None, None]
    cur_h, cur_t = h, t
    chain = _Chain(ring, combine=_merge_state)
    for s in range(P):
        works, nxt_h, nxt_t = [], None, None
        if s < P - 1:
            k, n_next = s % 2, ring.num_tokens[(r - s - 1) % P]
            if hbufs[k] is None:
                hbufs[k] = torch.empty(n_max, H, dtype=h.dtype, device=h.device)
                tbufs[k] = torch.empty(n_max, dtype=torch.int64, device=h.device)
            nxt_h, nxt_t = hbufs[k][:n_next], tbufs[k][:n_next]
            works = ring.exchange([cur_h, cur_t], [nxt_h, nxt_t], _TAG_MAIN)
        part = _new_state(cur_h.shape[0], acc, h.device)
        _fold_shard(cur_h, cur_t, w_op, offset, part, chunk, acc)
        # Merge the state of the visiting batch folded by the ranks before us and pass it on; at
        # s = P - 1 the successor is the batch's home, and we receive our own final state.
        next_tokens = ring.num_tokens[(r - s - 1) % P]
        chain.pass_on(part, lambda: _new_state(next_tokens, acc, h.device))
        _wait(works)
        cur_h, cur_t = nxt_h, nxt_t
    return chain.finish()


def _activations_backward(ring: _Ring, h, t, w, lse, gscale, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    w_op = _gemm_operand(w, h, acc)
    offset = ring.shard_offsets[r]
    dw = torch.zeros(w.shape[0], H, dtype=acc, device=w.device)
    hbufs, tbufs, pbufs = [None, None], [None, None], [None, None]
    cur_h, cur_t, cur_p = h, t, torch.stack([lse, gscale])  # pack: (2, n) = (lse, grad scale)
    chain = _Chain(ring)
    for s in range(P):
        works, nxt = [], (None, None, None)
        if s < P - 1:
            k, n_next = s % 2, ring.num_tokens[(r - s - 1) % P]
            if hbufs[k] is None:
                hbufs[k] = torch.empty(n_max, H, dtype=h.dtype, device=h.device)
                tbufs[k] = torch.empty(n_max, dtype=torch.int64, device=h.device)
                pbufs[k] = torch.empty(2 * n_max, dtype=acc, device=h.device)
            nxt = (hbufs[k][:n_next], tbufs[k][:n_next], pbufs[k][: 2 * n_next].view(2, n_next))
            works = ring.exchange([cur_h, cur_t, cur_p], list(nxt), _TAG_MAIN)
        part = torch.zeros(cur_h.shape[0], H, dtype=acc, device=h.device)
        _grad_shard(cur_h, cur_t, w_op, offset, cur_p[0], cur_p[1], part, dw, chunk, acc)
        # Add the dX of the visiting batch from the shards before ours and pass it on home.
        next_tokens = ring.num_tokens[(r - s - 1) % P]
        chain.pass_on(part, lambda: torch.empty(next_tokens, H, dtype=acc, device=h.device))
        _wait(works)
        cur_h, cur_t, cur_p = nxt
    return chain.finish(), dw


# ----------------------------------------------------------------------------------------------
# Gradients in forward (grad_in_forward): three GEMMs per strip instead of four
# ----------------------------------------------------------------------------------------------


def _single_with_grads(h, t, w, valid, acc, chunk, group_rows):
    """One rank: per row chunk, the full-vocabulary strip is folded and, its log-sum-exp being
    final at once, turned into the unit gradient (1 per valid token) of dX and dW
    (:func:`_single_grouped`)."""
    n, H = h.shape
    state = _new_state(n, acc, h.device)
    dx = torch.empty(n, H, dtype=h.dtype, device=h.device)  # each group's, rounded once
    dw = torch.zeros(w.shape[0], H, dtype=acc, device=w.device)
    _single_grouped(h, t, w, _gemm_operand(w, h, acc), acc, chunk, group_rows, valid.to(acc), dx,
                    dw, state=state)
    return state, dx, dw


def _activations_with_grads(ring: _Ring, h, t, w, valid, acc, chunk):
    """The activations schedule with gradients in forward, one round per row chunk of n tokens.

    Lap 1: every rank's chunk visits every shard (as in ``_activations_forward``) and each rank
    KEEPS the strip it formed for each visiting chunk, with that chunk's hidden rows and labels.
    After the lap each chunk's state is final at home. Lap 2: the chunk's (lse, unit gradient
    scale) travel the same way; each rank turns its kept strip into G, adds G . W_r to the dX
    accumulator travelling home and G^T . h to its own dW. Every strip is formed once.
    """
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    step = chunk or max(n_max, 1)  # every rank may hold no token
    w_op = _gemm_operand(w, h, acc)
    offset, shard_rows = ring.shard_offsets[r], w.shape[0]
    n_local = h.shape[0]
    state = _new_state(n_local, acc, h.device)
    dx = torch.empty(n_local, H, dtype=h.dtype, device=h.device)  # each chunk's, rounded once
    dw = torch.zeros(shard_rows, H, dtype=acc, device=w.device)
    unit = valid.to(acc)
    for start in range(0, n_max, step):
        rows = [max(0, min(step, n_q - start)) for n_q in ring.num_tokens]
        a, b = start, start + rows[r]
        kept = {}  # origin -> (its hidden rows in the GEMM dtype, targets in this shard, strip)
        cur_h, cur_t = h[a:b], t[a:b]
        chain = _Chain(ring, combine=_merge_state)
        for s in range(P):
            origin = (r - s) % P
            works, nxt_h, nxt_t = [], None, None
            if s < P - 1:  # the hidden rows are kept, so every hop gets fresh receive buffers
                n_next = rows[(r - s - 1) % P]
                nxt_h = torch.empty(n_next, H, dtype=h.dtype, device=h.device)
                nxt_t = torch.empty(n_next, dtype=torch.int64, device=h.device)
                works = ring.exchange([cur_h, cur_t], [nxt_h, nxt_t], _TAG_MAIN)
            part = _new_state(cur_h.shape[0], acc, h.device)
            targets = _local_targets(cur_t, offset, shard_rows)
            strip = None
            if cur_h.shape[0] > 0 and shard_rows > 0:
                h_op = cur_h.to(w_op.dtype)
                strip = _mm(h_op, w_op.T, acc)
                _note_strip(strip)
                fold_strip(strip, targets, part)
                kept[origin] = (h_op, targets, strip)
            next_tokens = rows[(r - s - 1) % P]
            chain.pass_on(part, lambda: _new_state(next_tokens, acc, h.device))
            _wait(works)
            cur_h, cur_t = nxt_h, nxt_t
            del strip
        state[:, a:b] = chain.finish()

        lse = state[0, a:b] + torch.log(state[1, a:b])
        cur_p = torch.stack([lse, unit[a:b]])  # (2, n): (lse, gradient scale) of a chunk
        chain = _Chain(ring)
        for s in range(P):
            origin = (r - s) % P
            works, nxt_p = [], None
            if s < P - 1:
                nxt_p = torch.empty(2, rows[(r - s - 1) % P], dtype=acc, device=h.device)
                works = ring.exchange([cur_p], [nxt_p], _TAG_MAIN)
            part = torch.zeros(rows[origin], H, dtype=acc, device=h.device)
            if origin in kept:
                h_op, targets, strip = kept.pop(origin)
                _grad_from_strip(strip, cur_p[0], targets, cur_p[1], w_op, h_op, part, dw, acc)
                del h_op, targets, strip
            next_tokens = rows[(r - s - 1) % P]
            chain.pass_on(part, lambda: torch.empty(next_tokens, H, dtype=acc, device=h.device))
            _wait(works)
            cur_p = nxt_p
        dx[a:b] = chain.finish()
    return state, dx, dw


def _common_gradient_scale(ring: _Ring, grad_loss: torch.Tensor, valid: torch.Tensor) -> Optional[float]:
    """The one value every valid token's loss gradient has on every rank of the ring, or None
    when they differ (then gradients computed in forward for a unit scale do not apply).
    All ranks take part and reach the same answer (one small all-gather)."""
    g = grad_loss.to(torch.float64)
    has_valid = valid.any()
    first = g[torch.argmax(valid.to(torch.int8))] if valid.numel() else g.new_zeros(())
    uniform = torch.where(valid, g == first, torch.ones_like(valid)).all()
    mine = torch.stack([has_valid.to(torch.float64), first, uniform.to(torch.float64)])
    if ring.world == 1:
        rows = [mine.tolist()]
    else:
        gathered = [torch.empty_like(mine) for _ in range(ring.world)]
        dist.all_gather(gathered, mine, group=ring.group)
        rows = torch.stack(gathered).cpu().tolist()
    scales = {row[1] for row in rows if row[0]}
    if not all(row[2] for row in rows) or len(scales) > 1:
        return None
    return scales.pop() if scales else 0.0


def _scaled(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` in ``dtype``: in place when ``grad`` has it, else rounded as it is
    written (one pass over the fp32 ``grad``, the same values as scaling it and then rounding)."""
    if grad.dtype == dtype:
        return grad.mul_(scale)
    return torch.mul(grad, scale, out=torch.empty_like(grad, dtype=dtype))


# the schedules that can compute the gradients in forward (see grad_in_forward)
_GRAD_IN_FORWARD_MODES = ("single", "activations")
_LOGGED_REPLAY = False


_FORWARD = {
    "single": _single_forward,
    "weights": _weights_forward,
    "activations": _activations_forward,
}
_BACKWARD = {
    "single": _single_backward,
    "weights": _weights_backward,
    "activations": _activations_backward,
}


class _RingDTPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight_shard, labels, ring: _Ring, chunk, ignore_index, grad_in_forward,
                gradient_rows):
        acc = _acc_dtype(hidden.dtype, weight_shard.dtype)
        h = hidden.contiguous()
        w = weight_shard.contiguous()
        t = labels.to(torch.int64).contiguous()
        valid = t != ignore_index
        # (ring_dtp_cross_entropy already turned it off where autograd will not differentiate)
        ctx.with_grads = grad_in_forward and ring.mode in _GRAD_IN_FORWARD_MODES
        unit_grads = ()
        if ctx.with_grads:
            if ring.mode == "single":
                state, dx, dw = _single_with_grads(h, t, w, valid, acc, chunk, gradient_rows)
            else:
                state, dx, dw = _activations_with_grads(ring, h, t, w, valid, acc, chunk)
            unit_grads = (dx, dw)
        elif ring.mode == "single":
            state = _single_forward(h, t, w, acc, chunk)
        else:
            state = _FORWARD[ring.mode](ring, h, t, w, acc, chunk)
        lse = state[0] + torch.log(state[1])
        loss = torch.where(valid, lse - state[2], torch.zeros_like(lse))
        ctx.save_for_backward(h, w, t, lse, *unit_grads)
        ctx.ring, ctx.chunk, ctx.ignore_index, ctx.acc = ring, chunk, ignore_index, acc
        ctx.gradient_rows = gradient_rows
        ctx.dtypes = (hidden.dtype, weight_shard.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        global _LOGGED_REPLAY
        h, w, t, lse, *unit_grads = ctx.saved_tensors
        ring, acc = ctx.ring, ctx.acc
        valid = t != ctx.ignore_index
        scale = _common_gradient_scale(ring, grad_loss, valid) if ctx.with_grads else None
        if scale is not None:
            dx, dw = (_scaled(g, scale, d) for g, d in zip(unit_grads, ctx.dtypes))
        else:
            if ctx.with_grads and not _LOGGED_REPLAY:
                _LOGGED_REPLAY = True
                logger.warning(
                    "Ring-DTP grad_in_forward: the loss gradient is not one value for every valid "
                    "token on every rank, so the gradients computed in forward do not apply; "
                    "replaying the strips (exact, one more GEMM per strip). Fold per-token "
                    "weights into ignore_index, or reduce the loss by a sum or mean."
                )
            gscale = torch.where(valid, grad_loss.to(acc), torch.zeros((), dtype=acc, device=h.device))
            if ring.mode == "single":
                dx, dw = _single_backward(h, t, w, lse, gscale, acc, ctx.chunk, ctx.gradient_rows)
            else:
                dx, dw = _BACKWARD[ring.mode](ring, h, t, w, lse, gscale, acc, ctx.chunk)
        dx = dx.to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = dw.to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def ring_dtp_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    mode: str = "auto",
    chunk_tokens: Optional[int] = None,
    ignore_index: int = -100,
    grad_in_forward: bool = False,
    gradient_rows: Optional[int] = None,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ W^T`` over the full vocabulary, W sharded on a ring.

    Args:
        hidden: [N, H] this rank's tokens (N may differ across ranks, and may be 0).
        weight_shard: [V_r, H] rows ``vocab_shard_range(V, r, P)`` of the full weight, r = rank in
            ``group``.
        labels: [N] target ids in [0, V), or ``ignore_index`` (loss 0, no gradient).
        group: the P ranks of the ring; ``None`` (or a single-rank group) means one rank.
        mode: ``"weights"``, ``"activations"`` or ``"auto"`` (see the module docstring).
        chunk_tokens: rows per strip; bounds the live strip to chunk_tokens x ceil(V/P).
        ignore_index: label value that marks ignored tokens.
        grad_in_forward: compute the gradients during the forward for a loss gradient of one
            value on every valid token of every rank (a sum or mean of the losses; the backward
            then scales them), forming every strip once instead of twice: three GEMMs per strip
            instead of four. Takes effect in the single-rank and ``activations`` schedules,
            which ``auto`` then picks (the ``weights`` schedule would have to keep every strip
            of a token until the last shard has visited). If the backward's gradient is not
            uniform, the strips are replayed as without it (exact either way; a warning says so
            once).
        gradient_rows: one rank (P = 1) only: rows of the gradient strip G kept for each
            weight-gradient GEMM, a multiple of ``chunk_tokens``; None: as many as fit in the
            bytes of the returned weight gradient (``gradient_group_rows``). More rows mean
            fewer GEMMs adding into the fp32 dW accumulator, for (rows - default) x V x b more
            bytes (``ring_dtp_workspace_bytes`` with the same ``gradient_rows``).

    Returns:
        [N] loss in fp32 (fp64 if an input is fp64), differentiable w.r.t. ``hidden`` and
        ``weight_shard``. Every rank of ``group`` must call this (and later its backward) together.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
    check_gradient_rows(gradient_rows, chunk_tokens)
    if hidden.dim() != 2 or weight_shard.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "expected hidden [N, H], weight_shard [V_r, H], labels [N]; got shapes "
            f"{tuple(hidden.shape)}, {tuple(weight_shard.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight_shard.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, "
            f"weight_shard {tuple(weight_shard.shape)}, labels {tuple(labels.shape)}"
        )
    if hidden.dtype not in _DTYPES or weight_shard.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtypes {hidden.dtype}, {weight_shard.dtype}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    # no gradients are computed in forward for a forward that autograd will not differentiate
    # (evaluation under no_grad: a Function's needs_input_grad does not see the grad mode)
    grad_in_forward = bool(grad_in_forward) and torch.is_grad_enabled() and (
        hidden.requires_grad or weight_shard.requires_grad)
    ring = _build_ring(hidden, weight_shard, labels, group, mode, ignore_index, grad_in_forward)
    chunk = None if chunk_tokens is None else int(chunk_tokens)
    rows = None if gradient_rows is None else int(gradient_rows)
    return _RingDTPFunction.apply(hidden, weight_shard, labels, ring, chunk, ignore_index,
                                  grad_in_forward, rows)
