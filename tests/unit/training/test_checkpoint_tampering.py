"""Tampered copies of one real torch_dist checkpoint (2 gloo ranks, saved once for the module),
each loaded through the patched ``_load_base_checkpoint`` with megatron-core's own torch_dist load
behind it, and checked by tools/verify_checkpoint.py: every rank raises naming the file, the tool
exits 1 naming it. Covers files the manifest does not list, lost or inconsistent manifest parts,
edited checksums, truncation with no manifest or with ``--no-verify-checkpoint`` (the ranks agree
on a failed load), and a corrupt tracker file."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.bounded.training import checkpoint_integrity as integrity
from megatron.bounded.training import checkpoint_manifest as manifest
from megatron.bounded.upstream.checkpointing import verify_checkpoint_before_load
from tests.unit.distributed import run_on_ranks
from tests.unit.training.test_checkpoint_manifest import TOOL, flip_byte, upstream_args

ITERATION = "iter_0000004"
TRACKER = "latest_checkpointed_iteration.txt"
SHARD_0, SHARD_1 = "__0_0.distcp", "__1_0.distcp"
INDEX, PART_1 = manifest.part_relpath(0), manifest.part_relpath(1)


def _edit_part(checkpoint: Path, rank: int, edit) -> None:
    path = checkpoint / manifest.part_relpath(rank)
    part = json.loads(path.read_text())
    edit(part)
    path.write_text(json.dumps(part))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _swap(first: Path, second: Path) -> None:
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


def _unlisted(checkpoint: Path, also_its_checksum: bool) -> None:
    """Rank 1's shard taken out of the index (and out of its part), then corrupted."""
    _edit_part(checkpoint, 0, lambda part: part["files"].pop(SHARD_1))
    if also_its_checksum:
        _edit_part(checkpoint, 1, lambda part: part["checksums"].pop(SHARD_1))
    flip_byte(checkpoint / SHARD_1, offset=100)


# name: (what is done to the checkpoint directory, the file named, --verify-checkpoint)
TAMPERINGS = {
    "shard out of the index, corrupted": (lambda c: _unlisted(c, False), SHARD_1, True),
    "shard out of the manifest, corrupted": (lambda c: _unlisted(c, True), SHARD_1, True),
    "file added": (lambda c: (c / "extra.pt").write_bytes(b"x" * 10), "extra.pt", True),
    "file added beside the parts": (
        lambda c: (c / manifest.MANIFEST_DIR / "notes.json").write_text("{}"),
        f"{manifest.MANIFEST_DIR}/notes.json", True),
    "rank 1's part deleted": (lambda c: ((c / PART_1).unlink(), flip_byte(c / SHARD_1)),
                              PART_1, True),
    "index deleted": (lambda c: ((c / INDEX).unlink(), flip_byte(c / SHARD_1)), INDEX, True),
    "index's world size edited": (
        lambda c: (_edit_part(c, 0, lambda part: part.update(world_size=1)),
                   flip_byte(c / SHARD_1)), PART_1, True),
    "rank 1's part broken": (lambda c: (c / PART_1).write_text("{"), PART_1, True),
    "shard truncated": (lambda c: _truncate(c / SHARD_1), SHARD_1, True),
    "shard deleted": (lambda c: (c / SHARD_0).unlink(), SHARD_0, True),
    "shards swapped": (lambda c: _swap(c / SHARD_0, c / SHARD_1), SHARD_0, True),
    "no manifest, shard truncated": (
        lambda c: (shutil.rmtree(c / manifest.MANIFEST_DIR), _truncate(c / SHARD_1)),
        SHARD_1, True),
    "shard truncated, no verification": (lambda c: _truncate(c / SHARD_1), SHARD_1, False),
    "no manifest, shard truncated, no verification": (
        lambda c: (shutil.rmtree(c / manifest.MANIFEST_DIR), _truncate(c / SHARD_1)),
        SHARD_1, False),
    "tracker corrupt": (lambda c: (c.parent / TRACKER).write_text("abc"), TRACKER, True),
    "tracker corrupt, no verification": (lambda c: (c.parent / TRACKER).write_text("abc"),
                                         TRACKER, False),
}


def _checksum_edits(checkpoint: Path) -> dict:
    """One tampering per checksum the manifest records: that CRC-32 changed in its part."""
    edits = {}
    for rank in (0, 1):
        part = json.loads((checkpoint / manifest.part_relpath(rank)).read_text())
        for relpath, entry in part["checksums"].items():
            keys = ([("records", i, 2) for i in range(len(entry["records"]))] + [("rest_crc32",)]
                    if "records" in entry else [("crc32", i) for i in range(len(entry["crc32"]))])
            for key in keys:
                edits[f"checksum of {relpath} edited ({'/'.join(map(str, key))})"] = (
                    lambda c, rank=rank, relpath=relpath, key=key: _edit_part(
                        c, rank, lambda part: _flip_crc(part["checksums"][relpath], key)),
                    relpath, True)
    return edits


def _flip_crc(entry, key) -> None:
    for step in key[:-1]:
        entry = entry[step]
    entry[key[-1]] = f"{int(entry[key[-1]], 16) ^ 1:08x}"


def _load_each_copy(rank, root, model, cases) -> dict:
    """Load a tampered copy of ``root`` per case through the patched load (megatron-core's
    torch_dist load behind it); {case: the error raised on this rank, or None; as ("before the
    load", error) when upstream's load was not called}."""
    import torch
    from megatron.core import dist_checkpointing

    loaded = []  # the copies upstream's load was called for on this rank

    def upstream(load_dir, args, rank0=False, **kwargs):
        checkpoint = os.path.join(load_dir, ITERATION)
        loaded.append(load_dir)
        return dist_checkpointing.load(model.sharded_state_dict(), checkpoint), checkpoint

    load = verify_checkpoint_before_load(upstream)
    reported = {}
    for number, (name, (tamper, _, verify)) in enumerate(cases.items()):
        copy = os.path.join(f"{root}-copies", f"case{number:02d}")
        if rank == 0:
            shutil.copytree(root, copy)
            tamper(Path(copy) / ITERATION)
        torch.distributed.barrier()
        try:
            load(copy, upstream_args(Path(copy), verify_checkpoint=verify))
            reported[name] = None
        except manifest.CheckpointIntegrityError as error:
            reported[name] = str(error)
        except BaseException as error:  # noqa: BLE001 - anything else is reported, not raised
            reported[name] = f"not refused by the manifest: {error!r}"
        if copy not in loaded:
            reported[name] = ("before the load", reported[name])
        torch.distributed.barrier()
    return reported


def _one_rank_failure(rank, root) -> str:
    """A load that fails on rank 1 only (it alone reads the truncated shard) while rank 0
    returns: the error every rank raises."""
    import torch

    copy = os.path.join(f"{root}-copies", "one-rank")
    if rank == 0:
        shutil.copytree(root, copy)
        _truncate(Path(copy) / ITERATION / SHARD_1)
    torch.distributed.barrier()

    def upstream(load_dir, args, rank0=False, **kwargs):
        if rank == 1:
            torch.load(os.path.join(load_dir, ITERATION, SHARD_1), weights_only=True)
        return "loaded on this rank"

    load = verify_checkpoint_before_load(upstream)
    try:
        load(copy, upstream_args(Path(copy), verify_checkpoint=False))
    except manifest.CheckpointIntegrityError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - this rank alone failed: reported, not raised
        return f"failed on this rank only: {error!r}"
    return "returned normally"


def _exits(rank) -> dict:
    """Upstream's load exiting (as it does, with status 0, on a corrupt legacy file) on rank 1
    only, and on every rank: {case: what this rank saw}."""
    outcomes = {}
    for name, exiting in (("rank 1 exits", {1}), ("every rank exits", {0, 1})):
        def upstream(load_dir, args, rank0=False, exiting=exiting, **kwargs):
            if rank in exiting:
                sys.exit()
            return "loaded"

        try:
            verify_checkpoint_before_load(upstream)(None, upstream_args(Path("unused")))
            outcomes[name] = "returned"
        except manifest.CheckpointIntegrityError as error:
            outcomes[name] = str(error)
        except SystemExit:
            outcomes[name] = "exited"
    return outcomes


def _tampering_body(rank, world_size, root):
    import torch
    from megatron.core import dist_checkpointing, parallel_state

    from tests.unit.training.test_dist_checkpoint import build_moe_gpt, cpu_checkpointing

    cpu_checkpointing()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        checkpoint = os.path.join(root, ITERATION)
        if rank == 0:
            os.makedirs(checkpoint)
            Path(root, TRACKER).write_text("4")
        torch.distributed.barrier()
        model = build_moe_gpt("grouped", True, seed=1)
        dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
        manifest.RECORD_MIN_BYTES = 1024  # small tensors: records keep their archives' CRCs
        integrity.writer.start(checkpoint)
        integrity.wait()
        torch.distributed.barrier()
        cases = {"untouched": (lambda c: None, None, True), **TAMPERINGS,
                 **_checksum_edits(Path(checkpoint))}
        reported = _load_each_copy(rank, root, build_moe_gpt("grouped", True, seed=2), cases)
        return {"reported": reported, "one_rank": _one_rank_failure(rank, root),
                "exits": _exits(rank),
                "named": {name: case[1] for name, case in cases.items()},
                "files": manifest.list_files(checkpoint)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tampering") / "save")
    results = run_on_ranks(_tampering_body, 2, args=(root,), timeout_s=420, daemon=False)
    return root, results


def _tool():
    spec = importlib.util.spec_from_file_location("verify_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(tampered) -> list:
    return list(tampered[1][0]["named"].items())


def test_every_tampering_is_refused_at_load_on_every_rank_naming_the_file(tampered):
    root, results = tampered
    named = results[0]["named"]
    assert any(name.startswith("checksum of") for name in named)  # the edits were generated
    for rank, result in enumerate(results):
        assert result["reported"]["untouched"] is None, result["reported"]["untouched"]
        for name, relpath in named.items():
            if relpath is None:
                continue
            message = _message(result["reported"][name])
            assert message is not None, f"rank {rank}: {name}: loaded"
            assert not message.startswith("not refused"), f"rank {rank}: {name}: {message}"
            assert relpath in message, f"rank {rank}: {name}: {relpath} not named in {message}"


def _message(reported):
    return reported[1] if isinstance(reported, tuple) else reported


def test_with_verification_every_rank_refuses_before_any_of_them_loads(tampered):
    _, results = tampered
    for rank, result in enumerate(results):
        assert not isinstance(result["reported"]["untouched"], tuple)  # upstream loaded it
        for name, (_, _, verify) in TAMPERINGS.items():
            before = isinstance(result["reported"][name], tuple)
            assert before == verify or name.startswith("tracker"), f"rank {rank}: {name}"
        for name in ("rank 1's part deleted", "index deleted", "index's world size edited",
                     "rank 1's part broken", "shard out of the index, corrupted"):
            message = _message(result["reported"][name])
            assert "does not match the manifest written when it was saved" in message, message


def test_an_edited_checksum_names_its_own_file_only(tampered):
    _, results = tampered
    files = results[0]["files"]
    for rank, result in enumerate(results):
        for name, relpath in results[0]["named"].items():
            if not name.startswith("checksum of"):
                continue
            message = _message(result["reported"][name])
            blamed = [other for other in files if f"  {other}: " in message]
            assert blamed == [relpath], f"rank {rank}: {name}: blamed {blamed}:\n{message}"


def test_a_load_failing_on_one_rank_fails_on_every_rank_naming_the_file(tampered):
    _, results = tampered
    for rank, result in enumerate(results):
        message = result["one_rank"]
        assert "failed on 1 of 2 rank(s)" in message and "rank 1: " in message, message
        assert f"  {SHARD_1}: size" in message, message


def test_an_exit_on_one_rank_fails_every_rank_and_one_on_every_rank_stays_an_exit(tampered):
    _, results = tampered
    for rank, result in enumerate(results):
        message = result["exits"]["rank 1 exits"]
        assert "failed on 1 of 2 rank(s)" in message and "rank 1: SystemExit" in message, message
        assert result["exits"]["every rank exits"] == "exited"


def test_the_tool_says_what_the_load_says(tampered, capsys):
    root, _ = tampered
    tool = _tool()
    assert tool.main([os.path.join(f"{root}-copies", "case00")]) == 0
    for number, (name, relpath) in enumerate(_cases(tampered)):
        if relpath is None:
            continue
        capsys.readouterr()
        status = tool.main([os.path.join(f"{root}-copies", f"case{number:02d}")])
        err = capsys.readouterr().err
        assert status == 1 and relpath in err, f"{name}: exit {status}, {relpath} not in:\n{err}"


_LOAD_SCRIPT = """
import argparse, sys
if sys.argv[2] == "patched":
    from megatron.bounded.upstream import patches
    patches.apply_patches()
from megatron.training import checkpointing
args = argparse.Namespace(non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None,
                          ckpt_step=None, verify_checkpoint=True, exit_on_missing_checkpoint=False)
checkpointing._load_base_checkpoint(sys.argv[1], args, rank0=True)
print("loaded")
"""


def test_a_corrupt_tracker_file_exits_non_zero_naming_it(tmp_path):
    (tmp_path / ITERATION).mkdir()
    tracker = tmp_path / TRACKER
    tracker.write_text("abc")
    runs = {how: subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(tmp_path), how],
                                capture_output=True, text=True, timeout=300,
                                cwd=Path(TOOL).parents[1])
            for how in ("upstream", "patched")}
    # upstream alone reports the error and exits with status 0, as if the job had succeeded
    assert runs["upstream"].returncode == 0 and "Invalid metadata file" in runs["upstream"].stdout
    patched = runs["patched"]
    assert patched.returncode != 0 and "loaded" not in patched.stdout
    assert f"tracker file {tracker} holds 'abc'" in patched.stderr, patched.stderr[-2000:]
