"""
The on-disk format of the file log store, as pure functions (no I/O, no
Twisted) shared by the live store, the recovery scan and the synchronous
reader that Spark executors use.

A log is a directory of segment files named after their first position
(C{00000000000000000000.seg}).  A segment is a header followed by batches::

    segment header (40 bytes, little-endian)
      magic      8s   b"SPSEG\\x00\\x00\\x01"
      position   u64  position of the first record in the segment
      offset     u64  payload byte offset of the first record
      created    u64  creation time, unix milliseconds
      reserved   u32  0
      crc        u32  CRC-32C of the 36 bytes before it

    batch (one per append; an append over 1 MiB is split into several)
      magic      u32  0x31425053 ("SPB1")
      crc        u32  CRC-32C of everything after this field, to the batch end
      position   u64  position of the first record of the batch
      offset     u64  payload byte offset of the first record
      count      u32  number of records
      data_len   u32  payload bytes
      attrs_len  u32  length of the attributes JSON (0: none)
      lag        u32  records written but not yet fsynced when this batch
                      was written (saturating): position - lag was durable
      lengths    count x u32   each record's size
      attrs      attrs_len bytes: JSON object str -> int
      data       data_len bytes: the payloads, concatenated

Why batches and out-of-band lengths: checksumming, indexing and reading work
per batch, never per record, and a batch's payload is one contiguous buffer
(with its lengths it is exactly Arrow's binary layout), so readers hand whole
byte ranges on.  The position and offset in every batch header make each
batch self-describing, so recovery can check continuity as well as checksums.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c

from streamproto.log.batch import BytesLike, lengths_array

#: its last byte is the segment format's version (L{streamproto.log.versions})
SEGMENT_MAGIC = b"SPSEG\x00\x00\x01"
SEGMENT_HEADER = struct.Struct("<8sQQQI")  # + crc u32
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size + 4  # 40

BATCH_MAGIC = 0x31425053
BATCH_HEADER = struct.Struct("<IIQQIIII")
BATCH_HEADER_SIZE = BATCH_HEADER.size  # 40
_AFTER_CRC = 8  # the CRC covers the header from this byte on

#: Appends larger than this are split into several batches (one record may
#: still exceed it on its own, up to max_record_size).  Small enough that a
#: reader starting inside a batch reads and checksums little more than it
#: returns; large enough that headers cost nothing (40 bytes a MiB).
MAX_BATCH_DATA = 1024 * 1024


class FormatError(Exception):
    """Bytes that are not a valid segment header or batch."""


def segment_file_name(position: int) -> str:
    return f"{position:020d}.seg"


def index_file_name(position: int) -> str:
    return f"{position:020d}.idx"


def encode_segment_header(position: int, offset: int, created_ms: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, position, offset, created_ms, 0)
    return head + struct.pack("<I", crc32c(head))


def decode_segment_header(buf: BytesLike) -> tuple[int, int, int]:
    """
    @return: (position, offset, created_ms)
    @raise FormatError: torn or garbled header.
    """
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise FormatError("short segment header")
    magic, position, offset, created, _ = SEGMENT_HEADER.unpack_from(buf, 0)
    (crc,) = struct.unpack_from("<I", buf, SEGMENT_HEADER.size)
    if magic[:7] == SEGMENT_MAGIC[:7] and magic[7] > SEGMENT_MAGIC[7] \
            and crc == crc32c(bytes(buf[:SEGMENT_HEADER.size])):
        # a whole header of a newer release: refused, never taken for a torn one
        from streamproto.log.versions import SEGMENT_VERSION, check
        check("a segment", magic[7], SEGMENT_VERSION)
    if magic != SEGMENT_MAGIC or crc != crc32c(bytes(buf[:SEGMENT_HEADER.size])):
        raise FormatError("bad segment header")
    return position, offset, created


def encode_batch(
    position: int,
    offset: int,
    lengths: array[int],
    data: BytesLike,
    attributes: Mapping[str, int] | None = None,
    lag: int = 0,
) -> list[BytesLike]:
    """
    @param lengths: the records' sizes, an C{array('I')}.
    @param data: their payloads, concatenated (bytes-like).
    @param lag: records before C{position} not yet fsynced (recovery uses it
        to tell a torn unsynced write from damage to durable data).
    @return: the batch as a list of buffers to write with one C{writev}.
    """
    attrs = b""
    if attributes:
        attrs = json.dumps(attributes, sort_keys=True, separators=(",", ":")).encode()
    lengths_bytes = lengths.tobytes() if _LITTLE else _swapped(lengths)
    crc = crc32c(data, crc32c(attrs, crc32c(lengths_bytes, crc32c(
        struct.pack("<QQIIII", position, offset, len(lengths), len(data), len(attrs), lag)))))
    header = BATCH_HEADER.pack(BATCH_MAGIC, crc, position, offset, len(lengths), len(data),
                               len(attrs), lag)
    return [header, lengths_bytes, attrs, data]


def _swapped(lengths: array[int]) -> bytes:
    a = array("I", lengths)
    a.byteswap()
    return a.tobytes()


_LITTLE = array("I", [1]).tobytes() == b"\x01\x00\x00\x00"


@dataclass(slots=True, eq=False)
class BatchHeader:
    """A decoded batch header, with where the batch sits in its buffer."""

    crc: int
    position: int
    offset: int
    count: int
    data_len: int
    attrs_len: int
    start: int
    lag: int = 0

    @property
    def size(self) -> int:
        return BATCH_HEADER_SIZE + 4 * self.count + self.attrs_len + self.data_len

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def end_position(self) -> int:
        return self.position + self.count

    @property
    def end_offset(self) -> int:
        return self.offset + self.data_len

    @property
    def data_start(self) -> int:
        return self.start + BATCH_HEADER_SIZE + 4 * self.count + self.attrs_len


def decode_batch_header(buf: BytesLike, start: int = 0) -> BatchHeader | None:
    """
    @return: L{BatchHeader} for the batch at C{buf[start:]}, or None if the
        buffer ends before the header does.
    @raise FormatError: not a batch header.
    """
    if len(buf) - start < BATCH_HEADER_SIZE:
        return None
    magic, crc, position, offset, count, data_len, attrs_len, lag = \
        BATCH_HEADER.unpack_from(buf, start)
    if magic != BATCH_MAGIC or lag > position:
        raise FormatError(f"bad batch magic at {start}")
    return BatchHeader(crc, position, offset, count, data_len, attrs_len, start, lag)


def verify_batch(buf: BytesLike, header: BatchHeader) -> None:
    """@raise FormatError: unless the CRC of the whole batch in C{buf} matches."""
    view = memoryview(buf)[header.start + _AFTER_CRC:header.end]
    if crc32c(view) != header.crc:
        raise FormatError(f"batch at position {header.position}: checksum mismatch")


def batch_lengths(buf: BytesLike, header: BatchHeader) -> array[int]:
    a = lengths_array()
    begin = header.start + BATCH_HEADER_SIZE
    a.frombytes(memoryview(buf)[begin:begin + 4 * header.count])
    if not _LITTLE:
        a.byteswap()
    return a


def batch_attributes(buf: BytesLike, header: BatchHeader) -> dict[str, int] | None:
    if not header.attrs_len:
        return None
    begin = header.start + BATCH_HEADER_SIZE + 4 * header.count
    try:
        attrs = json.loads(bytes(buf[begin:begin + header.attrs_len]))
    except ValueError:
        raise FormatError("bad attributes")
    if not isinstance(attrs, dict):
        raise FormatError("bad attributes")
    return attrs


def scan_batches(
    buf: BytesLike, start: int, position: int, offset: int, verify: bool = True,
) -> tuple[list[BatchHeader], int, str | None]:
    """
    Walk consecutive batches in C{buf} from C{start}.

    @param position: the position the first batch must start at.
    @param offset: the payload offset it must start at.
    @return: (headers, good_end, error): the valid batches in order, the byte
        index just after the last of them, and a description of why the scan
        stopped early (None when it stopped at a clean end of C{buf}).
    """
    headers: list[BatchHeader] = []
    i = start
    n = len(buf)
    while i < n:
        try:
            h = decode_batch_header(buf, i)
        except FormatError as e:
            return headers, i, str(e)
        if h is None:
            return headers, i, "torn batch header"
        if h.end > n:
            return headers, i, "torn batch"
        if h.position != position or h.offset != offset:
            return headers, i, (f"discontinuity: batch says {h.position}/{h.offset}, "
                                f"expected {position}/{offset}")
        if verify:
            try:
                verify_batch(buf, h)
            except FormatError as e:
                return headers, i, str(e)
        headers.append(h)
        position, offset, i = h.end_position, h.end_offset, h.end
    return headers, i, None


def encode_index(payload: object) -> bytes:
    """An index file: JSON with a CRC, so a torn one is detected and rebuilt."""
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<I", crc32c(body)) + body


def decode_index(data: bytes) -> Any:
    if len(data) < 4:
        raise FormatError("short index")
    (crc,) = struct.unpack_from("<I", data, 0)
    body = data[4:]
    if crc32c(body) != crc:
        raise FormatError("index checksum mismatch")
    return json.loads(body)
