"""Ring-DTP's two ring schedules, forward and backward: the weight shards travel (``weights``) or
the tokens do (``activations``, also with the gradients computed in forward).
Derivation: docs/operators/ring_dtp.md.
"""

from __future__ import annotations

import torch

# through the module, so every schedule calls the one binding of ``strips.mm`` (which the tests
# rebind to emulate the CUDA GEMM on CPU)
import megatron.bounded.loss.ring_dtp.strips as strips
from megatron.bounded.loss.ring_dtp.kernels import fold_strip
from megatron.bounded.loss.ring_dtp.ring import TAG_MAIN, Chain, Ring, wait


def weights_forward(ring: Ring, h, t, w, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    state = strips.new_state(h.shape[0], acc, h.device)
    bufs = [None, None]
    cur = w
    for s in range(P):
        owner = (r - s) % P
        works, nxt = [], None
        if s < P - 1:  # post the next hop before computing this one
            if bufs[s % 2] is None:
                bufs[s % 2] = torch.empty(max(ring.shard_sizes), H, dtype=w.dtype, device=w.device)
            nxt = bufs[s % 2][: ring.shard_sizes[(r - s - 1) % P]]
            works = ring.exchange([cur], [nxt], TAG_MAIN)
        if h.shape[0] > 0 and cur.shape[0] > 0:
            strips.fold_shard(h, t, strips.gemm_operand(cur, h, acc), ring.shard_offsets[owner],
                              state, chunk, acc)
        wait(works)
        cur = nxt
    return state


def weights_backward(ring: Ring, h, t, w, lse, gscale, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    dx = torch.zeros(h.shape[0], H, dtype=acc, device=h.device)
    bufs = [None, None]
    cur = w
    chain = Chain(ring)
    for s in range(P):
        owner = (r - s) % P
        works, nxt = [], None
        if s < P - 1:
            if bufs[s % 2] is None:
                bufs[s % 2] = torch.empty(max(ring.shard_sizes), H, dtype=w.dtype, device=w.device)
            nxt = bufs[s % 2][: ring.shard_sizes[(r - s - 1) % P]]
            works = ring.exchange([cur], [nxt], TAG_MAIN)
        contrib = torch.zeros(ring.shard_sizes[owner], H, dtype=acc, device=w.device)
        if h.shape[0] > 0 and cur.shape[0] > 0:
            offset = ring.shard_offsets[owner]
            strips.grad_shard(h, t, strips.gemm_operand(cur, h, acc), offset, lse, gscale, dx,
                              contrib, chunk, acc)
        # Add the accumulator of shard ``owner`` from the ranks before us and pass it on; at
        # s = P - 1 the successor is the owner, and we receive our own shard's total.
        next_rows = ring.shard_sizes[(r - s - 1) % P]
        chain.pass_on(contrib, lambda: torch.empty(next_rows, H, dtype=acc, device=w.device))
        wait(works)
        cur = nxt
    return dx, chain.finish()


def activations_forward(ring: Ring, h, t, w, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    w_op = strips.gemm_operand(w, h, acc)
    offset = ring.shard_offsets[r]
    hbufs, tbufs = [None, None], [None, None]
    cur_h, cur_t = h, t
    chain = Chain(ring, combine=strips.merge_state)
    for s in range(P):
        works, nxt_h, nxt_t = [], None, None
        if s < P - 1:
            k, n_next = s % 2, ring.num_tokens[(r - s - 1) % P]
            if hbufs[k] is None:
                hbufs[k] = torch.empty(n_max, H, dtype=h.dtype, device=h.device)
                tbufs[k] = torch.empty(n_max, dtype=torch.int64, device=h.device)
            nxt_h, nxt_t = hbufs[k][:n_next], tbufs[k][:n_next]
            works = ring.exchange([cur_h, cur_t], [nxt_h, nxt_t], TAG_MAIN)
        part = strips.new_state(cur_h.shape[0], acc, h.device)
        strips.fold_shard(cur_h, cur_t, w_op, offset, part, chunk, acc)
        # Merge the state of the visiting batch folded by the ranks before us and pass it on; at
        # s = P - 1 the successor is the batch's home, and we receive our own final state.
        next_tokens = ring.num_tokens[(r - s - 1) % P]
        chain.pass_on(part, lambda: strips.new_state(next_tokens, acc, h.device))
        wait(works)
        cur_h, cur_t = nxt_h, nxt_t
    return chain.finish()


def activations_backward(ring: Ring, h, t, w, lse, gscale, acc, chunk):
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    w_op = strips.gemm_operand(w, h, acc)
    offset = ring.shard_offsets[r]
    dw = torch.zeros(w.shape[0], H, dtype=acc, device=w.device)
    hbufs, tbufs, pbufs = [None, None], [None, None], [None, None]
    cur_h, cur_t, cur_p = h, t, torch.stack([lse, gscale])  # pack: (2, n) = (lse, grad scale)
    chain = Chain(ring)
    for s in range(P):
        works, nxt = [], (None, None, None)
        if s < P - 1:
            k, n_next = s % 2, ring.num_tokens[(r - s - 1) % P]
            if hbufs[k] is None:
                hbufs[k] = torch.empty(n_max, H, dtype=h.dtype, device=h.device)
                tbufs[k] = torch.empty(n_max, dtype=torch.int64, device=h.device)
                pbufs[k] = torch.empty(2 * n_max, dtype=acc, device=h.device)
            nxt = (hbufs[k][:n_next], tbufs[k][:n_next], pbufs[k][: 2 * n_next].view(2, n_next))
            works = ring.exchange([cur_h, cur_t, cur_p], list(nxt), TAG_MAIN)
        part = torch.zeros(cur_h.shape[0], H, dtype=acc, device=h.device)
        strips.grad_shard(cur_h, cur_t, w_op, offset, cur_p[0], cur_p[1], part, dw, chunk, acc)
        # Add the dX of the visiting batch from the shards before ours and pass it on home.
        next_tokens = ring.num_tokens[(r - s - 1) % P]
        chain.pass_on(part, lambda: torch.empty(next_tokens, H, dtype=acc, device=h.device))
        wait(works)
        cur_h, cur_t, cur_p = nxt
    return chain.finish(), dw


def activations_with_grads(ring: Ring, h, t, w, valid, acc, chunk):
    """The activations schedule with gradients in forward, one round per row chunk of n tokens.

    Lap 1: every rank's chunk visits every shard (as in ``activations_forward``) and each rank
    KEEPS the strip it formed for each visiting chunk, with that chunk's hidden rows and labels.
    After the lap each chunk's state is final at home. Lap 2: the chunk's (lse, unit gradient
    scale) travel the same way; each rank turns its kept strip into G, adds G . W_r to the dX
    accumulator travelling home and G^T . h to its own dW. Every strip is formed once.
    """
    P, r, H = ring.world, ring.rank, ring.hidden_size
    n_max = max(ring.num_tokens)
    step = chunk or max(n_max, 1)  # every rank may hold no token
    w_op = strips.gemm_operand(w, h, acc)
    offset, shard_rows = ring.shard_offsets[r], w.shape[0]
    n_local = h.shape[0]
    state = strips.new_state(n_local, acc, h.device)
    dx = torch.empty(n_local, H, dtype=h.dtype, device=h.device)  # each chunk's, rounded once
    dw = torch.zeros(shard_rows, H, dtype=acc, device=w.device)
    unit = valid.to(acc)
    for start in range(0, n_max, step):
        rows = [max(0, min(step, n_q - start)) for n_q in ring.num_tokens]
        a, b = start, start + rows[r]
        kept = {}  # origin -> (its hidden rows in the GEMM dtype, targets in this shard, strip)
        cur_h, cur_t = h[a:b], t[a:b]
        chain = Chain(ring, combine=strips.merge_state)
        for s in range(P):
            origin = (r - s) % P
            works, nxt_h, nxt_t = [], None, None
            if s < P - 1:  # the hidden rows are kept, so every hop gets fresh receive buffers
                n_next = rows[(r - s - 1) % P]
                nxt_h = torch.empty(n_next, H, dtype=h.dtype, device=h.device)
                nxt_t = torch.empty(n_next, dtype=torch.int64, device=h.device)
                works = ring.exchange([cur_h, cur_t], [nxt_h, nxt_t], TAG_MAIN)
            part = strips.new_state(cur_h.shape[0], acc, h.device)
            targets = strips.local_targets(cur_t, offset, shard_rows)
            strip = None
            if cur_h.shape[0] > 0 and shard_rows > 0:
                h_op = cur_h.to(w_op.dtype)
                strip = strips.mm(h_op, w_op.T, acc)
                strips.note_strip(strip)
                fold_strip(strip, targets, part)
                kept[origin] = (h_op, targets, strip)
            next_tokens = rows[(r - s - 1) % P]
            chain.pass_on(part, lambda: strips.new_state(next_tokens, acc, h.device))
            wait(works)
            cur_h, cur_t = nxt_h, nxt_t
            del strip
        state[:, a:b] = chain.finish()

        lse = state[0, a:b] + torch.log(state[1, a:b])
        cur_p = torch.stack([lse, unit[a:b]])  # (2, n): (lse, gradient scale) of a chunk
        chain = Chain(ring)
        for s in range(P):
            origin = (r - s) % P
            works, nxt_p = [], None
            if s < P - 1:
                nxt_p = torch.empty(2, rows[(r - s - 1) % P], dtype=acc, device=h.device)
                works = ring.exchange([cur_p], [nxt_p], TAG_MAIN)
            part = torch.zeros(rows[origin], H, dtype=acc, device=h.device)
            if origin in kept:
                h_op, targets, strip = kept.pop(origin)
                strips.grad_from_strip(strip, cur_p[0], targets, cur_p[1], w_op, h_op, part, dw,
                                       acc)
                del h_op, targets, strip
            next_tokens = rows[(r - s - 1) % P]
            chain.pass_on(part, lambda: torch.empty(next_tokens, H, dtype=acc, device=h.device))
            wait(works)
            cur_p = nxt_p
        dx[a:b] = chain.finish()
    return state, dx, dw
