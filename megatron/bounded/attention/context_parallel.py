"""Context parallelism for the TE-free attention: a sequence-to-head all-to-all (Ulysses).

With ``--context-parallel-size CP`` upstream's data path gives every rank of the context-parallel
group its zigzag share of each sequence: the sequence is cut into 2·CP equal chunks and rank r
keeps chunks r and 2·CP−1−r (``megatron.core.utils.get_batch_on_this_cp_rank``), s = S/CP tokens.
Everything outside attention is token-wise and runs on those s tokens. Attention needs the whole
sequence, so :func:`sequence_to_heads` trades the split: one all-to-all sends head group j of the
local tokens to rank j, which then holds all S tokens (reordered from the zigzag to the natural
order) for H/CP heads and runs ordinary causal attention on them; :func:`heads_to_sequence` is the
inverse all-to-all of the result. This is the sequence-head all-to-all of the paper's rank layout
(upstream's ``--cp-comm-type a2a`` does the same through Transformer Engine).

Key/value heads are split the same way. When the G query groups do not divide over CP, every
group is repeated r = lcm(G, CP)/G times first (so query head i still meets its own group; the
repeats' gradients sum back in the backward pass).

Memory bound per layer, in elements: the local q, k, v (s·b·(H + 2G')·d, G' = G or lcm(G, CP))
are packed once, exchanged once and reordered once, so the transient is 3·s·b·(H + 2G')·d, and
the attention output takes 2·s·b·H·d on its way back; the attention kernel then holds
S·b·(H + 2G')/CP·d = s·b·(H + 2G')·d, the same count as the local tensors. Nothing grows with S².
Tests: ``tests/unit/attention/test_ulysses.py`` (gloo, 2 and 4 ranks: values and gradients equal to
single-rank attention on the whole sequence).
"""

from __future__ import annotations

import math

import torch

from megatron.bounded.kernels.collectives import all_to_all_rows, permute_rows

__all__ = ["zigzag_to_natural", "expanded_query_groups", "sequence_to_heads", "heads_to_sequence"]


def zigzag_to_natural(cp_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk permutations between the rank order of an all-gathered sequence and the natural one.

    After the all-to-all, rank i's two chunks (i and 2·CP−1−i) sit at positions 2i and 2i+1.
    Returns ``(natural_from_gathered, gathered_from_natural)``: ``natural[c] =
    gathered[natural_from_gathered[c]]`` and the inverse.
    """
    chunks = 2 * cp_size
    position_of_chunk = [2 * c if c < cp_size else 2 * (chunks - 1 - c) + 1 for c in range(chunks)]
    natural_from_gathered = torch.tensor(position_of_chunk, dtype=torch.int64, device=device)
    gathered_from_natural = torch.empty_like(natural_from_gathered)
    gathered_from_natural[natural_from_gathered] = torch.arange(chunks, device=device)
    return natural_from_gathered, gathered_from_natural


def expanded_query_groups(num_query_groups: int, cp_size: int) -> int:
    """Key/value heads after repetition so that they split evenly over ``cp_size`` ranks."""
    if num_query_groups % cp_size == 0:
        return num_query_groups
    return num_query_groups * cp_size // math.gcd(num_query_groups, cp_size)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, b, h, d]`` (this rank's zigzag tokens, all heads) -> ``[S, b, h/CP, d]`` (the whole
    sequence in natural order, this rank's head group). Differentiable."""
    cp_size = group.size()
    seq, batch, heads, dim = x.shape
    if heads % cp_size or seq % 2:
        raise ValueError(f"{heads} heads / {seq} local tokens do not split over {cp_size} ranks")
    local_heads = heads // cp_size
    # [s, b, CP, h/CP, d] -> [CP, s, b, h/CP, d]: block j goes to rank j
    send = x.reshape(seq, batch, cp_size, local_heads, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_rows(send.view(cp_size * seq, batch, local_heads, dim), group)
    chunks = received.view(2 * cp_size, seq // 2, batch * local_heads * dim)
    natural_from_gathered, gathered_from_natural = zigzag_to_natural(cp_size, x.device)
    natural = permute_rows(chunks, natural_from_gathered, gathered_from_natural)
    return natural.view(cp_size * seq, batch, local_heads, dim)


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`sequence_to_heads`: ``[S, b, h/CP, d]`` -> ``[s, b, h, d]``."""
    cp_size = group.size()
    total, batch, local_heads, dim = y.shape
    seq = total // cp_size
    chunks = y.reshape(2 * cp_size, seq // 2, batch * local_heads * dim)
    natural_from_gathered, gathered_from_natural = zigzag_to_natural(cp_size, y.device)
    gathered = permute_rows(chunks, gathered_from_natural, natural_from_gathered)
    received = all_to_all_rows(gathered.view(cp_size * seq, batch, local_heads, dim), group)
    # [CP, s, b, h/CP, d]: block j is head group j of this rank's tokens
    blocks = received.view(cp_size, seq, batch, local_heads, dim)
    return blocks.permute(1, 2, 0, 3, 4).reshape(seq, batch, cp_size * local_heads, dim)
