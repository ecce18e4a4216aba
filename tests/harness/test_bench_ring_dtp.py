"""tools/benchmarks/bench_ring_dtp.py: which fused single-GPU baselines it runs, and a run on one
CPU process with its record and table."""

from __future__ import annotations

import json
import types

import pytest

from tests.harness.benchmark_modules import load_benchmark

bench = load_benchmark("bench_ring_dtp.py")

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


def test_one_process_on_the_cpu(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "r" / "ring.json"
    bench.main(["--tokens", "32", "--hidden", "16", "--vocab", "200", "--repeats", "2",
                "--grad-in-forward", "--out", str(out)])
    record = json.loads(out.read_text())
    config, rows = record["config"], {r["variant"]: r for r in record["results"]}
    assert (config["tokens_per_rank"], config["world_size"], config["device"]) == (32, 1, "cpu")
    assert config["weight_state_bytes_saved_per_rank"] == 0  # one rank holds every row
    assert list(rows) == ["standard", "ring_dtp[weights]", "ring_dtp[activations]", "ring_dtp[auto]",
                          "ring_dtp[activations+grad_in_forward]", "ring_dtp[auto+grad_in_forward]"]
    assert rows["standard"]["time_vs_standard"] == 1.0
    for name, row in rows.items():
        assert row["fwd_bwd_ms_median"] > 0 and "extra_peak_gib" not in row  # CUDA only
        if name != "standard":
            assert row["mode_used"] == "single"
            assert max(row["rel_err_loss"], row["rel_err_dx"], row["rel_err_dw"]) < 1e-5
            assert row["bound_gib"] > 0
    table = capsys.readouterr().out
    assert "| ring_dtp[auto+grad_in_forward] | single |" in table and f"wrote {out}" in table
