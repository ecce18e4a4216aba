"""tools/benchmarks/bench_reach.py with a GPU held to G GiB (--gpu-memory-gib): trials named apart,
the fit over every trained point, the prediction for the held memory, and the confirming runs
(jobs replaced by a recorder: no GPU)."""

from __future__ import annotations

import json

from tests.tool_modules import load_tool

GiB = 2**30


def _trial(bench, variant, layers, length, peak, outcome="ok", cap=None):
    return bench.Trial(variant=variant, layers=layers, seq_length=length, num_gpus=1,
                       flags=bench.variant_flags(variant, length, layers), outcome=outcome,
                       wall_s=1.0, peak_allocated_gib=peak if outcome == "ok" else None,
                       gpu_memory_gib=cap)


def test_ballast_leaves_the_asked_memory_free():
    ballast = load_tool("benchmarks/gpu_ballast.py")
    assert ballast.ballast_bytes(100 * GiB, 24 * GiB) == 76 * GiB
    assert ballast.ballast_bytes(20 * GiB, 24 * GiB) == 0


def test_held_memory_trials_are_named_and_reported_apart():
    bench = load_tool("benchmarks/bench_reach.py")
    # 8 KiB per token over 4 GiB: the fit comes from the whole-GPU points
    points = [_trial(bench, "chunked_attention", 8, n, 4 + n * 8192 / GiB)
              for n in (524_288, 1_048_576)]
    capped = [_trial(bench, "chunked_attention", 8, 1_835_008, 18.0, cap=20.0),
              _trial(bench, "chunked_attention", 8, 1_900_544, None, outcome="oom", cap=20.0)]
    assert capped[0].name == "chunked_attention_8L_1835008_20GiB"
    report = bench.build_report(points + capped, 137.8, 65_536, with_budget=False)
    whole, held = (report["variants"]["chunked_attention/8L"],
                   report["variants"]["chunked_attention/8L/20GiB"])
    assert whole["bytes_per_token"] == held["bytes_per_token"] == 8192.0
    # (20 - 2 - 4) GiB at 8 KiB per token, in granules of 65,536
    assert held["predicted_longest"] == 1_835_008
    assert (held["longest_trained"], held["shortest_oom"]) == (1_835_008, 1_900_544)
    assert whole["shortest_oom"] is None  # an out-of-memory under the held GPU is not the GPU's
    assert "8 (20 GiB GPU)" in bench.markdown(report)


def test_confirm_runs_the_prediction_for_the_held_memory(tmp_path, monkeypatch):
    bench = load_tool("benchmarks/bench_reach.py")
    for n in (524_288, 1_048_576):
        trial = _trial(bench, "chunked_attention", 8, n, 4 + n * 8192 / GiB)
        (tmp_path / f"{trial.name}.trial.json").write_text(json.dumps(bench.asdict(trial)))
    runs = []

    def record(self, variant, layers, length, snapshot, concurrent):
        runs.append((variant, layers, length, self.gpu_memory_gib))

    monkeypatch.setattr(bench.Runner, "run", record)
    bench.main(["--results-dir", str(tmp_path), "--variants", "chunked_attention", "--confirm",
                "--gpu-memory-gib", "20", "--confirm-layers", "chunked_attention=1",
                "--no-budget"])
    assert runs == [("chunked_attention", 1, 1_835_008, 20.0),
                    ("chunked_attention", 1, 1_900_544, 20.0)]
