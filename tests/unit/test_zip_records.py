"""The records of files made of torch.save archives, with the CRC-32s the archives recorded:
equal to the zip reader's view and to the CRC-32 of the bytes; anything else is refused (None)."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch

from megatron.bounded.zip_records import stored_records


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


OBJECTS = [torch.randn(70_000), {"w": torch.arange(12), "name": "x"}, torch.empty(0),
           torch.ones(5, 3, dtype=torch.bfloat16), [1, 2, 3]]


def test_a_chain_of_archives_gives_every_record_with_its_crc(tmp_path):
    archives = [saved(obj) for obj in OBJECTS]
    data = b"".join(archives)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    records = stored_records(str(path))
    assert records is not None
    expected, start = [], 0
    for archive in archives:  # the zip reader's view of each archive, shifted to its place
        for info in zipfile.ZipFile(io.BytesIO(archive)).infolist():
            local = archive[info.header_offset:info.header_offset + 30]
            name_length = int.from_bytes(local[26:28], "little")
            extra_length = int.from_bytes(local[28:30], "little")
            at = start + info.header_offset + 30 + name_length + extra_length
            expected.append((at, info.compress_size, info.CRC))
        start += len(archive)
    assert records == sorted(expected)
    assert all(zlib.crc32(data[offset:offset + length]) == crc for offset, length, crc in records)
    # the tensor of 70,000 floats is one record of 280,000 bytes
    assert max(length for _, length, _ in records) == 280_000


def compressed_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("a", b"abc" * 1000)
    return buffer.getvalue()


def commented_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a", b"abc")
        archive.comment = b"note"
    return buffer.getvalue()


@pytest.mark.parametrize("make", [
    lambda: b"",
    lambda: b"not an archive" * 10,
    lambda: b"x" + saved(OBJECTS[0]),  # a byte before the first archive
    lambda: saved(OBJECTS[0])[:-1],  # truncated
    lambda: saved(OBJECTS[1]) + b"\0",  # a byte after the last archive
    compressed_zip,
    commented_zip,
], ids=["empty", "text", "leading byte", "truncated", "trailing byte", "compressed",
        "comment"])
def test_anything_but_stored_archives_end_to_end_is_refused(tmp_path, make):
    path = tmp_path / "file"
    path.write_bytes(make())
    assert stored_records(str(path)) is None


def test_a_plain_zip_without_zip64_records_is_read(tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a", b"abc" * 100)
        archive.writestr("b", b"")
    path = tmp_path / "plain.zip"
    path.write_bytes(buffer.getvalue() * 2)
    records = stored_records(str(path))
    assert [length for _, length, _ in records] == [300, 0, 300, 0]
    assert records[0][2] == zlib.crc32(b"abc" * 100)
