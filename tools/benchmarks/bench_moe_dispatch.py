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
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_common import (  # puts the repository on sys.path
    PeakMemory, Stopwatch, cuda_event_ms, device_name, finish_distributed, init_distributed,
    markdown_table, max_over_ranks, relative_norm_difference, synchronize, utc_date, wall_times_s,
    write_json,
)

from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import paged_stash as ps
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.bounded.moe.moe_layer import bounded_moe_submodules
from megatron.bounded.units import GiB, MiB

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


def make_config(args, world: int, dtype, factor):
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


def build_layers(args, world: int, dtype):
    """(upstream's layers, our layers' config, our layers): the same router and expert weights."""
    torch.manual_seed(args.seed)
    upstream_cfg = make_config(args, world, dtype, None)
    upstream_layers = [get_moe_module_spec(use_te=False, num_experts=args.experts)(
        config=upstream_cfg, layer_number=i + 1) for i in range(args.layers)]
    ours_cfg = make_config(args, world, dtype, float(world))
    ours_cfg.bounded_moe_backend = "torch"
    ours_layers = [bounded_moe_submodules(ours_cfg, experts="grouped")(
        config=ours_cfg, layer_number=i + 1) for i in range(args.layers)]
    with torch.no_grad():
        for up, ours in zip(upstream_layers, ours_layers):
            ours.router.weight.copy_(up.router.weight)
            ours.experts.load_from_sequential_mlp(up.experts)
    for layer in upstream_layers + ours_layers:
        layer.cuda().train()
    return upstream_layers, ours_cfg, ours_layers


def stash_buffers(manager):
    return [buf for per_dtype in (manager.stash_buffers or {}).values() for buf in per_dtype.values()]


def stash_bytes_in_use(manager) -> int:
    """Bytes of the CUDA and host pages holding stashed activations right now (free lists)."""
    total = 0
    for buf in stash_buffers(manager):
        free_cuda, free_host = (buf.free_list_tail - buf.free_list_head).tolist()
        used_pages = (buf.num_cuda_pages - free_cuda) + (buf.num_host_pages - free_host)
        total += used_pages * buf.page_size * buf.hidden_size * buf.cuda_buffer.element_size()
    return total


def gather_from_ranks(values, dtype) -> list:
    """``values`` of every rank, in rank order."""
    local = torch.tensor(values, device="cuda", dtype=dtype)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def same_outputs(a: dict, b: dict) -> bool:
    """Whether two variants' outputs and input gradients are bitwise equal."""
    return bool(torch.equal(a["out"], b["out"]) and torch.equal(a["xgrad"], b["xgrad"]))


class MoEBench:
    """The stacked layers of both implementations on one input and output gradient, and the
    measurement of each variant (appended to ``results`` in the order they run)."""

    def __init__(self, args, rank: int, world: int, dtype):
        self.args, self.rank, self.world, self.dtype = args, rank, world, dtype
        self.upstream_layers, self.ours_cfg, self.ours_layers = build_layers(args, world, dtype)
        gen = torch.Generator(device="cuda").manual_seed(args.seed + rank)
        self.x0 = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=dtype, generator=gen)
        self.grad_out = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=dtype,
                                    generator=gen)
        self.results = []

    # -- one step

    @staticmethod
    def zero_grads(layers):
        for layer in layers:
            for p in layer.parameters():
                p.grad = None

    def forward(self, layers):
        x = self.x0.detach().clone().requires_grad_(True)
        h = x
        for layer in layers:
            y, _ = layer(h)
            h = h + y
        return x, h

    def step(self, layers):
        x, h = self.forward(layers)
        h.backward(self.grad_out)
        return h.detach(), x.grad

    def prepare(self, layers, before_step):
        self.zero_grads(layers)
        if before_step:
            before_step()

    def set_factor(self, factor):
        for layer in self.ours_layers:
            layer.token_dispatcher._comm_manager.moe_expert_rank_capacity_factor = factor
            layer.token_dispatcher.reset_over_budget()

    def reset_over_budget(self):
        for layer in self.ours_layers:
            layer.token_dispatcher.reset_over_budget()

    def over_budget(self) -> bool:
        flags = [l.token_dispatcher.check_over_budget() for l in self.ours_layers]
        flag = torch.stack([f.view(-1)[0] for f in flags]).any()
        return bool(max_over_ranks([flag.item()], "cuda")[0])

    # -- timing

    def queued_step_ms(self, run) -> float:
        """GPU time of ``run`` issued while the GPU is still busy (a sleep kernel), as a layer
        inside a model is issued while earlier layers compute: launch overhead is hidden up to
        the first host sync, which makes the host wait for the GPU and expose the launches
        after it. CUDA events around ``run``; the sleep covers the host's issue time."""
        synchronize()
        dist.barrier()
        torch.cuda._sleep(QUEUE_SLEEP_CYCLES)
        ms = cuda_event_ms(run)
        synchronize()  # every stream idle before the next step is prepared
        return ms

    def profile_step(self, name, layers, before_step):
        from torch.profiler import ProfilerActivity, profile

        self.prepare(layers, before_step)
        synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            self.step(layers)
            synchronize()
        if self.rank == 0:
            print(f"\n== profile: {name} (one forward+backward, rank 0) ==")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
            print("-- the same step, by host time (the profiler inflates it) --")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    def measure(self, name, layers, before_step=None, warmup=None) -> dict:
        """Median step time on an idle GPU, host issue time, queued GPU time and extra peak
        (per-rank medians, then the max over ranks; peak: max over ranks), and the last step's
        output and input gradient."""
        args = self.args
        for _ in range(args.warmup if warmup is None else warmup):
            self.prepare(layers, before_step)
            self.step(layers)
        synchronize()
        times, peaks, host_times = [], [], []
        out = xgrad = None
        for _ in range(args.iters):
            self.prepare(layers, before_step)
            with PeakMemory() as memory, Stopwatch() as clock:
                out, xgrad = self.step(layers)
            host_times.append(clock.host_s * 1e3)
            times.append(clock.wall_s * 1e3)
            peaks.append(memory.extra_bytes)
        queued_times = []
        for _ in range(args.iters):
            self.prepare(layers, before_step)
            queued_times.append(self.queued_step_ms(lambda: self.step(layers)))
        if args.profile:
            self.profile_step(name, layers, before_step)
        ms, peak, host_ms, queued_ms = max_over_ranks(
            [statistics.median(times), max(peaks), statistics.median(host_times),
             statistics.median(queued_times)], "cuda")
        return {"variant": name, "ms": ms, "extra_peak_gib": peak / GiB,
                "host_ms": host_ms, "queued_ms": queued_ms, "out": out, "xgrad": xgrad}

    # -- variants

    def upstream_variant(self) -> dict:
        res = self.measure("upstream_alltoall_sequential", self.upstream_layers)
        self.results.append(res)
        return res

    def ours_variant(self, name, factor) -> dict:
        self.set_factor(factor)
        res = self.measure(name, self.ours_layers, before_step=self.reset_over_budget)
        res["capacity_factor"] = factor
        res["over_budget"] = self.over_budget() if factor is not None else False
        self.results.append(res)
        return res

    def serial_wgrad_variant(self, factor, overlapped: dict) -> dict:
        """The experts' fc1 weight gradient computed in their own backward, not during the
        dispatch's backward exchange; compared bitwise with the ``overlapped`` variant."""
        links = [layer.token_dispatcher.wgrad_overlap for layer in self.ours_layers]
        self.set_wgrad_overlap([None] * len(self.ours_layers))
        serial = self.ours_variant(f"static_cf{factor:g}_serial_wgrad", factor)
        self.set_wgrad_overlap(links)
        serial["bitwise_equal_overlapped"] = same_outputs(serial, overlapped)
        return serial

    def set_wgrad_overlap(self, links):
        for layer, link in zip(self.ours_layers, links):
            layer.token_dispatcher.wgrad_overlap = layer.experts.wgrad_overlap = link

    def captured_variant(self, name, factor, eager: dict) -> dict:
        """The static step captured in a CUDA graph (after eager warm-up on a side stream, as
        capture requires) and timed as replays; compared bitwise with the ``eager`` variant."""
        layers = self.ours_layers
        self.set_factor(factor)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.zero_grads(layers)
                self.step(layers)
        torch.cuda.current_stream().wait_stream(side)
        self.zero_grads(layers)
        self.set_factor(factor)  # resets the over-budget flags outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, xgrad = self.step(layers)
        times = wall_times_s(graph.replay, self.args.iters, warmup=self.args.warmup)
        ms = max_over_ranks([statistics.median(t * 1e3 for t in times)], "cuda")[0]
        res = {"variant": name, "ms": ms, "extra_peak_gib": float("nan"),
               "capacity_factor": factor, "over_budget": self.over_budget(),
               "out": out.clone(), "xgrad": xgrad.clone()}
        res["bitwise_equal_eager"] = same_outputs(res, eager)
        del graph
        self.results.append(res)
        return res

    def paged_stash_variant(self) -> dict:
        """Static capacity (``--stash-cf``, default E_p) while upstream's PagedStashManager pages
        the expert activations of every layer but the last: the step's timing and the stash's
        pages against the static buffers they replace."""
        args, cfg = self.args, self.ours_cfg
        factor = args.stash_cf if args.stash_cf is not None else float(self.world)
        self.set_factor(factor)
        cfg.moe_expert_rank_capacity_factor = factor
        ps.PagedStashManager.STASH_MGR = None
        cfg.moe_paged_stash = True

        def stash_iteration():
            self.reset_over_budget()
            ps.paged_stash_reset(enabled=True, config=cfg)
            ps.paged_stash_init_chunk_handler(1, 0)

        # Warm-up covers the manager's capture iteration and the page allocation.
        res = self.measure("paged_stash", self.ours_layers, before_step=stash_iteration,
                           warmup=max(args.warmup, 3))
        manager = ps.PagedStashManager.get_instance()
        in_use = self.stash_in_use_after_forward(manager, stash_iteration)
        capacity = self.ours_layers[0].token_dispatcher.capacity_for(args.tokens)
        static_rows = self.world * capacity
        res["capacity_factor"] = factor
        res["over_budget"] = self.over_budget()
        res["stash_overflow"] = bool(manager.overflow.item()) if manager.overflow is not None else None
        res["stash_page_bytes"] = sum(buf.cuda_buffer.numel() * buf.cuda_buffer.element_size()
                                      for buf in stash_buffers(manager))
        res["stash_bytes_in_use_after_forward"] = in_use  # this rank's; compared later
        res["static_buffer_bytes_paged_layers"] = (
            static_rows * self.stashed_row_bytes() * (args.layers - 1))
        self.results.append(res)
        cfg.moe_paged_stash = False
        ps.PagedStashManager.STASH_MGR = None
        return res

    def stash_in_use_after_forward(self, manager, stash_iteration) -> int:
        """One more step, stopped between forward and backward: the pages in use then hold every
        paged layer's stashed activations (the stash's peak)."""
        self.zero_grads(self.ours_layers)
        stash_iteration()
        x, h = self.forward(self.ours_layers)
        synchronize()
        in_use = stash_bytes_in_use(manager)
        h.backward(self.grad_out)
        return in_use

    def stashed_row_bytes(self) -> int:
        """Bytes per stashed row: the expert input [H] and the fc1 output [2F]."""
        return (self.args.hidden + 2 * self.args.ffn) * (2 if self.dtype == torch.bfloat16 else 4)

    # -- routing

    def routed_rows(self) -> list:
        """Tokens actually received by this rank per layer (valid rows) under the no-drop
        factor."""
        args, world = self.args, self.world
        self.set_factor(float(world))
        rows = []
        with torch.no_grad():
            h = self.x0
            for layer in self.ours_layers:
                probs, routing_map = layer.router(h)
                local = args.experts // world
                counts = routing_map.sum(dim=0).view(world, local).sum(dim=1).to(torch.int64)
                recv = torch.empty_like(counts)
                dist.all_to_all_single(recv, counts)
                rows.append(int(recv.sum().item()))
                y, _ = layer(h)
                h = h + y
        return rows

    def compare_stash_to_routed(self, stash: dict, routed_rows: list) -> None:
        """Stashed bytes against the bytes of the rows routed to the paged layers (all but the
        last; the stashed tensors are the expert input [rows, H] and fc1 output [rows, 2F]):
        per rank, then the rank with the largest ratio."""
        routed_bytes = sum(routed_rows[:-1]) * self.stashed_row_bytes()
        in_use = stash["stash_bytes_in_use_after_forward"]
        worst = max(gather_from_ranks([in_use / routed_bytes, in_use, routed_bytes], torch.float64),
                    key=lambda v: v[0])
        stash["stash_in_use_over_routed"] = worst[0]
        stash["stash_bytes_in_use_after_forward"] = worst[1]
        stash["routed_bytes_paged_layers"] = worst[2]


def run_variants(bench: MoEBench):
    """Every variant in order: (upstream's result or None, static_nodrop's, paged stash's or
    None)."""
    args = bench.args
    reference = None if args.no_upstream else bench.upstream_variant()
    eager_static = {cf: bench.ours_variant(f"static_cf{cf:g}", cf) for cf in args.cf}
    if args.cf:
        bench.serial_wgrad_variant(args.cf[0], eager_static[args.cf[0]])
    if args.cuda_graph:
        for cf in args.cf:
            bench.captured_variant(f"static_cf{cf:g}_graph", cf, eager_static[cf])
    nodrop = bench.ours_variant("static_nodrop", float(bench.world))
    if not args.no_dropless:
        bench.ours_variant("dropless", None)
    stash = None
    if not args.no_paged_stash and args.layers >= 2:
        stash = bench.paged_stash_variant()
    return reference, nodrop, stash


def comparison_rows(results: list, reference, nodrop) -> list:
    """The records of ``results`` without their tensors, each with its differences to
    ``reference`` (upstream, when it ran); paged stash and dropless also say whether they are
    bitwise equal to ``nodrop``."""
    rows = []
    for res in results:
        row = {k: v for k, v in res.items() if k not in ("out", "xgrad")}
        if reference is not None:
            row["rel_out_vs_upstream"] = relative_norm_difference(res["out"], reference["out"])
            row["rel_xgrad_vs_upstream"] = relative_norm_difference(res["xgrad"], reference["xgrad"])
        if res is not nodrop and res["variant"] in ("paged_stash", "dropless"):
            row["bitwise_equal_static_nodrop"] = same_outputs(res, nodrop)
        rows.append(row)
    return rows


def meta_record(args, world: int, routed_rows_all: list) -> dict:
    return {
        "world_size": world,
        "tokens_per_rank": args.tokens,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "ffn": args.ffn,
        "layers": args.layers,
        "dtype": args.dtype,
        "iters": args.iters,
        "gpu": device_name(),
        "torch": torch.__version__,
        "routed_rows_per_rank_layer": routed_rows_all,
        "date": utc_date(),
    }


def summary(args, meta: dict, rows: list) -> str:
    """The printed summary: the setting, a table row per variant, what the times mean, the
    bitwise checks and the paged stash's bytes."""
    base_ms = rows[0]["ms"] if rows else None
    nan = float("nan")
    cells = [[r["variant"], r.get("capacity_factor", "-"), f"{r['ms']:.2f}",
              f"{r['ms'] / base_ms if base_ms else nan:.2f}", f"{r.get('host_ms', nan):.2f}",
              f"{r.get('queued_ms', nan):.2f}", f"{r['extra_peak_gib']:.2f}",
              r.get("over_budget", "-"), f"{r.get('rel_out_vs_upstream', nan):.2e}"]
             for r in rows]
    lines = [
        f"\nMoE fwd+bwd, {args.layers} layers, EP={meta['world_size']}, {args.tokens} tokens/rank, "
        f"H={args.hidden}, E={args.experts}, top-{args.topk}, FFN={args.ffn} SwiGLU, "
        f"{args.dtype}, {meta['gpu']}\n",
        markdown_table(["variant", "cf", "median ms", "x upstream", "host issue ms", "queued ms",
                        "extra peak GiB", "over budget", "rel out vs upstream"], cells),
        "\nmedian ms: wall time of a forward + backward issued on an idle GPU, to the end of "
        "its last kernel; host issue ms: until the host returned from issuing it; queued "
        "ms: GPU time of the same step issued behind earlier GPU work (as inside a model)",
    ]
    for r in rows:
        if "bitwise_equal_eager" in r:
            lines.append(f"{r['variant']}: replayed output and input gradient bitwise equal to "
                         f"eager: {r['bitwise_equal_eager']}")
        if "bitwise_equal_overlapped" in r:
            lines.append(f"{r['variant']}: output and input gradient bitwise equal with the fc1 "
                         f"weight gradient overlapped: {r['bitwise_equal_overlapped']}")
    stash = next((r for r in rows if r["variant"] == "paged_stash"), None)
    if stash is not None:
        lines.append(stash_summary(stash))
    return "\n".join(lines)


def stash_summary(s: dict) -> str:
    in_use, routed = s["stash_bytes_in_use_after_forward"], s["routed_bytes_paged_layers"]
    return (f"\npaged stash: pages in use after forward {in_use / MiB:.1f} MiB = "
            f"{s['stash_in_use_over_routed']:.3f} x the {routed / MiB:.1f} MiB of tokens "
            f"routed to the paged layers (the rank with the largest ratio); page buffers allocated "
            f"{s['stash_page_bytes'] / MiB:.1f} MiB (upstream sizes them for every layer, "
            f"the last unpaged one included); static buffers replaced "
            f"{s['static_buffer_bytes_paged_layers'] / MiB:.1f} "
            f"MiB, stash overflow {s['stash_overflow']}, bitwise equal to static_nodrop "
            f"{s.get('bitwise_equal_static_nodrop')}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_dispatch needs CUDA GPUs (launch with torchrun)", file=sys.stderr)
        return 2
    rank, world, _ = init_distributed(default_port=29512)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must divide over {world} ranks")
    bench = MoEBench(args, rank, world, dtype)
    reference, nodrop, stash = run_variants(bench)
    routed_rows = bench.routed_rows()
    routed_rows_all = gather_from_ranks(routed_rows, torch.int64)
    if stash is not None:
        bench.compare_stash_to_routed(stash, routed_rows)
    rows = comparison_rows(bench.results, reference, nodrop)
    meta = meta_record(args, world, routed_rows_all)
    if rank == 0:
        print(summary(args, meta, rows))
        if args.out:
            write_json(args.out, {"meta": meta, "results": rows})
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
