"""Compare the per-rank checksum records of two runs (see checksum_site/sitecustomize.py).

    python tools/diagnostics/checksums.py RUN_A_PREFIX RUN_B_PREFIX

For every rank: whether the micro-batch tokens and the parameters before the step are equal, and
for every gradient that differs the ratio sqrt(sumsq_b / sumsq_a). Gradients inside the rank's
distributed-optimizer shard are scaled in place by the clip coefficient, so a run whose gradients
differ only through the gradient norm shows one common ratio there.

``tools/diagnostics/compare_resume.sh`` runs the small example uninterrupted and resumed and calls
this on the two records.
"""

from __future__ import annotations

import argparse
import glob
import json
import math


def compare(a: dict, b: dict) -> dict:
    """Differences between two records of the same rank."""
    params = sorted(k for k in a["params_before"] if a["params_before"][k] != b["params_before"].get(k))
    ratios = {}
    for name, (_, sumsq_a) in a["grads_after"].items():
        other = b["grads_after"].get(name)
        if other is None or other == a["grads_after"][name]:
            continue
        ratios[name] = math.sqrt(other[1] / sumsq_a) if sumsq_a > 0 else math.inf
    return {
        "tokens_equal": a["tokens"] == b["tokens"],
        "params_differing": params,
        "grads_equal": sorted(set(a["grads_after"]) - set(ratios)),
        "grad_ratios": ratios,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix_a", help="BOUNDED_CHECKSUMS_OUT of the first run")
    parser.add_argument("prefix_b", help="BOUNDED_CHECKSUMS_OUT of the second run")
    args = parser.parse_args(argv)
    files = sorted(glob.glob(f"{args.prefix_a}_rank*.json"))
    if not files:
        parser.error(f"no {args.prefix_a}_rank*.json")
    identical = True
    for path_a in files:
        rank = path_a[len(args.prefix_a) + len("_rank"):-len(".json")]
        with open(path_a) as fa, open(f"{args.prefix_b}_rank{rank}.json") as fb:
            diff = compare(json.load(fa), json.load(fb))
        ratios = diff["grad_ratios"]
        identical &= diff["tokens_equal"] and not diff["params_differing"] and not ratios
        print(f"rank {rank}: tokens equal {diff['tokens_equal']}, "
              f"{len(diff['params_differing'])} parameters differ before the step, "
              f"{len(ratios)} of {len(ratios) + len(diff['grads_equal'])} gradients differ")
        for name, ratio in ratios.items():
            print(f"    {name}: {ratio:.7f}")
    print("identical" if identical else "different")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
