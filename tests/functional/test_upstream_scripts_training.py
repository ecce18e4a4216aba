"""Megatron-LM's Mixtral 8x7B example flags (tests/upstream_scripts.py, scaled down to one GPU)
train with this project's pretrain_gpt.py, marker ``gpu``: ``--moe-grouped-gemm`` without
Transformer Engine runs our grouped experts (upstream's local implementation would fall back to
SequentialMLP), and the loss falls."""

from __future__ import annotations

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import assert_loss_falls, run_pretrain
from tests.upstream_scripts import mixtral_8x7b_flags

pytestmark = [pytest.mark.gpu, requires_cuda]

ITERATIONS = 50


def test_mixtral_flags_train_with_grouped_experts(tmp_path):
    flags = mixtral_8x7b_flags(tmp_path / "checkpoints", train_iters=ITERATIONS)
    assert "--moe-grouped-gemm" in flags
    run = run_pretrain("mixtral_8x7b_flags_1gpu", 1, flags, port=29590, timeout_s=900)
    # our layer's own log line (megatron.bounded.moe.moe_layer) and the start-up line
    assert "MoE backend: torch-native all-to-all dispatcher (dropless (no capacity factor), EP=1), " \
           "experts GroupedExperts" in run.log, run.log[-4000:]
    assert "+ GroupedExperts (torch._grouped_mm)" in run.log
    assert "--moe-grouped-gemm -> GroupedExperts on torch._grouped_mm" in run.log
    assert "MoE backend: upstream" not in run.log  # no layer kept upstream's experts
    assert [record["iteration"] for record in run.records] == list(range(1, ITERATIONS + 1))
    assert_loss_falls(run.records, "Mixtral flags, grouped experts")
