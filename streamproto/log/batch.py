"""
The unit a log hands to readers: a run of consecutive records kept as one
buffer plus a lengths array, so that callers who forward bytes (sockets,
Arrow buffers) never touch records one by one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from typing import TypeAlias

#: What a log accepts as one record.
BytesLike: TypeAlias = bytes | bytearray | memoryview


def lengths_array(values: Iterable[int] = ()) -> array[int]:
    """An unsigned 32-bit array (C{array('I')} is 32-bit on every supported platform)."""
    a = array("I", values)
    assert a.itemsize == 4
    return a


class RecordBatch:
    """
    Consecutive records C{position .. position + len(self) - 1}.

    A batch read from several stored batches keeps their payloads as the
    separate buffers they were read into (L{chunks}): a forwarder sends
    each where it lies, and only a caller of L{data} pays for joining them
    (a copy of every byte: 5% of a styx/0 consumer's CPU at 1000-byte
    records when every read joined).

    @ivar position: position of the first record.
    @ivar lengths: C{array('I')} of record sizes.
    """

    __slots__ = ("position", "lengths", "_data", "_parts", "_offsets")

    position: int
    lengths: array[int]
    _data: bytes | memoryview | None
    _parts: list[tuple[array[int], BytesLike]] | None
    _offsets: array[int] | None

    def __init__(self, position: int, lengths: array[int], data: bytes | memoryview) -> None:
        self.position = position
        self.lengths = lengths
        self._data = data
        self._parts = None
        self._offsets = None

    @classmethod
    def from_parts(cls, position: int,
                   parts: Sequence[tuple[array[int], BytesLike]]) -> RecordBatch:
        """
        A batch whose payloads lie in several buffers (at least one).

        @param parts: C{(lengths, payloads)} in order: consecutive records'
            sizes (C{array('I')}) and their payloads, concatenated.
        """
        if len(parts) == 1:
            lengths, payloads = parts[0]
            return cls(position, lengths, memoryview(payloads))
        lengths = lengths_array()
        for part_lengths, _ in parts:
            lengths.extend(part_lengths)
        batch = cls(position, lengths, b"")
        batch._data = None
        batch._parts = list(parts)
        return batch

    @property
    def data(self) -> bytes | memoryview:
        """The records' payloads, concatenated (joined on first use when
        the batch has several L{chunks})."""
        if self._data is None:
            assert self._parts is not None
            self._data = b"".join(part for _, part in self._parts)
        return self._data

    @data.setter
    def data(self, value: bytes | memoryview) -> None:
        self._data = value
        self._parts = None

    def chunks(self) -> list[tuple[array[int], BytesLike]]:
        """
        The batch as C{(lengths, payloads)} pairs, in order, without
        joining: one pair unless it was read from several stored batches.
        """
        if self._parts is None:
            assert self._data is not None
            return [(self.lengths, self._data)]
        return self._parts

    @classmethod
    def from_records(cls, position: int, records: Iterable[BytesLike]) -> RecordBatch:
        copies = [bytes(r) for r in records]
        return cls(position, lengths_array(map(len, copies)), b"".join(copies))

    def __len__(self) -> int:
        return len(self.lengths)

    def __repr__(self) -> str:
        return f"<RecordBatch position={self.position} count={len(self)} bytes={self.nbytes}>"

    @property
    def next_position(self) -> int:
        return self.position + len(self.lengths)

    @property
    def nbytes(self) -> int:
        if self._data is None:
            assert self._parts is not None
            return sum(len(part) for _, part in self._parts)
        return len(self._data)

    def offsets(self) -> array[int]:
        """C{array('Q')} of n + 1 start offsets into C{data}: Arrow's layout."""
        if self._offsets is None:
            offs = array("Q", [0])
            offs.extend(accumulate(self.lengths))
            self._offsets = offs
        return self._offsets

    def records(self) -> list[bytes]:
        """The records as a list of bytes."""
        data = self.data.tobytes() if isinstance(self.data, memoryview) else self.data
        offs = self.offsets()
        return [data[a:b] for a, b in zip(offs, offs[1:])]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.records())

    def slice(self, start: int, stop: int | None = None) -> RecordBatch:
        """Records C{start..stop} (indices within the batch) as a new batch."""
        n = len(self.lengths)
        stop = n if stop is None else min(stop, n)
        start = min(start, stop)
        offs = self.offsets()
        return RecordBatch(self.position + start, self.lengths[start:stop],
                           self.data[offs[start]:offs[stop]])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecordBatch):
            return NotImplemented
        return (self.position == other.position and self.lengths == other.lengths
                and bytes(self.data) == bytes(other.data))


def empty_batch(position: int) -> RecordBatch:
    return RecordBatch(position, lengths_array(), b"")
