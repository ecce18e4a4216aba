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

import sys

import torch

from bench_common import Benchmark, gb_per_s  # puts the repository on sys.path

from megatron.bounded.kernels.row_gather import SKIP, gather_rows


def measure(run) -> None:
    a = run.args
    source = torch.randn(a.rows, a.hidden, device=run.device, dtype=torch.bfloat16)
    permutation = torch.randperm(a.rows, device=run.device)
    index = permutation.clone()
    index[a.valid:] = SKIP  # padding rows last, as in the expert-grouped order
    taken = index >= 0
    run.check("bitwise_equal_on_taken_rows",
              torch.equal(gather_rows(source, index)[taken], source.index_select(0, index[taken])))
    r = run.record
    r.update(run.time_variants({"index_select": lambda: source.index_select(0, permutation),
                                "row_gather": lambda: gather_rows(source, index),
                                "row_gather_no_skip": lambda: gather_rows(source, permutation)}))
    r["index_select_bytes"] = 2 * a.rows * a.hidden * source.element_size()
    r["row_gather_bytes"] = 2 * a.valid * a.hidden * source.element_size()
    for name, moved in (("index_select", "index_select"), ("row_gather", "row_gather"),
                        ("row_gather_no_skip", "index_select")):
        r[f"{name}_GBps"] = gb_per_s(r[f"{moved}_bytes"], r[f"{name}_ms"])


main = Benchmark("bench_row_gather", __doc__,
                 {"--rows": 196_608, "--valid": 131_072, "--hidden": 2048}, measure).main

if __name__ == "__main__":
    sys.exit(main())
