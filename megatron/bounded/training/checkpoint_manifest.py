"""Integrity manifests of checkpoint directories: per-file checksums written after a save,
verified before a load.

After a checkpoint save completes, every rank checksums its share of the checkpoint directory
(``iter_NNNNNNN/``) in a background thread and writes it as one part of the manifest in
``<checkpoint>/bounded_manifest/part_RRRRR.json``:

* rank r takes the torch_dist shard files it wrote itself (``__r_K.distcp``);
* rank 0 takes every other file (``.metadata``, ``common.pt``, ``metadata.json``, the legacy
  ``mp_rank_*`` files) and also writes the index: the name and size of every file of the
  checkpoint.

Hashing runs off the training loop: it starts when the save has completed on every rank (after
upstream's synchronous save returns, or in the finalize step of an asynchronous save) and is
joined before the next save starts and when training ends. Each part is written to a temporary
name and renamed, so a part is complete or absent; a job killed while hashing leaves a manifest
that is incomplete, not wrong.

Before a checkpoint is loaded, the ranks verify it together (each checks the files of the same
rule, sizes first, then CRC-32 streamed in chunks) and every rank raises
:class:`CheckpointIntegrityError` naming the files that do not match. A checkpoint without a
manifest (saved before manifests existed, or by another tool) or with missing parts is loaded
with a warning saying what was not verified. ``--no-verify-checkpoint`` skips the check;
``tools/verify_checkpoint.py DIR`` runs it offline.

The checksum is CRC-32 (``zlib.crc32``, no extra dependency). Files made of ``torch.save``
archives (torch_dist's shard files, ``common.pt``) keep the CRC-32 that each archive computed
for its records while saving (``megatron.bounded.training.zip_records``): writing their manifest reads
only the archives' directories and the bytes between the records, so it costs a small fraction
of reading the file. Every other file is hashed in blocks of ``BLOCK_BYTES`` by a pool of threads
(zlib releases the GIL, so the threads run in parallel; large ranges are read through memory
maps). A mismatch names the file and the record or byte range. It detects corrupted or
truncated files, not deliberate tampering. Manifests of the first two formats (one CRC per file;
blocks only) are still verified.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from megatron.bounded.settings import Settings, flag_name, knob
from megatron.bounded.training.zip_records import stored_records

logger = logging.getLogger(__name__)

MANIFEST_DIR = "bounded_manifest"
FORMAT_VERSION = 3  # 3: archive records and blocks; 2: blocks only; 1: one CRC per file
READABLE_FORMATS = (1, 2, 3)
ALGORITHM = "crc32"
BLOCK_BYTES = 256 * 1024**2  # one CRC of the manifest, hashed by one thread
MAX_HASH_THREADS = 8
RECORD_MIN_BYTES = 1024**2  # a record this large keeps the CRC-32 its archive recorded
MAPPED_READ_BYTES = 1024**2  # ranges this large are read through a memory map
# torch_dist (and torch_dcp / fsdp_dtensor) shard files carry the global rank that wrote them.
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
BYPASS_FLAG = flag_name("no_verify_checkpoint")  # CheckpointManifestSettings.verify_checkpoint, off


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint file does not match the manifest written when it was saved."""


@dataclass(frozen=True)
class CheckpointManifestSettings(Settings):
    """The manifest's flag: saves always write it; loads check it unless turned off."""

    verify_checkpoint: bool = knob(
        True, "Load a checkpoint without checking its files against the checksums written after "
        "it was saved (tools/verify_checkpoint.py checks a directory offline).")


def part_name(rank: int) -> str:
    return f"part_{rank:05d}.json"


def owner_rank(relpath: str, world_size: int) -> int:
    """The rank that checksums ``relpath`` when ``world_size`` ranks share the work."""
    match = _RANK_FILE.search(os.path.basename(relpath))
    if match is not None and int(match.group(1)) < world_size:
        return int(match.group(1))
    return 0


def list_files(directory: str) -> list[str]:
    """Every file under ``directory`` (relative, ``/``-separated, sorted), without the manifest."""
    found = []
    for root, dirs, files in os.walk(directory):
        rel_root = os.path.relpath(root, directory)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != MANIFEST_DIR]
            rel_root = ""
        for name in files:
            found.append(os.path.join(rel_root, name).replace(os.sep, "/"))
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
    temporary = f"{path}.tmp{os.getpid()}"
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
    """The parts of a directory's manifest that could be read."""

    files: dict  # relpath -> size (from the index, part 0)
    checksums: dict  # relpath -> {"size", "crc32"} (from every part present)
    missing_parts: list = field(default_factory=list)
    block_bytes: int = 0  # the blocks' size; 0: one CRC per file (the first format)


def read_manifest(directory: str) -> Optional[Manifest]:
    """The manifest of ``directory``, or None when it has none (no index part)."""
    manifest_dir = os.path.join(directory, MANIFEST_DIR)
    index_path = os.path.join(manifest_dir, part_name(0))
    if not os.path.isfile(index_path):
        return None
    with open(index_path, encoding="utf-8") as stream:
        index = json.load(stream)
    if index.get("format") not in READABLE_FORMATS or index.get("algorithm") != ALGORITHM:
        raise CheckpointIntegrityError(
            f"{index_path}: manifest format {index.get('format')} / {index.get('algorithm')} is "
            f"not one this version reads ({' or '.join(map(str, READABLE_FORMATS))} / {ALGORITHM})"
        )
    checksums = dict(index["checksums"])
    missing = []
    for rank in range(1, int(index["world_size"])):
        path = os.path.join(manifest_dir, part_name(rank))
        if not os.path.isfile(path):
            missing.append(rank)
            continue
        with open(path, encoding="utf-8") as stream:
            checksums.update(json.load(stream)["checksums"])
    return Manifest(files=dict(index["files"]), checksums=checksums, missing_parts=missing,
                    block_bytes=int(index.get("block_bytes", 0)))


@dataclass
class Report:
    """What one rank (or an offline check) found for its share of the files."""

    has_manifest: bool = True
    mismatches: list = field(default_factory=list)  # (relpath, reason)
    unchecked: list = field(default_factory=list)  # relpaths whose part is missing
    checked_files: int = 0
    checked_bytes: int = 0

    def merge(self, other: "Report") -> "Report":
        return Report(
            self.has_manifest and other.has_manifest,
            self.mismatches + other.mismatches,
            self.unchecked + other.unchecked,
            self.checked_files + other.checked_files,
            self.checked_bytes + other.checked_bytes,
        )


def verify_share(directory: str, manifest: Optional[Manifest], rank: int = 0,
                 world_size: int = 1) -> Report:
    """Check this rank's share of the files listed in ``manifest`` (all of them for one rank)."""
    if manifest is None:
        return Report(has_manifest=False)
    report = Report()
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
        expected = manifest.checksums.get(relpath)
        if expected is None:
            report.unchecked.append(relpath)
            continue
        to_hash[relpath] = (path, size, expected)
    by_block = {relpath: item for relpath, item in to_hash.items() if "records" not in item[2]}
    by_archive = {relpath: item for relpath, item in to_hash.items() if "records" in item[2]}
    if manifest.block_bytes:  # hashed in the blocks the manifest was written with
        found = block_checksums([path for path, _, _ in by_block.values()],
                                block_bytes=manifest.block_bytes)
    for relpath, (path, size, expected) in by_block.items():
        expected = expected[ALGORITHM]
        if manifest.block_bytes:
            bad = [i for i, (got, want) in enumerate(zip(found[path][ALGORITHM], expected))
                   if got != want]
            if bad or len(expected) != len(found[path][ALGORITHM]):
                first = bad[0] if bad else min(len(expected), len(found[path][ALGORITHM]))
                report.mismatches.append((relpath, f"CRC-32 differs from bytes "
                                                   f"{first * manifest.block_bytes:,} on "
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
    return report


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


def describe_mismatches(directory: str, report: Report, bypass: str = BYPASS_FLAG) -> str:
    listed = "\n".join(f"  {relpath}: {reason}" for relpath, reason in report.mismatches[:20])
    more = len(report.mismatches) - 20
    if more > 0:
        listed += f"\n  ... and {more} more"
    return (
        f"checkpoint {directory} does not match the manifest written when it was saved "
        f"({len(report.mismatches)} file(s)):\n{listed}\n"
        "The file is corrupt, truncated or was changed after the save. Restore it from a copy, "
        "load another checkpoint (e.g. --ckpt-step of an earlier save), or load it anyway with "
        f"{bypass}."
    )


def describe_unverified(directory: str, report: Report) -> Optional[str]:
    if not report.has_manifest:
        return (f"checkpoint {directory} has no integrity manifest ({MANIFEST_DIR}/; saved "
                "before manifests existed or by another tool): loaded without verification")
    if report.unchecked:
        return (f"checkpoint {directory}: {len(report.unchecked)} file(s) have no checksum (the "
                "manifest is incomplete, e.g. the job stopped while writing it); their sizes "
                f"match, their contents were not verified (first: {report.unchecked[0]})")
    return None


# --------------------------------------------------------------------------------------------
# During training: background writer, verification before load
# --------------------------------------------------------------------------------------------


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Writer:
    """At most one manifest part being written per process, in a background thread."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._directory = ""
        self._save_seconds: Optional[float] = None
        self.written: list[str] = []
        self.failures: list[str] = []
        self.waited_seconds: list[float] = []  # the training loop's only wait for the manifests

    def start(self, directory: str, save_seconds: Optional[float] = None) -> None:
        """Checksum this rank's share of the (complete) checkpoint ``directory`` in the
        background (its save took ``save_seconds``, when known); waits for the previous one
        first."""
        self.wait()
        rank, world_size = _rank_and_world()
        self._directory, self._save_seconds = directory, save_seconds
        self._thread = threading.Thread(
            target=self._run, args=(directory, rank, world_size),
            name="bounded-checkpoint-manifest", daemon=False,
        )
        self._thread.start()

    def _run(self, directory: str, rank: int, world_size: int) -> None:
        started = time.monotonic()
        try:
            path = write_part(directory, rank, world_size)
        except Exception as error:  # noqa: BLE001 - a manifest must never stop training
            self.failures.append(f"{directory}: {error!r}")
            logger.warning("checkpoint manifest of %s not written on rank %d: %r (the checkpoint "
                           "itself is complete; it will load without verification)",
                           directory, rank, error)
            return
        self.written.append(path)
        if rank == 0:
            logger.info("checkpoint manifest of %s written in %.1f s in the background (%d "
                        "threads)", directory, time.monotonic() - started, hash_threads())

    def wait(self) -> None:
        """Block until the manifest part being written (if any) is on disk; the time blocked is
        what the manifest adds to the job (reported against the save's time)."""
        if self._thread is None:
            return
        started = time.monotonic()
        self._thread.join()
        self._thread = None
        waited = time.monotonic() - started
        self.waited_seconds.append(waited)
        rank, _ = _rank_and_world()
        if rank == 0 and waited >= 0.05:
            share = (f" ({100 * waited / self._save_seconds:.1f}% of the save's "
                     f"{self._save_seconds:.1f} s)" if self._save_seconds else "")
            logger.info("waited %.2f s for the checkpoint manifest of %s%s", waited,
                        self._directory, share)


writer = _Writer()


def wait() -> None:
    """Join the background manifest writer (before a new save, and when training ends)."""
    writer.wait()


_verified: set[str] = set()


def verify_before_load(directory: str, enabled: bool = True) -> Optional[Report]:
    """Check ``directory`` against its manifest on every rank (each its share; the reports are
    gathered) and raise :class:`CheckpointIntegrityError` on all ranks if a file does not match.
    Once per directory and process; returns the merged report (None when skipped)."""
    import torch.distributed as dist

    if not enabled or directory in _verified or not os.path.isdir(directory):
        return None
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return None  # before the process group exists (e.g. --use-checkpoint-args): later
    rank, world_size = _rank_and_world()
    started = time.monotonic()
    try:
        manifest = read_manifest(directory)
        local = verify_share(directory, manifest, rank, world_size)
    except (OSError, ValueError, KeyError, CheckpointIntegrityError) as error:
        local = Report(mismatches=[(MANIFEST_DIR, f"unreadable manifest: {error}")])
    if distributed:
        reports = [None] * world_size
        dist.all_gather_object(reports, local)
    else:
        reports = [local]
    merged = reports[0]
    for report in reports[1:]:
        merged = merged.merge(report)
    merged.mismatches = list(dict.fromkeys(merged.mismatches))  # an unreadable index: once
    if merged.mismatches:
        raise CheckpointIntegrityError(describe_mismatches(directory, merged))
    _verified.add(directory)
    if rank == 0:
        note = describe_unverified(directory, merged)
        if note is not None:
            logger.warning(note)
            print(f"[bounded] WARNING: {note}", flush=True)
        else:
            print(f"[bounded] checkpoint {directory}: {merged.checked_files} files "
                  f"({merged.checked_bytes / 1024**3:.2f} GiB) match the manifest "
                  f"({time.monotonic() - started:.1f} s)", flush=True)
    return merged


# --------------------------------------------------------------------------------------------
# Which directory upstream's save writes and its load reads (megatron.training.checkpointing)
# --------------------------------------------------------------------------------------------

_pending_async: Optional[str] = None


def _read_tracker(checkpoints_path: str) -> tuple[int, bool]:
    """(iteration, release) from ``latest_checkpointed_iteration.txt``; (-1, False) without it.
    Read directly: upstream's reader also all-reduces the value on the GPU."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    if not os.path.isfile(tracker):
        return -1, False
    with open(tracker, encoding="utf-8") as stream:
        text = stream.read().strip()
    if text == "release":
        return 0, True
    try:
        return int(text), False
    except ValueError:
        return -1, False


def directory_for_save(args, iteration: int, non_persistent_ckpt: bool = False,
                       release: bool = False) -> Optional[str]:
    """The checkpoint directory upstream's ``save_checkpoint`` writes (None: node-local
    non-persistent checkpoints, which get no manifest)."""
    from megatron.training.checkpointing import _NON_PERSISTENT_CKPT_SUBDIR, get_checkpoint_name

    save_dir = args.save
    if non_persistent_ckpt:
        if args.non_persistent_ckpt_type != "global":
            return None
        save_dir = args.non_persistent_global_ckpt_dir or os.path.join(
            save_dir, _NON_PERSISTENT_CKPT_SUBDIR
        )
    if not save_dir:
        return None
    return get_checkpoint_name(save_dir, iteration, release=release, return_base_dir=True)


def directory_for_load(load_dir: Optional[str], args) -> Optional[str]:
    """The checkpoint directory upstream's ``_load_base_checkpoint`` will read from ``load_dir``
    (None: nothing to load, or a node-local non-persistent checkpoint)."""
    from megatron.training.checkpointing import _NON_PERSISTENT_CKPT_SUBDIR, get_checkpoint_name

    kind = getattr(args, "non_persistent_ckpt_type", None)
    if kind == "local":
        return None
    iteration, release = (-1, False) if load_dir is None else _read_tracker(load_dir)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    if kind == "global":
        non_persistent_dir = args.non_persistent_global_ckpt_dir or (
            None if load_dir is None else os.path.join(load_dir, _NON_PERSISTENT_CKPT_SUBDIR)
        )
        if non_persistent_dir is not None:
            non_persistent_iteration, _ = _read_tracker(non_persistent_dir)
            if non_persistent_iteration != -1 and non_persistent_iteration >= iteration:
                return get_checkpoint_name(non_persistent_dir, non_persistent_iteration,
                                           return_base_dir=True)
    if load_dir is None or (iteration == -1 and not release):
        return None
    return get_checkpoint_name(load_dir, iteration, release=release, return_base_dir=True)


def expect_async_save(directory: Optional[str]) -> None:
    """The next asynchronous save request scheduled writes ``directory``."""
    global _pending_async
    _pending_async = directory


def on_async_save_scheduled(request) -> None:
    """Give the request a finalize step that starts the manifest once every rank has written
    its files. Finalize steps run in order and the checkpoint's own (the coordinator writes the
    torch_dist ``.metadata`` there) come first; a request whose steps were moved to a later one
    (upstream does so for a logits flush) is skipped, so that the later one takes it."""
    global _pending_async
    if _pending_async is None or not getattr(request, "finalize_fns", None):
        return
    directory, _pending_async = _pending_async, None
    request.add_finalize_fn(lambda: writer.start(directory))
