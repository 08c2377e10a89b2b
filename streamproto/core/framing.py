"""
Length-prefixed record framing shared by the protocols: records as
C{[prefix][u32 big-endian size][payload]} frames.

- Styx HTTP ``application/vnd.styx.binary-records``: prefix ``b""``.
- Styx ``styx/0`` record messages: prefix ``b"\\x00\\x01"`` (int16 type 1).

Both directions work on a L{RecordBatch}-like pair (an C{array('I')} of
lengths and the concatenated payloads), so a whole batch is framed or
scanned in one call.  The optional C accelerator (``streamproto._speedups``)
does it without per-record Python; the pure-Python versions here behave
identically and are tested against it.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from typing import Protocol

from streamproto.log.batch import BytesLike, lengths_array

# the optional C accelerator or None (pure Python), imported once in
# streamproto.core.accelerator (which tells operators); sendpath and the
# codecs use it through this module
from streamproto.core import accelerator as _accelerator

_speedups = _accelerator.speedups


class _Batch(Protocol):
    """What L{frame_batch} needs of a batch (a L{streamproto.log.batch.RecordBatch})."""

    @property
    def lengths(self) -> array[int]: ...

    @property
    def data(self) -> BytesLike: ...

_U32 = struct.Struct(">I")

#: scan status: the buffer ends inside a frame (or max_records was reached)
NEED_MORE = 0
#: the next bytes are not a frame with this prefix (another message type)
OTHER = 1
#: a frame announces a size above the limit
TOO_LARGE = 2


def frame_records_py(lengths: Iterable[int], data: BytesLike, prefix: bytes = b"") -> bytes:
    if sum(lengths) != len(data):
        raise ValueError("lengths do not add up to the data size")
    parts: list[bytes | memoryview] = []
    append = parts.append
    pos = 0
    pack = _U32.pack
    view = memoryview(data)
    for n in lengths:
        if prefix:
            append(prefix)
        append(pack(n))
        append(view[pos:pos + n])
        pos += n
    return b"".join(parts)


def scan_frames_py(buf: BytesLike, start: int, prefix: bytes, max_size: int,
                   max_records: int = -1) -> tuple[bytes, bytes, int, int]:
    lengths = lengths_array()
    parts: list[memoryview] = []
    view = memoryview(buf)
    n = len(buf)
    pos = start
    hdr = len(prefix) + 4
    plen = len(prefix)
    status = NEED_MORE
    unpack = _U32.unpack_from
    while max_records < 0 or len(lengths) < max_records:
        if n - pos < hdr:
            rest = bytes(view[pos:min(n, pos + plen)])
            if rest and rest != prefix[:len(rest)]:
                status = OTHER
            break
        if plen and view[pos:pos + plen] != prefix:
            status = OTHER
            break
        (size,) = unpack(buf, pos + plen)
        if size > max_size:
            status = TOO_LARGE
            break
        if n - pos - hdr < size:
            break
        lengths.append(size)
        parts.append(view[pos + hdr:pos + hdr + size])
        pos += hdr + size
    return lengths.tobytes(), b"".join(parts), pos, status


def frame_records(lengths: array[int], data: BytesLike, prefix: bytes = b"") -> bytes:
    """Records (sizes C{lengths}, payloads C{data} concatenated) as one
    buffer of C{[prefix][u32 BE size][payload]} frames."""
    if _speedups is not None:
        return _speedups.frame_records(lengths, data, prefix)
    return frame_records_py(lengths, data, prefix)


def frame_batch(batch: _Batch, prefix: bytes = b"") -> bytes:
    """All records of C{batch} as one buffer of frames."""
    return frame_records(batch.lengths, batch.data, prefix)


def scan_frames(buf: BytesLike, start: int = 0, prefix: bytes = b"", max_size: int = 0x7FFFFFFF,
                max_records: int = -1) -> tuple[array[int], bytes, int, int]:
    """
    Scan consecutive frames in C{buf[start:]}.

    @return: (lengths, data, end, status): the sizes (C{array('I')}) and
        concatenated payloads of the whole frames found, the index just
        after the last of them, and why the scan stopped (L{NEED_MORE},
        L{OTHER}, L{TOO_LARGE}: then C{end} is where the bad frame starts).
    """
    if _speedups is not None:
        raw, data, end, status = _speedups.scan_frames(buf, start, prefix, max_size,
                                                        max_records)
    else:
        raw, data, end, status = scan_frames_py(buf, start, prefix, max_size, max_records)
    lengths = array("I")
    lengths.frombytes(raw)
    return lengths, data, end, status
