"""The indexed datasets of a run (``--data-path`` and the other data flags), checked at start-up
from their files, before the job takes its GPUs. Without this, megatron-core starts on a dataset
whose ``.bin`` was cut short and fails on the first sample that reaches past its end (possibly
hours in), and builds a split that holds no token forever: it adds empty epochs until they hold
the samples asked for.

The ``.idx`` layout (megatron-core's ``indexed_dataset``, version 1; little-endian)::

    9 bytes    b"MMIDIDX\\x00\\x00"
    uint64     version, 1
    uint8      code of the token dtype
    uint64     S: sequences
    uint64     D: entries of the document index (the documents + 1: it starts at 0)
    int32[S]   each sequence's length in tokens
    int64[S]   each sequence's byte offset in the .bin
    int64[D]   the document index
    int8[S]    each sequence's mode (multimodal datasets only)

Only the header and the lengths are read, the lengths through a memory map; of the ``.bin`` only
its size. A document here is one sequence of the ``.idx``: what megatron-core's GPT dataset
divides by ``--split`` (``tools/preprocess_data.py`` writes one per input document).
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy

from megatron.bounded.settings import BoundedArgumentError, flag_name

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic, version, token dtype code, sequences, document index entries
INDEX_HEADER = struct.Struct("<9sQBQQ")
# bytes per sequence of the .idx after the header: its length (int32) and offset (int64)
INDEX_BYTES_PER_SEQUENCE = 4 + 8
INDEX_BYTES_PER_DOCUMENT_ENTRY = 8
# the token dtype of each code of the header (megatron-core's DType)
TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
                6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
SPLITS = ("training", "validation", "test")
PER_SPLIT_FLAGS = ("train_data_path", "valid_data_path", "test_data_path")
PER_SPLIT_KEYS = ("train", "valid", "test")  # of --per-split-data-args-path's JSON
# the --split megatron-core takes when --data-path is given without one
LEGACY_DEFAULT_SPLIT = "969, 30, 1"
REMAKE = ("copy the pair again from where it was made, or preprocess the corpus again "
          "(tools/preprocess_data.py)")


@dataclass(frozen=True)
class DataSource:
    """One dataset prefix of the command line: the flag that names it, and the split it alone
    feeds (None: every split, divided by ``--split``)."""

    flag: str
    prefix: str
    split: Optional[int] = None

    @property
    def named(self) -> str:
        return f"{self.flag} {self.prefix}"


@dataclass(frozen=True)
class IndexedDataset:
    """What the ``.idx`` of ``prefix`` says, and the tokens its lengths add up to."""

    prefix: str
    token_bytes: int
    sequences: int
    lengths_offset: int
    tokens: int

    def tokens_between(self, begin: int, end: int) -> int:
        """Tokens of sequences [begin, end)."""
        return _sum_of_lengths(self.prefix + ".idx", self.lengths_offset, self.sequences, begin,
                               end)


def _sum_of_lengths(idx: str, offset: int, sequences: int, begin: int, end: int) -> int:
    """The sum of the lengths [begin, end) of the ``sequences`` int32 lengths at ``offset`` of
    ``idx``, mapped rather than read whole."""
    if end <= begin:
        return 0
    lengths = numpy.memmap(idx, dtype=numpy.int32, mode="r", offset=offset, shape=(sequences,))
    return int(lengths[begin:end].sum(dtype=numpy.int64))


def blend_prefixes(items) -> list:
    """The dataset prefixes of a blend list: ``PREFIX ...`` or ``WEIGHT PREFIX ...``."""
    if not items:
        return []
    items = list(items)
    if len(items) % 2 == 0 and all(_is_number(item) for item in items[0::2]):
        return items[1::2]
    return items


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def data_sources(args) -> List[DataSource]:
    """Every dataset prefix the run reads, from whichever data flag names them (none with
    ``--mock-data``; object-storage prefixes are left to upstream's own client)."""
    if getattr(args, "mock_data", False):
        return []
    sources = []
    if getattr(args, "data_path", None):
        sources = [DataSource("--data-path", prefix) for prefix in blend_prefixes(args.data_path)]
    elif getattr(args, "data_args_path", None):
        flag = f"--data-args-path {args.data_args_path}"
        text = _read_text(args.data_args_path, "--data-args-path")
        sources = [DataSource(flag, prefix) for prefix in blend_prefixes(text.split())]
    elif getattr(args, "per_split_data_args_path", None):
        sources = _per_split_file_sources(args.per_split_data_args_path)
    else:
        for split, name in enumerate(PER_SPLIT_FLAGS):
            sources += [DataSource(flag_name(name), prefix, split)
                        for prefix in blend_prefixes(getattr(args, name, None))]
    return [source for source in sources if "://" not in source.prefix]


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read()
    except (OSError, UnicodeDecodeError) as error:
        raise BoundedArgumentError(f"{flag} {path} cannot be read ({_reason(error)}): name the "
                                   "file that lists the dataset prefixes.") from None


def _per_split_file_sources(path: str) -> List[DataSource]:
    flag = f"--per-split-data-args-path {path}"
    text = _read_text(path, "--per-split-data-args-path")
    try:
        listed = json.loads(text)
        sources = []
        for split, key in enumerate(PER_SPLIT_KEYS):
            items = listed.get(key) or []
            items = items.split() if isinstance(items, str) else items
            sources += [DataSource(f"{flag} ({key})", prefix, split)
                        for prefix in blend_prefixes(items)]
        return sources
    except (ValueError, AttributeError) as error:
        raise BoundedArgumentError(
            f"{flag} is not a JSON object of \"train\", \"valid\" and \"test\" dataset lists "
            f"({error}): write it as {{\"train\": [\"PREFIX\"], \"valid\": [...], "
            "\"test\": [...]}.") from None


def _reason(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error)


# --------------------------------------------------------------------------------------------
# The files of one prefix
# --------------------------------------------------------------------------------------------


def check_dataset_files(source: DataSource) -> IndexedDataset:
    """The dataset of ``source``; refuses a missing file, an ``.idx`` that is not one or is cut
    short, a ``.bin`` of another size than the ``.idx`` describes, and a dataset with no token."""
    idx, bin_ = source.prefix + ".idx", source.prefix + ".bin"
    missing = [path for path in (bin_, idx) if not os.path.isfile(path)]
    if missing:
        raise BoundedArgumentError(
            f"{source.named}: {' and '.join(missing)} not found (a prefix names the pair "
            "PREFIX.bin and PREFIX.idx of a preprocessed dataset): give the prefix without the "
            "extension, or preprocess the data first."
        )
    try:
        files = (os.stat(idx), os.stat(bin_))
        return _checked_dataset(source, *[(f.st_size, f.st_mtime_ns) for f in files])
    except OSError as error:
        raise BoundedArgumentError(f"{source.named}: {error.filename} cannot be read "
                                   f"({_reason(error)}): make it readable by the job.") from None


# Keyed by the files' sizes and times: the early pass, the planner and the validation after
# upstream's each check the same files, and a file changed in between is read again.
@functools.lru_cache(maxsize=64)
def _checked_dataset(source: DataSource, idx_stat: Tuple[int, int],
                     bin_stat: Tuple[int, int]) -> IndexedDataset:
    dataset = read_index(source, idx_stat[0])
    idx, bin_ = source.prefix + ".idx", source.prefix + ".bin"
    described = dataset.tokens * dataset.token_bytes
    if bin_stat[0] != described:
        cause = ("the .bin was cut short (a copy or a preprocessing run that did not finish)"
                 if bin_stat[0] < described else "the .bin holds more than the .idx describes")
        raise BoundedArgumentError(
            f"{source.named}: {bin_} is {bin_stat[0]:,} bytes, and {idx} describes "
            f"{dataset.tokens:,} tokens of {dataset.token_bytes} byte(s), {described:,} bytes: "
            f"{cause}, or the two files come from different corpora. The .bin and .idx must be "
            f"the pair one preprocessing run wrote: {REMAKE}."
        )
    if dataset.tokens == 0:
        raise BoundedArgumentError(
            f"{source.named}: the dataset has {dataset.sequences} document(s) and no token "
            f"({idx}): there is nothing to train on. Check the corpus (its --json-keys field "
            "holds the text) and preprocess it again, or leave the prefix out."
        )
    return dataset


def read_index(source: DataSource, idx_size: int) -> IndexedDataset:
    """The header of ``source``'s ``.idx`` (``idx_size`` bytes), checked against its size, and the
    sum of its sequence lengths."""
    idx = source.prefix + ".idx"
    with open(idx, "rb") as stream:
        header = stream.read(INDEX_HEADER.size)
    magic = header[:len(INDEX_MAGIC)]
    if magic != INDEX_MAGIC[:len(magic)]:
        raise BoundedArgumentError(
            f"{source.named}: {idx} is not the index of a Megatron indexed dataset (it does not "
            f"start with {INDEX_MAGIC!r}): give the prefix of a dataset tools/preprocess_data.py "
            "wrote."
        )
    if len(header) < INDEX_HEADER.size:
        raise BoundedArgumentError(
            f"{source.named}: {idx} is {idx_size} bytes, shorter than the {INDEX_HEADER.size}-byte "
            f"header of an index: it was cut short; {REMAKE}."
        )
    _, version, code, sequences, document_entries = INDEX_HEADER.unpack(header)
    if version != INDEX_VERSION or code not in TOKEN_DTYPES:
        raise BoundedArgumentError(
            f"{source.named}: {idx} has version {version} and token dtype code {code}; "
            f"megatron-core reads version {INDEX_VERSION} with codes {min(TOKEN_DTYPES)} to "
            f"{max(TOKEN_DTYPES)}: the file is damaged or of another format; {REMAKE}."
        )
    needed = (INDEX_HEADER.size + sequences * INDEX_BYTES_PER_SEQUENCE
              + document_entries * INDEX_BYTES_PER_DOCUMENT_ENTRY)
    if idx_size not in (needed, needed + sequences):  # + one mode byte per sequence: multimodal
        cause = ("it was cut short" if idx_size < needed
                 else "it holds more than its header describes")
        raise BoundedArgumentError(
            f"{source.named}: {idx} is {idx_size:,} bytes, and its header's counts "
            f"({sequences:,} sequences, {max(document_entries - 1, 0):,} documents) make "
            f"{needed:,} bytes: {cause}; {REMAKE}."
        )
    tokens = _sum_of_lengths(idx, INDEX_HEADER.size, sequences, 0, sequences)
    return IndexedDataset(source.prefix, TOKEN_DTYPES[code]().itemsize, sequences,
                          INDEX_HEADER.size, tokens)


def check_data_files(args) -> None:
    """Each dataset prefix the run reads (:func:`data_sources`), through
    :func:`check_dataset_files`."""
    for source in data_sources(args):
        check_dataset_files(source)


# --------------------------------------------------------------------------------------------
# The splits
# --------------------------------------------------------------------------------------------


def split_bookends(split: str) -> List[Optional[Tuple[float, float]]]:
    """The (begin, end) fraction of each split of a ``--split`` text, None for a split of no
    share: megatron-core's reading (up to three numbers, normalized, summed in order)."""
    weights = [float(number) for number in re.findall(r"[.0-9]+", split)]
    if len(weights) > len(SPLITS) or not weights or sum(weights) <= 0:
        raise BoundedArgumentError(
            f"--split {split!r} must give up to three shares (training, validation, test), not "
            "all 0: e.g. --split 98,1,1."
        )
    weights += [0.0] * (len(SPLITS) - len(weights))
    shares = (numpy.array(weights, dtype=numpy.float64) / numpy.sum(weights)).tolist()
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share)
    return [(begin, end) if end > begin else None for begin, end in zip(ends, ends[1:])]


def split_documents(bookend: Tuple[float, float], documents: int) -> Tuple[int, int]:
    """The documents [begin, end) a split gets of ``documents``, rounded as megatron-core does."""
    return int(round(bookend[0] * float(documents))), int(round(bookend[1] * float(documents)))


def _trains(args) -> bool:
    if getattr(args, "skip_train", False):
        return False
    return bool(getattr(args, "train_samples", None) or getattr(args, "train_iters", None))


def check_data_splits(args) -> None:
    """Refuse a ``--split`` that leaves a split of a dataset with no document or no token (each
    split with a share is built, used or not, and one with no token is never finished), or gives
    training no share when the run trains. Datasets of the per-split flags are whole splits,
    already checked to hold a token."""
    divided = [source for source in data_sources(args) if source.split is None]
    if not divided:
        return
    split = args.split if getattr(args, "split", None) is not None else LEGACY_DEFAULT_SPLIT
    bookends = split_bookends(split)
    if bookends[0] is None and _trains(args):
        steps = (f"--train-samples {args.train_samples}" if getattr(args, "train_samples", None)
                 else f"--train-iters {args.train_iters}")
        raise BoundedArgumentError(
            f"--split {split!r} gives the training split no share, and {steps} trains on it: "
            "give training a share (e.g. --split 98,1,1)."
        )
    for source in divided:
        dataset = check_dataset_files(source)
        for name, bookend in zip(SPLITS, bookends):
            if bookend is not None:
                _check_split(source, dataset, split, name, bookend)


def _check_split(source: DataSource, dataset: IndexedDataset, split: str, name: str,
                 bookend: Tuple[float, float]) -> None:
    begin, end = split_documents(bookend, dataset.sequences)
    share = 100 * (bookend[1] - bookend[0])
    if end > begin and dataset.tokens_between(begin, end) > 0:
        return
    held = ("none, once rounded" if end <= begin else
            f"documents {begin} to {end - 1}, which hold no token")
    raise BoundedArgumentError(
        f"--split {split!r} gives the {name} split {share:.3g}% of the {dataset.sequences:,} "
        f"document(s) of {source.named}: {held} (megatron-core would build that split forever, "
        f"used or not). Give the {name} split at least one document's share (1/"
        f"{dataset.sequences:,} of the data), or a share of 0 (e.g. --split 100,0,0), or add "
        "documents."
    )
