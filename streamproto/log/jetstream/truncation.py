"""
Where one L{JetStreamLog} starts: truncation and retention.

A truncation appends a marker saying where the log now starts (through the
append chain, so that it is ordered with the appends and every front-end
learns it), then purges the messages it hides; a purge that fails only
leaves the space to the next retention round.  Retention truncates whole
messages while what remains still reaches each of the log's limits (count,
size, age), after appends (at most once a second) and in the store's
periodic rounds.

Kept apart from the log because it is the one writer of the log's start
besides what the log learns from the stream.
"""

from __future__ import annotations

import calendar
import time
from typing import TYPE_CHECKING, Any, cast

from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed

from streamproto.log.batch import lengths_array
from streamproto.log.errors import LogClosed, PositionOutOfRange
from streamproto.log.jetstream.chain import AppendChain, _Append
from streamproto.log.jetstream.common import LogPart, _Inline, log
from streamproto.log.jetstream.reading import MessageReader, _Found, _offsets
from streamproto.log.natsformat import MARKER, subjects_filter
from streamproto.log.natsio import JetStreamError, NotAvailable

if TYPE_CHECKING:
    from streamproto.log.jetstream.views import LogView as JetStreamLog


def cluster_time(stream_info: dict[str, Any] | None) -> float:
    """
    The stream leader's time when it answered C{stream_info} (its C{ts},
    RFC 3339 with nanoseconds), in seconds since the epoch; ours when the
    server gives none (before nats-server 2.10).
    """
    seconds = _epoch_seconds((stream_info or {}).get("ts"))
    return time.time() if seconds is None else seconds


def stream_age(stream_info: dict[str, Any] | None) -> float | None:
    """
    Seconds since the stream was added, on the stream leader's clock (its
    C{ts} less its C{created}); None when the server does not say.
    """
    info = stream_info or {}
    now, created = _epoch_seconds(info.get("ts")), _epoch_seconds(info.get("created"))
    if now is None or created is None:
        return None
    return now - created


def _epoch_seconds(value: object) -> float | None:
    """An RFC 3339 time of nats-server (nanoseconds, UTC) in seconds since the epoch."""
    if not isinstance(value, str):
        return None
    try:
        whole, _, fraction = value.rstrip("Z").partition(".")
        seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
        return seconds + (float("0." + fraction) if fraction.isdigit() else 0.0)
    except ValueError:
        return None


class Truncation(LogPart):
    """
    Truncates one log: what L{ILog.truncate} and L{ILog.truncate_offset}
    do, and its retention (L{retain}, and L{due} after appends).
    """

    def __init__(self, log: JetStreamLog, chain: AppendChain, reader: MessageReader) -> None:
        super().__init__(log)
        self._chain = chain
        self._reader = reader
        self._retention_running = False
        self._last_retention = 0.0

    def truncate(self, position: int | None = None) -> Deferred[int]:
        if self._log._closed:
            return fail(LogClosed(self.name))
        if position is None or position > self._log.end_position:
            position = self._log.end_position
        if position <= self._log.start_position:
            return succeed(self._log.start_position)
        if position == self._log.end_position:
            return self._truncate(position, self._log.end_offset)

        def at(found: _Found) -> Deferred[int]:
            info, entry = found
            return self._truncate(position, info.offset + _offsets(entry)[position - info.position])
        return self._reader.load("position", position).addCallback(at)

    def truncate_offset(self, offset: int) -> Deferred[int]:
        if self._log._closed:
            return fail(LogClosed(self.name))
        if offset > self._log.end_offset:
            return fail(PositionOutOfRange(f"offset {offset} beyond end {self._log.end_offset}"))
        if offset <= self._log.start_offset:
            return succeed(self._log.start_offset)
        return self._log.position_of_offset(offset).addCallback(
            lambda position: self._truncate(position, offset)).addCallback(
            lambda _: self._log.start_offset)

    @defer.inlineCallbacks
    def _truncate(self, position: int, offset: int) -> _Inline[int]:
        """A marker saying where the log starts, then the purge of what it hides."""
        a = _Append(lengths_array(), b"", None, self.store.monotonic() + self.store.timeout,
                    kind=MARKER, start=(position, offset))
        yield self._chain.enqueue(a)
        marker_seq = cast(int, a.last_seq)  # set once it is stored
        keep: int | None = marker_seq
        if position < self._log.end_position:
            try:
                info = yield self._reader.locate("position", position)
                keep = min(info.seq, marker_seq)
            except PositionOutOfRange:
                keep = None
        if keep is not None and keep > self._log._first_seq:
            try:
                yield self.store._call(self.store.io.purge, self.stream, keep)
                self._log._first_seq = keep
                self._log._index.forget_before(keep)
            except (NotAvailable, JetStreamError) as e:
                # the log is truncated (the marker is stored); the space
                # comes back at the next retention round
                log.warn("log {name}: purge below {seq} failed: {error}", name=self.name,
                         seq=keep, error=e)
        return self._log.start_position

    def due(self) -> bool:
        c = self._log.config
        now = self.store.monotonic()
        if self._retention_running or now - self._last_retention < 1.0:
            return False
        kept = self._log.end_position - self._log.start_position
        if c.log_max_count > 0 and kept > c.log_max_count + max(1, c.log_max_count // 8):
            return True
        size = self._log.end_offset - self._log.start_offset
        return c.log_max_size > 0 and size > c.log_max_size + max(1, c.log_max_size // 8)

    @defer.inlineCallbacks
    def retain(self) -> _Inline[int]:
        """
        Apply the retention limits: hide and purge whole messages while
        what remains still reaches each limit (so, as on the file store, a
        log keeps I{at least} its limits, here less than one message more).
        """
        if self._retention_running or self._log._closed:
            return self._log.start_position
        self._retention_running = True
        self._last_retention = self.store.monotonic()
        try:
            c = self._log.config
            cut = self._log.start_position
            if c.log_max_count > 0 and \
                    self._log.end_position - self._log.start_position > c.log_max_count:
                info = yield self._reader.locate("position",
                                                 self._log.end_position - c.log_max_count)
                cut = max(cut, info.position)
            if c.log_max_size > 0 and \
                    self._log.end_offset - self._log.start_offset > c.log_max_size:
                info = yield self._reader.locate("offset", self._log.end_offset - c.log_max_size)
                cut = max(cut, info.position)
            if c.log_max_age > 0:
                # by the cluster's clock, which stamped the messages: a
                # front-end whose clock runs an hour ahead would otherwise
                # purge every record younger than an hour's max age
                info = yield self.store._call(self.store.io.stream_info, self.stream)
                since = cluster_time(info) - c.log_max_age
                got = yield self.store._call(
                    self.store.io.get, self.stream,
                    next=subjects_filter(self.store.prefix, self.name),
                    start_time=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(since))
                    + f".{int(since % 1 * 1e6):06d}Z")
                if got is None:
                    cut = max(cut, self._log.end_position)
                else:
                    info = self._log._decode(got)
                    self._log._index.add(info)
                    cut = max(cut, info.position)
            if cut > self._log.start_position:
                yield self._log.truncate(cut)
        finally:
            self._retention_running = False
        return self._log.start_position
