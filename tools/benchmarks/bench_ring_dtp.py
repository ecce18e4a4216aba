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
import os
import statistics

import torch
import torch.distributed as dist

from bench_common import (  # puts the repository on sys.path
    PeakMemory, cell, command_line, device_name, finish_distributed, markdown_table, max_over_ranks,
    max_relative_difference, synchronize, utc_date, wall_times_s, write_json,
)

from megatron.bounded.loss.ring_dtp import (
    choose_ring_mode,
    reference_cross_entropy,
    ring_dtp_cross_entropy,
    ring_dtp_workspace_bytes,
    vocab_shard_range,
)
from megatron.bounded.units import GiB

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


class RingBench:
    """The inputs every variant runs on, the reference (the standard path) and one variant's
    measurement: accuracy, time, peak memory and Ring-DTP's bound."""

    def __init__(self, args, rank: int, world: int, device):
        self.args, self.world, self.device = args, world, device
        self.dtype = _DTYPES[args.dtype]
        self.elem_bytes = torch.finfo(self.dtype).bits // 8
        self.group = dist.group.WORLD if world > 1 else None
        n, hidden, vocab = args.tokens, args.hidden, args.vocab
        self.start, self.end = vocab_shard_range(vocab, rank, world)

        # Same full weight on every rank, a different batch per rank; random, never all zero.
        gen = torch.Generator(device=device).manual_seed(args.seed)
        full_w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.5).to(self.dtype)
        gen.manual_seed(args.seed + 1 + rank)
        x_data = torch.randn(n, hidden, device=device, generator=gen).to(self.dtype)
        self.labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
        self.grad_out = torch.rand(n, device=device, generator=gen) + 0.5
        assert x_data.abs().sum() > 0 and full_w.abs().sum() > 0, "inputs must not be all zero"
        shard_data = full_w[self.start:self.end].clone()

        self.x = x_data.clone().requires_grad_()
        self.w_full = full_w.clone().requires_grad_()
        self.w_shard = shard_data.clone().requires_grad_()
        self.fused = _fused_baselines(args.fused_baselines, device)
        self.ref = None

    def variants(self) -> list:
        """(name, mode, grad_in_forward) of each variant to run, in order."""
        args = self.args
        modes = ["weights", "activations", "auto"] if args.mode == "all" else [args.mode]
        variants = [("standard", None, False)] + [(f"ring_dtp[{m}]", m, False) for m in modes]
        if args.grad_in_forward:
            variants += [(f"ring_dtp[{m}+grad_in_forward]", m, True) for m in modes if m != "weights"]
        if args.skip_standard_memory:
            variants = variants[1:]
        return variants + [(name, name, False) for name in self.fused]

    def clear_grads(self):
        self.x.grad = self.w_full.grad = self.w_shard.grad = None

    def run(self, mode, grad_in_forward=False):
        args = self.args
        self.clear_grads()
        if mode in self.fused:
            loss = self.fused[mode](self.x, self.w_full, self.labels, reduction=args.reduction)
        else:
            if mode is None:
                loss = reference_cross_entropy(self.x, self.w_full, self.labels)
            else:
                loss = ring_dtp_cross_entropy(self.x, self.w_shard, self.labels, group=self.group,
                                              mode=mode, chunk_tokens=args.chunk_tokens,
                                              grad_in_forward=grad_in_forward,
                                              gradient_rows=args.gradient_rows)
            if args.reduction == "mean":
                loss = loss.mean()
        if args.reduction == "mean":
            loss.backward()
        else:
            loss.backward(self.grad_out)
        return loss.detach()

    def summed_weight_grad(self):
        """The full-weight gradient summed over all ranks, sliced to this rank's shard."""
        dw = self.w_full.grad.float()
        if self.world > 1:
            dist.all_reduce(dw)
        return dw[self.start:self.end]

    def reference(self):
        """Correctness first: the standard path is the reference (its dW summed over all ranks)."""
        ref_loss = self.run(None)
        self.ref = (ref_loss, self.x.grad.clone(), self.summed_weight_grad().clone())
        self.x.grad = self.w_full.grad = None

    def mode_used(self, mode, grad_in_forward) -> str:
        if mode is None:
            return "standard"
        if mode in self.fused:
            return "single GPU, full weight"
        if self.world == 1:
            return "single"
        if mode != "auto":
            return mode
        n_max = max_over_ranks([self.args.tokens], self.device)[0]
        return choose_ring_mode(n_max, self.args.vocab, self.world, grad_in_forward)

    def measure(self, name, mode, grad_in_forward) -> dict:
        args, device = self.args, self.device
        row = {"variant": name, "mode_used": self.mode_used(mode, grad_in_forward)}
        loss = self.run(mode, grad_in_forward)
        if self.ref is not None and mode is not None:
            # this rank's dW shard: Ring-DTP's own, or a full-weight gradient summed and sliced
            dw = self.w_shard.grad if mode not in self.fused else self.summed_weight_grad()
            row["rel_err_loss"], row["rel_err_dx"], row["rel_err_dw"] = max_over_ranks(
                [max_relative_difference(ours, ref, torch.float64)
                 for ours, ref in zip((loss, self.x.grad, dw), self.ref)], device)
        times = wall_times_s(lambda: self.run(mode, grad_in_forward), args.repeats,
                             warmup=max(0, args.warmup - 1), device=device)
        row["fwd_bwd_ms_median"] = max_over_ranks([statistics.median(times) * 1e3], device)[0]
        if device.type == "cuda":
            row.update(self.peaks(mode, grad_in_forward))
        if mode is not None and mode not in self.fused:
            row["bound_gib"] = max_over_ranks([self.bound_bytes(mode, grad_in_forward) / GiB],
                                              device)[0]
        return row

    def peaks(self, mode, grad_in_forward) -> dict:
        """Extra peak of one run, with and without the returned gradients (dX, and the full or
        shard dW), which every variant must hand back: the operator's own transient."""
        self.clear_grads()
        synchronize(self.device)
        with PeakMemory(self.device) as memory:
            self.run(mode, grad_in_forward)
            synchronize(self.device)
        extra = memory.extra_bytes
        grad_bytes = sum(t.grad.numel() * t.grad.element_size()
                         for t in (self.x, self.w_full, self.w_shard) if t.grad is not None)
        return dict(zip(("extra_peak_gib", "extra_peak_without_grads_gib"), max_over_ranks(
            [extra / GiB, (extra - grad_bytes) / GiB], self.device)))

    def bound_bytes(self, mode, grad_in_forward) -> int:
        """Ring-DTP's workspace bound plus the returned gradients (dX and the dW shard)."""
        args, n = self.args, self.args.tokens
        n_max = int(max_over_ranks([n], self.device)[0])
        return ring_dtp_workspace_bytes(
            n, args.hidden, args.vocab, self.world, mode, args.chunk_tokens,
            input_bytes=self.elem_bytes, max_tokens=n_max,
            grad_in_forward=grad_in_forward, gradient_rows=args.gradient_rows,
        ) + (n * args.hidden + (self.end - self.start) * args.hidden) * self.elem_bytes


def add_ratios_to_standard(results: dict) -> None:
    """Each row's time and extra peak over the standard path's, where that ran."""
    std = results.get("standard", {})
    for row in results.values():
        if std.get("fwd_bwd_ms_median"):
            row["time_vs_standard"] = row["fwd_bwd_ms_median"] / std["fwd_bwd_ms_median"]
        if std.get("extra_peak_gib"):
            row["peak_vs_standard"] = row["extra_peak_gib"] / std["extra_peak_gib"]


def config_record(args, bench: RingBench) -> dict:
    world = bench.world
    return {
        "tokens_per_rank": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
        "world_size": world, "chunk_tokens": args.chunk_tokens,
        "gradient_rows": args.gradient_rows, "dtype": args.dtype, "repeats": args.repeats,
        "reduction": args.reduction,
        # the output layer's rows this rank no longer holds, each with its weight (b), fp32
        # main gradient (4) and fp32 master weight + Adam moments (12), as a non-distributed
        # mixed-precision Adam keeps them
        "weight_state_bytes_saved_per_rank": (
            args.vocab - (bench.end - bench.start)) * args.hidden * (bench.elem_bytes + 16),
        "device": device_name(bench.device),
        "backend": dist.get_backend() if world > 1 else None,
        "torch": torch.__version__,
        "date": utc_date(),
        "command": command_line(),
    }


def main(argv=None):
    args = _parse(argv)
    rank, world, device = _init()
    bench = RingBench(args, rank, world, device)
    variants = bench.variants()
    if not args.skip_standard_memory:
        bench.reference()
    results = {}
    for name, mode, grad_in_forward in variants:
        results[name] = bench.measure(name, mode, grad_in_forward)
        bench.clear_grads()
    add_ratios_to_standard(results)
    if rank == 0:
        config = config_record(args, bench)
        print(_table(config, list(results.values())))
        if args.out:
            write_json(args.out, {"config": config, "results": list(results.values())})
    finish_distributed()


def _table(config, rows):
    head = (
        f"Ring-DTP benchmark: N={config['tokens_per_rank']}/rank, H={config['hidden']}, "
        f"V={config['vocab']}, P={config['world_size']}, chunk={config['chunk_tokens']}, "
        f"{config['dtype']}, {config['device']}\n"
        f"Output-layer weight + gradient + optimizer state saved per rank by sharding the "
        f"vocabulary: {config['weight_state_bytes_saved_per_rank'] / GiB:.2f} GiB "
        f"(weight bytes + 16 B per parameter not held)\n\n"
    )
    header = ["variant", "mode used", "fwd+bwd ms (median)", "time vs std", "extra peak GiB",
              "without returned grads GiB", "peak vs std", "bound GiB", "rel err loss",
              "rel err dX", "rel err dW"]
    columns = [("fwd_bwd_ms_median", ".2f"), ("time_vs_standard", ".3f"), ("extra_peak_gib", ".3f"),
               ("extra_peak_without_grads_gib", ".3f"), ("peak_vs_standard", ".3f"),
               ("bound_gib", ".3f"), ("rel_err_loss", ".1e"), ("rel_err_dx", ".1e"),
               ("rel_err_dw", ".1e")]
    cells = [[r["variant"], r["mode_used"], *(cell(r.get(key), spec) for key, spec in columns)]
             for r in rows]
    return head + markdown_table(header, cells)


if __name__ == "__main__":
    main()
