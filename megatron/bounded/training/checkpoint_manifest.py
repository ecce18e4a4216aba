"""Integrity manifests of checkpoint directories: per-file checksums written after a save,
verified before a load.

After a checkpoint save completes, every rank checksums its share of the checkpoint directory
(``iter_NNNNNNN/``) and writes it as one part of the manifest in
``<checkpoint>/bounded_manifest/part_RRRRR.json``:

* rank r takes the torch_dist shard files it wrote itself (``__r_K.distcp``);
* rank 0 takes every other file (``.metadata``, ``common.pt``, ``metadata.json``, the legacy
  ``mp_rank_*`` files) and also writes the index: the name and size of every file of the
  checkpoint.

The manifest covers every file of the directory except its own parts (:func:`is_manifest_file`,
the one list of what it leaves out). Each part is written to a temporary name and renamed, so a
part is complete or absent.

A check (:func:`verify_share`; every rank its share before a load, or one process offline) fails,
naming the file, when a listed file is missing, has another size or CRC-32, when a file on disk is
not listed, when a part is missing or unreadable, or when the index and the parts disagree (a file
listed without a checksum, a checksum for a file not listed). A checkpoint without any manifest
(saved before manifests existed, or by another tool) is checked only against its torch_dist
``.metadata`` (:func:`layout_mismatches`: every file it reads is there and long enough).

The checksum is CRC-32 (``zlib.crc32``, no extra dependency). Files made of ``torch.save``
archives (torch_dist's shard files, ``common.pt``) keep the CRC-32 that each archive computed
for its records while saving (``megatron.bounded.training.zip_records``): writing their manifest reads
only the archives' directories and the bytes between the records, so it costs a small fraction
of reading the file. Every other file is hashed in blocks of ``BLOCK_BYTES`` by a pool of threads
(zlib releases the GIL, so the threads run in parallel; large ranges are read through memory
maps). A mismatch names the file and the record or byte range. It detects corrupted or
truncated files, not deliberate tampering. Manifests of the first two formats (one CRC per file;
blocks only) are still verified. The training-time side (the background writer, the ranks'
agreed check before a load) is :mod:`megatron.bounded.training.checkpoint_integrity`.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from megatron.bounded.settings import Settings, flag_name, knob
from megatron.bounded.training.zip_records import stored_records
from megatron.bounded.units import MiB

MANIFEST_DIR = "bounded_manifest"
FORMAT_VERSION = 3  # 3: archive records and blocks; 2: blocks only; 1: one CRC per file
READABLE_FORMATS = (1, 2, 3)
ALGORITHM = "crc32"
BLOCK_BYTES = 256 * MiB  # one CRC of the manifest, hashed by one thread
MAX_HASH_THREADS = 8
RECORD_MIN_BYTES = MiB  # a record this large keeps the CRC-32 its archive recorded
MAPPED_READ_BYTES = MiB  # ranges this large are read through a memory map
# torch_dist (and torch_dcp / fsdp_dtensor) shard files carry the global rank that wrote them.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
BYPASS_FLAG = flag_name("no_verify_checkpoint")  # CheckpointManifestSettings.verify_checkpoint, off
# What reading or checking a manifest with malformed entries can raise: reported, not raised.
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file does not match the manifest written when it was saved."""


@dataclass(frozen=True)
class CheckpointManifestSettings(Settings):
    """The manifest's flag: saves always write it; loads check it unless turned off."""

    verify_checkpoint: bool = knob(
        True, "Load a checkpoint without checking its files against the checksums written after "
        "it was saved (tools/verify_checkpoint.py checks a directory offline).")


PART_PREFIX, PART_SUFFIX = "part_", ".json"
TEMPORARY_MARK = ".tmp"  # a part being written: part_RRRRR.json.tmp<pid>, renamed when complete


def part_name(rank: int) -> str:
    return f"{PART_PREFIX}{rank:05d}{PART_SUFFIX}"


def part_rank(name: str) -> Optional[int]:
    """The rank whose manifest part is called ``name`` (None: not a part's name)."""
    digits = name[len(PART_PREFIX):len(name) - len(PART_SUFFIX)]
    if name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX) and digits.isdigit():
        return int(digits) if part_name(int(digits)) == name else None
    return None


def is_manifest_file(relpath: str) -> bool:
    """Whether ``relpath`` (relative to the checkpoint, ``/``-separated) is one of the manifest's
    own files: a part, or a part being written. They are the only files the manifest does not
    list; any other file of the checkpoint must be listed."""
    folder, _, name = relpath.rpartition("/")
    return folder == MANIFEST_DIR and part_rank(name.partition(TEMPORARY_MARK)[0]) is not None


def owner_rank(relpath: str, world_size: int) -> int:
    """The rank that checksums ``relpath`` when ``world_size`` ranks share the work."""
    match = _RANK_FILE.search(os.path.basename(relpath))
    if match is not None and int(match.group(1)) < world_size:
        return int(match.group(1))
    return 0


def list_files(directory: str) -> list[str]:
    """Every file under ``directory`` (relative, ``/``-separated, sorted) but the manifest's own
    (:func:`is_manifest_file`)."""
    found = []
    for root, _, files in os.walk(directory):
        rel_root = os.path.relpath(root, directory)
        for name in files:
            relpath = os.path.normpath(os.path.join(rel_root, name)).replace(os.sep, "/")
            if not is_manifest_file(relpath):
                found.append(relpath)
    return sorted(found)


def checksum(path: str) -> tuple[int, str]:
    """(size in bytes, CRC-32 of the whole file as 8 hex digits): the first format's checksum."""
    size = os.path.getsize(path)
    return size, f"{_crc_of_range(path, 0, size):08x}"


def _crc_of_range(path: str, offset: int, length: int) -> int:
    """CRC-32 of bytes [offset, offset + length) of ``path``."""
    return _crc_of_ranges(path, [(offset, length)])


def _crc_of_ranges(path: str, ranges: list) -> int:
    """One CRC-32 over the bytes of ``ranges`` [(offset, length), ...] of ``path``, in order.
    Large ranges are read through a read-only memory map (no copy into Python objects, about
    1.4× a loop of reads), small ones with one read each. A file shorter than a range gives the
    CRC of what is there, which will not match. (A file truncated while it is mapped would raise
    SIGBUS: checkpoints are hashed when complete and verified before use, not while another
    process rewrites them.)"""
    crc = 0
    with open(path, "rb") as stream:
        descriptor = stream.fileno()
        size = os.fstat(descriptor).st_size
        for offset, length in ranges:
            available = max(0, min(length, size - offset))
            if available < MAPPED_READ_BYTES:
                crc = zlib.crc32(os.pread(descriptor, available, offset), crc)
            else:
                skip = offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a granule
                with mmap.mmap(descriptor, skip + available, offset=offset - skip,
                               access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        crc = zlib.crc32(view[skip:], crc)
                    finally:
                        view.release()
            if available < length:
                break
    return crc


def hash_threads() -> int:
    """Threads that hash blocks: half of this process's share of the host's cores (the ranks of
    a host hash at the same time, next to training), at most ``MAX_HASH_THREADS``."""
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MAX_HASH_THREADS, (os.cpu_count() or 2) // (2 * local_ranks)))


def block_checksums(paths: list[str], threads: Optional[int] = None,
                    block_bytes: Optional[int] = None) -> dict:
    """{path: {"size": bytes, "crc32": [one 8-hex-digit CRC-32 per block]}}, the blocks
    (``block_bytes``, default ``BLOCK_BYTES``) of all ``paths`` hashed by ``threads`` threads
    (default :func:`hash_threads`)."""
    block_bytes = block_bytes or BLOCK_BYTES
    sizes = {path: os.path.getsize(path) for path in paths}
    blocks = [(path, offset) for path in paths for offset in range(0, sizes[path], block_bytes)]
    with ThreadPoolExecutor(max_workers=threads or hash_threads()) as pool:
        crcs = pool.map(lambda block: _crc_of_range(
            block[0], block[1], min(block_bytes, sizes[block[0]] - block[1])), blocks)
        result = {path: {"size": size, ALGORITHM: []} for path, size in sizes.items()}
        for (path, _), crc in zip(blocks, crcs):
            result[path][ALGORITHM].append(f"{crc:08x}")
    return result


def _between(records: list, size: int) -> list:
    """The (offset, length) ranges of a ``size``-byte file outside ``records``."""
    ranges, covered = [], 0
    for offset, length, _ in records:
        if offset > covered:
            ranges.append((covered, offset - covered))
        covered = offset + length
    if size > covered:
        ranges.append((covered, size - covered))
    return ranges


def archive_checksums(path: str) -> Optional[dict]:
    """{"size", "records": [[offset, length, CRC-32], ...], "rest_crc32"} for a file of
    ``torch.save`` archives: its records of at least ``RECORD_MIN_BYTES`` keep the CRC-32 the
    archive computed while saving, the rest of the file (archive headers and directories, small
    records) is hashed here. None when the file is not such archives (or the rest would be large,
    e.g. archives saved without CRCs): the caller hashes it in blocks."""
    records = stored_records(path)
    if records is None:
        return None
    size = os.path.getsize(path)
    kept = [record for record in records if record[1] >= RECORD_MIN_BYTES and record[2]]
    rest = _between(kept, size)
    if sum(length for _, length in rest) > BLOCK_BYTES:
        return None
    return {"size": size,
            "records": [[offset, length, f"{crc:08x}"] for offset, length, crc in kept],
            "rest_" + ALGORITHM: f"{_crc_of_ranges(path, rest):08x}"}


def file_checksums(paths: list[str]) -> dict:
    """{path: checksums}: the archives' own CRC-32s where a file is ``torch.save`` archives
    (:func:`archive_checksums`; torch_dist shards, ``common.pt``), CRC-32 blocks otherwise."""
    by_archive = {path: archive_checksums(path) for path in paths}
    by_block = block_checksums([path for path, found in by_archive.items() if found is None])
    return {path: by_archive[path] or by_block[path] for path in paths}


def _write_json_atomically(path: str, payload: dict) -> None:
    temporary = f"{path}{TEMPORARY_MARK}{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as stream:
        json.dump(payload, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def write_part(directory: str, rank: int = 0, world_size: int = 1) -> str:
    """Checksum this rank's share of ``directory`` and write its manifest part; returns its path.

    Call only when the checkpoint is complete on every rank. With ``world_size`` 1 the one part
    covers every file (what ``tools/verify_checkpoint.py --write`` does)."""
    files = list_files(directory)
    owned = [relpath for relpath in files if owner_rank(relpath, world_size) == rank]
    hashed = file_checksums([os.path.join(directory, relpath) for relpath in owned])
    checksums = {relpath: hashed[os.path.join(directory, relpath)] for relpath in owned}
    payload = {
        "block_bytes": BLOCK_BYTES,
        "format": FORMAT_VERSION,
        "algorithm": ALGORITHM,
        "rank": rank,
        "world_size": world_size,
        "checksums": checksums,
    }
    if rank == 0:
        payload["files"] = {
            relpath: os.path.getsize(os.path.join(directory, relpath)) for relpath in files
        }
    manifest_dir = os.path.join(directory, MANIFEST_DIR)
    os.makedirs(manifest_dir, exist_ok=True)
    path = os.path.join(manifest_dir, part_name(rank))
    _write_json_atomically(path, payload)
    return path


@dataclass
class Manifest:
    """A directory's manifest as read: the index's list, the parts' checksums, and what is wrong
    with the manifest itself (a part missing or unreadable, the index and the parts disagreeing:
    the files cannot be checked against it)."""

    files: dict  # relpath -> size (from the index, part 0)
    checksums: dict  # relpath -> checksums (from every part)
    block_bytes: int = 0  # the blocks' size; 0: one CRC per file (the first format)
    problems: list = field(default_factory=list)  # (relpath, reason)


def part_relpath(rank: int) -> str:
    return f"{MANIFEST_DIR}/{part_name(rank)}"


def _read_part(directory: str, rank: int) -> dict:
    with open(os.path.join(directory, part_relpath(rank)), encoding="utf-8") as stream:
        part = json.load(stream)
    if not isinstance(part, dict) or not isinstance(part.get("checksums"), dict):
        raise ValueError("not a manifest part (no checksums)")
    return part


def read_manifest(directory: str) -> Optional[Manifest]:
    """The manifest of ``directory``, or None when it has none (no part at all)."""
    manifest_dir = os.path.join(directory, MANIFEST_DIR)
    names = os.listdir(manifest_dir) if os.path.isdir(manifest_dir) else []
    ranks = sorted(rank for rank in map(part_rank, names) if rank is not None)
    if not ranks:
        return None
    if ranks[0] != 0:
        left = ", ".join(map(part_relpath, ranks))
        return Manifest({}, {}, problems=[(part_relpath(0), f"missing: the manifest's index is "
                                           f"gone while {left} remain(s)")])
    try:
        index = _read_part(directory, 0)
        files, world_size = dict(index["files"]), int(index["world_size"])
    except READ_ERRORS as error:
        return Manifest({}, {}, problems=[(part_relpath(0), f"unreadable: {error!r}")])
    if index.get("format") not in READABLE_FORMATS or index.get("algorithm") != ALGORITHM:
        return Manifest({}, {}, problems=[(part_relpath(0), (
            f"manifest format {index.get('format')} / {index.get('algorithm')} is not one this "
            f"version reads ({' or '.join(map(str, READABLE_FORMATS))} / {ALGORITHM})"))])
    problems = [(part_relpath(rank), f"a part of rank {rank}, but the index says the manifest "
                 f"has {world_size} part(s)") for rank in ranks if rank >= world_size]
    checksums, complete = _read_checksums(directory, index, world_size, problems)
    if complete:  # a missing part already explains files without a checksum
        problems += [(relpath, "listed by the index, but no part has its checksum")
                     for relpath in sorted(set(files) - set(checksums))]
    problems += [(relpath, "has a checksum in the manifest, but the index does not list it")
                 for relpath in sorted(set(checksums) - set(files))]
    problems += [(relpath, f"the index records {files[relpath]} bytes, its part "
                  f"{checksums[relpath].get('size')}") for relpath in sorted(files)
                 if relpath in checksums and checksums[relpath].get("size") != files[relpath]]
    return Manifest(files, checksums, int(index.get("block_bytes", 0)), problems)


def _read_checksums(directory: str, index: dict, world_size: int, problems: list):
    """(every part's checksums, whether every part was read); what is wrong with a part is added
    to ``problems``."""
    checksums, complete = {}, True
    for rank in range(world_size):
        try:
            part = index if rank == 0 else _read_part(directory, rank)
        except FileNotFoundError:
            problems.append((part_relpath(rank), f"missing: rank {rank}'s part of the manifest "
                             "(the checksums of the files it wrote) is gone"))
            complete = False
            continue
        except READ_ERRORS as error:
            problems.append((part_relpath(rank), f"unreadable: {error!r}"))
            complete = False
            continue
        header = (part.get("rank"), part.get("world_size"), part.get("format"))
        if header != (rank, world_size, index.get("format")):
            problems.append((part_relpath(rank), f"written as rank {header[0]} of {header[1]} "
                             f"(format {header[2]}), the index as rank 0 of {world_size} (format "
                             f"{index.get('format')}): not a part of this manifest"))
        for relpath, entry in part["checksums"].items():
            if relpath in checksums or not _well_formed(entry):
                problems.append((relpath, "a second or malformed checksum in "
                                 f"{part_relpath(rank)}"))
            checksums[relpath] = entry if isinstance(entry, dict) else {}
    return checksums, complete


def _well_formed(entry) -> bool:
    """Whether a file's checksums have a shape that a readable format writes (checked before
    the file is hashed against them)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        return False
    if "records" in entry:
        records = entry["records"]
        return (isinstance(entry.get("rest_" + ALGORITHM), str) and isinstance(records, list)
                and all(isinstance(record, list) and len(record) == 3 for record in records))
    crcs = entry.get(ALGORITHM)
    return isinstance(crcs, str) or (
        isinstance(crcs, list) and all(isinstance(crc, str) for crc in crcs))


@dataclass
class Report:
    """What one rank (or an offline check) found for its share of the files."""

    has_manifest: bool = True
    mismatches: list = field(default_factory=list)  # (relpath, reason)
    checked_files: int = 0
    checked_bytes: int = 0

    def merge(self, other: "Report") -> "Report":
        return Report(
            self.has_manifest and other.has_manifest,
            self.mismatches + other.mismatches,
            self.checked_files + other.checked_files,
            self.checked_bytes + other.checked_bytes,
        )


NOT_LISTED = ("not listed by the manifest (written after the save or by something else, or its "
              "entry was removed): its contents are unverified")


def verify_share(directory: str, manifest: Optional[Manifest], rank: int = 0,
                 world_size: int = 1) -> Report:
    """Check this rank's share of ``directory`` (all of it for one rank): with a manifest, every
    file against it and no file left out of it; without one, the torch_dist layout (rank 0)."""
    if manifest is None:
        return Report(has_manifest=False,
                      mismatches=layout_mismatches(directory) if rank == 0 else [])
    if manifest.problems:  # the manifest cannot be trusted: its files are not checked against it
        return Report(mismatches=list(manifest.problems))
    report = Report()
    report.mismatches += [
        (relpath, NOT_LISTED) for relpath in list_files(directory)
        if relpath not in manifest.files and owner_rank(relpath, world_size) == rank]
    to_hash = {}  # relpath -> (path, size, expected CRCs)
    for relpath, size in sorted(manifest.files.items()):
        if owner_rank(relpath, world_size) != rank:
            continue
        path = os.path.join(directory, relpath)
        if not os.path.isfile(path):
            report.mismatches.append((relpath, "missing"))
            continue
        found_size = os.path.getsize(path)
        if found_size != size:
            report.mismatches.append((relpath, f"size {found_size} bytes, {size} when saved"))
            continue
        to_hash[relpath] = (path, size, manifest.checksums[relpath])
    _check_contents(to_hash, manifest.block_bytes, report)
    return report


def _check_contents(to_hash: dict, block_bytes: int, report: Report) -> None:
    """Hash the files of ``to_hash`` (relpath -> (path, size, expected checksums)) and add each to
    ``report``: a mismatch naming it, or a checked file."""
    by_block = {relpath: item for relpath, item in to_hash.items() if "records" not in item[2]}
    by_archive = {relpath: item for relpath, item in to_hash.items() if "records" in item[2]}
    if block_bytes:  # hashed in the blocks the manifest was written with
        found = block_checksums([path for path, _, _ in by_block.values()],
                                block_bytes=block_bytes)
    for relpath, (path, size, expected) in by_block.items():
        expected = expected.get(ALGORITHM)
        if block_bytes:
            got = found[path][ALGORITHM]
            bad = [i for i, (one, want) in enumerate(zip(got, expected or [])) if one != want]
            if bad or not isinstance(expected, list) or len(expected) != len(got):
                first = bad[0] if bad else min(len(expected or []), len(got))
                report.mismatches.append((relpath, f"CRC-32 differs from bytes "
                                                   f"{first * block_bytes:,} on "
                                                   f"({len(bad)} block(s))"))
                continue
        else:
            _, crc = checksum(path)
            if crc != expected:
                report.mismatches.append((relpath, f"CRC-32 {crc}, {expected} when saved"))
                continue
        report.checked_files += 1
        report.checked_bytes += size
    for relpath, reason in _archive_mismatches(by_archive).items():
        if reason:
            report.mismatches.append((relpath, reason))
        else:
            report.checked_files += 1
            report.checked_bytes += by_archive[relpath][1]


def _archive_mismatches(files: dict) -> dict:
    """{relpath: the first mismatch found, or ""} for files checked by their archives' records
    (``files``: relpath -> (path, size, expected checksums)); records hashed by a thread pool."""
    tasks = []  # (relpath, what, path, ranges, expected CRC)
    for relpath, (path, size, expected) in files.items():
        for offset, length, crc in expected["records"]:
            tasks.append((relpath, f"bytes {offset:,} to {offset + length:,} (one record of its "
                          f"archives)", path, [(offset, length)], crc))
        tasks.append((relpath, "the bytes between its records (archive headers and directories, "
                      "small records)", path, _between(expected["records"], size),
                      expected["rest_" + ALGORITHM]))
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
        found = list(pool.map(lambda task: f"{_crc_of_ranges(task[2], task[3]):08x}", tasks))
    reasons = {relpath: "" for relpath in files}
    for (relpath, what, _, _, want), got in zip(tasks, found):
        if got != want and not reasons[relpath]:
            reasons[relpath] = f"CRC-32 of {what} differs"
    return reasons


def listed(mismatches: list, most: int = 20) -> str:
    """One line per (relpath, reason), at most ``most`` of them."""
    lines = [f"  {relpath}: {reason}" for relpath, reason in mismatches[:most]]
    if len(mismatches) > most:
        lines.append(f"  ... and {len(mismatches) - most} more")
    return "\n".join(lines)


def describe_mismatches(directory: str, report: Report, bypass: str = BYPASS_FLAG) -> str:
    if not report.has_manifest:
        return (f"checkpoint {directory} has no integrity manifest and its files do not match "
                f"its {TORCH_DIST_METADATA} ({len(report.mismatches)} file(s)):\n"
                f"{listed(report.mismatches)}\nRestore the named file(s) from a copy or load "
                "another checkpoint (e.g. --ckpt-step of an earlier save).")
    return (
        f"checkpoint {directory} does not match the manifest written when it was saved "
        f"({len(report.mismatches)} file(s)):\n{listed(report.mismatches)}\n"
        "A file is corrupt, truncated, was changed or added after the save, or the manifest "
        f"itself ({MANIFEST_DIR}/) was changed or lost a part. Restore the named file(s) from a "
        "copy, load another checkpoint (e.g. --ckpt-step of an earlier save), or, having checked "
        f"the checkpoint otherwise, load it anyway with {bypass}."
    )


def describe_unverified(directory: str, report: Report) -> Optional[str]:
    if not report.has_manifest:
        return (f"checkpoint {directory} has no integrity manifest ({MANIFEST_DIR}/; saved "
                "before manifests existed or by another tool): loaded without verification "
                f"(only the file sizes its torch_dist {TORCH_DIST_METADATA} implies, if it has "
                "one, were checked)")
    return None


TORCH_DIST_METADATA = ".metadata"  # torch_dist's index of the bytes each file holds


def layout_mismatches(directory: str) -> list:
    """(relpath, reason) for each file that the torch_dist ``.metadata`` of ``directory`` reads
    from and that is missing or shorter than the bytes read there; [] for other formats. The
    check of a checkpoint without a manifest, and what names the file when a load fails."""
    if not os.path.isfile(os.path.join(directory, TORCH_DIST_METADATA)):
        return []
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data or {}
    except Exception as error:  # noqa: BLE001 - whatever breaks the unpickling names the file
        return [(TORCH_DIST_METADATA, f"unreadable ({type(error).__name__}: {error})")]
    needed = {}  # relpath -> the end of the last byte range read from it
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    mismatches = []
    for relpath, size in sorted(needed.items()):
        path = os.path.join(directory, relpath)
        if not os.path.isfile(path):
            mismatches.append((relpath, f"missing (its {TORCH_DIST_METADATA} reads from it)"))
        elif os.path.getsize(path) < size:
            mismatches.append((relpath, f"size {os.path.getsize(path)} bytes, but its "
                               f"{TORCH_DIST_METADATA} reads {size} bytes from it (truncated)"))
    return mismatches


def read_tracker(path: str) -> tuple[int, bool]:
    """(iteration, release) from a tracker file (``latest_checkpointed_iteration.txt``). One
    holding neither an iteration nor ``release`` raises :class:`CheckpointIntegrityError` naming
    it (upstream would print an error and exit with status 0, as if training had succeeded)."""
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointIntegrityError(f"tracker file {path} is unreadable ({error!r})") from error
    if text == "release":
        return 0, True
    if text.isascii() and text.isdigit():
        return int(text), False
    raise CheckpointIntegrityError(
        f"tracker file {path} holds {text[:40]!r}, neither an iteration number nor 'release': "
        "write into it the iteration to resume from (the number of the iter_NNNNNNN directory "
        "to load), or load another directory."
    )
