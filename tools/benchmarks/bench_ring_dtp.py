#!/usr/bin/env python3
"""Benchmark: Ring-DTP vs the standard materialized-logits cross-entropy, side by side.

Every rank holds its own batch of ``--tokens`` tokens. The standard path gives each rank the FULL
weight and materializes its N x V fp32 logits (``reference_cross_entropy``: logits, log-softmax and
their gradient). Ring-DTP gives each rank one vocabulary shard and runs the ring in ``weights``,
``activations`` and ``auto`` mode. For each variant the script reports the forward+backward median
time, the extra peak memory (``torch.cuda.max_memory_allocated`` after a reset, minus what was
allocated before; CUDA only; also without the bytes of the returned gradients, which every
variant hands back), Ring-DTP's bound (``ring_dtp_workspace_bytes`` plus the returned
gradients), and the largest relative error of the loss, dX and dW against the standard path (dW:
the standard full-weight gradient summed over all ranks and sliced to the shard). Times and memory
are the maximum over ranks. The standard path does 3 GEMMs (logits, dX, dW); Ring-DTP does 4 (it
recomputes each strip in backward instead of keeping it), so about 4/3 of the standard's GEMM time
is its floor when the hops are hidden; with ``--grad-in-forward`` it also runs
``grad_in_forward=True`` (activations and auto), which forms every strip once: 3 GEMMs. By default
the mean of the per-token losses is backpropagated (``--reduction mean``), as the fused
baselines' published benchmarks do; ``--reduction none`` backpropagates a random per-token gradient.

On CUDA, ``--fused-baselines`` also runs the single-GPU fused kernels Ring-DTP is compared with, on
each rank's own batch with the full weight: Liger's fused linear cross-entropy
(``liger-kernel``) and Apple's Cut Cross-Entropy (``cut-cross-entropy``). They are benchmark-only
extras (pure-Python wheels), imported when installed and skipped otherwise. Liger runs twice: as
it runs by default (``liger_flce``: the weight gradient accumulated in the weight's dtype, bf16
here) and with ``accum_dtype=torch.float32`` (``liger_flce_fp32``), the precision Ring-DTP always
accumulates in.

    torchrun --nproc_per_node=8 tools/benchmarks/bench_ring_dtp.py --tokens 16384 --hidden 7168 \
        --vocab 200000 --out results/ring_dtp.json
    python tools/benchmarks/bench_ring_dtp.py --tokens 64 --hidden 32 --vocab 1000 --repeats 2

Multi-process runs use NCCL on CUDA and gloo otherwise; a single process needs no launcher.
"""

from __future__ import annotations

import argparse
import functools
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from megatron.bounded.loss.ring_dtp import (  # noqa: E402
    choose_ring_mode,
    reference_cross_entropy,
    ring_dtp_cross_entropy,
    ring_dtp_workspace_bytes,
    vocab_shard_range,
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Single-GPU fused linear cross-entropy kernels to compare with: (module, function, keyword
# arguments). Liger accumulates the weight gradient in the weight's dtype by default (bf16 here);
# ``liger_flce_fp32`` asks it for fp32 accumulation, as Ring-DTP always does.
_FUSED_BASELINES = {
    "liger_flce": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", {}),
    "liger_flce_fp32": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy",
                        {"accum_dtype": torch.float32}),
    "cut_cross_entropy": ("cut_cross_entropy", "linear_cross_entropy", {}),
}


def _fused_baselines(choice: str, device) -> dict:
    """name -> per-token loss function (hidden [N, H], full weight [V, H], labels [N])."""
    if choice == "none" or device.type != "cuda":
        return {}
    names = list(_FUSED_BASELINES) if choice == "auto" else choice.split(",")
    found = {}
    for name in names:
        if name not in _FUSED_BASELINES:
            raise SystemExit(f"--fused-baselines: unknown {name!r}; choose from {list(_FUSED_BASELINES)}")
        module_name, function_name, kwargs = _FUSED_BASELINES[name]
        try:
            module = __import__(module_name, fromlist=[function_name])
        except ImportError:
            if choice != "auto":
                raise
            continue
        found[name] = functools.partial(getattr(module, function_name), **kwargs)
    return found


def _parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank (N)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (H)")
    p.add_argument("--vocab", type=int, default=65536, help="full vocabulary size (V)")
    p.add_argument("--mode", default="all", choices=["all", "auto", "weights", "activations"],
                   help="Ring-DTP modes to run next to the standard path")
    p.add_argument("--chunk-tokens", type=int, default=None, help="Ring-DTP token chunk per strip")
    p.add_argument("--gradient-rows", type=int, default=None,
                   help="one rank: Ring-DTP's rows of G per weight-gradient GEMM, a multiple of "
                   "--chunk-tokens (default: its rule)")
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per variant")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fused-baselines", default="auto",
                   help="comma-separated subset of %s, 'none', or 'auto' (those installed; CUDA "
                   "only)" % ",".join(_FUSED_BASELINES))
    p.add_argument("--reduction", default="mean", choices=["mean", "none"],
                   help="mean (default): the mean of the per-token losses is backpropagated, a "
                   "loss gradient of one value per token, as the fused baselines' benchmarks and "
                   "--grad-in-forward need; none: a random per-token loss gradient")
    p.add_argument("--grad-in-forward", action="store_true",
                   help="also run Ring-DTP with grad_in_forward=True in the activations and auto "
                   "modes (gradients computed in forward, every strip formed once)")
    p.add_argument("--skip-standard-memory", action="store_true",
                   help="do not run the standard path (e.g. when its N x V logits would not fit)")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    return p.parse_args(argv)


def _init():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, device


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce_max(value: float, device, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _barrier(world):
    if world > 1:
        dist.barrier()


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / max(expected.double().abs().max().item(), 1e-30)


def main(argv=None):
    args = _parse(argv)
    rank, world, device = _init()
    dtype = _DTYPES[args.dtype]
    elem_bytes = torch.finfo(dtype).bits // 8
    group = dist.group.WORLD if world > 1 else None
    n, hidden, vocab = args.tokens, args.hidden, args.vocab
    start, end = vocab_shard_range(vocab, rank, world)

    # Same full weight on every rank, a different batch per rank; random, never all zero.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    full_w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(dtype)
    gen.manual_seed(args.seed + 1 + rank)
    x_data = torch.randn(n, hidden, device=device, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    grad_out = torch.rand(n, device=device, generator=gen) + 0.5
    assert x_data.abs().sum() > 0 and full_w.abs().sum() > 0, "inputs must not be all zero"
    shard_data = full_w[start:end].clone()

    x = x_data.clone().requires_grad_()
    w_full = full_w.clone().requires_grad_()
    w_shard = shard_data.clone().requires_grad_()

    modes = ["weights", "activations", "auto"] if args.mode == "all" else [args.mode]
    variants = [("standard", None, False)] + [(f"ring_dtp[{m}]", m, False) for m in modes]
    if args.grad_in_forward:
        variants += [(f"ring_dtp[{m}+grad_in_forward]", m, True) for m in modes if m != "weights"]
    if args.skip_standard_memory:
        variants = variants[1:]
    fused = _fused_baselines(args.fused_baselines, device)
    variants += [(name, name, False) for name in fused]

    def run(mode, grad_in_forward=False):
        x.grad = w_full.grad = w_shard.grad = None
        if mode in fused:
            loss = fused[mode](x, w_full, labels, reduction=args.reduction)
        else:
            if mode is None:
                loss = reference_cross_entropy(x, w_full, labels)
            else:
                loss = ring_dtp_cross_entropy(x, w_shard, labels, group=group, mode=mode,
                                              chunk_tokens=args.chunk_tokens,
                                              grad_in_forward=grad_in_forward,
                                              gradient_rows=args.gradient_rows)
            if args.reduction == "mean":
                loss = loss.mean()
        if args.reduction == "mean":
            loss.backward()
        else:
            loss.backward(grad_out)
        return loss.detach()

    def weight_grad_of_shard(mode):
        """This rank's dW shard: Ring-DTP's own, or a full-weight gradient summed and sliced."""
        if mode not in fused:
            return w_shard.grad
        dw = w_full.grad.float()
        if world > 1:
            dist.all_reduce(dw)
        return dw[start:end]

    # Correctness first: the standard path is the reference (its dW summed over all ranks).
    results = {}
    ref = None
    if not args.skip_standard_memory:
        ref_loss = run(None)
        ref_dw = w_full.grad.float()
        if world > 1:
            dist.all_reduce(ref_dw)
        ref = (ref_loss, x.grad.clone(), ref_dw[start:end].clone())
        del ref_dw
        x.grad = w_full.grad = None

    for name, mode, grad_in_forward in variants:
        row = {"variant": name}
        row["mode_used"] = (
            "standard" if mode is None
            else "single GPU, full weight" if mode in fused
            else ("single" if world == 1 else
                  (choose_ring_mode(_reduce_max(n, device, world), vocab, world, grad_in_forward)
                   if mode == "auto" else mode))
        )
        loss = run(mode, grad_in_forward)
        if ref is not None and mode is not None:
            row["rel_err_loss"] = _reduce_max(_rel(loss, ref[0]), device, world)
            row["rel_err_dx"] = _reduce_max(_rel(x.grad, ref[1]), device, world)
            row["rel_err_dw"] = _reduce_max(_rel(weight_grad_of_shard(mode), ref[2]), device, world)
        for _ in range(max(0, args.warmup - 1)):
            run(mode, grad_in_forward)
        times = []
        for _ in range(args.repeats):
            _barrier(world)
            _sync(device)
            t0 = time.perf_counter()
            run(mode, grad_in_forward)
            _sync(device)
            times.append(time.perf_counter() - t0)
        row["fwd_bwd_ms_median"] = _reduce_max(statistics.median(times) * 1e3, device, world)
        if device.type == "cuda":
            x.grad = w_full.grad = w_shard.grad = None
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run(mode, grad_in_forward)
            _sync(device)
            extra = torch.cuda.max_memory_allocated(device) - base
            row["extra_peak_gib"] = _reduce_max(extra / 2**30, device, world)
            # the same without the returned gradients (dX, and the full or shard dW), which every
            # variant must hand back: the operator's own transient
            grad_bytes = sum(t.grad.numel() * t.grad.element_size()
                             for t in (x, w_full, w_shard) if t.grad is not None)
            row["extra_peak_without_grads_gib"] = _reduce_max((extra - grad_bytes) / 2**30, device, world)
        if mode is not None and mode not in fused:
            n_max = int(_reduce_max(n, device, world))
            bound = ring_dtp_workspace_bytes(
                n, hidden, vocab, world, mode, args.chunk_tokens,
                input_bytes=elem_bytes, max_tokens=n_max,
                grad_in_forward=grad_in_forward, gradient_rows=args.gradient_rows,
            ) + (n * hidden + (end - start) * hidden) * elem_bytes
            row["bound_gib"] = _reduce_max(bound / 2**30, device, world)
        results[name] = row
        x.grad = w_full.grad = w_shard.grad = None

    std = results.get("standard", {})
    for row in results.values():
        if std.get("fwd_bwd_ms_median"):
            row["time_vs_standard"] = row["fwd_bwd_ms_median"] / std["fwd_bwd_ms_median"]
        if std.get("extra_peak_gib"):
            row["peak_vs_standard"] = row["extra_peak_gib"] / std["extra_peak_gib"]

    if rank == 0:
        config = {
            "tokens_per_rank": n, "hidden": hidden, "vocab": vocab, "world_size": world,
            "chunk_tokens": args.chunk_tokens, "gradient_rows": args.gradient_rows,
            "dtype": args.dtype, "repeats": args.repeats,
            "reduction": args.reduction,
            # the output layer's rows this rank no longer holds, each with its weight (b), fp32
            # main gradient (4) and fp32 master weight + Adam moments (12), as a non-distributed
            # mixed-precision Adam keeps them
            "weight_state_bytes_saved_per_rank": (vocab - (end - start)) * hidden * (
                elem_bytes + 16),
            "device": (
                torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or "cpu"
            ),
            "backend": dist.get_backend() if world > 1 else None,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        }
        print(_table(config, list(results.values())))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"config": config, "results": list(results.values())}, f, indent=2)
            print(f"wrote {args.out}")
    if world > 1:
        dist.destroy_process_group()


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _table(config, rows):
    head = (
        f"Ring-DTP benchmark: N={config['tokens_per_rank']}/rank, H={config['hidden']}, "
        f"V={config['vocab']}, P={config['world_size']}, chunk={config['chunk_tokens']}, "
        f"{config['dtype']}, {config['device']}\n"
        f"Output-layer weight + gradient + optimizer state saved per rank by sharding the "
        f"vocabulary: {config['weight_state_bytes_saved_per_rank'] / 2**30:.2f} GiB "
        f"(weight bytes + 16 B per parameter not held)\n\n"
    )
    lines = [
        "| variant | mode used | fwd+bwd ms (median) | time vs std | extra peak GiB "
        "| without returned grads GiB | peak vs std | bound GiB | rel err loss | rel err dX "
        "| rel err dW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['mode_used']} | {_fmt(r.get('fwd_bwd_ms_median'), '.2f')} "
            f"| {_fmt(r.get('time_vs_standard'), '.3f')} | {_fmt(r.get('extra_peak_gib'), '.3f')} "
            f"| {_fmt(r.get('extra_peak_without_grads_gib'), '.3f')} "
            f"| {_fmt(r.get('peak_vs_standard'), '.3f')} | {_fmt(r.get('bound_gib'), '.3f')} "
            f"| {_fmt(r.get('rel_err_loss'), '.1e')} | {_fmt(r.get('rel_err_dx'), '.1e')} "
            f"| {_fmt(r.get('rel_err_dw'), '.1e')} |"
        )
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
