"""Benchmark one optimizer step: GPU-resident AdamW, CPU Adam offload, OffloadStreamAdamW.

On CUDA, in one run and on the same parameters and gradients:

  gpu_fused_adamw       torch.optim.AdamW(fused=True) on fp32 masters and moments kept on the GPU,
                        then the masters are copied into the working parameters;
  cpu_adamw_fused       the classic offload: gradients go to host (D2H), torch.optim.AdamW(fused=True)
                        updates fp32 masters on the CPU, working parameters come back (H2D);
  cpu_adamw_foreach     the same with torch's foreach AdamW, the update megatron-core's
                        HybridDeviceOptimizer runs on the host;
  offload_stream_adamw  OffloadStreamAdamW: host state streamed through GPU staging slots.

For each: median step time (synchronized wall clock), extra peak GPU memory over the working
parameters and gradients (``max_memory_allocated`` after ``reset_peak_memory_stats``), and the
host-link floor: bytes the step must move each way over the pinned-copy bandwidth measured here
with both directions busy at once. All variants run the same number of steps from the same start,
so their final parameters are compared with the first variant's.

Without CUDA it runs a small CPU smoke comparison of torch's fused AdamW with OffloadStreamAdamW.

  python tools/benchmarks/bench_offload_stream_adamw.py --numel 1000000000 --bucket-numel 100000000 \\
      --slots 2 --repeats 5 --out results/offload_stream_adamw.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench_common import (  # puts the repository on sys.path
    PeakMemory, Stopwatch, cell, command_line, device_name, markdown_table, synchronize, utc_date,
    wall_times_s, write_json,
)

from megatron.bounded.optimizer.offload_stream_adamw import (
    HOST_BYTES_PER_ELEMENT,
    STAGED_BYTES_PER_ELEMENT,
    OffloadStreamAdamW,
)
from megatron.bounded.units import GB, GiB, MiB

VARIANTS = ("gpu_fused_adamw", "cpu_adamw_fused", "cpu_adamw_foreach", "offload_stream_adamw")
ADAM_HYPERPARAMETERS = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1_000_000_000, help="parameters in total")
    parser.add_argument("--num-tensors", type=int, default=8, help="parameter tensors, of unequal sizes")
    parser.add_argument("--bucket-numel", type=int, default=100_000_000)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16",
        help="working parameter dtype (CUDA runs; the CPU smoke uses fp32)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        help="comma-separated subset of: " + ", ".join(VARIANTS) + " (the first one is the reference)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    return parser.parse_args(argv)


def tensor_sizes(numel: int, count: int) -> list[int]:
    """Split ``numel`` into ``count`` sizes proportional to 1..count (so some exceed a bucket)."""
    weights = range(1, count + 1)
    sizes = [numel * w // sum(weights) for w in weights]
    sizes[-1] += numel - sum(sizes)
    return [s for s in sizes if s > 0]


def make_tensors(sizes, dtype, device, seed, scale):
    generator = torch.Generator(device=device).manual_seed(seed)
    return [
        (torch.randn(n, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)
        for n in sizes
    ]


# ---------------------------------------------------------------------------------- variants


def gpu_fused_adamw(params, grads):
    """fp32 masters, fp32 gradients and both moments on the GPU; masters copied into params."""
    if params[0].dtype == torch.float32:
        masters, fp32_grads = params, grads
    else:
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        fp32_grads = [torch.empty_like(m) for m in masters]
    for master, grad in zip(masters, fp32_grads):
        master.grad = grad
    optimizer = torch.optim.AdamW(masters, fused=True, **ADAM_HYPERPARAMETERS)

    def step():
        if masters is not params:
            for fp32_grad, grad in zip(fp32_grads, grads):
                fp32_grad.copy_(grad)
        optimizer.step()
        if masters is not params:
            for param, master in zip(params, masters):
                param.detach().copy_(master)

    return step, {}


def cpu_adam_offload(params, grads, implementation):
    """Gradients D2H, AdamW on host fp32 masters, parameters H2D (no overlap). ``implementation``
    is torch's "fused" CPU kernel or "foreach" (what megatron-core's HybridDeviceOptimizer runs)."""
    host_masters = [torch.nn.Parameter(p.detach().cpu().float()) for p in params]
    for master in host_masters:
        master.grad = torch.empty_like(master)
    pinned_grads = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in grads]
    pinned_params = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
    optimizer = torch.optim.AdamW(host_masters, **{implementation: True}, **ADAM_HYPERPARAMETERS)

    def step():
        for pinned, grad in zip(pinned_grads, grads):
            pinned.copy_(grad, non_blocking=True)
        torch.cuda.synchronize()
        for master, pinned in zip(host_masters, pinned_grads):
            master.grad.copy_(pinned)
        optimizer.step()
        for pinned, master in zip(pinned_params, host_masters):
            pinned.copy_(master)
        for param, pinned in zip(params, pinned_params):
            param.detach().copy_(pinned, non_blocking=True)

    element = params[0].element_size()
    return step, {"d2h_bytes_per_param": element, "h2d_bytes_per_param": element}


def offload_stream_adamw(params, grads, bucket_numel, slots):
    for param, grad in zip(params, grads):
        param.grad = grad
    optimizer = OffloadStreamAdamW(params, bucket_numel=bucket_numel, num_slots=slots, **ADAM_HYPERPARAMETERS)
    info = {
        "d2h_bytes_per_param": HOST_BYTES_PER_ELEMENT,
        "h2d_bytes_per_param": HOST_BYTES_PER_ELEMENT,
        "buckets": len(optimizer.buckets),
        "largest_bucket": max(b.numel for b in optimizer.buckets),
        "optimizer": optimizer,
    }
    return optimizer.step, info


# ---------------------------------------------------------------------------------- link


def measure_pinned_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """GB/s of pinned H2D and D2H copies, alone and with both directions running at once."""
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    device_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_src.copy_(device_src)
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def run(h2d: bool, d2h: bool) -> float:
        with Stopwatch("cuda") as clock:
            if h2d:
                with torch.cuda.stream(h2d_stream):
                    device_dst.copy_(host_src, non_blocking=True)
            if d2h:
                with torch.cuda.stream(d2h_stream):
                    host_dst.copy_(device_src, non_blocking=True)
        return nbytes / clock.wall_s / GB

    result = {}
    for name, directions in (("h2d", (True, False)), ("d2h", (False, True)), ("each_way_bidirectional", (True, True))):
        run(*directions)
        result[name] = statistics.median(run(*directions) for _ in range(repeats))
    result["copy_bytes"] = nbytes
    return result


# ---------------------------------------------------------------------------------- main


def compare_to_reference(params, reference_params) -> dict:
    """Final parameters against the first variant's (same start, same gradients, same steps)."""
    return {
        "bitwise_equal_to_reference": all(torch.equal(p, r) for p, r in zip(params, reference_params)),
        "max_abs_diff_vs_reference": max(
            (p.float() - r.float()).abs().max().item() for p, r in zip(params, reference_params)
        ),
    }


def step_row(name: str, times: list, extra_peak, host_link_floor) -> dict:
    """A variant's record: its step times (s) and the measured peak and floor."""
    return {
        "variant": name,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "extra_peak_gpu_bytes": extra_peak,
        "host_link_floor_s": host_link_floor,
    }


def host_link_floor_s(info: dict, numel: int, link: dict) -> float:
    """Seconds the step's host copies take at least: the larger direction's bytes over the
    pinned bandwidth each way with both directions busy (0 for a GPU-resident step)."""
    if "h2d_bytes_per_param" not in info:
        return 0.0
    bidirectional = link["each_way_bidirectional"] * GB
    return max(info["h2d_bytes_per_param"] * numel / bidirectional,
               info["d2h_bytes_per_param"] * numel / bidirectional)


def cuda_variant(name, build, sizes, dtype, args, link, reference_params):
    """One variant on fresh parameters: (its record, its final parameters)."""
    params = make_tensors(sizes, dtype, "cuda", seed=0, scale=2e-2)
    synchronize()
    torch.cuda.empty_cache()
    with PeakMemory() as memory:
        step, info = build(params)
        times = wall_times_s(step, args.repeats, args.warmup, device="cuda")
    row = step_row(name, times, memory.extra_bytes, host_link_floor_s(info, args.numel, link))
    optimizer = info.pop("optimizer", None)
    if optimizer is not None:
        row["staging_bytes"] = optimizer.staging_bytes()
        row["staging_bound_bytes"] = (
            min(args.slots, info["buckets"]) * info["largest_bucket"] * STAGED_BYTES_PER_ELEMENT
        )
        row["host_state_bytes"] = optimizer.host_state_bytes()
        row["buckets"] = info["buckets"]
        optimizer.synchronize()
    row.update(compare_to_reference(params, reference_params or params))
    return row, params


def run_cuda(args) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sizes = tensor_sizes(args.numel, args.num_tensors)
    link = measure_pinned_bandwidth(min(GiB, max(args.numel * 4, 64 * MiB)))
    grads = make_tensors(sizes, dtype, "cuda", seed=1, scale=1e-2)
    builders = {
        "gpu_fused_adamw": lambda p: gpu_fused_adamw(p, grads),
        "cpu_adamw_fused": lambda p: cpu_adam_offload(p, grads, "fused"),
        "cpu_adamw_foreach": lambda p: cpu_adam_offload(p, grads, "foreach"),
        "offload_stream_adamw": lambda p: offload_stream_adamw(p, grads, args.bucket_numel, args.slots),
    }
    names = args.variants.split(",")
    unknown = [name for name in names if name not in builders]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(builders)}")
    results, reference_params = [], None
    for name in names:
        row, params = cuda_variant(name, builders[name], sizes, dtype, args, link, reference_params)
        results.append(row)
        reference_params = reference_params or params
        del params  # freed before the next variant's peak is measured, unless the reference
    return {"device": device_name("cuda"), "pinned_bandwidth_gbps": link, "results": results}


def run_cpu(args) -> dict:
    sizes = tensor_sizes(args.numel, args.num_tensors)
    grads = make_tensors(sizes, torch.float32, "cpu", seed=1, scale=1e-2)
    results, reference_params = [], None
    for name in ("cpu_fused_adamw", "offload_stream_adamw"):
        params = [torch.nn.Parameter(t) for t in make_tensors(sizes, torch.float32, "cpu", seed=0, scale=2e-2)]
        for param, grad in zip(params, grads):
            param.grad = grad
        if name == "cpu_fused_adamw":
            step = torch.optim.AdamW(params, fused=True, **ADAM_HYPERPARAMETERS).step
        else:
            step = OffloadStreamAdamW(
                params, bucket_numel=args.bucket_numel, num_slots=args.slots, **ADAM_HYPERPARAMETERS
            ).step
        times = wall_times_s(step, args.repeats, args.warmup, device="cpu")
        reference_params = reference_params or params
        row = step_row(name, times, None, None)
        row.update(compare_to_reference(params, reference_params))
        results.append(row)
    return {"device": "cpu", "pinned_bandwidth_gbps": None, "results": results}


def markdown_summary(report: dict) -> str:
    rows = report["results"]
    baseline = rows[0]["median_step_s"]
    offload = next((r["median_step_s"] for r in rows if r["variant"] == "cpu_adamw_foreach"), None)
    header = ["variant", "median step (s)", f"vs {rows[0]['variant']}", "speedup vs cpu_adamw_foreach",
              "extra GPU peak (GiB)", "host-link floor (s)", f"result vs {rows[0]['variant']}"]
    cells = []
    for row in rows:
        seconds = row["median_step_s"]
        if row["bitwise_equal_to_reference"]:
            result = "bitwise equal"
        else:
            result = f"max abs diff {row['max_abs_diff_vs_reference']:.3g}"
        peak = row["extra_peak_gpu_bytes"]
        cells.append([
            row["variant"], f"{seconds:.4f}", f"{seconds / baseline:.2f}x",
            "n/a" if offload is None else f"{offload / seconds:.2f}x",
            cell(None if peak is None else peak / GiB, ".3f", "n/a"),
            cell(row["host_link_floor_s"], ".4f", "n/a"), result,
        ])
    return markdown_table(header, cells)


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_cuda(args) if torch.cuda.is_available() else run_cpu(args)
    report.update(
        date=utc_date(),
        command=command_line(),
        torch=torch.__version__,
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    )
    print(markdown_summary(report))
    if report["pinned_bandwidth_gbps"]:
        link = report["pinned_bandwidth_gbps"]
        print(
            f"\npinned copies: H2D {link['h2d']:.1f} GB/s, D2H {link['d2h']:.1f} GB/s, "
            f"{link['each_way_bidirectional']:.1f} GB/s each way with both directions busy"
        )
    if args.out is not None:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
