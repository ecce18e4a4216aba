"""tools/benchmarks/bench_ring_dtp.py: which fused single-GPU baselines it runs."""

from __future__ import annotations

import types

import pytest

from tests.tool_modules import load_tool

bench = load_tool("benchmarks/bench_ring_dtp.py")

CUDA = types.SimpleNamespace(type="cuda")
CPU = types.SimpleNamespace(type="cpu")


@pytest.fixture
def fake_baselines(monkeypatch):
    # One importable stand-in and one that is not installed.
    monkeypatch.setattr(bench, "_FUSED_BASELINES", {
        "present": ("math", "sqrt", {}), "present_with_args": ("builtins", "int", {"base": 2}),
        "absent": ("no_such_module_for_this_test", "f", {})})


def test_none_or_cpu_runs_no_fused_baseline(fake_baselines):
    assert bench._fused_baselines("none", CUDA) == {}
    assert bench._fused_baselines("auto", CPU) == {}


def test_auto_takes_the_installed_ones(fake_baselines):
    import math

    found = bench._fused_baselines("auto", CUDA)
    assert set(found) == {"present", "present_with_args"}
    assert found["present"](9.0) == math.sqrt(9.0)
    # a baseline's keyword arguments are bound (as liger_flce_fp32's accum_dtype is)
    assert found["present_with_args"]("101") == 5


def test_liger_runs_both_weight_gradient_precisions():
    assert bench._FUSED_BASELINES["liger_flce"][2] == {}
    assert bench._FUSED_BASELINES["liger_flce_fp32"][2] == {"accum_dtype": bench.torch.float32}


def test_named_baselines_must_exist_and_import(fake_baselines):
    with pytest.raises(SystemExit, match="unknown 'other'"):
        bench._fused_baselines("other", CUDA)
    with pytest.raises(ImportError):
        bench._fused_baselines("present,absent", CUDA)
