#!/usr/bin/env python
"""Where the time of profiled training steps went, from a PyTorch profiler trace.

    python tools/diagnostics/summarize_trace.py TRACE.json[.gz] [--top 15] [--json OUT]

Upstream's profiler (``--profile --use-pytorch-profiler --profile-step-start S
--profile-step-end E --tensorboard-dir DIR``) writes ``DIR/../torch_profile/rank-R.json.gz``.
Per profiled step (``ProfilerStep#N``) and in all: the step's wall time, the time some GPU
kernel, copy or memset ran (the union of their intervals on all streams), hence the time the GPU
waited for the host; the kernels launched; the time the host spent in calls that wait for the
GPU (stream, event and device synchronization, blocking copies); and the kernels and host
operators that took the most time. A GPU that waits for the host while the host is not waiting
for the GPU is launch-bound: fewer, larger kernels (or a CUDA graph) are the remedy. Traces taken
with Python call stacks (``--pytorch-profiler-collect-callstack``) also get the Python functions
by self time (their own time, without the functions they called), which says whose code the host
spent its time in, and the Python functions by inclusive time, which says what a module's call
costs in all; stack tracing slows the host, so read those as shares, not as wall time. Host
operators are listed both inclusive (with what they called) and by self time, each with its
count, and every call that waited for the GPU is attributed to the operator and the Python
function it ran in (a wait inside a micro-batch drains the GPU's queue). With stacks, the
outermost host operators are also counted by the code that called them (the innermost Python
function outside torch, triton and the standard library's helpers): which lines of the model
issue the most operators, each of which costs host time. The GPU's idle time is also cut into
its gaps (the time between one GPU event's end and the next one's start, on no stream busy):
their total by length, and by the host operator (and, with stacks, the Python function) that
launched the kernel or copy that ended the gap, which names the host work the GPU waited for,
and by that kernel or copy itself, which names the phase of the step.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CALLS = ("LaunchKernel", "cuLaunch", "cudaGraphLaunch")
WAITING_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpyDtoH")
STEP_PREFIX = "ProfilerStep#"
# Frames that are not "the caller" of an operator: torch's and triton's own Python code and
# standard-library helpers wrapped around calls.
LIBRARY_FRAMES = ("<", "torch/", "triton/", "contextlib.py", "functools.py", "typing.py")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as stream:
        trace = json.load(stream)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [event for event in events if event.get("ph") == "X" and "dur" in event]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _is_waiting(name: str) -> bool:
    # asynchronous copies do not wait; a cudaMemcpy (without Async) does
    return any(call in name for call in WAITING_CALLS) and "Async" not in name


def summarize_window(events: list[dict], start: float, end: float, top: int) -> dict:
    """What ran in [start, end) (microseconds, the trace's clock)."""
    inside = [e for e in events if start <= e["ts"] < end]
    gpu = [e for e in inside if e.get("cat") in GPU_CATEGORIES]
    runtime = [e for e in inside if e.get("cat") == "cuda_runtime"]
    host_ops = [e for e in inside if e.get("cat") == "cpu_op"]
    wall = end - start
    busy = union_length([(e["ts"], min(e["ts"] + e["dur"], end)) for e in gpu])
    launches = sum(1 for e in runtime if any(call in e["name"] for call in LAUNCH_CALLS))
    waiting = sum(e["dur"] for e in runtime if _is_waiting(e["name"]))
    kernels = collections.Counter()
    kernel_counts = collections.Counter()
    for e in gpu:
        kernels[e["name"]] += e["dur"]
        kernel_counts[e["name"]] += 1
    operators = collections.Counter()
    operator_counts = collections.Counter()
    for e in host_ops:
        if not e["name"].startswith(STEP_PREFIX):
            operators[e["name"]] += e["dur"]
            operator_counts[e["name"]] += 1
    ms = 1e-3
    python_calls = [e for e in inside if e.get("cat") == "python_function"]
    python = self_times(python_calls)
    operators_self = self_times([e for e in host_ops if not e["name"].startswith(STEP_PREFIX)])
    python_inclusive = collections.Counter()
    python_counts = collections.Counter()
    for e in python_calls:
        python_inclusive[e["name"]] += e["dur"]
        python_counts[e["name"]] += 1
    waits = waits_by_caller([e for e in runtime if _is_waiting(e["name"])], host_ops, python_calls)
    by_caller = operators_by_caller(
        [e for e in host_ops if not e["name"].startswith(STEP_PREFIX)], python_calls)
    gaps = idle_gaps(gpu, start, end)
    launched = gaps_by_launcher(gaps, runtime, host_ops, python_calls)
    return {
        "idle_by_gap_length": gaps_by_length(gaps),
        "idle_by_launcher": [{"operator": op, "python": fn, "ms": t * ms, "count": n}
                             for (op, fn), (t, n) in sorted(launched.items(),
                                                            key=lambda kv: -kv[1][0])[:top]],
        "idle_before_gpu_event": [{"name": name, "ms": t * ms, "count": n}
                                  for name, (t, n) in sorted(gaps_by_next_event(gaps).items(),
                                                             key=lambda kv: -kv[1][0])[:top]],
        "wall_ms": wall * ms,
        "gpu_busy_ms": busy * ms,
        "gpu_idle_ms": (wall - busy) * ms,
        "gpu_busy_share": busy / wall if wall > 0 else 0.0,
        "gpu_events": len(gpu),
        "kernel_launches": launches,
        "host_waiting_for_gpu_ms": waiting * ms,
        "top_gpu": [{"name": name, "ms": t * ms, "count": kernel_counts[name]}
                    for name, t in kernels.most_common(top)],
        "top_host_operators": [{"name": name, "ms": t * ms, "count": operator_counts[name]}
                               for name, t in operators.most_common(top)],
        "top_host_operators_self": _by_self_time(operators_self, top),
        "top_python_self": _by_self_time(python, top),
        "top_python_inclusive": [{"name": name, "ms": t * ms, "calls": python_counts[name]}
                                 for name, t in python_inclusive.most_common(top)],
        "waits_for_gpu": [{"operator": op, "python": fn, "ms": t * ms, "count": n}
                          for (op, fn), (t, n) in sorted(waits.items(),
                                                         key=lambda kv: -kv[1][0])[:top]],
        "host_operators_by_caller": [
            {"caller": caller, "operator": op, "ms": t * ms, "count": n}
            for (caller, op), (t, n) in sorted(by_caller.items(),
                                               key=lambda kv: -kv[1][1])[:top]
        ] if python_calls else [],
    }


# upper ends (microseconds) of the gap lengths the idle time is totalled by
GAP_LENGTHS_US = (10, 100, 1_000, 10_000, float("inf"))


def idle_gaps(gpu: list[dict], start: float, end: float) -> list[tuple[float, float, dict]]:
    """The GPU's idle intervals in [start, end): ``(gap start, gap end, the GPU event that ends
    the gap)``, the gaps between the union of the events' intervals; the window's tail, which
    no event ends, is left out."""
    gaps, reach = [], start
    for e in sorted(gpu, key=lambda e: e["ts"]):
        if e["ts"] > reach:
            gaps.append((reach, e["ts"], e))
        reach = max(reach, min(e["ts"] + e["dur"], end))
    return gaps


def gaps_by_length(gaps: list) -> list[dict]:
    """Idle time and gap count per gap length class (``GAP_LENGTHS_US``)."""
    totals = [[0.0, 0] for _ in GAP_LENGTHS_US]
    for gap_start, gap_end, _ in gaps:
        length = gap_end - gap_start
        index = next(i for i, bound in enumerate(GAP_LENGTHS_US) if length < bound)
        totals[index][0] += length
        totals[index][1] += 1
    lower = (0,) + GAP_LENGTHS_US[:-1]
    return [{"from_us": low, "to_us": high, "ms": t * 1e-3, "count": n}
            for low, high, (t, n) in zip(lower, GAP_LENGTHS_US, totals)]


def gaps_by_next_event(gaps: list) -> dict:
    """``{GPU event name: (idle time, gaps)}``: each gap by the kernel or copy that ended it."""
    totals: dict = {}
    for gap_start, gap_end, e in gaps:
        t, n = totals.get(e["name"], (0.0, 0))
        totals[e["name"]] = (t + gap_end - gap_start, n + 1)
    return totals


def gaps_by_launcher(gaps: list, runtime: list[dict], host_ops: list[dict],
                     python_calls: list[dict]) -> dict:
    """``{(host operator, Python function): (idle time, gaps)}``: each gap by the innermost host
    operator and the innermost Python function (not a built-in) around the runtime call that
    launched the GPU event ending the gap (matched by the events' ``correlation``); "-" where
    the trace holds no such call."""
    launches = {e.get("args", {}).get("correlation"): e for e in runtime}
    points = []
    for gap_start, gap_end, e in gaps:
        launch = launches.get(e.get("args", {}).get("correlation"))
        points.append((gap_end - gap_start, launch))
    found = [launch for _, launch in points if launch is not None]
    operator_of = innermost_containers(host_ops, found)
    python_of = innermost_containers(python_calls, found, skip=_builtin)
    totals: dict = {}
    for length, launch in points:
        key = ("-", "-") if launch is None else (operator_of[id(launch)], python_of[id(launch)])
        t, n = totals.get(key, (0.0, 0))
        totals[key] = (t + length, n + 1)
    return totals


def innermost_containers(containers: list[dict], events: list[dict],
                         skip=lambda name: False) -> dict:
    """``{id(event): name}``: the innermost of ``containers`` on the event's thread that holds
    it and whose name ``skip`` does not reject ("-" for none), found in one sweep over both
    sorted by start (containers of one thread nest, as host operators and Python calls do)."""
    ordered = sorted(containers, key=lambda c: (c["ts"], -c["dur"]))
    stacks = collections.defaultdict(list)
    names, index = {}, 0
    for e in sorted(events, key=lambda e: e["ts"]):
        while index < len(ordered) and ordered[index]["ts"] <= e["ts"]:
            c = ordered[index]
            stacks[c.get("tid")].append(c)
            index += 1
        stack = stacks[e.get("tid")]
        names[id(e)] = "-"
        kept = [c for c in stack if c["ts"] + c["dur"] >= e["ts"] + e["dur"]]
        stacks[e.get("tid")] = kept
        for c in reversed(kept):
            if not skip(c["name"]):
                names[id(e)] = c["name"]
                break
    return names


def _by_self_time(totals: dict, top: int) -> list[dict]:
    return [{"name": name, "ms": t * 1e-3, "calls": calls}
            for name, (t, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]


def _builtin(name: str) -> bool:
    return name.startswith("<built-in")


def waits_by_caller(waits: list[dict], host_ops: list[dict], python_calls: list[dict]) -> dict:
    """``{(operator, Python function): (time, count)}`` of the calls that waited for the GPU,
    each by the innermost host operator and the innermost Python function it ran in (a
    function defined in Python: the built-in that made the call, such as ``torch.tensor``, is
    named before it)."""
    operator_of = innermost_containers(host_ops, waits)
    builtin_of = innermost_containers(python_calls, waits)
    caller_of = innermost_containers(python_calls, waits, skip=_builtin)
    totals: dict = {}
    for e in waits:
        builtin, caller = builtin_of[id(e)], caller_of[id(e)]
        python = caller if builtin in ("-", caller) else f"{builtin} in {caller}"
        key = (operator_of[id(e)], python)
        t, n = totals.get(key, (0.0, 0))
        totals[key] = (t + e["dur"], n + 1)
    return totals


def operators_by_caller(host_ops: list[dict], python_calls: list[dict]) -> dict:
    """``{(caller, operator): (inclusive time, count)}`` of the outermost host operators (those
    not nested in another operator of the same thread; an operator's own sub-operators are its
    business), each by the innermost Python function of its thread that contains it and is not
    a built-in or library frame (``LIBRARY_FRAMES``), "-" where there is none (autograd's
    C++ nodes in the backward)."""
    totals: dict = {}
    by_thread = collections.defaultdict(list)
    # at equal start, Python frames before operators and longer events before shorter ones
    for e in python_calls:
        by_thread[e.get("tid")].append((e["ts"], 0, -e["dur"], e))
    for e in host_ops:
        by_thread[e.get("tid")].append((e["ts"], 1, -e["dur"], e))
    for items in by_thread.values():
        items.sort(key=lambda item: item[:3])
        frames: list[dict] = []
        operators: list[dict] = []
        for ts, kind, _, e in items:
            for stack in (frames, operators):
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:
                    stack.pop()
            if kind == 0:
                frames.append(e)
                continue
            if not operators:
                caller = next((f["name"] for f in reversed(frames)
                               if not f["name"].startswith(LIBRARY_FRAMES)), "-")
                t, n = totals.get((caller, e["name"]), (0.0, 0))
                totals[(caller, e["name"])] = (t + e["dur"], n + 1)
            operators.append(e)
    return totals


def self_times(calls: list[dict]) -> dict:
    """``{name: (self time, calls)}`` of nested events (Python functions, host operators): each
    event's duration less the durations of the events directly nested in it on the same
    thread."""
    totals: dict = {}
    by_thread = collections.defaultdict(list)
    for e in calls:
        by_thread[e.get("tid")].append(e)
    for thread_calls in by_thread.values():
        thread_calls.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_calls: list[dict] = []
        for e in thread_calls:
            while open_calls and open_calls[-1]["ts"] + open_calls[-1]["dur"] <= e["ts"]:
                open_calls.pop()
            if open_calls:
                parent = open_calls[-1]["name"]
                t, n = totals[parent]
                totals[parent] = (t - e["dur"], n)
            t, n = totals.get(e["name"], (0.0, 0))
            totals[e["name"]] = (t + e["dur"], n + 1)
            open_calls.append(e)
    return totals


def summarize(events: list[dict], top: int = 15) -> dict:
    """Per profiled step and over all of them (the whole trace when it marks no step)."""
    steps = sorted((e for e in events if e.get("name", "").startswith(STEP_PREFIX)),
                   key=lambda e: e["ts"])
    if steps:
        windows = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in steps]
    else:
        first = min(e["ts"] for e in events)
        last = max(e["ts"] + e["dur"] for e in events)
        windows = [("trace", first, last)]
    per_step = {name: summarize_window(events, start, end, top) for name, start, end in windows}
    overall = summarize_window(events, windows[0][1], windows[-1][2], top)
    return {"steps": per_step, "all": overall}


def render(summary: dict) -> str:
    lines = ["| window | wall ms | GPU busy ms | GPU idle ms | busy | kernels launched | host "
             "waiting for GPU ms |", "|---|---|---|---|---|---|---|"]
    for name, s in list(summary["steps"].items()) + [("all", summary["all"])]:
        lines.append(f"| {name} | {s['wall_ms']:.1f} | {s['gpu_busy_ms']:.1f} | "
                     f"{s['gpu_idle_ms']:.1f} | {s['gpu_busy_share']:.0%} | "
                     f"{s['kernel_launches']:,} | {s['host_waiting_for_gpu_ms']:.1f} |")
    overall = summary["all"]
    lines += ["", "| GPU kernel / copy | ms | count |", "|---|---|---|"]
    lines += [f"| {k['name'][:100]} | {k['ms']:.2f} | {k['count']:,} |" for k in overall["top_gpu"]]
    lines += ["", "| host operator (inclusive) | ms | count |", "|---|---|---|"]
    lines += [f"| {o['name'][:100]} | {o['ms']:.2f} | {o['count']:,} |"
              for o in overall["top_host_operators"]]
    lines += ["", "| host operator (self) | ms | calls |", "|---|---|---|"]
    lines += [f"| {o['name'][:100]} | {o['ms']:.2f} | {o['calls']:,} |"
              for o in overall["top_host_operators_self"]]
    if overall["top_python_self"]:
        for kind in ("self", "inclusive"):
            lines += ["", f"| host Python function ({kind}) | ms | calls |", "|---|---|---|"]
            lines += [f"| {f['name'][:100]} | {f['ms']:.2f} | {f['calls']:,} |"
                      for f in overall[f"top_python_{kind}"]]
    if overall["waits_for_gpu"]:
        lines += ["", "| host waited for the GPU in (operator / Python function) | ms | count |",
                  "|---|---|---|"]
        lines += [f"| {w['operator'][:60]} / {w['python'][:60]} | {w['ms']:.2f} | {w['count']:,} |"
                  for w in overall["waits_for_gpu"]]
    lines += ["", "| GPU idle in gaps of (us) | ms | gaps |", "|---|---|---|"]
    lines += [f"| {g['from_us']:,}–{g['to_us']:,} | {g['ms']:.2f} | {g['count']:,} |"
              for g in overall["idle_by_gap_length"]]
    if overall["idle_by_launcher"]:
        lines += ["", "| GPU idle before a launch by (operator / Python function) | ms | gaps |",
                  "|---|---|---|"]
        lines += [f"| {g['operator'][:60]} / {g['python'][:60]} | {g['ms']:.2f} | "
                  f"{g['count']:,} |" for g in overall["idle_by_launcher"]]
    lines += ["", "| GPU idle before (kernel / copy) | ms | gaps |", "|---|---|---|"]
    lines += [f"| {g['name'][:100]} | {g['ms']:.2f} | {g['count']:,} |"
              for g in overall["idle_before_gpu_event"]]
    if overall["host_operators_by_caller"]:
        lines += ["", "| outermost host operators by caller (Python function / operator) | ms "
                  "| count |", "|---|---|---|"]
        lines += [f"| {c['caller'][:70]} / {c['operator'][:50]} | {c['ms']:.2f} | {c['count']:,} |"
                  for c in overall["host_operators_by_caller"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a PyTorch profiler chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=15, help="kernels and operators listed")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        parser.error(f"no trace at {args.trace}")
    events = load_events(args.trace)
    if not events:
        parser.error(f"{args.trace} has no complete events")
    summary = summarize(events, args.top)
    print(render(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
