"""What is alive at the peak: the live set of a CUDA allocator snapshot at its highest point.

PyTorch's caching allocator can record every allocation and free with its Python stack
(``torch.cuda.memory._record_memory_history``; upstream's ``--record-memory-history
--memory-snapshot-path PATH`` turns it on before the model is built and writes the snapshot after
the first iteration). :func:`peak_live_set` replays that record to the moment the allocated total
was highest and returns the blocks alive then, grouped by the source line that allocated them
(:func:`owner_of`), so a peak can be taken apart tensor by tensor.

The replay runs backwards from the blocks still allocated when the snapshot was taken: an
``alloc`` event is undone by removing its block, a ``free_completed`` by restoring it. That works
whether or not the record reaches back to the start of the process (the allocator keeps only the
newest events once its buffer is full); blocks allocated before the oldest event keep their place
without a stack. The bytes are the allocator's block sizes, the quantity
``torch.cuda.max_memory_allocated`` reports.

Runs anywhere (the snapshot is a plain pickle of dicts and lists): no GPU is needed to read one.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron.bounded.units import GiB

# the repository's root with a trailing separator (this file is four levels below it)
_REPO_ROOT = os.sep.join(os.path.abspath(__file__).split(os.sep)[:-4]) + os.sep

# Frames of these files say how a tensor was made, not who asked for it: skipped when naming
# the owner of a block.
_MACHINERY = (
    "/torch/", "/contextlib.py", "/functools.py", "<frozen", "/site-packages/triton/",
    "/typing.py", "/abc.py",
)


@dataclass
class Block:
    address: int
    size: int
    frames: Tuple[dict, ...] = ()


@dataclass
class PeakLiveSet:
    """The allocated total at its highest point and the blocks alive then."""

    peak_bytes: int
    final_bytes: int
    blocks: List[Block]
    # the event that reached the peak (an allocation): its owner, and where in the record it is
    peak_owner: str = ""
    peak_event_index: int = -1
    events: int = 0
    # events lost to the allocator's ring buffer are invisible: True when the record reaches back
    # to the first allocation of the process (no block without a stack at the peak)
    complete: bool = True
    by_owner: Dict[str, int] = field(default_factory=dict)

    def table(self, tokens: Optional[int] = None, top: int = 25) -> str:
        """Owners by bytes, largest first (with bytes per token when ``tokens`` is given)."""
        lines = [f"peak allocated {self.peak_bytes / GiB:.3f} GiB "
                 f"({len(self.blocks)} blocks; peak reached by {self.peak_owner or '?'})"]
        for owner, nbytes in sorted(self.by_owner.items(), key=lambda kv: -kv[1])[:top]:
            per_token = f"{nbytes / tokens:12,.0f} B/token" if tokens else ""
            lines.append(f"  {nbytes / GiB:9.3f} GiB {per_token}  {owner}")
        return "\n".join(lines)


def owner_of(frames: Sequence[dict], depth: int = 2) -> str:
    """The ``depth`` innermost frames outside PyTorch's machinery, as ``file:line function``
    joined by `` < `` (the allocating line first, then its caller); ``?`` without a stack."""
    named = []
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if any(part in filename for part in _MACHINERY):
            continue
        short = filename
        for root in ("/megatron/", "/site-packages/"):
            if root in filename:
                short = filename[filename.rindex(root) + 1:]
                break
        else:  # files of this repository (pretrain_gpt.py, tools/): relative to its root
            if filename.startswith(_REPO_ROOT):
                short = filename[len(_REPO_ROOT):]
        named.append(f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}")
        if len(named) == depth:
            break
    return " < ".join(named) if named else "?"


def _active_blocks(snapshot: dict, device: int) -> Dict[int, Block]:
    live = {}
    for segment in snapshot.get("segments", ()):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                live[block["address"]] = Block(block["address"], block["size"],
                                               tuple(block.get("frames", ())))
    return live


def _undo(live: Dict[int, Block], event: dict) -> int:
    """Undo one event on ``live``; the change of the allocated total (0 for other actions)."""
    action = event.get("action")
    if action == "alloc":
        block = live.pop(event["addr"], None)
        return -(block.size if block is not None else event["size"])
    if action == "free_completed":
        live[event["addr"]] = Block(event["addr"], event["size"], tuple(event.get("frames", ())))
        return event["size"]
    return 0


def peak_live_set(snapshot: dict, device: int = 0, owner_depth: int = 2) -> PeakLiveSet:
    """Replay ``snapshot`` (from ``torch.cuda.memory._snapshot()``) to its allocated peak."""
    traces = snapshot.get("device_traces", [])
    events = list(traces[device]) if device < len(traces) else []
    final_live = _active_blocks(snapshot, device)
    final_bytes = sum(block.size for block in final_live.values())
    # pass 1: the total after each event, walking back from the final state
    live, total = dict(final_live), final_bytes
    peak, peak_index = total, len(events) - 1  # index of the last event applied at the peak
    for index in range(len(events) - 1, -1, -1):
        total += _undo(live, events[index])
        if total > peak:  # strictly: the latest moment at the peak wins ties
            peak, peak_index = total, index - 1
    # pass 2: the live set at that moment
    live = dict(final_live)
    for index in range(len(events) - 1, peak_index, -1):
        _undo(live, events[index])
    by_owner: Dict[str, int] = {}
    for block in live.values():
        name = owner_of(block.frames, owner_depth)
        by_owner[name] = by_owner.get(name, 0) + block.size
    peak_owner = ""
    if 0 <= peak_index < len(events):
        peak_owner = owner_of(events[peak_index].get("frames", ()), owner_depth)
    return PeakLiveSet(
        peak_bytes=peak, final_bytes=final_bytes,
        blocks=sorted(live.values(), key=lambda b: -b.size),
        peak_owner=peak_owner, peak_event_index=peak_index, events=len(events),
        complete=all(block.frames for block in live.values()),
        by_owner=by_owner,
    )


def load_snapshot(path) -> dict:
    with open(path, "rb") as handle:
        return pickle.load(handle)


def linear_fit(points: Sequence[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
    """(slope, intercept) of y against x by least squares, e.g. bytes per token and the bytes
    that do not grow with the length; None with fewer than two distinct x."""
    points = [(float(x), float(y)) for x, y in points]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return slope, mean_y - slope * mean_x


def owners_per_token(points: Iterable[Tuple[int, PeakLiveSet]]) -> Dict[str, Tuple[float, float]]:
    """Least-squares bytes per token and intercept of each owner over (tokens, peak) points; an
    owner missing from a point counts 0 bytes there."""
    points = list(points)
    owners = sorted({name for _, live in points for name in live.by_owner})
    return {name: linear_fit([(tokens, live.by_owner.get(name, 0)) for tokens, live in points])
            for name in owners}
