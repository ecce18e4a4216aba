"""The family examples on one GPU at 262,144 tokens (marker ``gpu``).

``examples/gpt_oss_20b/train.sh`` (gpt-oss-20b's hidden size, heads, window pattern, sinks and 32
experts; 4 layers) and ``examples/kimi_k2/train.sh`` (Kimi-K2's multi-latent attention with its
real per-layer dimensions, a dense first layer; 3 layers, 16 experts) train three (Kimi-K2: two)
iterations of one 262,144-token sequence with every long-context operator the example passes (OffloadStreamAdamW,
SCO, Ring-DTP, PipelinedLLEP, full recompute in chunks): losses finite, and the peak allocated that
the launch-time budget printed within [0.95, 1.10] of the measured one. GPU memory per token of
context (and per token and hidden unit) goes to ``RESULTS_DIR/family_examples.json``.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import record_figures, run_script
from megatron.bounded.units import GiB

pytestmark = [pytest.mark.gpu, requires_cuda]

TOKENS = 262_144
_BUDGET = re.compile(r"\[bounded\] memory budget: peak allocated ([\d.]+) GiB predicted")
_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")

# example: (environment, hidden size)
# example -> (its environment, hidden size, iterations): two iterations reach the steady-state
# peak (the streamed optimizer's staging exists from the first step on); Kimi-K2's take 90 s each
SHAPES = {
    "gpt_oss_20b": ({"NUM_LAYERS": "4"}, 2880, 3),
    "kimi_k2": ({"NUM_LAYERS": "3", "NUM_EXPERTS": "16"}, 7168, 2),
}


@pytest.mark.parametrize("example", sorted(SHAPES))
def test_family_example_at_262144_tokens_within_the_budget(example):
    environment, hidden, iterations = SHAPES[example]
    run = run_script(f"{example}_262k", f"examples/{example}/train.sh", [], port=29640,
                     timeout_s=540, env_overrides={
                         **environment, "GPUS_PER_NODE": "1", "SEQ_LENGTH": str(TOKENS),
                         "TRAIN_ITERS": str(iterations), "LOG_INTERVAL": "1", "CHECKPOINT_DIR": "",
                         "TENSORBOARD_DIR": "", "SCO_HOST_BUDGET_GB": "16",
                         "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                     })
    losses = [record["lm_loss"] for record in run.records]
    assert len(losses) == iterations and all(map(math.isfinite, losses)), run.log[-3000:]
    peak_gib = max(record["peak_allocated_gib"] for record in run.records)
    budget_gib = float(_BUDGET.search(run.log).group(1))
    figures = {
        "environment": environment, "tokens": TOKENS, "lm_loss": losses,
        "iteration_s": [float(ms) / 1e3 for ms in _ITERATION_MS.findall(run.log)],
        "peak_allocated_gib": peak_gib, "budget_peak_gib": budget_gib,
        "budget_over_measured": budget_gib / peak_gib,
        "bytes_per_token": peak_gib * GiB / TOKENS,
        "bytes_per_token_per_hidden_unit": peak_gib * GiB / TOKENS / hidden,
        "startup_line": next(line for line in run.log.splitlines() if "[bounded] run:" in line),
    }
    record_figures("family_examples.json", example, figures)
    assert 0.95 <= figures["budget_over_measured"] <= 1.10, figures
