"""Packed documents at long context on one GPU (marker ``gpu``).

1,048,576 tokens of 8,192-token documents (an indexed dataset of token ids, each document ending
in the end-of-document id), the small example with every long-context operator on (Ring-DTP,
PipelinedLLEP, SCO, OffloadStreamAdamW, chunked recompute with the attention sublayer), two
iterations with ``--reset-attention-mask --eod-mask-loss``: the launch-time budget it printed is
within [0.95, 1.10] of its measured peak (the larger of the two iterations'); and two iterations
without (attention over the whole sequence, about 3.5 minutes each): the per-document second
iteration takes at most 0.1x the whole sequence's second iteration (the first ones include the
warm-up). Records go to ``RESULTS_DIR/packed_documents.json``; the second test reuses the first's
per-document run from there, so the two can run in separate jobs sharing ``RESULTS_DIR`` (the
whole-sequence job alone takes about 8 minutes).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import RESULTS_DIR, run_example, write_documents

pytestmark = [pytest.mark.gpu, requires_cuda]

TOKENS, DOCUMENT, VOCAB = 1_048_576, 8_192, 32_000  # NullTokenizer: end of document VOCAB - 1
LONG_CONTEXT_FLAGS = [
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--attention-backend", "fused", "--lr-warmup-iters", "0",
    "--ring-dtp", "--ring-dtp-chunk-tokens", "4096",
    "--pipelined-llep", "--pipelined-llep-token-budget", "16384",
    "--sco-host-budget-gb", "16", "--offload-stream-optimizer",
    "--chunked-recompute-tokens", "16384", "--chunked-recompute-attention",
    "--split", "100,0,0",  # no validation documents: a 1% split holds no 1M-token sample
]
_BUDGET = re.compile(r"\[bounded\] memory budget: peak allocated ([\d.]+) GiB predicted")
_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def _iterations(name: str, data_prefix: str, extra: list, port: int, iterations: int) -> dict:
    run = run_example(name, 1, LONG_CONTEXT_FLAGS + extra, port=port, timeout_s=540, env_overrides={
        "SEQ_LENGTH": str(TOKENS), "MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "1",
        "TRAIN_ITERS": str(iterations), "LOG_INTERVAL": "1", "PLAN": "off",
        "CHECKPOINT_DIR": "", "TENSORBOARD_DIR": "", "DATA_PATH": data_prefix,
        "TOKENIZER_TYPE": "NullTokenizer", "VOCAB_SIZE": str(VOCAB),
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    })
    assert len(run.records) == iterations, run.log[-3000:]
    return {
        "iteration_s": [float(ms) / 1e3 for ms in _ITERATION_MS.findall(run.log)],
        "peak_allocated_gib": max(record["peak_allocated_gib"] for record in run.records),
        "budget_peak_gib": float(_BUDGET.search(run.log).group(1)),
        "lm_loss": [record["lm_loss"] for record in run.records],
        "startup_line": next(line for line in run.log.splitlines() if "[bounded] run:" in line),
    }


def _packed(tmp_path_factory) -> dict:
    """The per-document run's figures: measured once per test session, written to
    ``RESULTS_DIR/packed_documents.json``."""
    record = RESULTS_DIR / "packed_documents.json"
    if record.exists():
        return json.loads(record.read_text())["packed"]
    packed = _iterations("packed_documents_1m", _data(tmp_path_factory),
                         ["--reset-attention-mask", "--eod-mask-loss"], port=29610, iterations=2)
    _record({"packed": packed})
    return packed


def _data(tmp_path_factory) -> str:
    """The documents' dataset prefix (the same documents in every job: a fixed seed)."""
    prefix = tmp_path_factory.getbasetemp() / "documents" / "documents"
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_documents(str(prefix), count=2 * TOKENS // DOCUMENT, length=DOCUMENT, vocab=VOCAB)
    return str(prefix)


def _record(figures: dict) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "packed_documents.json"
    previous = json.loads(path.read_text()) if path.exists() else {
        "tokens": TOKENS, "document_tokens": DOCUMENT, "flags": LONG_CONTEXT_FLAGS}
    path.write_text(json.dumps({**previous, **figures}, indent=1) + "\n")


def test_a_million_tokens_of_documents_within_the_budget(tmp_path_factory):
    packed = _packed(tmp_path_factory)
    budget_ratio = packed["budget_peak_gib"] / packed["peak_allocated_gib"]
    _record({"budget_over_measured": budget_ratio})
    assert "attention within documents" in packed["startup_line"]
    assert 0.95 <= budget_ratio <= 1.10, packed


def test_a_million_tokens_of_documents_step_in_a_tenth_of_whole_sequence_attention(
        tmp_path_factory):
    packed = _packed(tmp_path_factory)
    whole = _iterations("whole_sequence_1m", _data(tmp_path_factory), [], port=29620,
                        iterations=2)
    ratio = packed["iteration_s"][1] / whole["iteration_s"][1]  # steady state: the second
    _record({"whole_sequence": whole, "time_ratio": ratio})
    assert ratio <= 0.1, (packed, whole)
