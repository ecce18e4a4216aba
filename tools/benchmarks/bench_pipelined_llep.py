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
import json
import math
import os
import re
import statistics
import sys
import time

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

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
    import torch

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


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None):
    args = parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron.bounded.moe.experts import grouped_mlp
    from megatron.bounded.moe.pipelined_llep import num_chunks, pipelined_moe
    from megatron.bounded.moe.dispatch.token_dispatcher import StaticCapacityTokenDispatcher

    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain `python bench_pipelined_llep.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29513"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must divide over {world} ranks")
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    local = args.experts // world
    group = dist.group.WORLD
    variants = list(args.variants) if args.variants else [
        v for v in VARIANTS if v != "pipelined_llep" or args.llep_threshold is not None]
    if not cuda and "upstream_alltoall" in variants:
        if rank == 0:
            print("no CUDA: skipping upstream_alltoall (upstream's MoELayer needs GPUs)")
        variants.remove("upstream_alltoall")
    if "pipelined_llep" in variants and args.llep_threshold is None:
        raise SystemExit("pipelined_llep needs --llep-threshold")

    probs, routing_map = make_routing(args.tokens, args.experts, args.topk, args.skew,
                                      args.seed + rank, device)
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    x0 = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_out = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(device, dtype)

    def activation(fc1):
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        return F.silu(gate) * linear

    upstream_layer = None
    if "upstream_alltoall" in variants:
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
        upstream_layer = get_moe_module_spec(use_te=False, num_experts=args.experts)(
            config=cfg, layer_number=1).to(device).train()
        # Bypass the router: every variant sees the same synthetic routing.
        upstream_layer.route = lambda hidden_states, padding_mask=None: (probs, routing_map)
        w1 = torch.stack([e.linear_fc1.weight.detach().t() for e in
                          upstream_layer.experts.local_experts]).contiguous()
        w2 = torch.stack([e.linear_fc2.weight.detach().t() for e in
                          upstream_layer.experts.local_experts]).contiguous()
    else:
        wg = torch.Generator().manual_seed(args.seed + 7 + rank)
        w1 = (torch.randn(local, args.hidden, 2 * args.ffn, generator=wg) * 0.02).to(device, dtype)
        w2 = (torch.randn(local, args.ffn, args.hidden, generator=wg) * 0.02).to(device, dtype)
    w1 = torch.nn.Parameter(w1)
    w2 = torch.nn.Parameter(w2)

    from megatron.core.process_groups_config import ProcessGroupCollection

    class _DispatcherConfig:
        num_moe_experts = args.experts
        moe_router_topk = args.topk
        moe_expert_rank_capacity_factor = args.cf if args.cf is not None else float(world)

    dispatcher = StaticCapacityTokenDispatcher(
        local, list(range(rank * local, (rank + 1) * local)), _DispatcherConfig(),
        ProcessGroupCollection(ep=group))

    budget = math.ceil(args.tokens / args.chunks)
    stats_by_variant = {}

    def run_static(x, p):
        h, pp = dispatcher.dispatch_preprocess(x, routing_map, p)
        h, pp = dispatcher.token_dispatch(h, pp)
        h, tpe, pp = dispatcher.dispatch_postprocess(h, pp)
        y = grouped_mlp(h, tpe, pp, w1, w2, activation)
        return dispatcher.combine_postprocess(dispatcher.token_combine(
            dispatcher.combine_preprocess(y)))

    def pipelined(chunking, threshold=None):
        def run(x, p):
            stats = {}
            y = pipelined_moe(x, p, routing_map, w1, w2, activation, topk=args.topk,
                              token_budget=budget, max_chunks=args.chunks, ep_group=group,
                              imbalance_threshold=threshold, chunking=chunking, stats=stats)
            run.stats = stats
            return y
        return run

    def run_upstream(x, p):
        y, _ = upstream_layer(x)
        return y

    runners = {
        "upstream_alltoall": run_upstream,
        "static_unchunked": run_static,
        "pipelined_strided": pipelined("strided"),
        "pipelined_contiguous": pipelined("contiguous"),
        "pipelined_llep": pipelined("strided", args.llep_threshold),
    }
    params = {"upstream_alltoall": list(upstream_layer.parameters()) if upstream_layer else []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def phase_peak(base):
        """Peak above ``base`` since the last reset, then reset for the next phase."""
        if not cuda:
            return float("nan")
        peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        return peak

    def step(name, base=0):
        for prm in [w1, w2] + params.get(name, []):
            prm.grad = None
        x = x0.detach().clone().requires_grad_(True)
        p = probs.detach().clone().requires_grad_(name != "upstream_alltoall")
        if args.recompute:
            y = torch.utils.checkpoint.checkpoint(runners[name], x, p, use_reentrant=False)
        else:
            y = runners[name](x, p)
        forward_peak = phase_peak(base)
        y.backward(grad_out)
        return y.detach(), x.grad, forward_peak, phase_peak(base)

    def measure(name):
        for _ in range(args.warmup):
            step(name)
        sync()
        times, forward_peaks, backward_peaks = [], [], []
        out = xgrad = None
        for _ in range(args.iters):
            sync()
            dist.barrier()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out, xgrad, forward_peak, backward_peak = step(name, base)
            sync()
            times.append((time.perf_counter() - start) * 1e3)
            forward_peaks.append(forward_peak)
            backward_peaks.append(backward_peak)
        return times, (forward_peaks, backward_peaks), out, xgrad

    results = {}
    for name in variants:
        # Static-shape variants allocate the same on every rank, so an out-of-memory error hits
        # all ranks at the same allocation and can be recorded; upstream's exact-size dispatch
        # may fail on the hot rank alone, which then leaves the others waiting in a collective.
        oom = torch.zeros(1, device=device)
        try:
            times, peaks, out, xgrad = measure(name)
        except torch.cuda.OutOfMemoryError:
            oom.fill_(1)
            times = [float("nan")]
            peaks = ([float("nan")], [float("nan")])
            out = xgrad = None
            torch.cuda.empty_cache()
        dist.all_reduce(oom, op=dist.ReduceOp.MAX)
        if oom.item():
            results[name] = {"variant": name, "oom": True, "ms": float("nan"), "peak_gib": None,
                             "forward_peak_gib": None, "backward_peak_gib": None,
                             "_out": None, "_xgrad": None}
            if rank == 0:
                print(f"{name}: out of memory")
            continue
        forward_peaks, backward_peaks = peaks
        t = torch.tensor([statistics.median(times), max(forward_peaks), max(backward_peaks)],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        gib = (lambda b: b / 2**30) if cuda else (lambda b: None)
        row = {"variant": name, "ms": t[0].item(), "peak_gib": gib(max(t[1].item(), t[2].item())),
               "forward_peak_gib": gib(t[1].item()), "backward_peak_gib": gib(t[2].item()),
               "_out": out, "_xgrad": xgrad}
        stats = getattr(runners[name], "stats", None)
        if stats:
            per_rank = torch.tensor([int(stats["max_recv_rows"].item()),
                                     int(stats["max_send_rows"].item()),
                                     int(stats["dropped"].item())], device=device)
            dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
            even_share = args.topk * stats["chunk_tokens"] / world
            plan = stats.get("llep_plan")
            row.update(num_chunks=stats["num_chunks"], chunk_tokens=stats["chunk_tokens"],
                       recv_rows_bound=stats["recv_rows_bound"],
                       max_recv_rows=int(per_rank[0]), max_send_rows=int(per_rank[1]),
                       dropped=bool(per_rank[2]),
                       worst_send_ratio=int(per_rank[1]) / even_share,
                       llep_spills=len(plan.spills) if plan is not None else None,
                       llep_max_rank_load=(max(plan.rank_loads), max(plan.balanced_rank_loads))
                       if plan is not None else None)
        results[name] = row
        if cuda:
            torch.cuda.empty_cache()

    ref = results.get("static_unchunked")
    rows = []
    if ref is not None and ref.get("oom"):
        ref = None
    for name, row in results.items():
        if ref is not None and row is not ref and row["_out"] is not None:
            row["rel_out_vs_static"] = _rel(row["_out"], ref["_out"])
            row["rel_xgrad_vs_static"] = _rel(row["_xgrad"], ref["_xgrad"])
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})

    meta = {
        "world_size": world, "tokens_per_rank": args.tokens, "hidden": args.hidden,
        "ffn": args.ffn, "experts": args.experts, "topk": args.topk, "chunks": args.chunks,
        "token_budget": budget, "agreed_chunks": num_chunks(args.tokens, budget, args.chunks),
        "skew": args.skew, "dtype": dtype_name, "iters": args.iters, "recompute": args.recompute,
        "static_capacity_factor": _DispatcherConfig.moe_expert_rank_capacity_factor,
        "llep_threshold": args.llep_threshold,
        "device": torch.cuda.get_device_name() if cuda else "cpu (gloo)",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "receive_bound_gib_2EpkcHb": 2 * world * args.topk * budget * args.hidden
        * (2 if dtype == torch.bfloat16 else 4) / 2**30,
    }
    if rank == 0:
        print(f"\nMoE fwd+bwd, EP={world}, {args.tokens} tokens/rank, H={args.hidden}, "
              f"E={args.experts}, top-{args.topk}, FFN={args.ffn} SwiGLU, {dtype_name}, "
              f"skew {args.skew}, K={args.chunks} (c={budget}), "
              f"{'under activation checkpoint, ' if args.recompute else ''}{meta['device']}\n")
        print("| variant | median ms | x static | peak GiB (fwd / bwd) | K | max recv rows / bound "
              "| worst send ratio | rel out vs static |")
        print("|---|---|---|---|---|---|---|---|")
        base_ms = ref["ms"] if ref else None
        for r in rows:
            if r.get("oom"):
                print(f"| {r['variant']} | OOM | - | - | - | - | - | - |")
                continue
            ratio = f"{r['ms'] / base_ms:.2f}" if base_ms else "-"
            peak = (f"{r['peak_gib']:.3f} ({r['forward_peak_gib']:.3f} / {r['backward_peak_gib']:.3f})"
                    if r["peak_gib"] is not None else "-")
            recv = (f"{r['max_recv_rows']} / {r['recv_rows_bound']}"
                    if "max_recv_rows" in r else "-")
            send = f"{r['worst_send_ratio']:.2f}" if "worst_send_ratio" in r else "-"
            rel = f"{r['rel_out_vs_static']:.2e}" if "rel_out_vs_static" in r else "-"
            print(f"| {r['variant']} | {r['ms']:.2f} | {ratio} | {peak} | "
                  f"{r.get('num_chunks', '-')} | {recv} | {send} | {rel} |")
        print(f"\nreceive bound 2*E_p*k*c*H*b = {meta['receive_bound_gib_2EpkcHb']:.3f} GiB")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": rows}, f, indent=2)
    if upstream_layer is not None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
