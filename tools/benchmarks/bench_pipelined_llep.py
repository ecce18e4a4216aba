#!/usr/bin/env python3
"""PipelinedLLEP vs one-shot dispatch, side by side in one run: peak memory and fwd+bwd latency.

Launch one process per GPU (EP = number of processes, NCCL)::

    torchrun --nproc_per_node=8 tools/benchmarks/bench_pipelined_llep.py \\
        --tokens 65536 --hidden 2048 --experts 64 --topk 8 --chunks 10 --skew 80pct16 \\
        --out results/bench_pipelined_llep.json

Without CUDA it runs on CPU over gloo (latency only, upstream variant skipped), e.g.::

    torchrun --nproc_per_node=2 tools/benchmarks/bench_pipelined_llep.py \\
        --tokens 256 --hidden 32 --experts 8 --topk 2 --chunks 4

Every variant computes the routed-experts output of one MoE layer (SwiGLU experts) for the same
tokens, routing and expert weights, forward + backward with the same output gradient:

* ``upstream_alltoall``: upstream ``MoELayer`` with ``moe_token_dispatcher_type='alltoall'`` and
  ``SequentialMLP`` experts (exact per-peer sizes, one host sync per layer); its router is
  bypassed so it sees the synthetic routing.  CUDA only.
* ``static_unchunked``: our static-capacity dispatcher + grouped experts with rank capacity
  factor ``--cf`` (default E_p: a slab can hold every pair, nothing can drop).
* ``pipelined_strided`` / ``pipelined_contiguous``: ``pipelined_moe`` with K = ``--chunks``
  (token budget ceil(N / K)), strided or contiguous chunk membership.
* ``pipelined_llep`` (with ``--llep-threshold``): strided chunks plus LLEP balancing.

Reported per variant: median step time (max over ranks), the step's peak memory above what was
allocated before it (``torch.cuda.max_memory_allocated`` delta, max over ranks: the dispatch-
phase peak), the same split into the forward and the backward phase, relative output /
input-gradient difference to ``static_unchunked``, and for the
pipelined variants the chunk geometry, the most rows any rank received in one chunk against the
receive bound E_p * k * c, and the worst send ratio (most rows one rank sent one peer in one chunk,
over the even share k * c / E_p).

With ``--recompute`` every variant runs inside a (non-reentrant) activation checkpoint, as under
a decoder layer's full recompute: the forward keeps only the layer's input and the backward
re-runs the dispatch before its own, so the backward peak is the one that matters there.

Skew profiles (``--skew``): ``balanced`` (random top-k) or ``<P>pct<M>``, e.g. ``80pct16``: P% of
the tokens pick their top-k among M hot experts (experts 0..M-1, i.e. the first ranks), the
others pick at random.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_common import (  # puts the repository on sys.path
    PeakMemory, Stopwatch, cell, device_name, finish_distributed, init_distributed, markdown_table,
    max_over_ranks, relative_norm_difference, synchronize, utc_date, write_json,
)

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.bounded.moe.dispatch.token_dispatcher import StaticCapacityTokenDispatcher
from megatron.bounded.moe.experts import grouped_mlp
from megatron.bounded.moe.pipelined_llep import num_chunks, pipelined_moe
from megatron.bounded.units import GiB, ceil_div

VARIANTS = (
    "upstream_alltoall",
    "static_unchunked",
    "pipelined_strided",
    "pipelined_contiguous",
    "pipelined_llep",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per rank (default 65536)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN hidden size (SwiGLU)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--chunks", type=int, default=10,
                   help="K for the pipelined variants (budget = ceil(tokens / K), cap = K)")
    p.add_argument("--skew", default="balanced",
                   help="routing profile: balanced | <P>pct<M> (e.g. 80pct16)")
    p.add_argument("--cf", type=float, default=None,
                   help="capacity factor of static_unchunked (default E_p: no drops)")
    p.add_argument("--llep-threshold", type=float, default=None,
                   help="also run pipelined_llep with this imbalance threshold (>= 1.0)")
    p.add_argument("--variants", nargs="*", default=None, choices=VARIANTS,
                   help="variants to run (default: all that apply)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--recompute", action="store_true",
                   help="run each variant inside an activation checkpoint (full-recompute case)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=str, default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    if args.chunks < 1 or args.tokens < 1 or args.topk < 1:
        p.error("--chunks, --tokens and --topk must be >= 1")
    if args.skew != "balanced" and not re.fullmatch(r"\d+pct\d+", args.skew):
        p.error(f"--skew must be 'balanced' or '<P>pct<M>', got {args.skew!r}")
    return args


def make_routing(num_tokens, num_experts, topk, profile, seed, device):
    """Synthetic router output: (probs [N, E] fp32, routing_map [N, E] bool)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if profile != "balanced":
        pct, hot = (int(v) for v in profile.split("pct"))
        if not 0 <= pct <= 100 or not topk <= hot <= num_experts:
            raise SystemExit(f"--skew {profile}: need 0 <= P <= 100 and topk <= M <= experts")
        chosen = torch.rand(num_tokens, generator=g) < pct / 100.0
        logits[chosen.nonzero().squeeze(1)[:, None], torch.arange(hot)[None, :]] += 50.0
    scores = logits.softmax(dim=-1)
    val, idx = scores.topk(topk, dim=-1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(num_tokens, num_experts).scatter(1, idx, val / val.sum(-1, keepdim=True))
    return probs.to(device), routing_map.to(device)


def swiglu(fc1):
    gate, linear = torch.chunk(fc1, 2, dim=-1)
    return F.silu(gate) * linear


def select_variants(args, cuda: bool, rank: int) -> list:
    """The variants to run: ``--variants``, or all that apply (LLEP with a threshold)."""
    variants = list(args.variants) if args.variants else [
        v for v in VARIANTS if v != "pipelined_llep" or args.llep_threshold is not None]
    if not cuda and "upstream_alltoall" in variants:
        if rank == 0:
            print("no CUDA: skipping upstream_alltoall (upstream's MoELayer needs GPUs)")
        variants.remove("upstream_alltoall")
    if "pipelined_llep" in variants and args.llep_threshold is None:
        raise SystemExit("pipelined_llep needs --llep-threshold")
    return variants


def build_upstream(args, world: int, dtype, device, probs, routing_map):
    """Upstream's MoELayer (alltoall, SequentialMLP) with its router bypassed, so that it sees
    the synthetic routing; (layer, its experts' weights stacked as the grouped ones)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(args.seed)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=16,
        num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.ffn, ffn_hidden_size=args.ffn, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
        moe_router_dtype="fp32", expert_model_parallel_size=world, params_dtype=dtype,
        bf16=dtype == torch.bfloat16)
    layer = get_moe_module_spec(use_te=False, num_experts=args.experts)(
        config=cfg, layer_number=1).to(device).train()
    layer.route = lambda hidden_states, padding_mask=None: (probs, routing_map)
    experts = layer.experts.local_experts
    w1 = torch.stack([e.linear_fc1.weight.detach().t() for e in experts]).contiguous()
    w2 = torch.stack([e.linear_fc2.weight.detach().t() for e in experts]).contiguous()
    return layer, w1, w2


class LayerBench:
    """One MoE layer's routed experts per variant, on the same tokens, routing, expert weights
    and output gradient: the runners, one forward + backward step, and its measurement."""

    def __init__(self, args, variants, rank: int, world: int, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.cuda = device.type == "cuda"
        self.dtype_name = args.dtype or ("bf16" if self.cuda else "fp32")
        self.dtype = torch.bfloat16 if self.dtype_name == "bf16" else torch.float32
        local = args.experts // world
        self.probs, self.routing_map = make_routing(args.tokens, args.experts, args.topk,
                                                    args.skew, args.seed + rank, device)
        gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
        self.x0 = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(
            device=device, dtype=self.dtype)
        self.grad_out = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(
            device, self.dtype)
        self.upstream_layer = None
        if "upstream_alltoall" in variants:
            self.upstream_layer, w1, w2 = build_upstream(args, world, self.dtype, device,
                                                         self.probs, self.routing_map)
        else:
            wg = torch.Generator().manual_seed(args.seed + 7 + rank)
            w1 = (torch.randn(local, args.hidden, 2 * args.ffn, generator=wg) * 0.02).to(
                device, self.dtype)
            w2 = (torch.randn(local, args.ffn, args.hidden, generator=wg) * 0.02).to(
                device, self.dtype)
        self.w1, self.w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)
        self.capacity_factor = args.cf if args.cf is not None else float(world)
        config = types.SimpleNamespace(num_moe_experts=args.experts, moe_router_topk=args.topk,
                                       moe_expert_rank_capacity_factor=self.capacity_factor)
        self.dispatcher = StaticCapacityTokenDispatcher(
            local, list(range(rank * local, (rank + 1) * local)), config,
            ProcessGroupCollection(ep=dist.group.WORLD))
        self.budget = ceil_div(args.tokens, args.chunks)
        self.runners = {
            "upstream_alltoall": self.run_upstream,
            "static_unchunked": self.run_static,
            "pipelined_strided": self.pipelined("strided"),
            "pipelined_contiguous": self.pipelined("contiguous"),
            "pipelined_llep": self.pipelined("strided", args.llep_threshold),
        }
        self.params = {"upstream_alltoall": list(self.upstream_layer.parameters())
                       if self.upstream_layer else []}

    def run_static(self, x, p):
        d = self.dispatcher
        h, pp = d.dispatch_preprocess(x, self.routing_map, p)
        h, pp = d.token_dispatch(h, pp)
        h, tpe, pp = d.dispatch_postprocess(h, pp)
        y = grouped_mlp(h, tpe, pp, self.w1, self.w2, swiglu)
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))

    def pipelined(self, chunking, threshold=None):
        args = self.args

        def run(x, p):
            stats = {}
            y = pipelined_moe(x, p, self.routing_map, self.w1, self.w2, swiglu, topk=args.topk,
                              token_budget=self.budget, max_chunks=args.chunks,
                              ep_group=dist.group.WORLD, imbalance_threshold=threshold,
                              chunking=chunking, stats=stats)
            run.stats = stats
            return y
        return run

    def run_upstream(self, x, p):
        y, _ = self.upstream_layer(x)
        return y

    def step(self, name, memory=None):
        """One forward + backward: (output, input gradient, forward peak, backward peak), the
        peaks (``memory``'s phases) None without ``memory`` or CUDA."""
        for prm in [self.w1, self.w2] + self.params.get(name, []):
            prm.grad = None
        x = self.x0.detach().clone().requires_grad_(True)
        p = self.probs.detach().clone().requires_grad_(name != "upstream_alltoall")
        if self.args.recompute:
            y = torch.utils.checkpoint.checkpoint(self.runners[name], x, p, use_reentrant=False)
        else:
            y = self.runners[name](x, p)
        forward_peak = memory.phase_bytes() if memory else None
        y.backward(self.grad_out)
        return y.detach(), x.grad, forward_peak, memory.phase_bytes() if memory else None

    def measure(self, name):
        """``--warmup`` then ``--iters`` timed steps: (ms per step, (forward peaks, backward
        peaks), the last output, its input gradient)."""
        for _ in range(self.args.warmup):
            self.step(name)
        synchronize(self.device)
        times, forward_peaks, backward_peaks = [], [], []
        out = xgrad = None
        for _ in range(self.args.iters):
            with PeakMemory(self.device) as memory, Stopwatch(self.device) as clock:
                out, xgrad, forward_peak, backward_peak = self.step(name, memory)
            times.append(clock.wall_s * 1e3)
            forward_peaks.append(forward_peak)
            backward_peaks.append(backward_peak)
        return times, (forward_peaks, backward_peaks), out, xgrad

    def variant_row(self, name) -> dict:
        """The variant's record (maxima over ranks), or its out-of-memory record."""
        # Static-shape variants allocate the same on every rank, so an out-of-memory error hits
        # all ranks at the same allocation and can be recorded; upstream's exact-size dispatch
        # may fail on the hot rank alone, which then leaves the others waiting in a collective.
        oom = False
        try:
            times, peaks, out, xgrad = self.measure(name)
        except torch.cuda.OutOfMemoryError:
            oom = True
            torch.cuda.empty_cache()
        if max_over_ranks([float(oom)], self.device)[0]:
            if self.rank == 0:
                print(f"{name}: out of memory")
            return {"variant": name, "oom": True, "ms": float("nan"), "peak_gib": None,
                    "forward_peak_gib": None, "backward_peak_gib": None,
                    "_out": None, "_xgrad": None}
        peak_values = [max(p) if self.cuda else math.nan for p in peaks]
        ms, forward, backward = max_over_ranks([statistics.median(times), *peak_values],
                                               self.device)
        gib = (lambda b: b / GiB) if self.cuda else (lambda b: None)
        row = {"variant": name, "ms": ms, "peak_gib": gib(max(forward, backward)),
               "forward_peak_gib": gib(forward), "backward_peak_gib": gib(backward),
               "_out": out, "_xgrad": xgrad}
        stats = getattr(self.runners[name], "stats", None)
        if stats:
            row.update(self.chunk_record(stats))
        return row

    def chunk_record(self, stats: dict) -> dict:
        """A pipelined variant's chunk geometry and the most rows one rank received and sent."""
        recv, send, dropped = (int(v) for v in max_over_ranks(
            [int(stats[k].item()) for k in ("max_recv_rows", "max_send_rows", "dropped")],
            self.device))
        even_share = self.args.topk * stats["chunk_tokens"] / self.world
        plan = stats.get("llep_plan")
        return dict(num_chunks=stats["num_chunks"], chunk_tokens=stats["chunk_tokens"],
                    recv_rows_bound=stats["recv_rows_bound"],
                    max_recv_rows=recv, max_send_rows=send, dropped=bool(dropped),
                    worst_send_ratio=send / even_share,
                    llep_spills=len(plan.spills) if plan is not None else None,
                    llep_max_rank_load=(max(plan.rank_loads), max(plan.balanced_rank_loads))
                    if plan is not None else None)


def compare_to_static(results: dict):
    """(rows without the tensors, each with its output and input-gradient difference to
    ``static_unchunked``; the reference row, None where it did not run or ran out of memory)."""
    ref = results.get("static_unchunked")
    if ref is not None and ref.get("oom"):
        ref = None
    rows = []
    for row in results.values():
        if ref is not None and row is not ref and row["_out"] is not None:
            row["rel_out_vs_static"] = relative_norm_difference(row["_out"], ref["_out"])
            row["rel_xgrad_vs_static"] = relative_norm_difference(row["_xgrad"], ref["_xgrad"])
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows, ref


def meta_record(args, bench: LayerBench) -> dict:
    return {
        "world_size": bench.world, "tokens_per_rank": args.tokens, "hidden": args.hidden,
        "ffn": args.ffn, "experts": args.experts, "topk": args.topk, "chunks": args.chunks,
        "token_budget": bench.budget,
        "agreed_chunks": num_chunks(args.tokens, bench.budget, args.chunks),
        "skew": args.skew, "dtype": bench.dtype_name, "iters": args.iters,
        "recompute": args.recompute, "static_capacity_factor": bench.capacity_factor,
        "llep_threshold": args.llep_threshold,
        "device": device_name(bench.device) + ("" if bench.cuda else " (gloo)"),
        "torch": torch.__version__, "date": utc_date(),
        "receive_bound_gib_2EpkcHb": 2 * bench.world * args.topk * bench.budget * args.hidden
        * (2 if bench.dtype == torch.bfloat16 else 4) / GiB,
    }


def summary(args, meta: dict, rows: list, ref) -> str:
    """The printed summary: the setting, a table row per variant and the receive bound."""
    head = (f"\nMoE fwd+bwd, EP={meta['world_size']}, {args.tokens} tokens/rank, H={args.hidden}, "
            f"E={args.experts}, top-{args.topk}, FFN={args.ffn} SwiGLU, {meta['dtype']}, "
            f"skew {args.skew}, K={args.chunks} (c={meta['token_budget']}), "
            f"{'under activation checkpoint, ' if args.recompute else ''}{meta['device']}\n\n")
    base_ms = ref["ms"] if ref else None
    cells = []
    for r in rows:
        if r.get("oom"):
            cells.append([r["variant"], "OOM"] + ["-"] * 6)
            continue
        peak = (f"{r['peak_gib']:.3f} ({r['forward_peak_gib']:.3f} / {r['backward_peak_gib']:.3f})"
                if r["peak_gib"] is not None else "-")
        recv = f"{r['max_recv_rows']} / {r['recv_rows_bound']}" if "max_recv_rows" in r else "-"
        cells.append([r["variant"], f"{r['ms']:.2f}",
                      f"{r['ms'] / base_ms:.2f}" if base_ms else "-", peak,
                      r.get("num_chunks", "-"), recv, cell(r.get("worst_send_ratio"), ".2f"),
                      cell(r.get("rel_out_vs_static"), ".2e")])
    table = markdown_table(["variant", "median ms", "x static", "peak GiB (fwd / bwd)", "K",
                            "max recv rows / bound", "worst send ratio", "rel out vs static"],
                           cells)
    return (head + table
            + f"\n\nreceive bound 2*E_p*k*c*H*b = {meta['receive_bound_gib_2EpkcHb']:.3f} GiB")


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = init_distributed(default_port=29513)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must divide over {world} ranks")
    variants = select_variants(args, device.type == "cuda", rank)
    bench = LayerBench(args, variants, rank, world, device)
    results = {}
    for name in variants:
        results[name] = bench.variant_row(name)
        if bench.cuda:
            torch.cuda.empty_cache()
    rows, ref = compare_to_static(results)
    meta = meta_record(args, bench)
    if rank == 0:
        print(summary(args, meta, rows, ref))
        if args.out:
            write_json(args.out, {"meta": meta, "results": rows})
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
