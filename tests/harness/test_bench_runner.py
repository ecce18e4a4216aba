"""The operator benchmarks' runner (``bench_common.Benchmark``) on the CPU: a tiny declared
benchmark run end to end (its flags beside the common ones, warm-up and timed calls of each
variant, its correctness check, the record with its stamps and the markdown summary), a
failing check failing the run, and the refusal without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness.benchmark_modules import load_benchmark
from tests.tool_modules import REPO_ROOT

C = load_benchmark("bench_common.py")


def tiny_benchmark(calls: dict, ours_offset: float = 0.0, needs_cuda: bool = False):
    """A sum over a vector: a Python loop (the reference) against torch's, ``ours_offset``
    added to ours (a wrong result when not 0); ``calls`` counts each variant's calls."""
    def measure(run):
        x = torch.arange(run.args.size, dtype=torch.float64)

        def counted(name, fn):
            def work():
                calls[name] = calls.get(name, 0) + 1
                return fn()
            return work

        variants = {"reference": counted("reference", lambda: sum(x.tolist())),
                    "ours": counted("ours", lambda: x.sum().item() + ours_offset)}
        results = {name: work() for name, work in variants.items()}
        run.check("equal", results["ours"] == results["reference"])
        run.record.update(run.time_variants(variants))
        for scale in run.args.scales:
            run.add_row({"scale": scale, "sum": scale * results["ours"]})

    return C.Benchmark("bench_tiny", "A tiny sum.\n\nMore words.", {
        "--size": 8, "--scales": [1, 2], "--fast": False,
        "--mode": dict(choices=("a", "b"), default="a")}, measure, repeats=5, warmup=2,
        needs_cuda=needs_cuda)


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_declared_benchmark_runs_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "tools/benchmarks/bench_tiny.py")])
    calls, out = {}, tmp_path / "r" / "tiny.json"
    argv = ["--size", "4", "--scales", "3", "5", "--repeats", "3", "--warmup", "1",
            "--out", str(out)]
    assert tiny_benchmark(calls).main(argv) == 0
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["torch"] == torch.__version__
    assert record["commit"] == git_head()
    assert record["command"].split()[1] == "tools/benchmarks/bench_tiny.py"
    assert record["date"].endswith("+00:00")
    assert record["shape"] == {"size": 4, "scales": [3, 5], "fast": False, "mode": "a",
                               "repeats": 3, "warmup": 1}
    assert record["equal"] is True and "failed_checks" not in record
    assert record["reference_ms"] >= 0 and record["ours_ms"] >= 0
    assert calls == {"reference": 1 + 1 + 3, "ours": 1 + 1 + 3}  # checked, warm-up, timed
    assert record["rows"] == [{"scale": 3, "sum": 18.0}, {"scale": 5, "sum": 30.0}]
    printed = capsys.readouterr().out
    assert "| metric | value |" in printed and "| equal | True |" in printed
    assert "| scale | sum |" in printed and "| 5 | 30 |" in printed


def test_a_failing_check_fails_the_run_and_is_recorded(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert tiny_benchmark({}, ours_offset=1.0).main(["--repeats", "1", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    assert record["equal"] is False and record["failed_checks"] == ["equal"]
    assert "check failed: equal" in capsys.readouterr().err


def test_without_a_gpu_a_cuda_benchmark_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = {}
    assert tiny_benchmark(calls, needs_cuda=True).main([]) == 2
    assert "bench_tiny needs a CUDA GPU" in capsys.readouterr().err and calls == {}


def test_help_shows_the_first_line_and_the_common_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tiny_benchmark({}).main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "A tiny sum." in out and "More words" not in out
    assert all(flag in out for flag in ("--size", "--fast", "--repeats", "--warmup", "--out"))


def test_flags_take_their_type_from_the_default():
    import argparse

    parser = argparse.ArgumentParser()
    C.add_flags(parser, {"--n": 3, "--x": 0.5, "--name": "a", "--list": [1], "--on": False,
                         "--kind": dict(choices=("p", "q"), default="p")})
    args = parser.parse_args(["--n", "4", "--x", "2", "--list", "5", "6", "--on", "--kind", "q"])
    assert (args.n, args.x, args.name, args.list, args.on, args.kind) == (4, 2.0, "a", [5, 6],
                                                                          True, "q")
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "1.5"])


def test_commit_falls_back_to_the_environment(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("no git")

    monkeypatch.setattr(C.subprocess, "run", no_git)
    monkeypatch.setenv("BENCH_COMMIT", "abc123")
    assert C.commit() == "abc123"
    monkeypatch.delenv("BENCH_COMMIT")
    assert C.commit() == "unknown"


def test_summary_table_lists_numbers_and_rows():
    record = {"date": "d", "device": "cpu", "torch": "t", "shape": {"n": 1}, "ok": True,
              "ms": 1.23456, "rows": [{"a": 1}, {"a": 2, "b": 0.5}], "note": "text"}
    assert C.summary_table(record).splitlines() == [
        "| metric | value |", "|---|---|", "| ok | True |", "| ms | 1.235 |", "",
        "rows:", "| a | b |", "|---|---|", "| 1 | - |", "| 2 | 0.5 |"]


def test_a_benchmark_that_warms_up_its_own_way_has_no_warmup_flag(tmp_path, capsys):
    calls = {}
    bench = C.dataclasses.replace(tiny_benchmark(calls), warmup=None)
    with pytest.raises(SystemExit):
        bench.main(["--warmup", "1"])
    assert "unrecognized arguments: --warmup" in capsys.readouterr().err
    assert bench.main(["--repeats", "2", "--out", str(tmp_path / "r.json")]) == 0
    assert calls == {"reference": 1 + 2, "ours": 1 + 2}  # checked, then timed only
    assert "warmup" not in json.loads((tmp_path / "r.json").read_text())["shape"]
