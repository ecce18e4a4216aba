#!/usr/bin/env python3
"""Benchmark SCO (checkpoint-boundary offload) against plain full recompute, side by side.

A stack of pre-LN transformer-like layers (LayerNorm, QKV, causal SDPA, projection, LayerNorm,
GELU MLP; residuals), each layer checkpointed with a reentrant checkpoint, runs forward+backward
with and without :class:`megatron.bounded.activations.sco.CheckpointOffload`. The two variants
alternate in every repeat. Reported per variant: median forward+backward time, peak memory
(``torch.cuda.max_memory_allocated``, absolute and above what was allocated before the step),
offloaded boundaries/bytes and ``max_restored_on_device``; gradients of the two variants are
compared bitwise on the first repeat.

Examples::

    # GPU
    python tools/benchmarks/bench_sco.py --layers 16 --seq 32768 --hidden 4096 --budget-gb 8 \\
        --out results/bench_sco.json
    # CPU smoke test
    python tools/benchmarks/bench_sco.py --layers 3 --seq 64 --hidden 64 --repeats 2 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench_common import (  # puts the repository on sys.path
    PeakMemory, Stopwatch, cell, device_name, markdown_table, on_cuda, synchronize, write_json,
)

from megatron.bounded.activations.sco import CheckpointOffload
from megatron.bounded.units import GiB, MiB

VARIANTS = ("baseline", "sco")


class Layer(nn.Module):
    def __init__(self, hidden, heads, ffn_mult):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_mult * hidden, bias=False)
        self.fc2 = nn.Linear(ffn_mult * hidden, hidden, bias=False)

    def forward(self, h):  # h: [S, B, H]
        s, b, hid = h.shape
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)

        def heads(t):  # [S, B, H] -> [B, heads, S, d]
            return t.reshape(s, b, self.heads, hid // self.heads).permute(1, 2, 0, 3)

        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        h = h + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, hid))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Stack(nn.Module):
    def __init__(self, layers, hidden, heads, ffn_mult):
        super().__init__()
        self.embed = nn.Linear(hidden, hidden, bias=False)  # makes the stack input a computed tensor
        self.layers = nn.ModuleList([Layer(hidden, heads, ffn_mult) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, ckpt):
        h = self.embed(x)
        for layer in self.layers:
            h = ckpt(layer, h)
        return self.norm(h).float().square().mean()


def _checkpoint_fn(impl):
    if impl == "torch":
        from torch.utils.checkpoint import checkpoint

        return lambda fn, *a: checkpoint(fn, *a, use_reentrant=True)
    from megatron.core import tensor_parallel

    return lambda fn, *a: tensor_parallel.checkpoint(fn, False, *a)


def _one_step(model, x, ckpt, sco, device):
    for p in model.parameters():
        p.grad = None
    synchronize(device)
    gc.collect()
    with PeakMemory(device) as memory, Stopwatch(device) as clock:
        with sco if sco is not None else contextlib.nullcontext():
            loss = model(x, ckpt)
        loss.backward()
    return clock.wall_s, memory.peak_bytes, memory.extra_bytes


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn-mult", type=int, default=4)
    ap.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="host budget in GiB (default: enough for every boundary)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--impl", choices=["torch", "megatron"], default="torch")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True), so the bitwise check is meaningful",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.impl == "megatron" and not on_cuda(args.device):
        ap.error("--impl megatron needs CUDA (upstream's CheckpointFunction saves the CUDA RNG state)")
    if args.hidden % heads_of(args):
        ap.error("--hidden must be a multiple of --head-dim (or smaller than it)")
    return args


def heads_of(args) -> int:
    return max(1, args.hidden // args.head_dim)


def run_alternating(model, x, ckpt, budget, args, device):
    """``--warmup`` then ``--repeats`` steps of each variant, alternating: the timed steps' times
    and peaks per variant, SCO's stats, and the gradients of the first two timed steps."""
    results = {v: {"times_s": [], "peaks": [], "peaks_above": []} for v in VARIANTS}
    stats = {}
    grads = {}
    for it in range(args.warmup + args.repeats):
        for v in VARIANTS:
            sco = CheckpointOffload(budget) if v == "sco" else None
            t, peak, above = _one_step(model, x, ckpt, sco, device)
            if it in (args.warmup, args.warmup + 1) and (v, it) not in grads:
                grads[(v, it - args.warmup)] = [p.grad.detach().clone() for p in model.parameters()]
            if it >= args.warmup:
                results[v]["times_s"].append(t)
                results[v]["peaks"].append(peak)
                results[v]["peaks_above"].append(above)
            if sco is not None:
                stats = dict(sco.stats)
    return results, stats, grads


def variant_rows(results) -> dict:
    """Per variant: median step time and the largest peaks (None off CUDA)."""
    rows = {}
    for v in VARIANTS:
        r = results[v]
        peaks = [p for p in r["peaks"] if p is not None]
        aboves = [p for p in r["peaks_above"] if p is not None]
        rows[v] = {
            "median_ms": 1e3 * statistics.median(r["times_s"]),
            "peak_gib": max(peaks) / GiB if peaks else None,
            "peak_above_start_gib": max(aboves) / GiB if aboves else None,
        }
    return rows


def summary_record(args, device, budget, boundary_bytes, rows, stats, bitwise, repeatable) -> dict:
    """The run's record: its configuration, each variant's row (SCO's with its stats), the
    gradient checks, and the peak saved against the drop the offloaded boundaries predict."""
    out = {
        "config": {
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "hidden": args.hidden,
            "heads": heads_of(args),
            "ffn_mult": args.ffn_mult,
            "dtype": args.dtype,
            "impl": args.impl,
            "deterministic": args.deterministic,
            "device": str(device),
            "device_name": device_name(device),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "host_budget_bytes": budget,
            "boundary_bytes": boundary_bytes,
        },
        "baseline": rows["baseline"],
        "sco": dict(rows["sco"], **stats),
        "grads_bitwise_equal": bitwise,
        "baseline_grads_repeatable": repeatable,
    }
    if rows["baseline"]["peak_gib"] is not None:
        out["peak_saved_gib"] = rows["baseline"]["peak_gib"] - rows["sco"]["peak_gib"]
        # expected drop: the offloaded boundaries, less the two restored in backward
        k = stats.get("offloaded_boundaries", 0)
        out["expected_saved_gib_approx"] = max(0, k - 2) * boundary_bytes / GiB
    out["time_ratio_sco_over_baseline"] = rows["sco"]["median_ms"] / rows["baseline"]["median_ms"]
    return out


def print_summary(args, out, rows, stats) -> None:
    config = out["config"]
    boundary_bytes, budget = config["boundary_bytes"], config["host_budget_bytes"]
    print(
        f"SCO benchmark: {args.layers} layers, S={args.seq}, B={args.batch}, H={args.hidden}, "
        f"{args.dtype}, {args.impl} checkpoint, {config['device_name']}, "
        f"boundary {boundary_bytes / MiB:.3f} MiB, budget {budget / MiB:.3f} MiB"
    )
    print()
    cells = []
    for v in VARIANTS:
        r = rows[v]
        off = stats.get("offloaded_boundaries", 0) if v == "sco" else 0
        off_b = stats.get("offloaded_bytes", 0) if v == "sco" else 0
        mr = stats.get("max_restored_on_device", 0) if v == "sco" else "-"
        cells.append([v, cell(r["median_ms"], ".2f", "n/a"), cell(r["peak_gib"], ".3f", "n/a"),
                      cell(r["peak_above_start_gib"], ".3f", "n/a"), off, f"{off_b / GiB:.3f}", mr])
    print(markdown_table(["variant", "fwd+bwd median (ms)", "peak (GiB)", "peak above start (GiB)",
                          "offloaded", "offloaded GiB", "max restored on device"], cells))
    print()
    print(
        f"time ratio sco/baseline: {out['time_ratio_sco_over_baseline']:.3f}; "
        f"peak saved: {cell(out.get('peak_saved_gib'), '.3f', 'n/a')} GiB "
        f"(expected about {cell(out.get('expected_saved_gib_approx'), '.3f', 'n/a')}); "
        f"grads bitwise equal: {out['grads_bitwise_equal']} "
        f"(baseline repeatable: {out['baseline_grads_repeatable']})"
    )


def main(argv=None):
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(1234)
    model = Stack(args.layers, args.hidden, heads_of(args), args.ffn_mult).to(device=device, dtype=dtype)
    x = torch.randn(args.seq, args.batch, args.hidden, device=device, dtype=dtype)
    ckpt = _checkpoint_fn(args.impl)

    boundary_bytes = args.seq * args.batch * args.hidden * torch.empty((), dtype=dtype).element_size()
    if args.budget_gb is None:
        budget = args.layers * boundary_bytes
    else:
        budget = int(args.budget_gb * GiB)

    results, stats, grads = run_alternating(model, x, ckpt, budget, args, device)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(grads[a], grads[b]))

    bitwise = same(("baseline", 0), ("sco", 0))
    # if the baseline itself is not repeatable (e.g. a non-deterministic attention backward),
    # a bitwise comparison with SCO says nothing
    baseline_repeatable = same(("baseline", 0), ("baseline", 1)) if args.repeats > 1 else None
    grads.clear()
    rows = variant_rows(results)
    out = summary_record(args, device, budget, boundary_bytes, rows, stats, bitwise,
                         baseline_repeatable)
    print_summary(args, out, rows, stats)
    if args.out:
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()
