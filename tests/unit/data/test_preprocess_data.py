"""tools/preprocess_data.py: a small JSONL corpus -> a tokenizer trained on it -> .bin/.idx that
megatron-core's GPTDataset machinery builds the training dataset from; and the examples' dry
run with DATA_PATH (vocabulary size read from that tokenizer)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

pytest.importorskip("tokenizers", reason="the data extra is not installed: pip install '.[data]'")
pytest.importorskip("transformers", reason="the data extra is not installed: pip install '.[data]'")

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "preprocess_data.py"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def _corpus(path: Path, documents: int = 300) -> list:
    rng = random.Random(7)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "." for _ in range(documents)]
    with open(path, "w", encoding="utf-8") as out:
        for index, text in enumerate(texts):
            out.write(json.dumps({"id": index, "text": text}) + "\n")
            if index == 10:
                out.write("\n")  # blank lines are skipped
    return texts


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = _corpus(root / "corpus.jsonl")
    done = subprocess.run(
        [sys.executable, str(TOOL), "--input", str(root / "corpus.jsonl"), "--output-prefix",
         str(root / "out" / "corpus"), "--train-tokenizer", str(root / "tokenizer"),
         "--vocab-size", "320", "--append-eod", "--workers", "2", "--log-interval", "100"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root, texts, done.stderr


def test_tokenizer_is_trained_and_documents_are_its_tokens_plus_eod(preprocessed):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    root, texts, log = preprocessed
    prefix = root / "out" / "corpus_text_document"
    # renamed into place: no temporary file or directory is left beside them
    assert sorted(os.listdir(root / "out")) == ["corpus_text_document.bin",
                                                "corpus_text_document.idx"]
    assert "300 documents" in log and "--data-path" in log
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))  # offline, from the directory
    assert len(tokenizer) <= 320 and tokenizer.eos_token == "<|endoftext|>"
    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == len(texts)
    for index in (0, 10, 11, 299):  # order kept across the workers
        expected = tokenizer(texts[index], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert dataset[index].tolist() == expected
    assert dataset.index.dtype == numpy.uint16  # 320 tokens fit


def test_the_start_up_check_reads_the_same_documents_and_tokens(preprocessed):
    """pretrain_gpt.py's check of a --data-path prefix (its own .idx reader) accepts the pair and
    counts what megatron-core's dataset holds."""
    from megatron.bounded.data.indexed_check import DataSource, check_dataset_files
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    root, texts, _ = preprocessed
    prefix = str(root / "out" / "corpus_text_document")
    checked = check_dataset_files(DataSource("--data-path", prefix))
    dataset = IndexedDataset(prefix)
    assert checked.sequences == len(texts) == len(dataset)
    assert checked.tokens == int(dataset.sequence_lengths.sum()) and checked.token_bytes == 2


def test_gpt_dataset_builds_training_samples_from_it(preprocessed, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    root, _, _ = preprocessed
    # the tokenizer as pretrain_gpt.py builds it for --tokenizer-type HuggingFaceTokenizer
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(root / "tokenizer"), metadata_path={"library": "huggingface"}
    )
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=64, blend=([str(root / "out" / "corpus_text_document")], None),
        split="100,0,0", path_to_cache=str(tmp_path / "cache"), tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()
    assert isinstance(train, GPTDataset) and len(train) >= 40
    eod = json.loads((root / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]
    seen_eod = False
    for index in range(40):
        sample = train[index]
        tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
        assert len(tokens) == len(labels) == 64
        assert tokens[1:] == labels[:-1]  # next-token labels
        assert all(0 <= token < 320 for token in tokens)
        seen_eod |= eod in tokens
    assert seen_eod  # documents are separated by the end-of-text token


def test_dry_run_with_data_path_reads_the_vocabulary_from_the_tokenizer(preprocessed):
    root, _, _ = preprocessed
    env = dict(os.environ, DRY_RUN="1", NUM_GPUS="1", PYTHON=sys.executable,
               DATA_PATH=str(root / "out" / "corpus_text_document"), TOKENIZER_MODEL=str(root / "tokenizer"))
    done = subprocess.run(["bash", str(REPO_ROOT / "examples/moe_small/train.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Per-GPU memory budget" in done.stdout
    printed = subprocess.run(
        [sys.executable, str(TOOL), "--tokenizer-model", str(root / "tokenizer"), "--print-vocab-size"],
        capture_output=True, text=True, timeout=120,
    )
    assert printed.returncode == 0 and int(printed.stdout) <= 320


def test_gpt2_vocab_and_merges_become_an_offline_tokenizer_directory(preprocessed, tmp_path):
    """GPT-2 style files (here: the trained tokenizer's own vocab/merges) load locally and can be
    saved as a directory HuggingFaceTokenizer loads without the network."""
    from transformers import AutoTokenizer

    root, texts, _ = preprocessed
    files = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    bpe = json.loads((root / "tokenizer" / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    done = subprocess.run(
        [sys.executable, str(TOOL), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
         str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
         "--save-tokenizer", str(tmp_path / "gpt2_dir")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "gpt2_dir"))
    assert saved(texts[3])["input_ids"] == files(texts[3], add_special_tokens=False)["input_ids"]
    assert saved.eos_token == "<|endoftext|>"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), "--input", "x.jsonl", "--output-prefix", "y"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--tokenizer-model" in done.stderr and "--train-tokenizer" in done.stderr


def _hashes(directory: Path) -> dict:
    """{relative path: sha256} of every file under ``directory``."""
    import hashlib

    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


REFUSED_INPUTS = {  # case -> (the input's lines, or None for no file; extra flags; named)
    "mistyped input": (None, [], ["--input", "corpus.jsonl.typo"]),
    "not UTF-8": ([b'{"text": "alpha beta"}\n', '{"text": "caf\u00e9"}\n'.encode("latin-1")],
                  ["--workers", "2"], ["--input", "line 2", "UTF-8"]),
    "no line has the key": ([b'{"id": 1, "content": "alpha"}\n', b'{"id": 2, "content": "b"}\n'],
                            [], ["--json-keys text", "content, id"]),
    "no document": ([b"\n", b"  \n"], [], ["--input", "no document"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED_INPUTS))
def test_a_refused_input_leaves_the_existing_dataset_as_it_was(preprocessed, tmp_path, case):
    """Each refusal: exit status 2, one line naming the flag, no traceback, and the .bin/.idx
    already at the output prefix byte-identical, with no temporary file beside them."""
    import shutil

    root, _, _ = preprocessed
    lines, flags, named = REFUSED_INPUTS[case]
    out = tmp_path / "out"
    out.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(root / "out" / f"corpus_text_document{suffix}", out)
    before = _hashes(out)
    corpus = tmp_path / ("corpus.jsonl.typo" if lines is None else "corpus.jsonl")
    if lines is not None:
        corpus.write_bytes(b"".join(lines))
    done = subprocess.run(
        [sys.executable, str(TOOL), "--input", str(corpus), "--output-prefix", str(out / "corpus"), "--tokenizer-model", str(root / "tokenizer"),
         "--append-eod", *flags],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    # one line (after the warnings of the libraries it imports), naming the flag and the fix
    refusal = [line for line in done.stderr.splitlines() if line.startswith("preprocess_data:")]
    assert "Traceback" not in done.stderr and refusal == done.stderr.strip().splitlines()[-1:]
    assert all(word in refusal[0] for word in named), done.stderr
    assert _hashes(out) == before
