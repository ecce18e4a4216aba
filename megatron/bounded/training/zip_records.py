"""Where the data of a file made of ``torch.save`` archives lies, with the CRC-32 that each
archive already recorded for it.

``torch.save`` writes a zip archive whose records are stored uncompressed and carry the CRC-32
of their bytes, computed while saving. A torch_dist shard file (``__R_K.distcp``) is such
archives one after another, one per saved tensor or object, and ``common.pt`` is one archive.
The checkpoint manifest takes those CRC-32s instead of reading the bytes again after the save:
for such a file only the archives' directories and the bytes between the records are read.

:func:`stored_records` walks the archives from the end of the file backwards (each ends with its
end-of-central-directory record, which locates its directory and its start) and returns
``[(offset, length, crc32), ...]`` of every record's data, or ``None`` as soon as anything is not
exactly that layout (a compressed, encrypted or overlapping record, a comment, an extensible
zip64 field, a byte that is no archive's): the caller then hashes the file itself.
"""

from __future__ import annotations

import os
import struct
from typing import List, Optional, Tuple

Record = Tuple[int, int, int]  # (offset in the file, length, CRC-32 recorded by the archive)

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_EOCD_SIGNATURE = 0x06054B50
_LOCATOR = struct.Struct("<IIQI")  # zip64 end-of-central-directory locator, 20 bytes
_LOCATOR_SIGNATURE = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory without extra data
_EOCD64_SIGNATURE = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_CENTRAL_SIGNATURE = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50
_ZIP64_EXTRA = 0x0001
_FULL32 = 0xFFFFFFFF
_FLAG_ENCRYPTED = 0x1
_STORED = 0
MAX_ARCHIVES = 1_000_000  # a walk that would need more is not this layout


def _read(descriptor: int, offset: int, length: int) -> Optional[bytes]:
    if offset < 0 or length < 0:
        return None
    data = os.pread(descriptor, length, offset)
    return data if len(data) == length else None


def _zip64_values(extra: bytes, wanted: int) -> Optional[List[int]]:
    """The first ``wanted`` 8-byte values of the zip64 extra field in ``extra``."""
    position = 0
    while position + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4:position + 4 + size]
        if tag == _ZIP64_EXTRA:
            if len(body) < 8 * wanted:
                return None
            return list(struct.unpack_from(f"<{wanted}Q", body))
        position += 4 + size
    return None


def _archive_ending_at(descriptor: int, end: int) -> Optional[Tuple[int, List[Record]]]:
    """(start, records) of the archive whose last byte is ``end - 1``."""
    eocd = _read(descriptor, end - _EOCD.size, _EOCD.size)
    if eocd is None:
        return None
    signature, _, _, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(eocd)
    if signature != _EOCD_SIGNATURE or comment:
        return None
    tail = end - _EOCD.size  # where the directory (or the zip64 records) end
    locator = _read(descriptor, tail - _LOCATOR.size, _LOCATOR.size)
    if locator is not None and _LOCATOR.unpack(locator)[0] == _LOCATOR_SIGNATURE:
        _, _, eocd64_offset, _ = _LOCATOR.unpack(locator)
        eocd64_at = tail - _LOCATOR.size - _EOCD64.size
        eocd64 = _read(descriptor, eocd64_at, _EOCD64.size)
        if eocd64 is None:
            return None
        (signature, record_size, _, _, _, _, _, entries, cd_size,
         cd_offset) = _EOCD64.unpack(eocd64)
        if signature != _EOCD64_SIGNATURE or record_size != _EOCD64.size - 12:
            return None
        start, tail = eocd64_at - eocd64_offset, eocd64_at
    else:
        if _FULL32 in (cd_size, cd_offset):
            return None
        start = tail - cd_size - cd_offset
    if start < 0 or start + cd_offset + cd_size != tail:
        return None
    directory = _read(descriptor, start + cd_offset, cd_size)
    if directory is None:
        return None
    records: List[Record] = []
    position = 0
    for _ in range(entries):
        if position + _CENTRAL.size > len(directory):
            return None
        (signature, _, _, flags, method, _, _, crc, compressed, uncompressed, name_length,
         extra_length, comment_length, _, _, _, local_offset) = _CENTRAL.unpack_from(
             directory, position)
        if signature != _CENTRAL_SIGNATURE or method != _STORED or flags & _FLAG_ENCRYPTED:
            return None
        extra_at = position + _CENTRAL.size + name_length
        extra = directory[extra_at:extra_at + extra_length]
        position = extra_at + extra_length + comment_length
        # zip64: the 32-bit fields that overflowed are in the extra field, in this order
        big = [value == _FULL32 for value in (uncompressed, compressed, local_offset)]
        if any(big):
            values = _zip64_values(extra, sum(big))
            if values is None:
                return None
            values = iter(values)
            uncompressed, compressed, local_offset = (
                next(values) if overflowed else value
                for overflowed, value in zip(big, (uncompressed, compressed, local_offset)))
        if compressed != uncompressed:
            return None
        local = _read(descriptor, start + local_offset, _LOCAL.size)
        if local is None:
            return None
        fields = _LOCAL.unpack(local)
        if fields[0] != _LOCAL_SIGNATURE:
            return None
        data_at = start + local_offset + _LOCAL.size + fields[9] + fields[10]
        if data_at + compressed > start + cd_offset:
            return None
        records.append((data_at, compressed, crc))
    if position != len(directory):
        return None
    return start, records


def stored_records(path: str) -> Optional[List[Record]]:
    """Every record of the ``torch.save`` archives that make up ``path``, sorted by offset, or
    None when the file is not exactly such archives one after another."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(descriptor).st_size
        if end == 0:
            return None
        records: List[Record] = []
        for _ in range(MAX_ARCHIVES):
            found = _archive_ending_at(descriptor, end)
            if found is None:
                return None
            end, archive_records = found
            records.extend(archive_records)
            if end == 0:
                break
        else:
            return None
    finally:
        os.close(descriptor)
    records.sort()
    covered = 0
    for offset, length, _ in records:
        if offset < covered:
            return None  # overlapping records: not a layout torch.save writes
        covered = offset + length
    return records
