"""Helpers of the single-kernel GPU benchmarks (``bench_weighted_swiglu.py``, ``bench_slot_sum.py``,
``bench_row_gather.py``, ``bench_strip_softmax.py``, ``bench_rotary.py``). A benchmark run as a
script has this directory on ``sys.path`` (Python puts the script's own there); importing this
module also puts the repository there, so the benchmark can import ``megatron.bounded`` without
PYTHONPATH."""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


def median_cuda_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median of ``repeats`` timings of ``fn()`` (CUDA events) after ``warmup`` untimed calls
    (Triton compiles on the first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def max_relative_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours − reference| / max |reference|, in fp32."""
    ours, reference = ours.float(), reference.float()
    return ((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def parse_on_cuda(parser, argv, name: str):
    """Add ``--repeats`` and ``--out`` (the options every kernel benchmark has) to ``parser``,
    parse ``argv`` and seed torch; None (after saying so) when there is no GPU for ``name``."""
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU", file=sys.stderr)
        return None
    torch.manual_seed(0)
    return args


def report(result: dict, out) -> None:
    """Print ``result`` as JSON and write it to ``out`` when given."""
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
