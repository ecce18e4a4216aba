#!/usr/bin/env python3
"""SDPA core attention, forward + backward, per PyTorch kernel backend (one GPU).

    python tools/benchmarks/bench_sdpa_attention.py --tokens 32768 131072 --out sdpa.json

The shape is the small example's attention (16 query heads, 4 key/value groups, head dim 64,
bf16, causal, batch 1) in the layout ``SDPACoreAttention`` passes ([b, heads, s, d] views of
[s, b, heads, d] tensors). At long context the layer's time is almost all attention, so this
says which backend ``megatron.bounded.attention.core.FUSED_SDPA_BACKENDS`` should try first. Each
backend runs with grouped-query attention (``enable_gqa``) and, where it refuses that, with the
key/value heads repeated to the query heads. Outputs and input gradients are compared with the
flash backend's (max |difference| / max |flash|).

With ``--document-tokens L`` each sequence is packed documents of L tokens and attention stays
within each: flash's variable-length kernel over the whole sequence
(``megatron.bounded.attention.documents.document_attention``) against each document through SDPA
with each backend in turn; FLOPs count the documents' causal blocks only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_common import (  # puts the repository on sys.path
    Benchmark, PeakMemory, max_relative_difference,
)
from megatron.bounded.units import GiB

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _inputs(tokens: int, heads: int, groups: int, head_dim: int):
    def make(h):  # [s, b, h, d] -> [b, h, s, d] view, as the module passes them
        t = torch.randn(tokens, 1, h, head_dim, device="cuda", dtype=torch.bfloat16)
        return t.permute(1, 2, 0, 3).requires_grad_()
    return make(heads), make(groups), make(groups)


def _step(backend, q, k, v, grad_out, repeat_kv: bool):
    """One forward + backward; returns (output, dq, dk, dv)."""
    for t in (q, k, v):
        t.grad = None
    kk, vv = k, v
    if repeat_kv:
        repeats = q.shape[1] // k.shape[1]
        kk, vv = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(
            q, kk, vv, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]),
            enable_gqa=not repeat_kv and q.shape[1] != k.shape[1],
        )
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _length_rows(run, tokens: int) -> None:
    """One row per backend at ``tokens``: with grouped-query attention, and where the backend
    refuses that, with the key/value heads repeated."""
    args = run.args
    q, k, v = _inputs(tokens, args.heads, args.groups, args.head_dim)
    grad_out = torch.randn(1, args.heads, tokens, args.head_dim, device="cuda",
                           dtype=torch.bfloat16)
    # causal: half of the s² score entries, forward 2 GEMMs, backward 5 (flash-style)
    flops = 7 * 2 * tokens * tokens * args.heads * args.head_dim / 2
    reference = None
    for name, backend in BACKENDS.items():
        for repeat_kv in (False, True):
            row = {"tokens": tokens, "backend": name, "repeat_kv": repeat_kv}
            ran, reference = _timed_row(
                run, row, lambda: _step(backend, q, k, v, grad_out, repeat_kv), reference, flops)
            if ran and not repeat_kv:
                break  # GQA ran: no need for repeated heads


def _timed_row(run, row: dict, step, reference, flops: float):
    """Fill ``row`` with ``step``'s largest difference from ``reference`` (its own first result
    when None), its median time, TFLOP/s and extra peak, or the error that stopped it; returns
    (whether it ran, the reference)."""
    try:
        result = step()
        torch.cuda.synchronize()
    except RuntimeError as error:
        row["error"] = str(error).splitlines()[0][:200]
        run.add_row(row)
        return False, reference
    reference = result if reference is None else reference
    row["rel_diff_vs_first"] = max(max_relative_difference(a, b) for a, b in zip(result, reference))
    with PeakMemory() as memory:
        ms = run.median_ms(step)
    row.update(fwd_bwd_ms=ms, tflops=flops / ms / 1e9, extra_peak_gib=memory.extra_bytes / GiB)
    run.add_row(row)
    return True, reference


def _document_rows(run, tokens: int) -> None:
    """One row per kernel at ``tokens`` packed as documents of ``--document-tokens``."""
    args = run.args
    from megatron.bounded.attention.documents import DocumentParams, document_attention

    length = args.document_tokens
    ends = torch.arange(length, tokens + 1, length, device="cuda")
    if ends.numel() == 0 or ends[-1] != tokens:
        ends = torch.cat([ends, torch.tensor([tokens], device="cuda")])
    documents = DocumentParams.from_ends(ends, 1, tokens)
    q, k, v = (t.permute(2, 0, 1, 3).detach().requires_grad_()  # [s, b, h, d]
               for t in _inputs(tokens, args.heads, args.groups, args.head_dim))
    grad_out = torch.randn(tokens, 1, args.heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16)
    bounds = documents.sequences[0]
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    flops = sum(7 * 2 * n * n * args.heads * args.head_dim / 2 for n in lengths)
    scale = 1.0 / math.sqrt(args.head_dim)

    def varlen():
        return document_attention(q, k, v, documents, scale)

    def each_document(backend):
        def run():
            pieces = []
            for start, end in zip(bounds, bounds[1:]):
                with sdpa_kernel([backend]):
                    pieces.append(F.scaled_dot_product_attention(
                        *(t[start:end].permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                        scale=scale, enable_gqa=True).permute(2, 0, 1, 3))
            return torch.cat(pieces)
        return run

    kernels = {"varlen_flash": varlen, **{f"per_document_{name}": each_document(backend)
                                          for name, backend in BACKENDS.items()
                                          if name != "efficient"}}
    reference = None
    for name, forward in kernels.items():
        row = {"tokens": tokens, "document_tokens": length, "documents": len(lengths),
               "kernel": name}

        def step(forward=forward):
            for t in (q, k, v):
                t.grad = None
            out = forward()
            out.backward(grad_out)
            return out.detach(), q.grad, k.grad, v.grad

        _, reference = _timed_row(run, row, step, reference, flops)


def measure(run) -> None:
    for tokens in run.args.tokens:
        (_document_rows if run.args.document_tokens else _length_rows)(run, tokens)
        torch.cuda.empty_cache()  # the length's tensors are gone with its call


main = Benchmark("bench_sdpa_attention", __doc__, {
    "--tokens": [32768, 131072], "--heads": 16, "--groups": 4, "--head-dim": 64,
    "--document-tokens": dict(type=int, default=0,
                              help="pack each sequence with documents of this many tokens (0: one)"),
}, measure, warmup=1).main

if __name__ == "__main__":
    raise SystemExit(main())
