"""Tokenize a JSONL corpus into Megatron's indexed dataset (``.bin`` + ``.idx``).

    bounded-preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR_OR_NAME \\
        --append-eod --workers 8

(``python tools/preprocess_data.py ...`` the same, from a clone without installing it)

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per ``--json-keys`` key, default
``text``): one document per JSON line, its tokens and, with ``--append-eod``, the tokenizer's
end-of-text token. Train on it with ``--data-path data/corpus_text_document`` and the same
tokenizer (``DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=...`` for the example scripts).
The files are written by megatron-core's ``IndexedDatasetBuilder``, so ``GPTDataset`` reads them;
they are written under temporary names in the output directory and renamed into place at the
end, so a failed run leaves an existing pair as it was. Refused (exit status 2, one line): an
``--input`` that is not a readable file, a line that is not UTF-8 or not a JSON object, a
``--json-keys`` key no line has, and an input without a document.

The flags are Megatron-LM's (``--input``, ``--json-keys``, ``--output-prefix``,
``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``,
``--append-eod``, ``--workers``, ``--log-interval``); the tokenizers are HuggingFace's
(``pip install 'megatron-bounded[data]'``):

  HuggingFaceTokenizer  ``--tokenizer-model``: a local tokenizer directory, or a hub name online
  GPT2BPETokenizer      ``--vocab-file`` vocab.json and ``--merge-file`` merges.txt, read
                        locally (byte-level BPE with ``<|endoftext|>``, GPT-2's)

Helpers, without a corpus to tokenize:

  --train-tokenizer DIR --vocab-size V  first train a byte-level BPE tokenizer of V tokens on the
                        ``--input`` texts (HuggingFace ``tokenizers``; ``<|endoftext|>`` is its
                        end-of-text token) and save it to DIR as a tokenizer directory, then
                        tokenize with it: a corpus with no tokenizer of its own trains offline
  --save-tokenizer DIR  save the tokenizer given by the other flags as a directory that
                        ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` loads
                        offline (e.g. from GPT-2 vocab.json/merges.txt), and exit
  --print-vocab-size    print the vocabulary size training will see (``len(tokenizer)``) and exit
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Iterator, List, Optional, Tuple


END_OF_TEXT = "<|endoftext|>"
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer")


class Refused(Exception):
    """A refusal: ``main`` prints its one line and exits 2."""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, help="JSONL file: one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys whose text to tokenize, one output per key (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="HuggingFaceTokenizer")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="HuggingFaceTokenizer: a tokenizer directory or a hub name")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--append-eod", action="store_true",
                       help="end every document with the tokenizer's end-of-text token")
    group.add_argument("--train-tokenizer", type=str, default=None, metavar="DIR",
                       help="train a byte-level BPE tokenizer on --input first, save it to DIR "
                       "and tokenize with it (needs --vocab-size)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="vocabulary size of the tokenizer --train-tokenizer trains")
    group.add_argument("--save-tokenizer", type=str, default=None, metavar="DIR",
                       help="save the tokenizer as a directory HuggingFaceTokenizer loads, and exit")
    group.add_argument("--print-vocab-size", action="store_true",
                       help="print the tokenizer's vocabulary size and exit")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, default=None,
                       help="writes PREFIX_<key>_document.bin and .idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress updates without a terminal (default 1000)")
    args = parser.parse_args(argv)
    if args.print_vocab_size or args.save_tokenizer:
        if args.train_tokenizer:
            parser.error("--train-tokenizer cannot be combined with --print-vocab-size/--save-tokenizer")
    else:
        for flag in ("input", "output_prefix"):
            if getattr(args, flag) is None:
                parser.error(f"--{flag.replace('_', '-')} is required")
    if args.train_tokenizer:
        if args.vocab_size is None or args.vocab_size < 1:
            parser.error("--train-tokenizer needs --vocab-size V (e.g. 32000)")
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", args.train_tokenizer
    elif args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        parser.error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model NAME_OR_DIR "
                     "(or --train-tokenizer DIR --vocab-size V to train one on --input)")
    elif args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        parser.error("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    return args


# ------------------------------------------------------------------------------------ tokenizer


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise Refused("the HuggingFace tokenizers need the `transformers` package: "
                      "pip install 'megatron-bounded[data]'") from error
    return transformers


def load_tokenizer(args: argparse.Namespace):
    """The HuggingFace tokenizer the flags describe, loaded from local files when they are."""
    transformers = _transformers()
    if args.tokenizer_type == "GPT2BPETokenizer":
        # GPT-2's file names in a scratch directory: the class then reads them locally (its
        # constructor's keywords differ between transformers releases, from_pretrained's do not)
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory() as files:
            shutil.copyfile(args.vocab_file, os.path.join(files, "vocab.json"))
            shutil.copyfile(args.merge_file, os.path.join(files, "merges.txt"))
            return transformers.GPT2TokenizerFast.from_pretrained(
                files, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT, unk_token=END_OF_TEXT
            )
    return transformers.AutoTokenizer.from_pretrained(args.tokenizer_model)


def check_input(path: str) -> None:
    """Refuse an ``--input`` that cannot be read, before any output is opened."""
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise Refused(f"--input {path} is not a readable file; pass the JSONL corpus (one JSON "
                      "object per line)")


class Corpus:
    """The JSONL file of ``--input``, read line by line in this process (the workers get texts
    only, so every refusal is raised here); what it saw is checked at the end (``check``)."""

    def __init__(self, path: str, keys: List[str]):
        self.path, self.keys = path, keys
        self.documents, self.seen, self.refusal = 0, set(), None

    def texts(self) -> Iterator[Tuple[dict, int]]:
        """({key: its text, None where the line lacks it}, bytes read) of each non-blank line. A
        line refused ends them and ``check`` raises the refusal: a worker pool reads them in a
        thread of its own, which would hand the exception to a worker process."""
        try:
            with open(self.path, "rb") as lines:
                for number, raw in enumerate(lines, 1):
                    if raw.strip():
                        record = self._record(number, raw)
                        self.documents += 1
                        self.seen.update(record)
                        yield {key: self._text(number, record, key) for key in self.keys}, len(raw)
        except Refused as refusal:
            self.refusal = refusal

    def _record(self, number: int, raw: bytes) -> dict:
        where = f"--input {self.path}: line {number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise Refused(f"{where} is not UTF-8 (byte {error.start}); convert the file to UTF-8 "
                          "(e.g. iconv -f latin1 -t utf-8)") from None
        except json.JSONDecodeError as error:
            raise Refused(f"{where} is not JSON ({error.msg}); write one JSON object per "
                          "line") from None
        if not isinstance(record, dict):
            raise Refused(f"{where} is not a JSON object; write one JSON object per line")
        return record

    def _text(self, number: int, record: dict, key: str) -> Optional[str]:
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            raise Refused(f"--input {self.path}: line {number}: --json-keys key {key!r} holds "
                          f"{type(value).__name__}, not text; pass the key of the text")
        return value

    def check(self) -> None:
        """Refuse a corpus without documents, or a key no line has (its output would hold only
        end-of-text tokens, or nothing)."""
        if self.refusal:
            raise self.refusal
        if not self.documents:
            raise Refused(f"--input {self.path} has no document (every line is blank); pass a "
                          "JSONL corpus, one JSON object per line")
        missing = [key for key in self.keys if key not in self.seen]
        if missing:
            raise Refused(f"--json-keys {' '.join(missing)}: no line of --input {self.path} has "
                          f"it (keys seen: {', '.join(sorted(self.seen))}); pass --json-keys "
                          "with the key of the text")


def read_texts(corpus: Corpus) -> Iterator[str]:
    """Every non-empty text of the corpus's keys, in order (for tokenizer training)."""
    for texts, _ in corpus.texts():
        yield from (text for text in texts.values() if text)


def train_tokenizer(input_path: str, keys: List[str], vocab_size: int, directory: str):
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens on the corpus; save it to
    ``directory`` in the format ``AutoTokenizer.from_pretrained(directory)`` loads."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as error:
        raise Refused("--train-tokenizer needs the `tokenizers` package: "
                      "pip install 'megatron-bounded[data]'") from error
    transformers = _transformers()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = Corpus(input_path, keys)
    tokenizer.train_from_iterator(read_texts(corpus), trainer=trainer)
    corpus.check()  # before the tokenizer is saved
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
    )
    wrapped.save_pretrained(directory)
    return wrapped


def end_of_text_id(tokenizer) -> int:
    eod = tokenizer.eos_token_id
    if eod is None:
        raise Refused("--append-eod, but the tokenizer has no end-of-text (eos) token; use a "
                      "tokenizer that defines one, or leave out --append-eod")
    return eod


# ----------------------------------------------------------------------------------- tokenizing

_worker_tokenizer = None


def _init_worker(args: argparse.Namespace) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(args)


def _tokenize_line(job):
    """One line's ({key: text}, bytes read) -> ({key: token ids}, bytes read); runs in a worker
    process."""
    (texts, read_bytes), eod = job
    documents = {}
    for key, text in texts.items():
        ids = _worker_tokenizer(text or "", add_special_tokens=False)["input_ids"]
        if eod is not None:
            ids = list(ids) + [eod]
        documents[key] = ids
    return documents, read_bytes


class Progress:
    """A progress bar (tqdm, on a terminal) or a line every ``interval`` documents."""

    def __init__(self, total_bytes: int, interval: int):
        self.interval, self.documents, self.start = interval, 0, time.time()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing")
            except ImportError:
                pass

    def update(self, read_bytes: int) -> None:
        self.documents += 1
        if self.bar is not None:
            self.bar.update(read_bytes)
        elif self.documents % self.interval == 0:
            rate = self.documents / max(time.time() - self.start, 1e-9)
            print(f"preprocess_data: {self.documents:,} documents ({rate:,.0f}/s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def preprocess(args: argparse.Namespace) -> dict:
    """Tokenize ``args.input``; returns {key: (prefix written, documents, tokens)}. The files are
    written in a temporary directory beside them and renamed into place only at the end."""
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    staging = tempfile.mkdtemp(dir=output_dir, prefix=".preprocess_data-")
    try:
        written = _tokenize_into(args, staging)
        for prefix, *_ in written.values():
            for suffix in (".bin", ".idx"):
                os.replace(os.path.join(staging, os.path.basename(prefix) + suffix),
                           prefix + suffix)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _tokenize_into(args: argparse.Namespace, staging: str) -> dict:
    """Write each key's .bin/.idx into the directory ``staging``, under their final names."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = load_tokenizer(args)
    eod = end_of_text_id(tokenizer) if args.append_eod else None
    dtype = DType.optimal_dtype(len(tokenizer))
    builders, totals = {}, {}
    for key in args.json_keys:
        prefix = output_prefix(args.output_prefix, key)
        staged = os.path.join(staging, os.path.basename(prefix))
        builders[key] = (prefix, staged, IndexedDatasetBuilder(staged + ".bin", dtype=dtype))
        totals[key] = [0, 0]
    progress = Progress(os.path.getsize(args.input), args.log_interval)
    corpus = Corpus(args.input, args.json_keys)
    jobs = ((texts, eod) for texts in corpus.texts())

    def write(results):
        for documents, read_bytes in results:
            for key, ids in documents.items():
                if ids:  # an empty document would be an empty sequence in the index
                    builders[key][2].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                    totals[key][0] += 1
                    totals[key][1] += len(ids)
            progress.update(read_bytes)

    if args.workers == 1:
        _init_worker(args)
        write(map(_tokenize_line, jobs))
    else:
        with multiprocessing.get_context("spawn").Pool(
            args.workers, initializer=_init_worker, initargs=(args,)
        ) as pool:
            write(pool.imap(_tokenize_line, jobs, chunksize=32))
    progress.close()
    corpus.check()
    written = {}
    for key, (prefix, staged, builder) in builders.items():
        builder.finalize(staged + ".idx")
        written[key] = (prefix, *totals[key])
    return written


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except Refused as refusal:
        print(f"preprocess_data: {refusal}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.train_tokenizer or not (args.print_vocab_size or args.save_tokenizer):
        check_input(args.input)  # before anything is written
    if args.train_tokenizer:
        trained = train_tokenizer(args.input, args.json_keys, args.vocab_size, args.train_tokenizer)
        print(f"preprocess_data: trained a byte-level BPE tokenizer of {len(trained)} tokens, "
              f"saved to {args.train_tokenizer}", file=sys.stderr)
    if args.print_vocab_size:
        print(len(load_tokenizer(args)))
        return 0
    if args.save_tokenizer:
        load_tokenizer(args).save_pretrained(args.save_tokenizer)
        print(f"preprocess_data: saved the tokenizer to {args.save_tokenizer}: train with "
              f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {args.save_tokenizer}",
              file=sys.stderr)
        return 0
    for key, (prefix, documents, tokens) in preprocess(args).items():
        print(f"preprocess_data: {key}: {documents:,} documents, {tokens:,} tokens -> "
              f"{prefix}.bin/.idx (train with --data-path {prefix})", file=sys.stderr)
    return 0
