"""
Runs of Lumberjack events kept as one buffer: the server's hot path
without a Python object, or a line of Python, per event.

A writer (Filebeat, go-lumber) sends a batch as a window frame and one
compressed frame of some thousands of JSON frames.  The server scans the
inflated frames into a L{PayloadRun} (the payloads concatenated and an
C{array('I')} of their sizes) in one call, validates the run in one JSON
parse (L{streamproto.lumberjack.codec.validate_run}) and splices it into
log records in one more (L{splice}), which the store appends whole.

The optional C accelerator (C{streamproto._speedups}) does the scanning
and splicing; L{scan_json_py} and L{splice_py} are the same in Python,
used without it and tested against it.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import overload

from streamproto.core.framing import _speedups
from streamproto.log.batch import BytesLike, lengths_array

#: scan status: stopped at another frame type or version, at max_events, or
#: at fewer than 2 bytes
OTHER = 0
#: the buffer ends inside a JSON frame (need: the index its end needs, or -1
#: when its header is cut)
INCOMPLETE = 1
#: a JSON frame's size is above max_frame (need: that size)
TOO_LARGE = 2

_JSON = 0x4A  # 'J'
_seq_size = struct.Struct(">II")


class PayloadRun(Sequence[bytes]):
    """
    Consecutive event payloads as one buffer: C{data} holds them end to
    end, C{lengths} (an C{array('I')}) their sizes.  Indexing gives the
    payloads as bytes (tests, custom sinks); the server itself only ever
    handles the run whole.
    """

    __slots__ = ("data", "lengths", "_offsets")

    def __init__(self, data: bytes = b"", lengths: array[int] | None = None) -> None:
        self.data = data
        self.lengths = lengths_array() if lengths is None else lengths
        self._offsets: list[int] | None = None

    @classmethod
    def of(cls, payloads: Sequence[BytesLike]) -> PayloadRun:
        """The run of C{payloads} (any sequence of bytes-likes, or a run)."""
        if isinstance(payloads, PayloadRun):
            return payloads
        return cls(b"".join(payloads), lengths_array(map(len, payloads)))

    @classmethod
    def join(cls, runs: Sequence[PayloadRun]) -> PayloadRun:
        """One run of C{runs} end to end."""
        if len(runs) == 1:
            return runs[0]
        lengths = lengths_array()
        for run in runs:
            lengths.extend(run.lengths)
        return cls(b"".join(run.data for run in runs), lengths)

    @property
    def nbytes(self) -> int:
        """The payloads' size in all."""
        return len(self.data)

    def _starts(self) -> list[int]:
        if self._offsets is None:
            self._offsets = [0, *accumulate(self.lengths)]
        return self._offsets

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> PayloadRun: ...

    def __getitem__(self, index: int | slice) -> bytes | PayloadRun:
        starts = self._starts()
        if isinstance(index, slice):
            first, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("a run is sliced with step 1 only")
            stop = max(first, stop)
            return PayloadRun(self.data[starts[first]:starts[stop]], self.lengths[first:stop])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("run index out of range")
        return self.data[starts[index]:starts[index + 1]]

    def __iter__(self) -> Iterator[bytes]:
        data = self.data
        start = 0
        for n in self.lengths:
            yield data[start:start + n]
            start += n

    def split(self, n: int) -> tuple[PayloadRun, PayloadRun]:
        """(the first C{n} payloads, the rest)."""
        return self[:n], self[n:]

    def count_to_reach(self, nbytes: int) -> int:
        """How many payloads from the first make C{nbytes} or more (all: C{len(self)})."""
        for count, total in enumerate(accumulate(self.lengths), 1):
            if total >= nbytes:
                return count
        return len(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PayloadRun):
            return self.lengths == other.lengths and self.data == other.data
        if isinstance(other, Sequence) and not isinstance(other, (bytes, bytearray, str)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like a list

    def __repr__(self) -> str:
        return f"PayloadRun({list(self)!r})"


def scan_json_py(buf: BytesLike, start: int, version: int, max_frame: int,
                 max_events: int) -> tuple[bytes, bytes, bytes, int, int, int]:
    """
    Consecutive JSON frames of C{version} from C{buf[start:]}:
    (seqs, lengths, data, end, status, need), as the C accelerator's
    C{lumberjack_json} returns them (see L{OTHER}, L{INCOMPLETE},
    L{TOO_LARGE}; C{max_events} <= 0: no limit).
    """
    seqs, lengths = lengths_array(), lengths_array()
    view = memoryview(buf)
    parts: list[memoryview] = []
    end = len(buf)
    pos = start
    status = need = 0
    unpack = _seq_size.unpack_from
    while end - pos >= 2 and buf[pos] == version and buf[pos + 1] == _JSON:
        if end - pos < 10:
            status, need = INCOMPLETE, -1
            break
        seq, size = unpack(buf, pos + 2)
        if size > max_frame:
            status, need = TOO_LARGE, size
            break
        if end - pos - 10 < size:
            status, need = INCOMPLETE, pos + 10 + size
            break
        seqs.append(seq)
        lengths.append(size)
        parts.append(view[pos + 10:pos + 10 + size])
        pos += 10 + size
        if 0 < max_events == len(lengths):
            break
    return seqs.tobytes(), lengths.tobytes(), b"".join(parts), pos, status, need


def splice_py(lengths: array[int], data: BytesLike, head: bytes, prefix: bytes,
              suffix: bytes, tail: bytes) -> tuple[bytes, bytes]:
    """
    C{head + (prefix + record + suffix for each record) + tail} and the
    spliced records' sizes (bytes of native uint32), as the C
    accelerator's C{splice} returns them.
    """
    if sum(lengths) != len(data):
        raise ValueError("lengths do not add up to the data size")
    view = memoryview(data)
    parts: list[BytesLike] = [head]
    start = 0
    for n in lengths:
        parts += (prefix, view[start:start + n], suffix)
        start += n
    parts.append(tail)
    extra = len(prefix) + len(suffix)
    out_lengths = lengths_array(n + extra for n in lengths)
    return b"".join(parts), out_lengths.tobytes()


def scan_json(buf: BytesLike, start: int, version: int, max_frame: int,
              max_events: int) -> tuple[array[int], PayloadRun, int, int, int]:
    """
    Consecutive JSON frames of C{version} from C{buf[start:]}: (seqs,
    payloads, end, status, need); see L{scan_json_py}.
    """
    if _speedups is not None:
        raw_seqs, raw_lengths, data, end, status, need = _speedups.lumberjack_json(
            buf, start, version, max_frame, max_events)
    else:
        raw_seqs, raw_lengths, data, end, status, need = scan_json_py(
            buf, start, version, max_frame, max_events)
    seqs, lengths = array("I"), array("I")
    seqs.frombytes(raw_seqs)
    lengths.frombytes(raw_lengths)
    return seqs, PayloadRun(data, lengths), end, status, need


def splice(run: PayloadRun, head: bytes, prefix: bytes, suffix: bytes,
           tail: bytes) -> tuple[bytes, array[int]]:
    """The run's payloads between C{prefix} and C{suffix}, all between
    C{head} and C{tail}: (bytes, each spliced payload's size)."""
    if _speedups is not None:
        data, raw = _speedups.splice(run.lengths, run.data, head, prefix, suffix, tail)
    else:
        data, raw = splice_py(run.lengths, run.data, head, prefix, suffix, tail)
    lengths = array("I")
    lengths.frombytes(raw)
    return data, lengths
