#!/usr/bin/env python3
"""Hold all but G GiB of every visible GPU's free memory, so that a job started next finds a GPU
of G GiB (``bench_reach.py --gpu-memory-gib G`` confirms a predicted longest length this way).

    python tools/benchmarks/gpu_ballast.py --leave-gib 24

Prints ``ready`` once the memory is held, and holds it until its standard input closes.
"""

from __future__ import annotations

import argparse
import sys

GiB = 2**30


def ballast_bytes(free_bytes: int, leave_bytes: int) -> int:
    """Bytes to hold so that ``leave_bytes`` stay free (nothing when less is free already)."""
    return max(0, int(free_bytes) - int(leave_bytes))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave-gib", type=float, required=True, help="GiB to leave free per GPU")
    args = p.parse_args(argv)
    import torch

    held = []
    for device in range(torch.cuda.device_count()):
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.empty(0, device="cuda")  # this process's context is created before measuring
            free, _ = torch.cuda.mem_get_info()
            size = ballast_bytes(free, int(args.leave_gib * GiB))
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    print("ready", " ".join(f"{t.numel() / GiB:.2f}" for t in held), flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
