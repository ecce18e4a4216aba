#!/usr/bin/env python3
"""Side-by-side MoE layer benchmark: upstream alltoall + SequentialMLP vs the torch-native
static-capacity dispatcher + grouped experts (optionally with upstream's paged stash).

Launch on GPUs (one process per GPU, EP = number of processes):

    torchrun --nproc_per_node=2 tools/benchmarks/bench_moe_dispatch.py --out moe.json

Every variant runs the same stack of MoE layers (``--layers``, residual ``h = h + moe(h)``)
with identical router and expert weights and the same input, forward + backward, and reports
the median step time on an idle GPU, the host's issue time of the step, the step's GPU time
when it is issued behind earlier GPU work (as inside a model, where the launches of a sync-free
layer overlap the previous layers' kernels), the extra peak memory of a step (``max_memory_allocated`` during the
step minus what was allocated before it) and the largest relative output difference to the
upstream variant.  For paged stash it also reports the bytes of the pages in use at the end of
a forward (the stash's peak) against the bytes of the tokens actually routed to the stashed
layers, the page buffers upstream allocated, and the static buffers they replace.

Variants: ``upstream`` (MoELayer, moe_token_dispatcher_type=alltoall, SequentialMLP),
``static_cf<cf>`` for each ``--cf`` (our dispatcher, drops above the budget),
``static_cf<cf>_graph`` with ``--cuda-graph`` (the same step captured once in a CUDA graph and
replayed: no launch overhead and no host sync), ``static_cf<cf>_serial_wgrad`` for the first
``--cf`` factor (the experts' fc1 weight gradient computed in their own backward, not during the
dispatch's backward exchange: what ``megatron.bounded.moe.wgrad_handoff`` saves),
``static_nodrop`` (cf = E_p: a slab can hold every pair, nothing can drop), ``dropless``
(factor None: the rerun path, one host sync per layer) and ``paged_stash`` (static
capacity with factor ``--stash-cf``, default E_p, while upstream's PagedStashManager pages the
expert activations of every layer but the last).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# About 50 ms at an H200's clock, longer than issuing one forward + backward of the layers.
QUEUE_SLEEP_CYCLES = 100_000_000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank (default 16384)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN hidden size (SwiGLU)")
    p.add_argument("--layers", type=int, default=2,
                   help="stacked MoE layers (>= 2 so paged stash has a layer to page)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--cf", type=float, nargs="*", default=[1.5],
                   help="rank capacity factors to time (default 1.5)")
    p.add_argument("--stash-cf", type=float, default=None,
                   help="capacity factor for the paged-stash variant (default: E_p, no drops)")
    p.add_argument("--no-paged-stash", action="store_true", help="skip the paged-stash variant")
    p.add_argument("--no-dropless", action="store_true", help="skip the dropless variant")
    p.add_argument("--no-upstream", action="store_true", help="skip the upstream variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=str, default=None, help="write results as JSON here")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time each --cf factor captured in a CUDA graph (forward + backward "
                        "of the whole layer stack, router included): the static path without "
                        "launch overhead (it has no host sync, so it can be captured)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one forward+backward of each variant with "
                        "torch.profiler and print its 15 most expensive GPU kernels and its 20 "
                        "most expensive host operations (rank 0)")
    return p.parse_args(argv)


def _rel(a, b):
    a = a.float()
    b = b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None):
    args = parse_args(argv)

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("bench_moe_dispatch needs CUDA GPUs (launch with torchrun)", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "RANK" not in os.environ:  # plain `python bench_moe_dispatch.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()

    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import paged_stash as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.bounded.moe.moe_layer import bounded_moe_submodules

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must divide over {world} ranks")

    def make_config(factor):
        cfg = TransformerConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=16,
            num_moe_experts=args.experts,
            moe_router_topk=args.topk,
            moe_ffn_hidden_size=args.ffn,
            ffn_hidden_size=args.ffn,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bias_activation_fusion=False,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_router_dtype="fp32",
            expert_model_parallel_size=world,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
        )
        # Upstream ties these fields to HybridEP in __post_init__; set them afterwards.
        cfg.moe_expert_rank_capacity_factor = factor
        cfg.moe_paged_stash = False
        cfg.moe_paged_stash_page_size = 64
        cfg.moe_paged_stash_buffer_size_factor_cuda = 1.10
        cfg.moe_paged_stash_buffer_size_factor_cpu = 0.0
        return cfg

    torch.manual_seed(args.seed)
    upstream_cfg = make_config(None)
    upstream_layers = [get_moe_module_spec(use_te=False, num_experts=args.experts)(
        config=upstream_cfg, layer_number=i + 1) for i in range(args.layers)]
    ours_cfg = make_config(float(world))
    ours_cfg.bounded_moe_backend = "torch"
    ours_layers = [bounded_moe_submodules(ours_cfg, experts="grouped")(
        config=ours_cfg, layer_number=i + 1) for i in range(args.layers)]
    with torch.no_grad():
        for up, ours in zip(upstream_layers, ours_layers):
            ours.router.weight.copy_(up.router.weight)
            ours.experts.load_from_sequential_mlp(up.experts)
    for layer in upstream_layers + ours_layers:
        layer.cuda().train()

    gen = torch.Generator(device="cuda").manual_seed(args.seed + rank)
    x0 = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=dtype, generator=gen)
    grad_out = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=dtype, generator=gen)

    def zero_grads(layers):
        for layer in layers:
            for p in layer.parameters():
                p.grad = None

    def forward(layers):
        x = x0.detach().clone().requires_grad_(True)
        h = x
        for layer in layers:
            y, _ = layer(h)
            h = h + y
        return x, h

    def step(layers):
        x, h = forward(layers)
        h.backward(grad_out)
        return h.detach(), x.grad

    def stash_bytes_in_use(manager):
        """Bytes of the CUDA and host pages holding stashed activations right now (free lists)."""
        total = 0
        for per_dtype in (manager.stash_buffers or {}).values():
            for buf in per_dtype.values():
                free_cuda, free_host = (buf.free_list_tail - buf.free_list_head).tolist()
                used_pages = (buf.num_cuda_pages - free_cuda) + (buf.num_host_pages - free_host)
                total += used_pages * buf.page_size * buf.hidden_size * buf.cuda_buffer.element_size()
        return total

    def set_factor(factor):
        for layer in ours_layers:
            layer.token_dispatcher._comm_manager.moe_expert_rank_capacity_factor = factor
            layer.token_dispatcher.reset_over_budget()

    def over_budget():
        flags = [l.token_dispatcher.check_over_budget() for l in ours_layers]
        flag = torch.stack([f.view(-1)[0] for f in flags]).any().to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def profile_step(name, layers, before_step):
        from torch.profiler import ProfilerActivity, profile

        zero_grads(layers)
        if before_step:
            before_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(layers)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"\n== profile: {name} (one forward+backward, rank 0) ==")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
            print("-- the same step, by host time (the profiler inflates it) --")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    def queued_step_ms(run):
        """GPU time of ``run`` issued while the GPU is still busy (a sleep kernel), as a layer
        inside a model is issued while earlier layers compute: launch overhead is hidden up to
        the first host sync, which makes the host wait for the GPU and expose the launches
        after it. CUDA events around ``run``; the sleep covers the host's issue time."""
        torch.cuda.synchronize()
        dist.barrier()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(QUEUE_SLEEP_CYCLES)
        begin.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)

    def measure(name, layers, before_step=None, warmup=None):
        for _ in range(args.warmup if warmup is None else warmup):
            zero_grads(layers)
            if before_step:
                before_step()
            step(layers)
        torch.cuda.synchronize()
        times, peaks, host_times = [], [], []
        out = None
        for _ in range(args.iters):
            zero_grads(layers)
            if before_step:
                before_step()
            torch.cuda.synchronize()
            dist.barrier()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out, xgrad = step(layers)
            host_times.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            peaks.append(torch.cuda.max_memory_allocated() - base)
        queued_times = []
        for _ in range(args.iters):
            zero_grads(layers)
            if before_step:
                before_step()
            queued_times.append(queued_step_ms(lambda: step(layers)))
        if args.profile:
            profile_step(name, layers, before_step)
        # Per-rank medians, then the max over ranks; peak: max over ranks.
        t = torch.tensor([statistics.median(times), max(peaks), statistics.median(host_times),
                          statistics.median(queued_times)], device="cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"variant": name, "ms": t[0].item(), "extra_peak_gib": t[1].item() / 2**30,
                "host_ms": t[2].item(), "queued_ms": t[3].item(), "out": out, "xgrad": xgrad}

    results = []
    reference = None
    if not args.no_upstream:
        res = measure("upstream_alltoall_sequential", upstream_layers)
        reference = res
        results.append(res)

    def ours_variant(name, factor):
        set_factor(factor)
        res = measure(name, ours_layers, before_step=lambda: [l.token_dispatcher.reset_over_budget()
                                                              for l in ours_layers])
        res["capacity_factor"] = factor
        res["over_budget"] = over_budget() if factor is not None else False
        results.append(res)
        return res

    def captured_variant(name, factor):
        """The static step captured in a CUDA graph (after eager warm-up on a side stream, as
        capture requires) and timed as replays; outputs equal to eager are checked below."""
        set_factor(factor)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                zero_grads(ours_layers)
                step(ours_layers)
        torch.cuda.current_stream().wait_stream(side)
        zero_grads(ours_layers)
        set_factor(factor)  # resets the over-budget flags outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, xgrad = step(ours_layers)
        for _ in range(args.warmup):
            graph.replay()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        t = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res = {"variant": name, "ms": t.item(), "extra_peak_gib": float("nan"),
               "capacity_factor": factor, "over_budget": over_budget(),
               "out": out.clone(), "xgrad": xgrad.clone()}
        del graph
        results.append(res)
        return res

    def set_wgrad_overlap(links):
        for layer, link in zip(ours_layers, links):
            layer.token_dispatcher.wgrad_overlap = layer.experts.wgrad_overlap = link

    eager_static = {}
    for cf in args.cf:
        eager_static[cf] = ours_variant(f"static_cf{cf:g}", cf)
    if args.cf:
        links = [layer.token_dispatcher.wgrad_overlap for layer in ours_layers]
        set_wgrad_overlap([None] * len(ours_layers))
        serial = ours_variant(f"static_cf{args.cf[0]:g}_serial_wgrad", args.cf[0])
        set_wgrad_overlap(links)
        first = eager_static[args.cf[0]]
        serial["bitwise_equal_overlapped"] = bool(
            torch.equal(serial["out"], first["out"]) and torch.equal(serial["xgrad"], first["xgrad"]))
    if args.cuda_graph:
        for cf in args.cf:
            res = captured_variant(f"static_cf{cf:g}_graph", cf)
            res["bitwise_equal_eager"] = bool(torch.equal(res["out"], eager_static[cf]["out"])
                                              and torch.equal(res["xgrad"], eager_static[cf]["xgrad"]))
    nodrop = ours_variant("static_nodrop", float(world))
    if not args.no_dropless:
        ours_variant("dropless", None)

    stash_info = None
    # bytes per stashed row: the expert input [H] and the fc1 output [2F]
    width_bytes = (args.hidden + 2 * args.ffn) * (2 if dtype == torch.bfloat16 else 4)
    if not args.no_paged_stash and args.layers >= 2:
        factor = args.stash_cf if args.stash_cf is not None else float(world)
        set_factor(factor)
        ours_cfg.moe_expert_rank_capacity_factor = factor
        ps.PagedStashManager.STASH_MGR = None
        ours_cfg.moe_paged_stash = True

        def stash_iteration():
            for l in ours_layers:
                l.token_dispatcher.reset_over_budget()
            ps.paged_stash_reset(enabled=True, config=ours_cfg)
            ps.paged_stash_init_chunk_handler(1, 0)

        # Warm-up covers the manager's capture iteration and the page allocation.
        res = measure("paged_stash", ours_layers, before_step=stash_iteration,
                      warmup=max(args.warmup, 3))
        manager = ps.PagedStashManager.get_instance()
        # One more step, stopped between forward and backward: the pages in use then hold every
        # paged layer's stashed activations (the stash's peak).
        zero_grads(ours_layers)
        stash_iteration()
        x, h = forward(ours_layers)
        torch.cuda.synchronize()
        in_use = stash_bytes_in_use(manager)
        h.backward(grad_out)
        del x, h
        page_bytes = 0
        for per_dtype in (manager.stash_buffers or {}).values():
            for buf in per_dtype.values():
                page_bytes += buf.cuda_buffer.numel() * buf.cuda_buffer.element_size()
        capacity = ours_layers[0].token_dispatcher.capacity_for(args.tokens)
        static_rows = world * capacity
        res["capacity_factor"] = factor
        res["over_budget"] = over_budget()
        res["stash_overflow"] = bool(manager.overflow.item()) if manager.overflow is not None else None
        res["stash_page_bytes"] = page_bytes
        res["stash_bytes_in_use_after_forward"] = in_use  # this rank's; compared below
        res["static_buffer_bytes_paged_layers"] = static_rows * width_bytes * (args.layers - 1)
        stash_info = res
        results.append(res)
        ours_cfg.moe_paged_stash = False
        ps.PagedStashManager.STASH_MGR = None

    # Tokens actually received per rank per layer (valid rows) under the no-drop factor.
    set_factor(float(world))
    routed_rows = []
    with torch.no_grad():
        h = x0
        for layer in ours_layers:
            probs, routing_map = layer.router(h)
            local = args.experts // world
            counts = routing_map.sum(dim=0).view(world, local).sum(dim=1).to(torch.int64)
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts)
            routed_rows.append(int(recv.sum().item()))
            y, _ = layer(h)
            h = h + y
    routed_local = torch.tensor(routed_rows, device="cuda", dtype=torch.int64)
    routed_gathered = [torch.empty_like(routed_local) for _ in range(world)]
    dist.all_gather(routed_gathered, routed_local)
    routed_rows_all = [t.tolist() for t in routed_gathered]
    if stash_info is not None:
        # Stashed bytes against the bytes of the rows routed to the paged layers (all but the
        # last; the stashed tensors are the expert input [rows, H] and fc1 output [rows, 2F]):
        # per rank, then the rank with the largest ratio.
        routed_bytes = sum(routed_rows[:-1]) * width_bytes
        ratio_and_bytes = torch.tensor([stash_info["stash_bytes_in_use_after_forward"] / routed_bytes,
                              stash_info["stash_bytes_in_use_after_forward"], routed_bytes],
                             device="cuda", dtype=torch.float64)
        gathered = [torch.empty_like(ratio_and_bytes) for _ in range(world)]
        dist.all_gather(gathered, ratio_and_bytes)
        worst = max((t.tolist() for t in gathered), key=lambda v: v[0])
        stash_info["stash_in_use_over_routed"] = worst[0]
        stash_info["stash_bytes_in_use_after_forward"] = worst[1]
        stash_info["routed_bytes_paged_layers"] = worst[2]

    rows = []
    for res in results:
        row = {k: v for k, v in res.items() if k not in ("out", "xgrad")}
        if reference is not None:
            row["rel_out_vs_upstream"] = _rel(res["out"], reference["out"])
            row["rel_xgrad_vs_upstream"] = _rel(res["xgrad"], reference["xgrad"])
        for key in ("bitwise_equal_eager", "bitwise_equal_overlapped"):
            if key in res:
                row[key] = res[key]
        if res is not nodrop and res["variant"] in ("paged_stash", "dropless"):
            row["bitwise_equal_static_nodrop"] = bool(
                torch.equal(res["out"], nodrop["out"]) and torch.equal(res["xgrad"], nodrop["xgrad"]))
        rows.append(row)

    meta = {
        "world_size": world,
        "tokens_per_rank": args.tokens,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "ffn": args.ffn,
        "layers": args.layers,
        "dtype": args.dtype,
        "iters": args.iters,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "routed_rows_per_rank_layer": routed_rows_all,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if rank == 0:
        base_ms = rows[0]["ms"] if rows else None
        print(f"\nMoE fwd+bwd, {args.layers} layers, EP={world}, {args.tokens} tokens/rank, "
              f"H={args.hidden}, E={args.experts}, top-{args.topk}, FFN={args.ffn} SwiGLU, "
              f"{args.dtype}, {meta['gpu']}\n")
        print("| variant | cf | median ms | x upstream | host issue ms | queued ms | "
              "extra peak GiB | over budget | rel out vs upstream |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            ratio = r["ms"] / base_ms if base_ms else float("nan")
            print(f"| {r['variant']} | {r.get('capacity_factor', '-')} | {r['ms']:.2f} | "
                  f"{ratio:.2f} | {r.get('host_ms', float('nan')):.2f} | "
                  f"{r.get('queued_ms', float('nan')):.2f} | {r['extra_peak_gib']:.2f} | "
                  f"{r.get('over_budget', '-')} | {r.get('rel_out_vs_upstream', float('nan')):.2e} |")
        print("\nmedian ms: wall time of a forward + backward issued on an idle GPU, to the end of "
              "its last kernel; host issue ms: until the host returned from issuing it; queued "
              "ms: GPU time of the same step issued behind earlier GPU work (as inside a model)")
        for r in rows:
            if "bitwise_equal_eager" in r:
                print(f"{r['variant']}: replayed output and input gradient bitwise equal to eager: "
                      f"{r['bitwise_equal_eager']}")
            if "bitwise_equal_overlapped" in r:
                print(f"{r['variant']}: output and input gradient bitwise equal with the fc1 "
                      f"weight gradient overlapped: {r['bitwise_equal_overlapped']}")
        if stash_info is not None:
            s = next(r for r in rows if r["variant"] == "paged_stash")
            in_use, routed = s["stash_bytes_in_use_after_forward"], s["routed_bytes_paged_layers"]
            print(f"\npaged stash: pages in use after forward {in_use / 2**20:.1f} MiB = "
                  f"{s['stash_in_use_over_routed']:.3f} x the {routed / 2**20:.1f} MiB of tokens "
                  f"routed to the paged layers (the rank with the largest ratio); page buffers allocated "
                  f"{s['stash_page_bytes'] / 2**20:.1f} MiB (upstream sizes them for every layer, "
                  f"the last unpaged one included); static buffers replaced "
                  f"{s['static_buffer_bytes_paged_layers'] / 2**20:.1f} "
                  f"MiB, stash overflow {s['stash_overflow']}, bitwise equal to static_nodrop "
                  f"{s.get('bitwise_equal_static_nodrop')}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": rows}, f, indent=2)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
