"""A system's longest sequence, to within a ratio (5% by default): double from a length that
trains until one does not, then bisect (geometrically) between the longest that trained and the
shortest that did not. A probe that runs out of memory, is refused before anything is built (our
planner) or outlasts the per-run time limit does not train; a refusal that names the longest
length that fits (``longest_hint``) is probed next."""

from __future__ import annotations

import math
from typing import Callable, Optional

GRANULE = 1_024  # lengths are multiples of this
MAX_LENGTH = 2**23


def round_down(length: float, granule: int = GRANULE) -> int:
    return int(length) // granule * granule


def next_length(longest: Optional[int], failing: Optional[int], hint: Optional[int],
                probed: set, ratio: float, cap: int = MAX_LENGTH) -> Optional[int]:
    """The next length to probe given the longest that trained and the shortest that did not
    (None: none yet), or None when the search is done."""
    if longest is None:  # the first probe failed: halve down to one granule
        length = round_down(failing // 2)
        return length if length >= GRANULE else None
    if failing is None:
        length = min(2 * longest, cap)
    elif failing <= longest * ratio:
        return None
    elif hint is not None and longest < hint < failing and hint not in probed:
        length = hint
    else:
        length = round_down(math.sqrt(longest * failing))
    return length if length not in probed and length > longest and length != failing else None


def search(probe: Callable[[int], Optional[dict]], start: int, ratio: float = 1.05,
           cap: int = MAX_LENGTH) -> dict:
    """Probe lengths from ``start`` (``probe(length)``: the run's record, or None when no time is
    left to run it); the longest that trained, the shortest that did not and why, every probe,
    and whether the search finished."""
    longest = failing = hint = None
    bound, probes = None, []
    length = start
    while length is not None:
        record = probe(length)
        if record is None:
            return _result(longest, failing, bound, probes, finished=False)
        probes.append({"seq_length": length, "outcome": record["outcome"]})
        if record["outcome"] == "ok":
            longest = length
        else:
            failing, bound = length, record["outcome"]
            hint = record.get("longest_hint", hint)
        length = next_length(longest, failing, hint, {p["seq_length"] for p in probes}, ratio, cap)
    return _result(longest, failing, bound, probes, finished=True)


def _result(longest, failing, bound, probes, finished: bool) -> dict:
    return {"longest": longest, "shortest_failing": failing, "failing_outcome": bound,
            "probes": probes, "finished": finished}
