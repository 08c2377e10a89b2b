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

    __slots__ = ("data", "lengths", "_offsets", "_pieces")

    def __init__(self, data: bytes = b"", lengths: array[int] | None = None,
                 pieces: list[BytesLike] | None = None) -> None:
        self.data = data
        self.lengths = lengths_array() if lengths is None else lengths
        self._offsets: list[int] | None = None
        # the payloads one by one, kept where the pure-Python path has them
        self._pieces = pieces

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

    def pieces(self) -> list[BytesLike]:
        """The payloads as a list of bytes-likes (the pure-Python path's
        way to splice; made once a run)."""
        if self._pieces is None:
            view = memoryview(self.data)
            self._pieces = [view[end - n:end]
                            for n, end in zip(self.lengths, accumulate(self.lengths))]
        return self._pieces

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
    seqs, lengths, parts, end, status, need = _scan_json_parts(buf, start, version, max_frame,
                                                               max_events)
    return (lengths_array(seqs).tobytes(), lengths_array(lengths).tobytes(), b"".join(parts),
            end, status, need)


def _scan_json_parts(buf: BytesLike, start: int, version: int, max_frame: int,
                     max_events: int
                     ) -> tuple[list[int], list[int], list[BytesLike], int, int, int]:
    seqs: list[int] = []
    lengths: list[int] = []
    parts: list[BytesLike] = []
    add_seq, add_length, add_part = seqs.append, lengths.append, parts.append
    json_type = _JSON
    end = len(buf)
    pos = start
    status = need = count = 0
    unpack = _seq_size.unpack_from
    while end - pos >= 2 and buf[pos] == version and buf[pos + 1] == json_type:
        if end - pos < 10:
            status, need = INCOMPLETE, -1
            break
        seq, size = unpack(buf, pos + 2)
        if size > max_frame:
            status, need = TOO_LARGE, size
            break
        stop = pos + 10 + size
        if stop > end:
            status, need = INCOMPLETE, stop
            break
        add_seq(seq)
        add_length(size)
        add_part(buf[pos + 10:stop])
        pos = stop
        count += 1
        if count == max_events:
            break
    return seqs, lengths, parts, pos, status, need


def splice_py(lengths: array[int], data: BytesLike, head: bytes, prefix: bytes,
              suffix: bytes, tail: bytes) -> tuple[bytes, bytes]:
    """
    C{head + (prefix + record + suffix for each record) + tail} and the
    spliced records' sizes (bytes of native uint32), as the C
    accelerator's C{splice} returns them.
    """
    if sum(lengths) != len(data):
        raise ValueError("lengths do not add up to the data size")
    return _splice_pieces(PayloadRun(bytes(data), lengths).pieces(), lengths, head, prefix,
                          suffix, tail)


def _splice_pieces(pieces: list[BytesLike], lengths: array[int], head: bytes, prefix: bytes,
                   suffix: bytes, tail: bytes) -> tuple[bytes, bytes]:
    extra = len(prefix) + len(suffix)
    out_lengths = lengths_array(map(extra.__add__, lengths))
    if not pieces:
        return head + tail, out_lengths.tobytes()
    joined = (suffix + prefix).join(pieces)
    return b"".join((head, prefix, joined, suffix, tail)), out_lengths.tobytes()


def scan_json(buf: BytesLike, start: int, version: int, max_frame: int,
              max_events: int) -> tuple[array[int], PayloadRun, int, int, int]:
    """
    Consecutive JSON frames of C{version} from C{buf[start:]}: (seqs,
    payloads, end, status, need); see L{scan_json_py}.
    """
    if _speedups is None:
        # the pieces are kept: the run is spliced from them (twice) without cutting it again
        seq_list, length_list, parts, end, status, need = _scan_json_parts(
            buf, start, version, max_frame, max_events)
        lengths = lengths_array(length_list)
        return (lengths_array(seq_list), PayloadRun(b"".join(parts), lengths, parts), end,
                status, need)
    raw_seqs, raw_lengths, data, end, status, need = _speedups.lumberjack_json(
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
        # the run's pieces are cut once, for the validation's splice and the records'
        data, raw = _splice_pieces(run.pieces(), run.lengths, head, prefix, suffix, tail)
    lengths = array("I")
    lengths.frombytes(raw)
    return data, lengths
