#!/usr/bin/env python3
"""Benchmark the padding-skipping row gather (``megatron.bounded.kernels.row_gather``) against
``index_select``, the gather it replaces in the static-capacity dispatcher.

Shape of the MoE-layer benchmark: the received slabs of EP = 2 at capacity factor 1.5, i.e.
R = 2 · 98,304 = 196,608 rows of H = 2048 bf16, of which ``--valid`` (default 131,072: 16,384
tokens × top-8 with balanced routing) carry data and the rest are padding (index ``SKIP``). Reported:
median time of ``index_select`` over all rows (what the dispatcher did), of the kernel, and of the
kernel with no row skipped (its raw copy speed), the bytes each moves, and whether the taken rows
are bitwise equal (they must be).

    python tools/benchmarks/bench_row_gather.py [--rows 196608 --valid 131072 --hidden 2048]
        [--repeats 20] [--out results/row_gather.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_common import (  # puts the repository on sys.path
    gb_per_s, median_cuda_ms, parse_on_cuda, report,
)

from megatron.bounded.kernels.row_gather import SKIP, gather_rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=196_608)
    parser.add_argument("--valid", type=int, default=131_072)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parse_on_cuda(parser, argv, "bench_row_gather")
    if args is None:
        return 2
    device = torch.device("cuda")
    source = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16)
    permutation = torch.randperm(args.rows, device=device)
    index = permutation.clone()
    index[args.valid:] = SKIP  # padding rows last, as in the expert-grouped order
    taken = index >= 0
    row_bytes = args.hidden * source.element_size()
    ours = gather_rows(source, index)
    result = {
        "shape": vars(args),
        "bitwise_equal_on_taken_rows": bool(torch.equal(ours[taken], source.index_select(0, index[taken]))),
        "index_select_ms": median_cuda_ms(lambda: source.index_select(0, permutation), args.repeats),
        "row_gather_ms": median_cuda_ms(lambda: gather_rows(source, index), args.repeats),
        "row_gather_no_skip_ms": median_cuda_ms(lambda: gather_rows(source, permutation), args.repeats),
        "index_select_bytes": 2 * args.rows * row_bytes,
        "row_gather_bytes": 2 * args.valid * row_bytes,
    }
    result["index_select_GBps"] = gb_per_s(result["index_select_bytes"], result["index_select_ms"])
    result["row_gather_GBps"] = gb_per_s(result["row_gather_bytes"], result["row_gather_ms"])
    result["row_gather_no_skip_GBps"] = gb_per_s(result["index_select_bytes"],
                                                 result["row_gather_no_skip_ms"])
    report(result, args.out)
    return 0 if result["bitwise_equal_on_taken_rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
