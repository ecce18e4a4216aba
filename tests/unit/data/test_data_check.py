"""pretrain_gpt.py's start-up check of the training data (megatron.bounded.data.indexed_check):
indexed datasets written by megatron-core's own builder, then damaged as copies and transfers
damage them; each is refused before the model is built with one message naming the flag, the
files and the fix, exit status 2 and no traceback, and the user's files are left as they were."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from megatron.bounded.data import indexed_check
from megatron.bounded.launch import arguments
from megatron.bounded.launch.arguments import BoundedArgumentError, validate_bounded_args
from tests.conftest import MINIMAL_PRETRAIN_FLAGS
from tests.conftest import write_indexed_dataset as write_dataset
from tests.unit.launch.test_bad_input import (  # noqa: F401 - the autouse fixture: one host, no TE
    assert_refused_once_on_rank_0, stack_without_te_and_resiliency,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# the minimal command line without its mock data: each test names its dataset
FLAGS = [flag for flag in MINIMAL_PRETRAIN_FLAGS if flag != "--mock-data"]
TEN_DOCUMENTS = [[1 + (index + token) % 100 for token in range(12 + index)] for index in range(10)]


def hashes(directory: Path) -> dict:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.iterdir()) if path.is_file()}


def parse(monkeypatch, flags):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FLAGS, *flags])
    return parse_args(arguments.add_bounded_args)


def refused_early(monkeypatch, capsys, flags, named) -> str:
    """The refusal of ``flags`` before upstream's validation (exit 2, one line on rank 0)."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FLAGS, *flags])
    assert_refused_once_on_rank_0(monkeypatch, capsys, arguments.check_flags_before_upstream,
                                  named[0])
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        arguments.check_flags_before_upstream()
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in named:
        assert text in err, err
    return err


def test_the_reader_agrees_with_megatron_cores_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for dtype, multimodal in ((numpy.uint16, False), (numpy.int32, False), (numpy.uint16, True)):
        prefix = write_dataset(tmp_path / f"{dtype.__name__}{multimodal}", TEN_DOCUMENTS, dtype,
                               multimodal)
        source = indexed_check.DataSource("--data-path", str(prefix))
        ours = indexed_check.check_dataset_files(source)
        theirs = IndexedDataset(str(prefix), multimodal=multimodal)
        assert ours.sequences == len(theirs) == 10
        assert ours.tokens == int(theirs.sequence_lengths.sum())
        assert ours.token_bytes == numpy.dtype(dtype).itemsize
        assert ours.tokens_between(3, 7) == int(theirs.sequence_lengths[3:7].sum())


def test_a_whole_dataset_passes_at_start_up_and_after_upstreams_validation(monkeypatch, tmp_path):
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *FLAGS, "--data-path", str(prefix),
                                      "--split", "80,10,10"])
    arguments.check_flags_before_upstream()  # no exit
    validate_bounded_args(parse(monkeypatch, ["--data-path", "1", str(prefix), "--split",
                                              "80,10,10"]))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _other_corpus(tmp_path: Path, prefix: Path) -> None:
    """``prefix``'s .idx replaced by another corpus's (same documents, one token longer each)."""
    other = write_dataset(tmp_path / "other", [document + [7] for document in TEN_DOCUMENTS])
    shutil.copyfile(f"{other}.idx", f"{prefix}.idx")
    for ext in (".bin", ".idx"):
        os.remove(f"{other}{ext}")


TOKENS = sum(len(document) for document in TEN_DOCUMENTS)  # 165 tokens of 2 bytes
# name: (what is done to the dataset at tmp_path/corpus, the flags that name it, what the
# refusal names besides the flag)
DAMAGE = {
    "bin cut short": (lambda tmp, prefix: _truncate(Path(f"{prefix}.bin"), 100), ["--data-path"],
                      ["corpus.bin is 100 bytes", f"corpus.idx describes {TOKENS} tokens",
                       f"{2 * TOKENS} bytes", "cut short"]),
    "bin of another corpus's idx": (_other_corpus, ["--data-path"],
                                    [f"corpus.bin is {2 * TOKENS} bytes", "corpus.idx describes",
                                     "different corpora"]),
    "idx cut short": (lambda tmp, prefix: _truncate(Path(f"{prefix}.idx"), 120), ["--data-path"],
                      ["corpus.idx is 120 bytes", "10 sequences", "cut short"]),
    "idx shorter than its header": (lambda tmp, prefix: _truncate(Path(f"{prefix}.idx"), 20),
                                    ["--data-path"], ["corpus.idx is 20 bytes", "34-byte header"]),
    "idx not an index": (lambda tmp, prefix: Path(f"{prefix}.idx").write_text('{"text": "hi"}'),
                         ["--data-path"], ["corpus.idx is not the index"]),
    "no document": (lambda tmp, prefix: write_dataset(prefix, []), ["--data-path"],
                    ["0 document(s) and no token"]),
    "documents without a token": (lambda tmp, prefix: write_dataset(prefix, [[], []]),
                                  ["--data-path"], ["2 document(s) and no token"]),
    "second of a weighted blend": (lambda tmp, prefix: _truncate(Path(f"{prefix}.bin"), 10),
                                   ["--data-path", "0.5", "GOOD", "0.5"], ["corpus.bin is 10 bytes"]),
    "per-split flag": (lambda tmp, prefix: _truncate(Path(f"{prefix}.bin"), 10),
                       ["--train-data-path"], ["corpus.bin is 10 bytes"]),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_dataset_is_refused_before_upstream_naming_its_files(monkeypatch, capsys,
                                                                       tmp_path, name):
    damage, flags, named = DAMAGE[name]
    data = tmp_path / "data"
    data.mkdir()
    prefix = write_dataset(data / "corpus", TEN_DOCUMENTS)
    good = write_dataset(tmp_path / "good", TEN_DOCUMENTS)
    damage(tmp_path, prefix)
    before = hashes(data)
    flags = [str(good) if flag == "GOOD" else flag for flag in flags] + [str(prefix)]
    refused_early(monkeypatch, capsys, flags, [f"{flags[0]} ", f"{prefix}:", *named])
    assert hashes(data) == before  # read, never written


def test_prefixes_listed_in_a_file_are_checked_and_named_with_it(monkeypatch, capsys, tmp_path):
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS)
    _truncate(Path(f"{prefix}.bin"), 10)
    listed = tmp_path / "blend.txt"
    listed.write_text(f"1.0 {prefix}\n")
    refused_early(monkeypatch, capsys, ["--data-args-path", str(listed)],
                  [f"--data-args-path {listed} {prefix}", "corpus.bin is 10 bytes"])
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": [str(prefix)], "valid": [], "test": []}))
    refused_early(monkeypatch, capsys, ["--per-split-data-args-path", str(per_split)],
                  [f"--per-split-data-args-path {per_split} (train) {prefix}"])
    per_split.write_text(json.dumps([str(prefix)]))  # a list, not the object of three lists
    refused_early(monkeypatch, capsys, ["--per-split-data-args-path", str(per_split)],
                  [f"--per-split-data-args-path {per_split} is not a JSON object"])
    refused_early(monkeypatch, capsys, ["--data-args-path", str(tmp_path / "missing.txt")],
                  [f"--data-args-path {tmp_path / 'missing.txt'} cannot be read"])


# (--split, the refusal's words): ten documents
SPLIT_CASES = [
    pytest.param(["--split", "98,1,1"], ["--split '98,1,1'", "validation split 1% of the 10",
                                         "none, once rounded", "1/10 of the data"],
                 id="validation-gets-no-document"),
    pytest.param([], ["--split '969, 30, 1'", "validation split 3% of the 10"],
                 id="upstreams-default-split"),
    pytest.param(["--split", "0,1,0"], ["--split '0,1,0'", "no share", "--train-iters 3"],
                 id="training-without-a-share"),
]


@pytest.mark.parametrize("flags,named", SPLIT_CASES)
def test_a_split_that_gets_no_document_is_refused_naming_split(monkeypatch, tmp_path, flags,
                                                               named):
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS)
    with pytest.raises(BoundedArgumentError) as refused:
        validate_bounded_args(parse(monkeypatch, ["--data-path", str(prefix), *flags]))
    for text in named:
        assert text in str(refused.value), str(refused.value)


def test_a_split_whose_documents_hold_no_token_is_refused(monkeypatch, tmp_path):
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS[:8] + [[], []])
    with pytest.raises(BoundedArgumentError, match="test split 20% of the 10 document.*"
                                                   "documents 8 to 9, which hold no token"):
        validate_bounded_args(parse(monkeypatch, ["--data-path", str(prefix), "--split",
                                                  "8,0,2"]))


def test_splits_that_each_get_a_document_pass(monkeypatch, tmp_path):
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS)
    for split in ("80,10,10", "100,0,0", "90,10"):
        validate_bounded_args(parse(monkeypatch, ["--data-path", str(prefix), "--split", split]))
    # a per-split dataset is its split whole: --split does not divide it
    validate_bounded_args(parse(monkeypatch, ["--train-data-path", str(prefix), "--split",
                                              "98,1,1"]))


def test_the_split_bookends_round_as_megatron_core_does():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )

    for split in ("98,1,1", "969, 30, 1", "90,10", "1,1,1", "0.7,0.2,0.1", "100,0,0"):
        expected = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        assert indexed_check.split_bookends(split) == expected, split


def test_pretrain_gpt_exits_with_the_split_refusal_before_building_anything(tmp_path):
    """The whole entry point, as a job runs it: one message, status 2, no traceback."""
    prefix = write_dataset(tmp_path / "corpus", TEN_DOCUMENTS)
    before = hashes(tmp_path)
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *FLAGS, "--data-path", str(prefix),
         "--split", "98,1,1"],
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.count("[bounded] error:") == 1 and "--split '98,1,1'" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert hashes(tmp_path) == before
