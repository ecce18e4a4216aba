"""Training on one's own text, marker ``gpu``: a JSONL corpus, a byte-level BPE tokenizer trained
on it and the indexed dataset, both written by tools/preprocess_data.py (offline), then the small
example with ``DATA_PATH`` and ``TOKENIZER_MODEL`` on 1 GPU for 50 iterations, over the whole
packed sequences and within each document: the loss falls."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.conftest import requires_cuda
from tests.functional.harness import REPO_ROOT, TRAIN_ITERS, assert_loss_falls, run_example

pytest.importorskip("tokenizers", reason="needs the data extra: pip install '.[data]'")
pytest.importorskip("transformers", reason="needs the data extra: pip install '.[data]'")
pytestmark = [pytest.mark.gpu, requires_cuda]

SUBJECTS = "the cat|a dog|my friend|the old man|a small bird|the teacher|our neighbour".split("|")
VERBS = "sees|likes|follows|finds|calls|paints|watches".split("|")
OBJECTS = "the garden|a red ball|the river|an apple|the night sky|a long road|the market".split("|")


def _write_corpus(path, documents=3000):
    """Simple sentences with learnable structure (a word model can predict much of each)."""
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(documents):
            sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                         for _ in range(rng.randint(3, 30))]
            out.write(json.dumps({"text": " ".join(sentences).capitalize()}) + "\n")


@pytest.mark.parametrize("documents", [False, True], ids=["whole_sequences", "packed_documents"])
def test_train_on_own_text(tmp_path, documents):
    """With ``documents``: ``--reset-attention-mask --eod-mask-loss``, attention within each
    document of the packed sequences (the tokenizer's end-of-text token ends each)."""
    _write_corpus(tmp_path / "corpus.jsonl")
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools/preprocess_data.py"), "--input", str(tmp_path / "corpus.jsonl"),
         "--output-prefix", str(tmp_path / "data" / "corpus"), "--train-tokenizer", str(tmp_path / "tokenizer"),
         "--vocab-size", "1000", "--append-eod", "--workers", "4"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    extra = ["--reset-attention-mask", "--eod-mask-loss"] if documents else []
    name = "own_data_documents_1gpu" if documents else "own_data_1gpu"
    run = run_example(name, 1, extra, port=29594, env_overrides={
        "DATA_PATH": str(tmp_path / "data" / "corpus_text_document"),
        "TOKENIZER_MODEL": str(tmp_path / "tokenizer"), "HF_HUB_OFFLINE": "1",
    })
    assert "> building GPTDataset" in run.log and "MockGPTDataset" not in run.log
    assert ("attention within documents" in run.log) == documents
    assert [record["iteration"] for record in run.records] == list(range(1, TRAIN_ITERS + 1))
    assert_loss_falls(run.records, "own text, 1 GPU")
