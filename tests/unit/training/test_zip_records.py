"""The records of files made of torch.save archives, with the CRC-32s the archives recorded:
equal to the zip reader's view and to the CRC-32 of the bytes; anything else is refused (None)."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import torch

from megatron.bounded.training.zip_records import stored_records


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


def zip64_archive(data: bytes) -> bytes:
    """One stored record whose central-directory sizes and offset are in the zip64 extra field
    (as torch.save writes records of 4 GiB and more), built by hand."""
    import struct

    name = b"archive/data/0"
    crc = zlib.crc32(data)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF, 0xFFFFFFFF,
                        len(name), 20) + name + struct.pack("<HHQQ", 1, 16, len(data), len(data))
    extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), 0)
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, crc, 0xFFFFFFFF,
                          0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0, 0xFFFFFFFF) + name + extra
    cd_offset = len(local) + len(data)
    eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, 1, 1, len(central),
                         cd_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, cd_offset + len(central), 1)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return local + data + central + eocd64 + locator + eocd


def test_zip64_sizes_and_offsets_are_read_from_the_extra_field(tmp_path):
    data = bytes(range(200)) * 7
    archive = zip64_archive(data)
    assert zipfile.ZipFile(io.BytesIO(archive)).read("archive/data/0") == data  # a valid zip
    path = tmp_path / "big.distcp"
    path.write_bytes(saved(OBJECTS[1]) + archive)
    records = stored_records(str(path))
    offset = len(saved(OBJECTS[1])) + 30 + len("archive/data/0") + 20
    assert records[-1] == (offset, len(data), zlib.crc32(data))
