"""Checkpoint integrity manifests: written after a save (synchronous and asynchronous, through
the patches of upstream's save path), verified before a load on every rank, and offline by
tools/verify_checkpoint.py. A flipped byte in any file of a real torch_dist checkpoint is
reported at load with the file's name."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest

from megatron.bounded.training import checkpoint_integrity as integrity
from megatron.bounded.training import checkpoint_manifest as manifest
from megatron.bounded.upstream.checkpointing import (
    checkpoint_manifest_after_save,
    checkpoint_manifest_when_async_save_completes,
    verify_checkpoint_before_load,
)
from tests.unit.distributed import run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[3]
TOOL = REPO_ROOT / "tools" / "verify_checkpoint.py"


def fake_checkpoint(root: Path) -> Path:
    """A directory shaped like a 2-rank torch_dist checkpoint (contents are arbitrary bytes)."""
    checkpoint = root / "iter_0000007"
    (checkpoint / "sub").mkdir(parents=True)
    files = {
        ".metadata": b"metadata" * 10,
        "common.pt": b"common" * 50,
        "__0_0.distcp": bytes(range(256)) * 40,
        "__1_0.distcp": bytes(reversed(range(256))) * 40,
        "__1_1.distcp": b"\x00" * 3000,
        "sub/model_optim_rng.pt": b"legacy" * 30,
    }
    for name, data in files.items():
        (checkpoint / name).write_bytes(data)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    return checkpoint


def flip_byte(path: Path, offset: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def write_two_rank_manifest(checkpoint: Path) -> None:
    for rank in (0, 1):
        manifest.write_part(str(checkpoint), rank, 2)


FILES = [".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp", "__1_1.distcp",
         "sub/model_optim_rng.pt"]


def test_each_rank_checksums_its_own_shard_files_and_rank_0_the_rest():
    assert manifest.owner_rank("__3_0.distcp", 8) == 3
    assert manifest.owner_rank("optimizer__3_12.distcp", 8) == 3
    assert manifest.owner_rank("__9_0.distcp", 8) == 0  # written by a rank the job no longer has
    assert manifest.owner_rank(".metadata", 8) == 0
    assert manifest.owner_rank("mp_rank_01/model_optim_rng.pt", 8) == 0


def test_parts_cover_every_file_exactly_once(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    read = manifest.read_manifest(str(checkpoint))
    assert sorted(read.files) == sorted(FILES)
    assert sorted(read.checksums) == sorted(FILES)
    assert read.problems == []
    report = manifest.verify_share(str(checkpoint), read)
    assert report.mismatches == []
    assert report.checked_files == len(FILES)
    # two verifying ranks split the files between them, together all of them
    shares = [manifest.verify_share(str(checkpoint), read, rank, 2) for rank in (0, 1)]
    assert sum(share.checked_files for share in shares) == len(FILES)
    assert all(share.checked_files for share in shares)


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_is_reported_with_the_file_name(tmp_path, name):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    flip_byte(checkpoint / name)
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert [relpath for relpath, _ in report.mismatches] == [name]
    assert "CRC-32" in report.mismatches[0][1]
    message = manifest.describe_mismatches(str(checkpoint), report)
    assert name in message and "--no-verify-checkpoint" in message


def test_blocks_are_hashed_in_parallel_and_a_flip_names_its_byte_range(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 1000)
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    read = manifest.read_manifest(str(checkpoint))
    assert read.block_bytes == 1000
    # 10,240 bytes in blocks of 1,000: 11 CRCs, each of its block alone
    crcs = read.checksums["__0_0.distcp"]["crc32"]
    data = (checkpoint / "__0_0.distcp").read_bytes()
    assert crcs == [f"{zlib.crc32(data[i:i + 1000]):08x}" for i in range(0, len(data), 1000)]
    one, many = (manifest.block_checksums([str(checkpoint / "__0_0.distcp")], threads=n)
                 for n in (1, 4))
    assert one == many
    flip_byte(checkpoint / "__0_0.distcp", offset=4321)
    # verified in the manifest's blocks, whatever this version writes
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 4096)
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert report.mismatches == [("__0_0.distcp", "CRC-32 differs from bytes 4,000 on (1 block(s))")]


def archive_checkpoint(root: Path, compute_crc32: bool = True) -> tuple[Path, int]:
    """A checkpoint whose shard file is torch.save archives end to end, as torch_dist writes it,
    one of them a 2 MiB tensor; returns (checkpoint, the tensor's byte count)."""
    import io

    import torch
    from torch.utils.serialization import config

    checkpoint = root / "iter_0000003"
    checkpoint.mkdir(parents=True)
    pieces = []
    before = config.save.compute_crc32
    config.save.compute_crc32 = compute_crc32
    try:
        for obj in (torch.arange(10), torch.ones(512, 1024), {"step": 3}):
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            pieces.append(buffer.getvalue())
    finally:
        config.save.compute_crc32 = before
    (checkpoint / "__0_0.distcp").write_bytes(b"".join(pieces))
    (checkpoint / ".metadata").write_bytes(b"metadata" * 10)
    return checkpoint, 512 * 1024 * 4


def test_archive_records_keep_their_crcs_and_the_save_reads_only_the_rest(tmp_path, monkeypatch):
    checkpoint, tensor_bytes = archive_checkpoint(tmp_path)
    shard = checkpoint / "__0_0.distcp"
    size = shard.stat().st_size
    hashed = []
    crc_of_ranges = manifest._crc_of_ranges
    monkeypatch.setattr(manifest, "_crc_of_ranges", lambda path, ranges: (
        hashed.append((os.path.basename(path), sum(length for _, length in ranges)))
        or crc_of_ranges(path, ranges)))
    manifest.write_part(str(checkpoint))
    entry = manifest.read_manifest(str(checkpoint)).checksums["__0_0.distcp"]
    [(offset, length, crc)] = entry["records"]
    assert length == tensor_bytes
    assert crc == f"{zlib.crc32(shard.read_bytes()[offset:offset + length]):08x}"
    # writing the manifest read the shard's bytes outside the tensor, once
    assert hashed == [("__0_0.distcp", size - tensor_bytes), (".metadata", 80)]
    monkeypatch.setattr(manifest, "_crc_of_ranges", crc_of_ranges)
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert report.mismatches == [] and report.checked_files == 2
    flip_byte(shard, offset=offset + length // 2)
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert report.mismatches == [("__0_0.distcp", f"CRC-32 of bytes {offset:,} to "
                                  f"{offset + length:,} (one record of its archives) differs")]
    flip_byte(shard, offset=offset + length // 2)
    flip_byte(shard, offset=40)  # in the first archive's header
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert [reason for _, reason in report.mismatches] == [
        "CRC-32 of the bytes between its records (archive headers and directories, small "
        "records) differs"]


def test_archives_saved_without_crcs_are_hashed_by_the_manifest(tmp_path):
    checkpoint, tensor_bytes = archive_checkpoint(tmp_path, compute_crc32=False)
    manifest.write_part(str(checkpoint))
    entry = manifest.read_manifest(str(checkpoint)).checksums["__0_0.distcp"]
    assert entry["records"] == []  # the archives' CRC fields are 0: none is taken
    flip_byte(checkpoint / "__0_0.distcp", offset=(checkpoint / "__0_0.distcp").stat().st_size // 2)
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert [relpath for relpath, _ in report.mismatches] == ["__0_0.distcp"]


def test_first_format_manifests_are_still_verified(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    for rank in (0, 1):  # rewrite both parts as the first format wrote them
        path = checkpoint / manifest.MANIFEST_DIR / manifest.part_name(rank)
        part = json.loads(path.read_text())
        part["format"] = 1
        part.pop("block_bytes")
        for relpath in part["checksums"]:
            size, crc = manifest.checksum(str(checkpoint / relpath))
            part["checksums"][relpath] = {"size": size, "crc32": crc}
        path.write_text(json.dumps(part))
    read = manifest.read_manifest(str(checkpoint))
    assert read.block_bytes == 0
    assert manifest.verify_share(str(checkpoint), read).checked_files == len(FILES)
    flip_byte(checkpoint / "common.pt")
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert [relpath for relpath, _ in report.mismatches] == ["common.pt"]


def test_hash_threads_share_the_host_between_its_ranks(monkeypatch):
    monkeypatch.setattr(manifest.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert manifest.hash_threads() == manifest.MAX_HASH_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert manifest.hash_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert manifest.hash_threads() == 4


def test_truncated_and_missing_files_are_reported(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    data = (checkpoint / "__1_0.distcp").read_bytes()
    (checkpoint / "__1_0.distcp").write_bytes(data[:-1])
    (checkpoint / "common.pt").unlink()
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    reasons = dict(report.mismatches)
    assert reasons["common.pt"] == "missing"
    assert reasons["__1_0.distcp"].startswith(f"size {len(data) - 1} bytes")


def test_absent_manifest_is_reported_as_unverified(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    assert manifest.read_manifest(str(checkpoint)) is None
    report = manifest.verify_share(str(checkpoint), None)
    assert not report.has_manifest and "no integrity manifest" in manifest.describe_unverified(
        str(checkpoint), report)


def test_a_missing_part_is_an_error_naming_it(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    manifest.write_part(str(checkpoint), 0, 2)  # rank 1's part never written
    read = manifest.read_manifest(str(checkpoint))
    part = f"{manifest.MANIFEST_DIR}/{manifest.part_name(1)}"
    assert [relpath for relpath, _ in read.problems] == [part]
    # every rank's share reports it, whichever files the rank owns
    for rank in (0, 1):
        report = manifest.verify_share(str(checkpoint), read, rank, 2)
        assert [relpath for relpath, _ in report.mismatches] == [part]
        assert report.mismatches[0][1].startswith("missing")


def test_only_the_manifests_own_parts_are_left_out_of_it(tmp_path):
    assert manifest.is_manifest_file(f"{manifest.MANIFEST_DIR}/{manifest.part_name(3)}")
    assert manifest.is_manifest_file(f"{manifest.MANIFEST_DIR}/{manifest.part_name(1)}.tmp42")
    for other in ("bounded_manifest/part_3.json", "bounded_manifest/notes.json",
                  manifest.part_name(0), f"sub/{manifest.MANIFEST_DIR}/{manifest.part_name(0)}"):
        assert not manifest.is_manifest_file(other), other
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    (checkpoint / manifest.MANIFEST_DIR / f"{manifest.part_name(1)}.tmp42").write_text("{")
    (checkpoint / manifest.MANIFEST_DIR / "notes.json").write_text("{}")
    (checkpoint / "sub" / "added.pt").write_bytes(b"added")
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert [relpath for relpath, _ in report.mismatches] == ["bounded_manifest/notes.json",
                                                             "sub/added.pt"]
    assert all("not listed by the manifest" in reason for _, reason in report.mismatches)


def test_index_and_parts_that_disagree_name_the_file(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    index = checkpoint / manifest.MANIFEST_DIR / manifest.part_name(0)
    part = json.loads(index.read_text())
    part["files"].pop("__1_1.distcp")  # listed nowhere, its checksum still in rank 1's part
    part["files"]["gone.pt"] = 5  # listed, no checksum anywhere
    index.write_text(json.dumps(part))
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert sorted(report.mismatches) == [
        ("__1_1.distcp", "has a checksum in the manifest, but the index does not list it"),
        ("gone.pt", "listed by the index, but no part has its checksum")]


def test_a_malformed_checksum_names_its_file(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    path = checkpoint / manifest.MANIFEST_DIR / manifest.part_name(1)
    part = json.loads(path.read_text())
    part["checksums"]["__1_0.distcp"]["crc32"] = 7
    path.write_text(json.dumps(part))
    report = manifest.verify_share(str(checkpoint), manifest.read_manifest(str(checkpoint)))
    assert report.mismatches == [("__1_0.distcp", "a second or malformed checksum in "
                                  f"{manifest.MANIFEST_DIR}/{manifest.part_name(1)}")]


@pytest.mark.parametrize("text,expected", [("12\n", (12, False)), ("release", (0, True)),
                                           ("abc", None), ("", None), ("-1", None)])
def test_a_tracker_file_holds_an_iteration_or_release(tmp_path, text, expected):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(text)
    if expected is not None:
        assert manifest.read_tracker(str(tracker)) == expected
    else:
        with pytest.raises(manifest.CheckpointIntegrityError, match=f"tracker file {tracker}"):
            manifest.read_tracker(str(tracker))


# --------------------------------------------------------------------------------------------
# tools/verify_checkpoint.py
# --------------------------------------------------------------------------------------------


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_tool_exit_status_names_the_bad_file(tmp_path):
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    ok = run_tool(tmp_path)  # a save directory: its latest checkpoint
    assert ok.returncode == 0, ok.stderr
    assert f"{len(FILES)} files" in ok.stdout
    flip_byte(checkpoint / "__1_1.distcp", offset=1234)
    bad = run_tool(checkpoint)
    assert bad.returncode == 1
    assert "__1_1.distcp" in bad.stderr and "__0_0.distcp" not in bad.stderr


def test_tool_usage_errors_and_missing_manifest(tmp_path):
    assert run_tool(tmp_path / "nowhere").returncode == 2
    assert run_tool("--no-such-option", tmp_path).returncode == 2
    checkpoint = fake_checkpoint(tmp_path)
    assert run_tool(tmp_path, "--iteration", 8).returncode == 2
    unverified = run_tool(checkpoint)
    assert unverified.returncode == 1 and "no integrity manifest" in unverified.stderr
    written = run_tool(checkpoint, "--write")
    assert written.returncode == 0, written.stderr
    assert run_tool(tmp_path, "--iteration", 7).returncode == 0


def test_tool_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("not a checkpoint")
    for extra in ([], ["--write"]):  # --write would hash the directory and write a manifest
        refused = run_tool(notes, *extra)
        assert refused.returncode == 2, refused.stderr
        assert f"{notes} is not a checkpoint: it has no .metadata or metadata.json" in refused.stderr
        assert "mp_rank_*" in refused.stderr and "latest_checkpointed_iteration.txt" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert sorted(os.listdir(notes)) == ["todo.txt"]
    (tmp_path / "iter_0000003").mkdir()  # a save directory whose latest checkpoint is empty
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    refused = run_tool(tmp_path, "--write")
    assert refused.returncode == 2 and "iter_0000003 is not a checkpoint" in refused.stderr
    assert os.listdir(tmp_path / "iter_0000003") == []


# --------------------------------------------------------------------------------------------
# The patches of upstream's save and load path
# --------------------------------------------------------------------------------------------


def upstream_args(save: Path, **overrides) -> argparse.Namespace:
    values = dict(save=str(save), async_save=False, non_persistent_ckpt_type=None,
                  non_persistent_global_ckpt_dir=None, ckpt_step=None, verify_checkpoint=True)
    values.update(overrides)
    return argparse.Namespace(**values)


def fake_save(written_by_upstream):
    """An upstream-shaped ``save_checkpoint`` that writes a checkpoint and tracker file."""

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                        num_floating_point_operations_so_far, checkpointing_context=None,
                        pipeline_rank=None, expert_rank=None, tensor_rank=None,
                        pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                        train_data_iterator=None, preprocess_common_state_dict_fn=None,
                        release=False):
        written_by_upstream(iteration)

    return save_checkpoint


def test_synchronous_save_writes_the_manifest_after_upstream_returns(tmp_path, monkeypatch):
    monkeypatch.setattr("megatron.training.global_vars.get_args", lambda: upstream_args(tmp_path))
    order = []

    def upstream(iteration):
        assert not (tmp_path / f"iter_{iteration:07d}" / manifest.MANIFEST_DIR).exists()
        fake_checkpoint(tmp_path)
        order.append("saved")

    save = checkpoint_manifest_after_save(fake_save(upstream))
    save(7, None, None, None, 0, non_persistent_ckpt=False)
    integrity.wait()
    assert order == ["saved"]
    read = manifest.read_manifest(str(tmp_path / "iter_0000007"))
    assert read is not None and sorted(read.files) == sorted(FILES)


def test_asynchronous_save_writes_the_manifest_in_the_last_finalize_step(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    monkeypatch.setattr("megatron.training.global_vars.get_args",
                        lambda: upstream_args(tmp_path, async_save=True))
    scheduled = []
    schedule = checkpoint_manifest_when_async_save_completes(scheduled.append)

    def upstream(iteration):
        # upstream builds the request with its own finalize steps, then schedules it
        schedule(AsyncRequest(None, None, [lambda: fake_checkpoint(tmp_path)]))

    checkpoint_manifest_after_save(fake_save(upstream))(7, None, None, None, 0)
    [request] = scheduled
    checkpoint = tmp_path / "iter_0000007"
    assert not checkpoint.exists()  # nothing written before the request completes
    for finalize in request.finalize_fns:  # what upstream runs once every rank has written
        finalize()
    integrity.wait()
    assert sorted(manifest.read_manifest(str(checkpoint)).files) == sorted(FILES)
    # a request scheduled later without a pending save gets no step
    later = AsyncRequest(None, None, [lambda: None])
    schedule(later)
    assert len(later.finalize_fns) == 1


def test_non_persistent_local_checkpoints_get_no_manifest(tmp_path):
    args = upstream_args(tmp_path, non_persistent_ckpt_type="local")
    assert integrity.directory_for_save(args, 5, non_persistent_ckpt=True) is None
    assert integrity.directory_for_load(str(tmp_path), args) is None
    args = upstream_args(tmp_path, non_persistent_ckpt_type="global")
    assert integrity.directory_for_save(args, 5, non_persistent_ckpt=True) == str(
        tmp_path / "non_persistent" / "iter_0000005")


def test_load_resolves_the_directory_upstream_reads(tmp_path):
    fake_checkpoint(tmp_path)
    args = upstream_args(tmp_path)
    assert integrity.directory_for_load(str(tmp_path), args) == str(tmp_path / "iter_0000007")
    args.ckpt_step = 3
    assert integrity.directory_for_load(str(tmp_path), args) == str(tmp_path / "iter_0000003")
    assert integrity.directory_for_load(str(tmp_path / "empty"), upstream_args(tmp_path)) is None


def test_load_is_refused_before_upstream_reads_a_corrupt_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_verified", set())
    checkpoint = fake_checkpoint(tmp_path)
    write_two_rank_manifest(checkpoint)
    flip_byte(checkpoint / "__0_0.distcp")
    loads = []
    load = verify_checkpoint_before_load(lambda *a, **k: loads.append(a) or "loaded")
    with pytest.raises(manifest.CheckpointIntegrityError, match=r"__0_0\.distcp.*CRC-32"):
        load(str(tmp_path), upstream_args(tmp_path), rank0=True)
    assert loads == []
    # the bypass flag hands the load to upstream unchecked
    assert load(str(tmp_path), upstream_args(tmp_path, verify_checkpoint=False)) == "loaded"


def test_no_verify_checkpoint_flag_is_parsed(monkeypatch):
    from megatron.training.arguments import parse_args

    from megatron.bounded.launch.arguments import add_bounded_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base])
    assert parse_args(add_bounded_args).verify_checkpoint is True
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, "--no-verify-checkpoint"])
    assert parse_args(add_bounded_args).verify_checkpoint is False


# --------------------------------------------------------------------------------------------
# A real torch_dist checkpoint on 2 gloo ranks
# --------------------------------------------------------------------------------------------


def _real_checkpoint_body(rank, world_size, root):
    import torch
    from megatron.core import dist_checkpointing, parallel_state

    from tests.unit.training.test_dist_checkpoint import build_moe_gpt, cpu_checkpointing

    cpu_checkpointing()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        checkpoint = os.path.join(root, "iter_0000004")
        if rank == 0:
            os.makedirs(checkpoint)
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as tracker:
                tracker.write("4")
        torch.distributed.barrier()
        model = build_moe_gpt("grouped", True, seed=1)
        dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
        # this model's tensors are small: let records of 1 KiB keep their archives' CRC-32s
        manifest.RECORD_MIN_BYTES = 1024
        integrity.writer.start(checkpoint)  # what the save patch does once the save returned
        integrity.wait()
        torch.distributed.barrier()
        files = manifest.list_files(checkpoint)
        entries = manifest.read_manifest(checkpoint).checksums
        # a flipped byte in the middle of each shard's largest record, and one near its start
        flips = {name: len(name) for name in files}
        records = {name: entries[name]["records"] for name in files if entries[name].get("records")}
        for name, kept in records.items():
            offset, length, _ = max(kept, key=lambda record: record[1])
            flips[f"{name}@record"] = offset + length // 2
        load = verify_checkpoint_before_load(lambda *a, **k: "loaded by upstream")
        args = upstream_args(Path(root))
        reported = {}
        for flip, offset in flips.items():
            name = flip.split("@")[0]
            integrity._verified.clear()
            if rank == 0:
                flip_byte(Path(checkpoint) / name, offset=offset)
            torch.distributed.barrier()
            try:
                load(root, args, rank0=False)
                reported[flip] = None
            except manifest.CheckpointIntegrityError as error:
                reported[flip] = str(error)
            torch.distributed.barrier()
            if rank == 0:
                flip_byte(Path(checkpoint) / name, offset=offset)  # restore it
            torch.distributed.barrier()
        integrity._verified.clear()
        clean = load(root, args, rank0=False)
        loaded = build_moe_gpt("grouped", True, seed=2)
        loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), checkpoint))
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters()))
        return {"files": files, "reported": reported, "clean": clean, "same": same,
                "records": sorted(records),
                "archives": sorted(name for name in files if "records" in entries[name])}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("manifest"))
    return run_on_ranks(_real_checkpoint_body, 2, args=(root,), timeout_s=420, daemon=False)


def test_real_checkpoint_manifest_covers_every_rank_file(real_checkpoint):
    files = real_checkpoint[0]["files"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files)
    assert real_checkpoint[0]["clean"] == "loaded by upstream" and real_checkpoint[0]["same"]


def test_flipped_byte_in_any_real_checkpoint_file_is_named_at_load_on_every_rank(real_checkpoint):
    files = real_checkpoint[0]["files"]
    # torch_dist's shard files are checked by their archives' records
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(real_checkpoint[0]["archives"])
    assert real_checkpoint[0]["records"]
    for rank, result in enumerate(real_checkpoint):
        assert len(result["reported"]) == len(files) + len(result["records"])
        for flip, message in result["reported"].items():
            name = flip.split("@")[0]
            assert message is not None, f"rank {rank}: a flipped byte in {name} was not reported"
            assert f"  {name}: " in message and "--no-verify-checkpoint" in message, message
            others = [other for other in files if other != name and f"  {other}: " in message]
            assert not others, f"rank {rank}: {others} reported for a flip in {name}"
            if flip.endswith("@record"):
                assert "(one record of its archives) differs" in message, message


def test_the_wait_for_a_manifest_is_reported_against_its_save(tmp_path, monkeypatch, caplog):
    checkpoint = fake_checkpoint(tmp_path)
    writer = integrity._Writer()
    release = threading.Event()
    monkeypatch.setattr(manifest, "write_part", lambda *args: release.wait(5) and "part")
    caplog.set_level("INFO", logger=integrity.logger.name)
    writer.start(str(checkpoint), save_seconds=10.0)
    threading.Timer(0.3, release.set).start()
    writer.wait()
    assert len(writer.waited_seconds) == 1 and writer.waited_seconds[0] >= 0.2
    assert f"for the checkpoint manifest of {checkpoint} (" in caplog.text
    assert "% of the save's 10.0 s)" in caplog.text
    writer.wait()  # nothing running: no second wait is counted
    assert len(writer.waited_seconds) == 1
