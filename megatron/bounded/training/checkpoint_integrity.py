"""Checkpoint integrity during training: the manifest written in the background after each save,
the ranks' agreed check before each load, and their agreement on a load that failed.

Hashing runs off the training loop: it starts when the save has completed on every rank (after
upstream's synchronous save returns, or in the finalize step of an asynchronous save) and is
joined before the next save starts and when training ends. A job killed while hashing leaves a
manifest with a part missing, which a load refuses like any other incomplete manifest.

Before a checkpoint is loaded, the ranks check it together (each the files of the same rule,
:func:`megatron.bounded.training.checkpoint_manifest.verify_share`) and gather what they found,
so that every rank raises :class:`CheckpointIntegrityError` naming the same files before any of
them loads. Upstream's load itself can fail on some ranks only (a shard file only they read):
:func:`agreed_load` makes every rank raise then, naming the file where the torch_dist layout
shows it. ``--no-verify-checkpoint`` skips the check before the load, not the agreement after it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from megatron.bounded.training import checkpoint_manifest as manifest
from megatron.bounded.training.checkpoint_manifest import CheckpointIntegrityError
from megatron.bounded.units import GiB

logger = logging.getLogger(__name__)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value) -> Optional[list]:
    """``value`` of every rank (all_gather_object over the default process group); None when
    this process is not one of several ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _before_process_group() -> bool:
    """A rank of a multi-rank job whose process group does not exist yet (e.g. reading the
    arguments with --use-checkpoint-args): it cannot agree with the others, so it leaves the check
    to the load that follows."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    return not initialized and int(os.environ.get("WORLD_SIZE", "1")) > 1


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
            path = manifest.write_part(directory, rank, world_size)
        except Exception as error:  # noqa: BLE001 - a manifest must never stop training
            self.failures.append(f"{directory}: {error!r}")
            logger.warning("checkpoint manifest of %s not written on rank %d: %r (the checkpoint "
                           "itself is complete, but a load will refuse it for the missing part: "
                           "load an earlier checkpoint, or this one with %s)",
                           directory, rank, error, manifest.BYPASS_FLAG)
            return
        self.written.append(path)
        if rank == 0:
            logger.info("checkpoint manifest of %s written in %.1f s in the background (%d "
                        "threads)", directory, time.monotonic() - started, manifest.hash_threads())

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


def verify_before_load(directory: str, enabled: bool = True) -> Optional[manifest.Report]:
    """Check ``directory`` on every rank (each its share; the reports are gathered) and raise
    :class:`CheckpointIntegrityError` on all ranks if a file, or the manifest itself, does not
    match. Once per directory and process; returns the merged report (None when skipped)."""
    if not enabled or directory in _verified or not os.path.isdir(directory):
        return None
    if _before_process_group():
        return None
    rank, world_size = _rank_and_world()
    started = time.monotonic()
    try:
        local = manifest.verify_share(directory, manifest.read_manifest(directory), rank,
                                      world_size)
    except manifest.READ_ERRORS as error:
        local = manifest.Report(mismatches=[(manifest.MANIFEST_DIR,
                                             f"unreadable manifest: {error!r}")])
    reports = _gather(local) or [local]
    merged = reports[0]
    for report in reports[1:]:
        merged = merged.merge(report)
    merged.mismatches = list(dict.fromkeys(merged.mismatches))  # a manifest's problem: once
    if merged.mismatches:
        raise CheckpointIntegrityError(manifest.describe_mismatches(directory, merged))
    _verified.add(directory)
    if rank == 0:
        note = manifest.describe_unverified(directory, merged)
        if note is not None:
            logger.warning(note)
            print(f"[bounded] WARNING: {note}", flush=True)
        else:
            print(f"[bounded] checkpoint {directory}: {merged.checked_files} files "
                  f"({merged.checked_bytes / GiB:.2f} GiB) match the manifest "
                  f"({time.monotonic() - started:.1f} s)", flush=True)
    return merged


def _summary(error: BaseException) -> str:
    """The first and last lines of ``error`` (torch's checkpoint errors carry whole tracebacks)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or ["(no message)"]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"
    return f"{type(error).__name__}: {text}"


def agreed_load(directory: Optional[str], load: Callable):
    """``load()`` on this rank, then every rank learns whether it failed anywhere: if it did,
    every rank raises :class:`CheckpointIntegrityError` naming the failed ranks, their errors and
    the files of ``directory`` that are missing or truncated (otherwise one rank would stop and
    the others go on with a model the checkpoint did not fully restore, or wait forever). An exit
    taken by every rank (upstream's ``--exit-on-missing-checkpoint``) stays an exit."""
    try:
        result, failure = load(), None
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # torch's CheckpointException is a BaseException, and
        result, failure = None, error  # upstream exits (status 0) when a legacy file is corrupt
    local = None if failure is None else (_summary(failure), isinstance(failure, SystemExit))
    failures = _gather(local)
    if failures is None or not any(failures) or all(one and one[1] for one in failures):
        if failure is not None:
            raise failure
        return result
    where = "\n".join(f"  rank {rank}: {one[0]}" for rank, one in enumerate(failures) if one)
    found = manifest.layout_mismatches(directory) if directory else []
    files = (f"files that do not match its {manifest.TORCH_DIST_METADATA}:\n"
             f"{manifest.listed(found)}" if found else
             f"no file is missing or shorter than its {manifest.TORCH_DIST_METADATA} says")
    raise CheckpointIntegrityError(
        f"loading checkpoint {directory} failed on {sum(map(bool, failures))} of "
        f"{len(failures)} rank(s):\n{where}\n{files}\nRestore the named file(s) from a copy or "
        "load another checkpoint (e.g. --ckpt-step of an earlier save); every rank stops here."
    ) from failure


# --------------------------------------------------------------------------------------------
# Which directory upstream's save writes and its load reads (megatron.training.checkpointing)
# --------------------------------------------------------------------------------------------

_pending_async: Optional[str] = None


def _read_tracker(checkpoints_path: str) -> tuple[int, bool]:
    """(iteration, release) from ``latest_checkpointed_iteration.txt``; (-1, False) without it.
    Read here: upstream's reader all-reduces the value on the GPU, and exits with status 0 when
    the file is corrupt, where this raises naming it."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    if not os.path.isfile(tracker):
        return -1, False
    return manifest.read_tracker(tracker)


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
