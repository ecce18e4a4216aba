"""tools/benchmarks/bench_ring_dtp.py: which fused single-GPU baselines it runs."""

from __future__ import annotations

import types

import pytest

from tests.unit.tool_modules import load_tool

bench = load_tool("benchmarks/bench_ring_dtp.py")

CUDA = types.SimpleNamespace(type="cuda")
CPU = types.SimpleNamespace(type="cpu")


@pytest.fixture
def fake_baselines(monkeypatch):
    # One importable stand-in and one that is not installed.
    monkeypatch.setattr(bench, "_FUSED_BASELINES", {
        "present": ("math", "sqrt"), "absent": ("no_such_module_for_this_test", "f")})


def test_none_or_cpu_runs_no_fused_baseline(fake_baselines):
    assert bench._fused_baselines("none", CUDA) == {}
    assert bench._fused_baselines("auto", CPU) == {}


def test_auto_takes_the_installed_ones(fake_baselines):
    import math

    assert bench._fused_baselines("auto", CUDA) == {"present": math.sqrt}


def test_named_baselines_must_exist_and_import(fake_baselines):
    with pytest.raises(SystemExit, match="unknown 'other'"):
        bench._fused_baselines("other", CUDA)
    with pytest.raises(ImportError):
        bench._fused_baselines("present,absent", CUDA)
