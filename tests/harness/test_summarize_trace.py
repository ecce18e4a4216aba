"""tools/diagnostics/summarize_trace.py on a hand-made trace (every figure by hand) and on a trace
the PyTorch profiler wrote on the CPU."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "diagnostics" / "summarize_trace.py"
S = load_tool("diagnostics/summarize_trace.py")


def event(name, cat, ts, dur, **extra):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **extra}


# two steps of 1,000 us: kernels on two streams (overlapping in step 1), launches, one sync
EVENTS = [
    event("ProfilerStep#3", "user_annotation", 0, 1000),
    event("aten::mm", "cpu_op", 10, 300),
    event("cudaLaunchKernel", "cuda_runtime", 20, 5),
    event("cudaLaunchKernel", "cuda_runtime", 30, 5),
    event("gemm", "kernel", 100, 200, tid=7),
    event("swiglu", "kernel", 250, 100, tid=8),  # overlaps the gemm by 50 us
    event("aten::_local_scalar_dense", "cpu_op", 395, 310),  # waits on the GPU
    event("aten::empty", "cpu_op", 396, 2),  # nested in it
    event("cudaStreamSynchronize", "cuda_runtime", 400, 300),
    event("cudaMemcpyAsync", "cuda_runtime", 710, 10),  # does not wait
    event("Memcpy DtoH", "gpu_memcpy", 720, 30),
    event("ProfilerStep#4", "user_annotation", 1000, 1000),
    event("aten::mm", "cpu_op", 1010, 100),
    event("cudaLaunchKernel", "cuda_runtime", 1020, 5),
    event("gemm", "kernel", 1100, 200, tid=7),
    {"ph": "i", "name": "instant", "ts": 5},  # not a complete event: ignored
    # Python calls on the host thread: step() calls layer() twice, the first layer() calls mm
    event("train.py(1): step", "python_function", 1000, 900, tid=1),
    event("model.py(5): layer", "python_function", 1010, 300, tid=1),
    event("<built-in method mm>", "python_function", 1020, 100, tid=1),
    event("model.py(5): layer", "python_function", 1400, 200, tid=1),
    event("loader.py(9): next", "python_function", 1050, 400, tid=2),  # another thread
]


def test_hand_made_trace(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as stream:
        json.dump({"traceEvents": EVENTS}, stream)
    summary = S.summarize(S.load_events(str(path)), top=5)
    first, second = summary["steps"]["ProfilerStep#3"], summary["steps"]["ProfilerStep#4"]
    assert first["wall_ms"] == pytest.approx(1.0)
    assert first["gpu_busy_ms"] == pytest.approx(0.280)  # 100..350 and 720..750
    assert first["gpu_idle_ms"] == pytest.approx(0.720)
    assert first["kernel_launches"] == 2 and second["kernel_launches"] == 1
    assert first["host_waiting_for_gpu_ms"] == pytest.approx(0.300)
    assert second["gpu_busy_ms"] == pytest.approx(0.200)
    overall = summary["all"]
    assert overall["wall_ms"] == pytest.approx(2.0)
    assert overall["gpu_busy_ms"] == pytest.approx(0.48)
    assert overall["top_gpu"][0] == {"name": "gemm", "ms": pytest.approx(0.4), "count": 2}
    assert overall["top_host_operators"] == [
        {"name": "aten::mm", "ms": pytest.approx(0.4), "count": 2},
        {"name": "aten::_local_scalar_dense", "ms": pytest.approx(0.31), "count": 1},
        {"name": "aten::empty", "ms": pytest.approx(0.002), "count": 1}]
    operators_self = {o["name"]: (o["ms"], o["calls"]) for o in overall["top_host_operators_self"]}
    assert operators_self["aten::_local_scalar_dense"] == (pytest.approx(0.308), 1)
    assert overall["waits_for_gpu"] == [{"operator": "aten::_local_scalar_dense", "python": "-",
                                         "ms": pytest.approx(0.3), "count": 1}]
    python = {f["name"]: (f["ms"], f["calls"]) for f in overall["top_python_self"]}
    assert python == {"train.py(1): step": (pytest.approx(0.4), 1),  # 900 - 300 - 200
                      "model.py(5): layer": (pytest.approx(0.4), 2),  # 300 - 100 + 200
                      "<built-in method mm>": (pytest.approx(0.1), 1),
                      "loader.py(9): next": (pytest.approx(0.4), 1)}
    inclusive = {f["name"]: (f["ms"], f["calls"]) for f in overall["top_python_inclusive"]}
    assert inclusive["model.py(5): layer"] == (pytest.approx(0.5), 2)
    assert first["top_python_self"] == []
    table = S.render(summary)
    assert "| ProfilerStep#3 | 1.0 | 0.3 | 0.7 | 28% | 2 | 0.3 |" in table
    assert "| model.py(5): layer | 0.40 | 2 |" in table


def test_union_length():
    assert S.union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert S.union_length([]) == 0


def test_trace_written_by_the_profiler(tmp_path):
    path = tmp_path / "trace.json"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            torch.ones(64, 64) @ torch.ones(64, 64)
            prof.step()
    out = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, str(TOOL), str(path), "--json", str(out)],
                            capture_output=True, text=True, check=True)
    summary = json.loads(out.read_text())
    assert len(summary["steps"]) == 2 and summary["all"]["gpu_busy_ms"] == 0
    assert any(o["name"] == "aten::matmul" for o in summary["all"]["top_host_operators"])
    assert "| all |" in result.stdout


def test_missing_trace_is_a_usage_error(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "none.json")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "no trace at" in result.stderr


def test_a_wait_is_named_by_the_built_in_and_the_python_function_that_called_it():
    loss = event("loss.py(3): loss_func", "python_function", 0, 100, tid=1)
    tensor = event("<built-in method tensor>", "python_function", 10, 50, tid=1)
    copy = event("aten::copy_", "cpu_op", 12, 40, tid=1)
    waits = [event("cudaStreamSynchronize", "cuda_runtime", 15, 30, tid=1),
             event("cudaStreamSynchronize", "cuda_runtime", 70, 10, tid=1),  # in loss_func only
             event("cudaStreamSynchronize", "cuda_runtime", 200, 5, tid=1)]  # in nothing
    totals = S.waits_by_caller(waits, [copy], [loss, tensor])
    assert totals == {("aten::copy_", "<built-in method tensor> in loss.py(3): loss_func"): (30, 1),
                      ("-", "loss.py(3): loss_func"): (10, 1), ("-", "-"): (5, 1)}


def test_outermost_operators_are_counted_by_the_code_that_called_them():
    layer = event("megatron/layer.py(5): forward", "python_function", 0, 100, tid=1)
    call_impl = event("torch/nn/modules/module.py(1783): _call_impl", "python_function", 5, 60,
                      tid=1)
    builtin = event("<built-in method to of Tensor>", "python_function", 10, 20, tid=1)
    ops = [event("aten::to", "cpu_op", 10, 20, tid=1),
           event("aten::_to_copy", "cpu_op", 11, 15, tid=1),  # nested: not counted
           event("aten::to", "cpu_op", 40, 5, tid=1),  # in _call_impl, called by forward
           event("aten::mm", "cpu_op", 70, 10, tid=1),  # in forward only
           event("aten::mm", "cpu_op", 70, 10, tid=2)]  # on a thread without Python frames
    totals = S.operators_by_caller(ops, [layer, call_impl, builtin])
    assert totals == {("megatron/layer.py(5): forward", "aten::to"): (25, 2),
                      ("megatron/layer.py(5): forward", "aten::mm"): (10, 1),
                      ("-", "aten::mm"): (10, 1)}


def test_idle_gaps_are_counted_by_length_and_by_the_operator_that_launched_what_ended_them():
    ops = [event("aten::mm", "cpu_op", 0, 50, tid=1),
           event("aten::add", "cpu_op", 300, 2000, tid=1)]
    frames = [event("model.py(5): layer", "python_function", 0, 2500, tid=1),
              event("<built-in method add>", "python_function", 300, 2000, tid=1)]
    runtime = [event("cudaLaunchKernel", "cuda_runtime", 10, 5, tid=1, args={"correlation": 1}),
               event("cudaLaunchKernel", "cuda_runtime", 2200, 5, tid=1,
                     args={"correlation": 2})]
    gpu = [event("gemm", "kernel", 20, 80, tid=7, args={"correlation": 1}),
           event("add", "kernel", 2210, 10, tid=7, args={"correlation": 2}),
           event("copy", "gpu_memcpy", 2212, 4, tid=8)]  # inside the add: no gap
    gaps = S.idle_gaps(gpu, 0, 3000)
    assert [(a, b, e["name"]) for a, b, e in gaps] == [(0, 20, "gemm"), (100, 2210, "add")]
    by_length = {(g["from_us"], g["to_us"]): (g["ms"], g["count"]) for g in S.gaps_by_length(gaps)}
    assert by_length[(10, 100)] == (pytest.approx(0.020), 1)
    assert by_length[(1000, 10000)] == (pytest.approx(2.110), 1)
    assert S.gaps_by_launcher(gaps, runtime, ops, frames) == {
        ("aten::mm", "model.py(5): layer"): (20, 1),
        ("aten::add", "model.py(5): layer"): (2110, 1)}
    summary = S.summarize_window(ops + frames + runtime + gpu, 0, 3000, top=5)
    assert summary["idle_by_launcher"][0] == {"operator": "aten::add",
                                              "python": "model.py(5): layer",
                                              "ms": pytest.approx(2.11), "count": 1}
    assert "| 1,000–10,000 | 2.11 | 1 |" in S.render({"steps": {}, "all": summary})
    assert S.gaps_by_next_event(gaps) == {"gemm": (20, 1), "add": (2110, 1)}
    assert "| add | 2.11 | 1 |" in S.render({"steps": {}, "all": summary})
