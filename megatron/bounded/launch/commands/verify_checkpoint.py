"""Check a checkpoint directory against the integrity manifest written when it was saved.

    bounded-verify-checkpoint DIR [--iteration N] [--write]
    python tools/verify_checkpoint.py DIR ...   (the same, from a clone without installing it)

DIR is one checkpoint (``.../iter_0000100``) or a save directory (``--save``; the latest
checkpoint in ``latest_checkpointed_iteration.txt`` is checked, or ``--iteration N``). The same
check as pretrain_gpt.py before a load (megatron.bounded.training.checkpoint_manifest): every file
of the checkpoint must be listed in ``DIR/bounded_manifest/`` with its size and CRC-32, and every
part of the manifest present and consistent; files are named when they do not match.

  --iteration N   with a save directory: check iter_N instead of the latest
  --write         write a manifest for a checkpoint that has none (e.g. saved before manifests
                  existed), from the files as they are now, then check it

Exit status: 0 every file matches, 1 a file does not match, the manifest is incomplete or
inconsistent, the checkpoint has none, or the tracker file is corrupt, 2 usage error (no such
directory, a directory that is not a checkpoint, naming what it lacks, bad flags).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron.bounded.training import checkpoint_manifest as manifest
from megatron.bounded.training.resume_check import TRACKER_FILE as TRACKER
from megatron.bounded.training.resume_check import not_a_checkpoint
from megatron.bounded.units import GiB


def resolve(directory: str, iteration) -> str:
    """The checkpoint directory to check; raises ValueError for a usage error (no such
    directory, or one that is neither a checkpoint nor a save directory) and
    CheckpointIntegrityError for a corrupt tracker file."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no such directory")
    tracker = os.path.join(directory, TRACKER)
    if iteration is None and not os.path.isfile(tracker):
        checkpoint = directory  # a checkpoint itself
    else:
        if iteration is None:
            iteration, release = manifest.read_tracker(tracker)
            name = "release" if release else f"iter_{iteration:07d}"
        else:
            name = f"iter_{iteration:07d}"
        checkpoint = os.path.join(directory, name)
        if not os.path.isdir(checkpoint):
            raise ValueError(f"{checkpoint}: no such checkpoint")
    why = not_a_checkpoint(checkpoint)
    if why is not None:  # --write would hash whatever the directory holds
        save_dir = f", nor a --save directory (no {TRACKER})" if checkpoint == directory else ""
        raise ValueError(f"{why}{save_dir}: pass a checkpoint (iter_NNNNNNN) or the --save "
                         "directory of a run")
    return checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Check a checkpoint against its integrity manifest (exit 0 ok, 1 mismatch, "
        "2 usage)."
    )
    parser.add_argument("directory", help="a checkpoint (iter_N) or a save directory")
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--write", action="store_true",
                        help="write a manifest first if the checkpoint has none")
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    try:
        checkpoint = resolve(options.directory, options.iteration)
    except ValueError as error:
        print(f"verify_checkpoint: {error}", file=sys.stderr)
        return 2
    except manifest.CheckpointIntegrityError as error:
        print(f"verify_checkpoint: {error}", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        if options.write and manifest.read_manifest(checkpoint) is None:
            manifest.write_part(checkpoint)
            print(f"wrote {os.path.join(checkpoint, manifest.MANIFEST_DIR)}")
        report = manifest.verify_share(checkpoint, manifest.read_manifest(checkpoint))
    except manifest.READ_ERRORS as error:
        print(f"verify_checkpoint: {checkpoint}: unreadable manifest: {error}", file=sys.stderr)
        return 1
    if report.mismatches:
        print(manifest.describe_mismatches(checkpoint, report, bypass="--no-verify-checkpoint "
                                           "(pretrain_gpt.py)"), file=sys.stderr)
        return 1
    unverified = manifest.describe_unverified(checkpoint, report)
    if unverified is not None:
        print(unverified.replace("loaded without verification", "not verified"), file=sys.stderr)
        return 1
    print(f"{checkpoint}: {report.checked_files} files ({report.checked_bytes / GiB:.2f} GiB) "
          f"match the manifest ({time.monotonic() - started:.1f} s)")
    return 0
