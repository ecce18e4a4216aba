"""tools/benchmarks/bench_pipelined_llep.py on the CPU: the synthetic routing, which variants run,
the printed table, and a whole run on two ranks over gloo with its record."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.harness.benchmark_modules import BENCHMARKS, load_benchmark
from tests.tool_modules import REPO_ROOT

bench = load_benchmark("bench_pipelined_llep.py")


def test_skewed_routing_sends_the_chosen_tokens_to_the_hot_experts():
    probs, routing_map = bench.make_routing(512, 16, 2, "100pct4", seed=0, device="cpu")
    assert routing_map.sum(dim=1).eq(2).all()
    assert not routing_map[:, 4:].any()  # every token picked among experts 0..3
    assert torch.allclose(probs.sum(dim=1), torch.ones(512))
    _, balanced = bench.make_routing(512, 16, 2, "balanced", seed=0, device="cpu")
    assert balanced[:, 4:].any()
    with pytest.raises(SystemExit, match="topk <= M"):
        bench.make_routing(8, 16, 2, "50pct1", seed=0, device="cpu")


def test_variants_that_apply(capsys):
    args = bench.parse_args([])
    assert bench.select_variants(args, cuda=True, rank=0) == [
        "upstream_alltoall", "static_unchunked", "pipelined_strided", "pipelined_contiguous"]
    args = bench.parse_args(["--llep-threshold", "1.3"])
    assert bench.select_variants(args, cuda=False, rank=0)[-1] == "pipelined_llep"
    assert "skipping upstream_alltoall" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --llep-threshold"):
        bench.select_variants(bench.parse_args(["--variants", "pipelined_llep"]), True, 0)


def test_summary_marks_out_of_memory_and_missing_reference():
    args = bench.parse_args(["--chunks", "4"])
    meta = {"world_size": 2, "dtype": "fp32", "token_budget": 8, "device": "cpu (gloo)",
            "receive_bound_gib_2EpkcHb": 0.5}
    rows = [{"variant": "static_unchunked", "oom": True, "ms": float("nan"), "peak_gib": None},
            {"variant": "pipelined_strided", "ms": 3.0, "peak_gib": None, "num_chunks": 4,
             "recv_rows_bound": 16, "max_recv_rows": 12, "worst_send_ratio": 1.5}]
    lines = bench.summary(args, meta, rows, None).splitlines()
    assert "| static_unchunked | OOM | - | - | - | - | - | - |" in lines
    assert "| pipelined_strided | 3.00 | - | - | 4 | 12 / 16 | 1.50 | - |" in lines
    assert lines[-1] == "receive bound 2*E_p*k*c*H*b = 0.500 GiB"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_on_the_cpu(tmp_path):
    out = tmp_path / "llep.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), str(BENCHMARKS / "bench_pipelined_llep.py"),
               "--tokens", "64", "--hidden", "16", "--ffn", "32", "--experts", "4", "--topk", "2",
               "--chunks", "4", "--skew", "80pct2", "--llep-threshold", "1.3", "--iters", "2",
               "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    meta, rows = record["meta"], {r["variant"]: r for r in record["results"]}
    assert (meta["world_size"], meta["device"], meta["token_budget"]) == (2, "cpu (gloo)", 16)
    assert list(rows) == ["static_unchunked", "pipelined_strided", "pipelined_contiguous",
                          "pipelined_llep"]
    for name, row in rows.items():
        assert row["ms"] > 0 and row["peak_gib"] is None  # no CUDA: no memory statistics
        if name != "static_unchunked":
            assert row["rel_out_vs_static"] < 1e-5 and row["rel_xgrad_vs_static"] < 1e-5
            assert 0 < row["max_recv_rows"] <= row["recv_rows_bound"]
            assert row["num_chunks"] == meta["agreed_chunks"]
    assert rows["pipelined_llep"]["llep_spills"] is not None
    assert "| pipelined_llep |" in done.stdout
