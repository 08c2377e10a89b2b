"""
The read side of one L{JetStreamLog}: records by position, payload bytes by
offset, and the position of an offset.

A message is found from what the log's L{MessageIndex} knows of the
messages' coordinates, else by a short binary search of the stream by
sequence; its body comes from the store's L{BodyCache} (this front-end's own
appends, and what readers fetched), else from the stream leader (which
serves committed messages only), and the next few messages of a sequential
reader are fetched ahead.

Kept apart from the log because it only ever reads the acknowledged state:
nothing here changes what the log has learnt except the index of where
messages are.
"""

from __future__ import annotations

import bisect
from array import array
from itertools import accumulate
from typing import TYPE_CHECKING, TypeAlias

from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed

from streamproto.log.batch import RecordBatch
from streamproto.log.gate import read_bytes_shortcut, read_shortcut
from streamproto.log.errors import CorruptLog, LogClosed, PositionOutOfRange
from streamproto.log.jetstream.common import LogPart, _Inline
from streamproto.log.msgindex import BodyEntry, holds
from streamproto.log.natsformat import (
    BatchInfo, MessageFormatError, decode_body, subjects_filter,
)

if TYPE_CHECKING:
    from streamproto.log.jetstream.views import LogView as JetStreamLog

#: the message holding a position or offset, with its cached body
_Found: TypeAlias = tuple[BatchInfo, BodyEntry]


class MessageReader(LogPart):
    """
    Reads one log: what L{ILog.read}, L{ILog.read_bytes} and
    L{ILog.position_of_offset} do, and the message lookups truncation and
    retention use (L{load}, L{locate}).
    """

    def __init__(self, log: JetStreamLog) -> None:
        super().__init__(log)
        self._index = log._index

    def read(self, position: int, max_records: int = -1,
             max_bytes: int = 1048576) -> Deferred[RecordBatch]:
        answered = read_shortcut(self._log._check_position, position, self._log.end_position, max_records)
        if answered is not None:
            return answered
        found = self._cached("position", position)
        if found is not None:
            return succeed(self._slice(found[0], found[1], position, max_records, max_bytes))
        return self.load("position", position).addCallback(
            lambda found: self._slice(found[0], found[1], position, max_records, max_bytes))

    def _slice(self, info: BatchInfo, entry: BodyEntry, position: int, max_records: int,
               max_bytes: int) -> RecordBatch:
        """
        Records from C{position} in message C{info}, continued into the
        next messages while they are in memory and the limits allow (so
        that small appends read back in one batch).
        """
        batch = _slice_one(info, entry, position, max_records, max_bytes)
        count, nbytes = len(batch), batch.nbytes
        if batch.next_position < info.end_position or nbytes >= max_bytes \
                or (max_records >= 0 and count >= max_records):
            return batch
        parts = [batch]
        current = info
        while True:
            following = self._index.after(current)
            if following is None:
                break
            current = following
            if following.count == 0:
                continue
            cached = self.store.cache.get((self._id, following.seq))
            if cached is None:
                break
            entry = cached
            left = -1 if max_records < 0 else max_records - count
            more = _slice_one(following, entry, following.position, left, max_bytes - nbytes)
            if nbytes + more.nbytes > max_bytes:
                break  # its first record alone is over what is left
            parts.append(more)
            count += len(more)
            nbytes += more.nbytes
            if more.next_position < following.end_position or nbytes >= max_bytes \
                    or (max_records >= 0 and count >= max_records):
                break
        if len(parts) == 1:
            return batch
        # each message's payloads stay where they are (RecordBatch.chunks)
        return RecordBatch.from_parts(position, [c for part in parts for c in part.chunks()])

    def _cached(self, key: str, target: int) -> _Found | None:
        """(info, body entry) of the message holding C{target}, if in memory."""
        _below, above = self._index.bounds(key, target)
        if above is not None and holds(above, key, target):
            entry = self.store.cache.get((self._id, above.seq))
            if entry is not None:
                return above, entry
        return None

    @defer.inlineCallbacks
    def load(self, key: str, target: int) -> _Inline[_Found]:
        info = yield self.locate(key, target)
        entry = self.store.cache.get((self._id, info.seq))
        if entry is None:
            entry = yield self._fetch_body(info.seq)
        self._prefetch(info)
        return info, entry

    @defer.inlineCallbacks
    def locate(self, key: str, target: int) -> _Inline[BatchInfo]:
        """The message holding position (or payload byte) C{target}: memory, or a short search."""
        below, above = self._index.bounds(key, target)
        if above is not None and holds(above, key, target):
            return above
        lo = below.seq if below is not None else self._log._first_seq - 1
        upper = above.seq if above is not None else self._log._end_seq + 1
        answer = above
        io = self.store.io
        filter_ = subjects_filter(self.store.prefix, self.name)
        while upper - lo > 1:
            mid = (lo + upper) // 2
            got = yield self.store._call(io.get, self.stream, seq=mid, next=filter_)
            if self._log._closed:
                raise LogClosed(self.name)
            if got is None or got.seq >= upper:
                upper = mid
                continue
            info = self._log._decode(got)
            self._index.add(info)
            end = info.end_position if key == "position" else info.end_offset
            if end > target:
                answer, upper = info, info.seq
            else:
                lo = info.seq
        if answer is None or not holds(answer, key, target):
            if target < (self._log.start_position if key == "position" else self._log.start_offset):
                raise PositionOutOfRange(f"{key} {target} was truncated")
            raise CorruptLog(f"log {self.name}: no message holds {key} {target}")
        return answer

    @defer.inlineCallbacks
    def _fetch_body(self, seq: int) -> _Inline[BodyEntry]:
        got = yield self.store._call(self.store.io.get_direct, self.stream, seq)
        if got is None:
            raise PositionOutOfRange(f"message {seq} of log {self.name} was purged")
        info = self._log._decode(got)
        self._index.add(info)
        try:
            lengths, data = decode_body(info, got.data)
        except MessageFormatError as e:
            raise CorruptLog(f"log {self.name}: {e}")
        return self.store.cache.put((self._id, seq), lengths, data)

    def _prefetch(self, info: BatchInfo) -> None:
        """Read ahead the next messages of a sequential reader."""
        for seq in range(info.seq + 1, min(info.seq + 1 + self.store.read_ahead,
                                          self._log._end_seq + 1)):
            if self.store.cache.get((self._id, seq)) is None:
                self._fetch_body(seq).addErrback(lambda f: None)

    def read_bytes(self, offset: int, max_bytes: int = 1048576) -> Deferred[bytes]:
        answered = read_bytes_shortcut(self._log._check_offset, offset, self._log.end_offset,
                                       max_bytes)
        if answered is not None:
            return answered

        def cut(found: _Found) -> bytes:
            info, entry = found
            at = offset - info.offset
            return bytes(entry[1][at:at + max_bytes])
        found = self._cached("offset", offset)
        if found is not None:
            return succeed(cut(found))
        return self.load("offset", offset).addCallback(cut)

    def position_of_offset(self, offset: int) -> Deferred[int]:
        if self._log._closed:
            return fail(LogClosed(self.name))
        if not self._log.start_offset <= offset <= self._log.end_offset:
            return fail(PositionOutOfRange(f"offset {offset} out of range"))
        if offset == self._log.end_offset:
            return succeed(self._log.end_position)

        def find(found: _Found) -> int:
            info, entry = found
            offsets = _offsets(entry)
            k = bisect.bisect_right(offsets, offset - info.offset, 0, len(entry[0])) - 1
            return info.position + k
        found = self._cached("offset", offset)
        if found is not None:
            return succeed(find(found))
        return self.load("offset", offset).addCallback(find)


    def offset_of_position(self, position: int) -> Deferred[int]:
        """Where record C{position} starts (L{ILog.offset_of_position})."""
        try:
            self._log._check_position(position)
        except Exception as e:
            return fail(e)
        if position == self._log.end_position:
            return succeed(self._log.end_offset)

        def at(found: _Found) -> int:
            info, entry = found
            return info.offset + _offsets(entry)[position - info.position]
        found = self._cached("position", position)
        if found is not None:
            return succeed(at(found))
        return self.load("position", position).addCallback(at)


def _slice_one(info: BatchInfo, entry: BodyEntry, position: int, max_records: int,
               max_bytes: int) -> RecordBatch:
    """Records from C{position} within one message: at least one, whole ones within C{max_bytes}."""
    lengths: array[int] = entry[0]
    data: bytes | memoryview = entry[1]
    offsets = _offsets(entry)
    n = len(lengths)
    i = position - info.position
    stop = n if max_records < 0 else min(n, i + max_records)
    limit = offsets[i] + max(max_bytes, 0)
    j = bisect.bisect_right(offsets, limit, i + 1, stop + 1) - 1
    j = max(j, i + 1)
    return RecordBatch(position, lengths[i:j], data[offsets[i]:offsets[j]])


def _offsets(entry: BodyEntry) -> list[int]:
    """The n + 1 record offsets of a cached message body (computed once)."""
    if entry[2] is None:
        entry[2] = list(accumulate(entry[0], initial=0))
    offsets: list[int] = entry[2]
    return offsets
