"""The gated delta rule (the token mixer of gated DeltaNet layers), chunked, in PyTorch; and the
choice between it and flash-linear-attention's Triton kernel.

Per head, with keys and queries of width ``dk`` and values of width ``dv``, the state
``S ∈ R^{dk×dv}`` starts at 0 (or ``initial_state``) and for every token ``t``::

    S ← exp(g_t) · S                       (decay, g_t ≤ 0)
    u_t = β_t · (v_t − Sᵀ k_t)              (delta: what S predicts for k_t, corrected)
    S ← S + k_t u_tᵀ
    o_t = Sᵀ (scale · q_t)

:func:`chunk_gated_delta_rule` computes the same outputs a chunk of ``C`` tokens at a time. Inside
a chunk, with ``G_i = g_1 + … + g_i`` (the chunk's cumulative decay) and ``S₀`` the state before
it, unrolling the recurrence gives

* ``u_i = β_i (v_i − e^{G_i} S₀ᵀ k_i − Σ_{j<i} e^{G_i−G_j} (k_i·k_j) u_j)``, i.e. the unit lower
  triangular system ``(I + A) U = β V − β e^{G} K S₀`` with ``A_ij = β_i e^{G_i−G_j} k_i·k_j``
  for ``j < i``; solved once per chunk for both right-hand sides (``W_v = (I+A)⁻¹ βV``,
  ``W_k = (I+A)⁻¹ β e^G K``), so ``U = W_v − W_k S₀``;
* ``o_i = e^{G_i} S₀ᵀ q_i + Σ_{j≤i} e^{G_i−G_j} (q_i·k_j) u_j``;
* the next chunk's state ``e^{G_C} S₀ + Σ_j e^{G_C−G_j} k_j u_jᵀ``.

The triangular solves and the within-chunk products of every chunk run batched; only the state
is carried from chunk to chunk. A sequence that is not a multiple of ``C`` is padded with
``β = 0, g = 0`` tokens, which leave the state unchanged; their outputs are dropped. The
arithmetic runs in float32 (float64 inputs stay float64) and the output has the inputs' dtype.

Packed documents (``cu_seqlens``, the offsets of the documents of one sequence) start each from a
zero state. The chunks stay where they are, across document starts; within a chunk the pairs
``(i, j)`` of different documents are masked out of ``A`` and the scores, ``S₀`` reaches only the
tokens before the chunk's first document start, the next chunk's state keeps only the chunk's
last document (and ``S₀`` only if that document began before the chunk), and ``G`` is summed
within each document. Masks and zeros only, no subtraction: a document's outputs do not depend
on another document's values, not even through rounding; memory stays O(chunk).

:func:`gated_delta_rule` runs flash-linear-attention's ``chunk_gated_delta_rule`` (fla-core, an
optional dependency: ``pip install megatron-bounded[gdn]``) for CUDA tensors when fla is
importable and ``deterministic`` is off, else :func:`chunk_gated_delta_rule`. Both take
``[batch, tokens, heads, width]`` tensors with as many query/key heads as value heads; with
packed documents the batch's sequences run as one sequence of their documents (fla's
``cu_seqlens``).

Tests: ``tests/unit/attention/test_gated_delta_net.py`` (outputs and gradients equal a float64 token by
token recurrence, several chunk sizes, lengths not a multiple of the chunk; with ``cu_seqlens``,
the recurrence reset at each document start).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule", "fla_chunk_kernel", "l2_normalize",
           "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6  # flash-linear-attention's and transformers' Qwen3-Next


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dimension (the queries' and keys' normalization of
    gated DeltaNet)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@functools.lru_cache(maxsize=1)
def fla_chunk_kernel():
    """flash-linear-attention's ``chunk_gated_delta_rule``, or None where fla is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError:
        return None
    return kernel


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: Optional[float] = None,
                     deterministic: bool = False, initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                     cu_seqlens_cpu: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(output [b, t, h, dv], final state [b, h, dk, dv] in fp32 (fp64 for fp64 inputs) or
    None)`` of the gated delta rule from ``initial_state`` (None: zeros): fla's Triton kernel on
    CUDA when installed (and not ``deterministic``: its backward accumulates atomically), else
    ours.

    ``cu_seqlens``: offsets of packed documents over the ``b · t`` tokens taken sequence after
    sequence, every sequence's end among them; each document then starts from a zero state, as
    if it ran alone (no state in or out). ``cu_seqlens_cpu``: the same offsets on the host, which
    spare fla's kernel a wait for the device."""
    batch, tokens = q.shape[:2]
    documents = {}
    if cu_seqlens is not None:  # fla's convention: the documents of one sequence
        q, k, v, g, beta = (x.reshape(1, batch * tokens, *x.shape[2:]) for x in (q, k, v, g, beta))
        documents = dict(cu_seqlens=cu_seqlens.long())
    kernel = fla_chunk_kernel()
    if kernel is not None and q.is_cuda and not deterministic:
        if cu_seqlens is not None:
            documents["cu_seqlens_cpu"] = cu_seqlens_cpu
        output, state = kernel(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, **documents)
    else:
        output, state = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                               initial_state=initial_state,
                                               output_final_state=output_final_state, **documents)
    return output.reshape(batch, tokens, *output.shape[2:]), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
                           scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(output [b, t, h, dv], final state [b, h, dk, dv] or None)`` of the gated delta rule
    (module docstring) on ``q, k [b, t, h, dk]``, ``v [b, t, h, dv]``, ``g, beta [b, t, h]``;
    ``scale`` defaults to ``dk ** -0.5``. ``cu_seqlens``: the offsets of the documents of one
    sequence (``b = 1``, fla's convention), each of which starts from a zero state; neither an
    initial nor a final state then."""
    if cu_seqlens is not None and (k.shape[0] != 1 or initial_state is not None
                                   or output_final_state):
        raise ValueError("the gated delta rule over documents (cu_seqlens) takes one sequence "
                         "and neither an initial nor a final state")
    out_dtype = v.dtype
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, tokens, heads, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    pad = (-tokens) % chunk_size
    n_chunks = (tokens + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [b, t, h, ...] -> [b, h, n, C, ...] in the working dtype, padded with zeros
        x = x.to(work).transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(batch, heads, n_chunks, chunk_size, *x.shape[3:])

    q, k, v = chunks(q * scale), chunks(k), chunks(v)
    g, beta = chunks(g), chunks(beta)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    if cu_seqlens is None:
        decay, visible, sees_state, reaches_end = g.cumsum(-1), lower, None, None
    else:
        decay, visible, sees_state, reaches_end = _within_documents(g, cu_seqlens, lower)
    # G_i (decay): the cumulative decay within each chunk; e^{G_i − G_j} for the visible pairs,
    # e^{G_i}: how much of S₀ token i sees; e^{G_C − G_j}: how much of token j the next S₀ keeps
    pair_decay = _exp_where(decay.unsqueeze(-1) - decay.unsqueeze(-2), visible)
    from_state = _exp_where(decay, sees_state)
    to_end = _exp_where(decay[..., -1:] - decay, reaches_end)

    k_beta = k * beta.unsqueeze(-1)
    a = (k_beta @ k.transpose(-1, -2)) * pair_decay
    system = a.tril(-1) + torch.eye(chunk_size, dtype=work, device=q.device)
    w_v = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                        unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, k_beta * from_state.unsqueeze(-1), upper=False,
                                        unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # visible pairs only: pair_decay is 0 elsewhere
    q_decayed = q * from_state.unsqueeze(-1)
    state_decay = from_state[..., -1:]  # e^{G_C}: how much of S₀ the next S₀ keeps
    k_to_end = k * to_end.unsqueeze(-1)

    state = (torch.zeros(batch, heads, dk, dv, dtype=work, device=q.device)
             if initial_state is None else initial_state.to(work))
    outputs = []
    for index in range(n_chunks):
        u = w_v[:, :, index] - w_k[:, :, index] @ state
        outputs.append(q_decayed[:, :, index] @ state + scores[:, :, index] @ u)
        state = state * state_decay[:, :, index].unsqueeze(-1) + \
            k_to_end[:, :, index].transpose(-1, -2) @ u
    output = torch.stack(outputs, dim=2).reshape(batch, heads, n_chunks * chunk_size, dv)
    output = output[:, :, :tokens].transpose(1, 2).to(out_dtype)
    return output, (state if output_final_state else None)


def _exp_where(x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """``e^x`` where ``keep`` (everywhere for None), else 0: masked before exp, for ``x`` may be
    large where it is not kept (``G_i − G_j > 0`` above the diagonal)."""
    return x.exp() if keep is None else x.masked_fill(~keep, float("-inf")).exp()


def _within_documents(g: torch.Tensor, cu_seqlens: torch.Tensor, lower: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(decay, visible, sees_state, reaches_end)`` of chunks ``g`` [b, h, n, C] cut at the
    document starts of ``cu_seqlens``: the cumulative decay summed within each document only (a
    sum through another document would pass its rounding on), the pairs of one document
    (``lower`` within documents), the tokens S₀ reaches (those before the chunk's first start)
    and those the next S₀ keeps (the chunk's last document; its S₀ only if that document began
    before the chunk). Masks and sums within documents only: no document's outputs depend on
    another's values at all. The padding tokens belong to the last document."""
    n_chunks, chunk_size = g.shape[-2:]
    starts = torch.zeros(n_chunks * chunk_size, dtype=torch.long, device=g.device)
    starts[cu_seqlens[:-1]] = 1  # device indices: no wait for the device
    begun = starts.view(n_chunks, chunk_size).cumsum(-1)  # documents begun within the chunk so far
    visible = lower & (begun.unsqueeze(-1) == begun.unsqueeze(-2))
    decay = (visible.to(g.dtype) @ g.unsqueeze(-1)).squeeze(-1)
    return decay, visible, begun == 0, begun == begun[..., -1:]
