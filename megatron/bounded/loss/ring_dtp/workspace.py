"""The bound of Ring-DTP's transient working set on one rank, term by term in
docs/operators/ring_dtp.md ("Memory bound")."""

from __future__ import annotations

from typing import Optional

from megatron.bounded.loss.ring_dtp.ring import MODES, choose_ring_mode
from megatron.bounded.loss.ring_dtp.single import gradient_group_rows


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
    cuda_kernels: bool = False,
) -> int:
    """Upper bound (bytes) of Ring-DTP's transient working set on one rank, term by term in
    docs/operators/ring_dtp.md.

    Inputs and the returned gradients are not included. ``num_tokens`` is this rank's N,
    ``max_tokens`` the largest N on the ring (defaults to ``num_tokens``); ``mode="auto"`` is
    resolved with :func:`choose_ring_mode`. ``cuda_kernels``: one rank on CUDA with Triton (the
    strip kernels of ``kernels``, 16-bit GEMMs writing fp32 and adding into it in place),
    what training runs; otherwise the bound covers the eager paths too.
    """
    n_local = int(num_tokens)
    n_max = int(max_tokens) if max_tokens is not None else n_local
    h, v, p = int(hidden_size), int(vocab_size), int(world_size)
    a, b = int(acc_bytes), int(input_bytes)
    s = -(-v // p)
    rows = n_max if chunk_tokens is None else min(int(chunk_tokens), n_max)
    if p == 1:
        return _single_rank_workspace_bytes(n_local, rows, h, v, a, b, grad_in_forward,
                                            gradient_rows, cuda_kernels)
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


def _single_rank_workspace_bytes(n, rows, h, v, a, b, grad_in_forward, gradient_rows,
                                 cuda_kernels) -> int:
    """The bound on one rank, the larger over the two GEMM dtypes the strips' gradient may take:
    the accumulation dtype (strips formed in the kept buffer) or, for 16-bit inputs, the input
    dtype (a separate fp32 strip, rounded into the buffer). With ``cuda_kernels`` only the
    input dtype (16-bit GEMMs writing fp32), and neither the eager fold's temporaries nor fp32
    copies or products exist."""
    if n == 0 or v == 0:
        return 8 * n * a
    if cuda_kernels:
        kinds = [(b, b != a)]
    else:
        kinds = [(a, False)] + ([(b, True)] if b != a else [])
    best = 0
    for g, separate in kinds:
        group = gradient_rows or gradient_group_rows(rows, h, b, g, a, separate)
        group = min(group, -(-n // rows) * rows)
        total = group * v * g  # the kept rows of G (the strips are formed in them when g = a)
        total += rows * v * a if separate else 0  # the fp32 strip, rounded into G
        total += group * h * a  # one group's fp32 dX product
        total += v * h * a  # the fp32 dW accumulator (with gradients in forward: kept until backward)
        total += 8 * n * a  # per-token vectors (dX is written in the input dtype: returned)
        if not cuda_kernels:
            total += 2 * rows * v * a  # the eager fold's two temporaries of a strip's size
        if b != a and not cuda_kernels:
            # fp32 copies of the weight and of a group's hidden rows (upcast GEMMs), or the fp32
            # products of 16-bit GEMMs that cannot add into fp32 in place
            total += v * h * a + group * h * a
        best = max(best, total)
    return best


def _with_grads_workspace_bytes(n_local, n_max, rows, h, v, p, a, b) -> int:
    """The bound with ``grad_in_forward`` in the activations schedule."""
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
