"""
Pravega segments on top of the shared log store.

A segment is one log addressed by payload byte offset: every append stores
the writer's bytes (whole Event frames, type 0 + int length + data, exactly
as the reference keeps them) as one or more records, so the segment's byte
offsets are the log's payload offsets and a ReadSegment is a
C{read_bytes}.

State that must survive a restart is kept in the log's attributes, written
atomically with the data they describe:

- C{attr:<32 hex digits>}: the segment attribute with that UUID.  As in the
  reference, a writer's last event number (its dedup level) is the
  attribute named by its writer id, persisted with the append that reached
  it; UpdateSegmentAttribute writes the same namespace;
- C{sealed}: 1 once sealed (persisted after every earlier append);
- C{mtime}: last modification, milliseconds since 1970.

Segment names (C{scope/stream/0.#epoch.0}) contain characters the log store
forbids, so L{log_name} escapes them reversibly: C{pravega_} then every byte
of the UTF-8 name outside C{[A-Za-z0-9-]} as C{_xx} (two lowercase hex
digits; C{_} itself is C{_5f}).  A name whose escaped form exceeds the store's
200 characters becomes C{pravega__h} + SHA-256 hex, which no escaped name can
produce (escapes are C{_} + hex); those are the only names L{segment_name}
cannot invert.
"""

import hashlib
import re
import time
import uuid
from collections.abc import Generator
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, inlineCallbacks, succeed
from twisted.logger import Logger

from streamproto.core.observer import Observers
from streamproto.log.config import MAX_NAME_LENGTH, LogConfig
from streamproto.log.interfaces import ILog, ILogStore
from streamproto.log.errors import (
    AppendConflict, LogClosed, LogExists, LogNotFound, PositionOutOfRange,
)

PREFIX = "pravega_"
_HASHED = PREFIX + "_h"
_PLAIN = re.compile(r"[A-Za-z0-9-]")
#: A record can hold a whole AppendBlock plus its AppendBlockEnd.
SEGMENT_LOG_CONFIG = LogConfig(max_record_size=2 * 0x00FFFFFF + 16)
#: Largest segment a merge (transaction commit) copies: it is held in memory.
MAX_MERGE_BYTES = 256 * 1024 * 1024


class SegmentError(Exception):
    """Base of the errors the server maps to Pravega error replies."""


class _NamedSegmentError(SegmentError):
    """An error about one segment, constructed with its name."""

    @property
    def segment(self):
        return self.args[0] if self.args else None


class SegmentNotFound(_NamedSegmentError):
    pass


class SegmentExists(_NamedSegmentError):
    pass


class SegmentSealed(_NamedSegmentError):
    pass


class SegmentTruncated(SegmentError):
    """C{offset} is before the segment's C{start_offset}."""

    def __init__(self, start_offset):
        super().__init__(f"segment truncated at {start_offset}")
        self.start_offset = start_offset


class MergeTooLarge(SegmentError):
    """The source of a merge is larger than a merge may be."""


class BadOffset(SegmentError):
    """An offset that disagrees with the segment's length (C{expected})."""

    def __init__(self, expected):
        super().__init__(f"expected offset {expected}")
        self.expected = expected


def log_name(segment: str) -> str:
    """The log store name of a segment (see the module docstring)."""
    out = [PREFIX]
    for ch in segment:
        if _PLAIN.match(ch):
            out.append(ch)
        else:
            out.extend("_%02x" % b for b in ch.encode("utf-8", "surrogatepass"))
    name = "".join(out)
    if len(name) > MAX_NAME_LENGTH or not segment:
        return _HASHED + hashlib.sha256(segment.encode("utf-8", "surrogatepass")).hexdigest()
    return name


def segment_name(name: str) -> str | None:
    """
    Inverse of L{log_name}.

    @return: the segment name, or None if C{name} is not an escaped segment
        name (another protocol's log, or a hashed long name).
    """
    if not name.startswith(PREFIX) or name.startswith(_HASHED):
        return None
    body = name[len(PREFIX):]
    raw = bytearray()
    i = 0
    while i < len(body):
        if body[i] == "_":
            try:
                raw.append(int(body[i + 1:i + 3], 16))
            except ValueError:
                return None
            i += 3
        else:
            raw += body[i].encode("ascii")
            i += 1
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


#: What Pravega puts between a parent segment's name and a transient
#: segment's ids (NameUtils.getTransientNameFromId).
TRANSIENT_DELIMITER = "#transient."


def transient_name(parent: str, writer_id: uuid.UUID) -> str:
    """
    A new transient segment name for C{parent}, as Pravega makes them:
    C{parent#transient.<writer id hex>.<random UUID hex>} (32 lowercase hex
    digits each).
    """
    return f"{parent}{TRANSIENT_DELIMITER}{writer_id.hex}.{uuid.uuid4().hex}"


def is_transient(name: str) -> bool:
    """Whether C{name} is a transient segment's name (see L{transient_name})."""
    i = name.rfind(TRANSIENT_DELIMITER)
    return i >= 0 and len(name) - (i + len(TRANSIENT_DELIMITER)) == 65


def attribute_key(attribute_id: uuid.UUID) -> str:
    return "attr:" + attribute_id.hex


writer_key = attribute_key


def _now_ms():
    return int(time.time() * 1000)


class Segment:
    """
    One open segment, shared by every connection of a server.

    C{issued_offset} is the length including appends not yet durable: it is
    what conditional appends are checked against and what DataAppended
    reports as the write offset.  C{log.end_offset} is the durable length,
    all readers ever see.  C{issued_position} is the log position the next
    append will take.

    Several front-ends of one shared store (C{--store nats://...}) may
    append to one segment.  What this one issued is its own view; whenever
    nothing of its own is pending it takes the log's end as it knows it
    (the store tells it of other front-ends' appends), and a conditional
    append also expects its log position, which the store judges where the
    append lands: a conditional append never succeeds on a stale view.
    """

    log = Logger()

    def __init__(self, store: "SegmentStore", name: str, log: ILog) -> None:
        self.store = store
        self.name = name
        self.log_ = log
        attrs = log.attributes
        self.sealed = bool(attrs.get("sealed"))
        self.seal_durable = self.sealed
        self.mtime = attrs.get("mtime", 0)
        self.issued_offset = log.end_offset
        self.issued_position = log.end_position
        self._issued: dict[str, int] = {}  # writer key -> last event number sent to the log
        self._pending = 0
        self._idle: Observers[None] = Observers()  # waiting for no pending appends
        self._tail_waiters: set[Deferred[None]] = set()
        self.failed: BaseException | None = None
        self.deleted = False

    # -- writers ---------------------------------------------------------
    def last_event_number(self, writer_id: uuid.UUID, default: int) -> int:
        """The writer's last event number issued to the log (durable once idle)."""
        key = writer_key(writer_id)
        n = self._issued.get(key)
        if n is None:
            n = self.log_.attributes.get(key, default)
        return n

    def durable_event_number(self, writer_id: uuid.UUID, default: int) -> int:
        return self.log_.attributes.get(writer_key(writer_id), default)

    def attribute(self, attribute_id: uuid.UUID, default: int) -> int:
        """The durable value of a UUID attribute."""
        if self.deleted:
            raise SegmentNotFound(self.name)
        return self.log_.attributes.get(attribute_key(attribute_id), default)

    def update_attribute(self, attribute_id: uuid.UUID, new_value: int, expected_value: int,
                         null: int) -> Deferred[bool]:
        """
        Set a UUID attribute if its value (C{null} when unset, counting
        updates and appends not yet durable) is C{expected_value}.

        @return: Deferred firing with True once the new value is durable, or
            False at once if the value differs.
        """
        try:
            self._check_writable()
        except Exception as e:  # a SegmentError, or the log error that failed the segment
            return fail(e)
        if self.last_event_number(attribute_id, null) != expected_value:
            return succeed(False)
        key = attribute_key(attribute_id)
        expected = self._expecting(key)
        self._issued[key] = new_value
        self.mtime = _now_ms()
        d = self._track(self.log_.append([], {key: new_value, "mtime": self.mtime},
                                         expected_attributes=expected),
                        lambda _: True)

        def changed(f):
            # stored meanwhile through another front-end (or by an update
            # whose outcome was unknown): the value differs after all
            f.trap(AppendConflict)
            return False
        return d.addErrback(changed)

    def _expecting(self, key):
        """
        What the log's attribute C{key} must still be when an append
        setting it lands: its value counting appends issued but not yet
        durable (None when unset).  Checked by the store where the append
        takes its place, so that a writer's events are stored once even when
        an append whose outcome was unknown (a timeout on a replicated
        store) was stored after all and the writer resent them.
        """
        if key in self._issued:
            return {key: self._issued[key]}
        return {key: self.log_.attributes.get(key)}

    def settle(self) -> Deferred[None]:
        """@return: Deferred firing once every append issued so far is done."""
        if not self._pending:
            return succeed(None)
        return self._idle.when()

    def _check_writable(self):
        if self.deleted:
            raise SegmentNotFound(self.name)
        if self.failed is not None:
            raise self.failed
        if self.sealed:
            raise SegmentSealed(self.name)

    def append(self, data: bytes, writer_id: uuid.UUID, event_number: int,
               expected_offset: int | None = None) -> Deferred[int]:
        """
        Issue an append at once (so appends keep their arrival order).

        @return: Deferred firing with the segment length after this append
            once it is durable; fails with L{SegmentSealed},
            L{SegmentNotFound}, L{BadOffset} or a log error.
        """
        try:
            self._check_writable()
        except Exception as e:  # a SegmentError, or the log error that failed the segment
            return fail(e)
        self._take_log_end()
        if expected_offset is not None and expected_offset != self.issued_offset:
            return fail(BadOffset(self.issued_offset))
        limit = self.log_.config.max_record_size
        records: list[bytes] | list[memoryview]
        if len(data) <= limit:
            records = [data]
        else:
            view = memoryview(data)
            records = [view[i:i + limit] for i in range(0, len(data), limit)]
        position = self.issued_position
        self.issued_offset += len(data)
        self.issued_position += len(records)
        end = self.issued_offset
        key = writer_key(writer_id)
        expected = self._expecting(key)
        self._issued[key] = event_number
        self.mtime = _now_ms()
        d = self.log_.append(records, {key: event_number, "mtime": self.mtime},
                             expected_position=None if expected_offset is None else position,
                             expected_attributes=expected)
        if expected_offset is None:
            return self._track(d, lambda _: end)

        def moved(f):
            # the log does not end where this front-end thought: another one
            # appended first.  The check failed, nothing was written; this
            # front-end's view is retaken from the log once idle
            f.trap(AppendConflict)
            if self.log_.end_position == position:
                return f    # the writer's event number changed, not the length
            if self._issued.get(key) == event_number:
                # nothing of this writer's was issued after it: undo
                if expected[key] is None:
                    del self._issued[key]
                else:
                    self._issued[key] = expected[key]
            if self.issued_position == position + len(records):
                # nothing at all was issued after it: undo
                self.issued_position = position
                self.issued_offset = end - len(data)
            return fail(BadOffset(self.log_.end_offset))
        return self._track(d.addErrback(moved), lambda _: end, spared=(BadOffset,))

    def _take_log_end(self) -> None:
        """
        With nothing of ours pending, what we issued is what the log says
        it holds, which includes other front-ends' appends to a shared
        store (and nothing else: a local store has only ours).
        """
        if not self._pending:
            self.issued_offset = self.log_.end_offset
            self.issued_position = self.log_.end_position

    def append_merged(self, data: bytes, marker: str) -> Deferred[int]:
        """
        Append the whole content of a merged segment as one log append,
        with attribute C{marker} set to 1 in the same atomic write: after a
        crash either all of it is there and marked, or none of it.

        @return: Deferred firing with the segment length once durable.
        """
        try:
            self._check_writable()
        except Exception as e:  # a SegmentError, or the log error that failed the segment
            return fail(e)
        limit = self.log_.config.max_record_size
        view = memoryview(data)
        records = [view[i:i + limit] for i in range(0, len(data), limit)]
        self.issued_offset += len(data)
        end = self.issued_offset
        self.mtime = _now_ms()
        # never twice, even when a first try's outcome was unknown
        return self._track(self.log_.append(records, {marker: 1, "mtime": self.mtime},
                                            expected_attributes={marker: None}),
                           lambda _: end)

    def _track(self, d, on_success, spared=()):
        """
        Count C{d} as pending until it fires.  A failure fails the segment
        (its issued view no longer matches the log: it is reopened), except
        for the errors in C{spared}, which only fail this append.
        """
        self._pending += 1

        def done(result):
            self._pending -= 1
            if not self._pending:
                self._idle.fire()
            return result

        def failed(f):
            if f.check(LogClosed) and self.deleted:
                return fail(SegmentNotFound(self.name))
            if f.check(*spared):
                return f
            if self.failed is None:
                # our issued_offset no longer matches the log: reopen it
                self.failed = f.value
                self.store._forget(self)
                self.log.error("segment {segment} failed: {error}", segment=self.name,
                               error=f.value)
            return f

        d.addCallbacks(on_success, failed)
        d.addBoth(done)
        return d

    # -- maintenance -----------------------------------------------------
    def seal(self) -> Deferred[int]:
        """@return: Deferred firing with the final length once the seal is durable."""
        try:
            self._check_writable()
        except Exception as e:  # a SegmentError, or the log error that failed the segment
            return fail(e)
        self.sealed = True
        self.mtime = _now_ms()
        end = self.issued_offset

        def durable(_):
            self.seal_durable = True
            waiters, self._tail_waiters = self._tail_waiters, set()
            for d in waiters:
                if not d.called:
                    d.callback(None)
            return end

        return self._track(self.log_.append([], {"sealed": 1, "mtime": self.mtime}), durable)

    def truncate(self, offset: int) -> Deferred[int]:
        """@return: Deferred firing with the new start offset."""
        if self.deleted:
            return fail(SegmentNotFound(self.name))
        if offset < 0 or offset > self.log_.end_offset:
            return fail(BadOffset(self.log_.end_offset))
        if offset <= self.log_.start_offset:
            return succeed(self.log_.start_offset)
        return self.log_.truncate_offset(offset)

    def info(self) -> dict[str, Any]:
        return {
            "segment": self.name,
            "sealed": self.seal_durable,
            "start_offset": self.log_.start_offset,
            "write_offset": self.log_.end_offset,
            "last_modified": self.mtime,
        }

    # -- reading ---------------------------------------------------------
    def read(self, offset: int, max_bytes: int) -> Deferred[tuple[bytes, bool, bool]]:
        """
        @return: Deferred firing with C{(data, at_tail, end_of_segment)} of
            what is durable at C{offset} (possibly nothing); fails with
            L{SegmentTruncated} below the start offset.
        """
        log = self.log_
        if self.deleted:
            return fail(SegmentNotFound(self.name))
        if offset < log.start_offset:
            return fail(SegmentTruncated(log.start_offset))
        if offset >= log.end_offset:
            return succeed((b"", not self.seal_durable, self.seal_durable))

        def flags(data):
            at_end = offset + len(data) >= log.end_offset
            return data, at_end and not self.seal_durable, at_end and self.seal_durable

        def truncated(f):
            f.trap(PositionOutOfRange)   # truncated while we were reading
            return fail(SegmentTruncated(log.start_offset))

        return log.read_bytes(offset, max_bytes).addCallbacks(flags, truncated)

    def wait_for_data(self, offset: int, timeout: float) -> Deferred[None]:
        """
        @return: Deferred firing (with None) once bytes beyond C{offset} are
            durable, the segment is sealed, or C{timeout} seconds passed;
            cancellable.
        """
        if self.log_.end_offset > offset or self.seal_durable or self.deleted:
            return succeed(None)
        waiting = self.log_.wait_offset(offset, timeout)

        def cancel(_):
            waiting.cancel()

        d: Deferred[None] = Deferred(cancel)
        self._tail_waiters.add(d)

        def woke(_):
            self._tail_waiters.discard(d)
            if not d.called:
                d.callback(None)

        def broke(f):
            self._tail_waiters.discard(d)
            if not f.check(CancelledError) and not d.called:
                d.errback(SegmentNotFound(self.name)
                          if self.deleted or f.check(LogClosed) else f)

        waiting.addCallbacks(woke, broke)
        d.addBoth(self._stop_waiting, waiting)
        return d

    def _stop_waiting(self, result, waiting):
        if not waiting.called:
            waiting.cancel()
        return result


class SegmentStore:
    """
    The segments of one server: opens logs lazily and shares each open
    L{Segment} between connections (dedup and conditional appends need one
    view of every writer's state).
    """

    log = Logger()

    def __init__(self, store: ILogStore, config: LogConfig = SEGMENT_LOG_CONFIG) -> None:
        self.store = store
        self.config = config
        self._open: dict[str, Segment] = {}
        # segment name -> the Deferreds waiting for it to open
        self._opening: dict[str, list[Deferred[Segment]]] = {}

    def _forget(self, segment: Segment) -> None:
        if self._open.get(segment.name) is segment:
            del self._open[segment.name]

    def get(self, name: str) -> Deferred[Segment]:
        """@return: Deferred firing with the L{Segment}; fails with L{SegmentNotFound}."""
        seg = self._open.get(name)
        if seg is not None:
            return succeed(seg)
        d: Deferred[Segment] = Deferred()
        waiting = self._opening.get(name)
        if waiting is not None:
            waiting.append(d)
            return d
        self._opening[name] = [d]

        def opened(log):
            seg = self._open[name] = Segment(self, name, log)
            return seg

        def missing(f):
            f.trap(LogNotFound)
            return fail(SegmentNotFound(name))

        def deliver(result):
            for w in self._opening.pop(name):
                w.callback(result) if not hasattr(result, "check") else w.errback(result)

        opening = self.store.get(log_name(name))
        opening.addCallbacks(opened, missing).addBoth(deliver)
        return d

    def create(self, name: str) -> Deferred[Segment]:
        """@return: Deferred firing with the new L{Segment}; fails with L{SegmentExists}."""
        if name in self._open:
            return fail(SegmentExists(name))

        def created(log):
            seg = Segment(self, name, log)
            seg.mtime = _now_ms()
            self._open[name] = seg
            return log.append([], {"mtime": seg.mtime}).addCallback(lambda _: seg)

        def exists(f):
            f.trap(LogExists)
            return fail(SegmentExists(name))

        return self.store.create(log_name(name), self.config).addCallbacks(created, exists)

    def delete(self, name: str) -> Deferred[None]:
        """Delete a segment: pending appends fail, waiting reads end."""
        seg = self._open.pop(name, None)
        if seg is not None:
            seg.deleted = True
            waiters, seg._tail_waiters = seg._tail_waiters, set()
            for d in waiters:
                if not d.called:
                    d.errback(SegmentNotFound(name))

        def missing(f):
            f.trap(LogNotFound)
            return fail(SegmentNotFound(name))

        return self.store.delete(log_name(name)).addErrback(missing)

    @inlineCallbacks
    def merge(self, target: str, source: str, max_bytes: int = MAX_MERGE_BYTES
              ) -> Generator[Deferred[Any], Any, int]:
        """
        Seal C{source}, append all its bytes to C{target} atomically, then
        delete C{source} (a transaction commit).  Idempotent: the target
        remembers (attribute C{merged:<hash of source>}) that it took
        C{source}, so a merge retried after a crash never appends twice.

        @return: Deferred firing with the target's length; fails with
            L{SegmentNotFound}, L{SegmentSealed} (target sealed) or
            L{MergeTooLarge}.
        """
        tgt = yield self.get(target)
        marker = "merged:" + hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        if tgt._issued.get(marker) and not tgt.log_.attributes.get(marker):
            # a merge of source (a commit retried meanwhile) is in flight:
            # this answer stands for its append, so it waits for it, and the
            # source is kept until it is stored (if it fails, the target
            # reopens without the marker and the merge is done again here)
            yield tgt.settle()
            tgt = yield self.get(target)
        if tgt.log_.attributes.get(marker):
            try:
                yield self.delete(source)
            except SegmentNotFound:
                pass
            return tgt.issued_offset
        src = yield self.get(source)
        if not src.sealed:
            yield src.seal()
        yield src.settle()
        size = src.log_.end_offset - src.log_.start_offset
        if size > max_bytes:
            raise MergeTooLarge(f"{source}: {size} bytes")
        chunks = []
        offset = src.log_.start_offset
        while offset < src.log_.end_offset:
            data, _, _ = yield src.read(offset, 4 * 1024 * 1024)
            if not data:
                break
            chunks.append(data)
            offset += len(data)
        tgt._issued[marker] = 1
        end = yield tgt.append_merged(b"".join(chunks), marker)
        try:
            yield self.delete(source)
        except SegmentNotFound:
            pass
        self.log.info("merged {source} into {target}", source=source, target=target)
        return end

    @inlineCallbacks
    def delete_transients(self) -> Generator[Deferred[Any], Any, list[str]]:
        """
        Delete every transient segment in the store: what a crash left of
        the transient segments of connections that are gone.

        @return: Deferred firing with the names deleted.
        """
        deleted = []
        for name in self.names():
            if is_transient(name):
                try:
                    yield self.delete(name)
                except SegmentNotFound:
                    continue
                deleted.append(name)
        if deleted:
            self.log.info("deleted {n} transient segments left from before",
                          n=len(deleted))
        return deleted

    def names(self) -> list[str]:
        """Segment names in the store (hashed long names are left out)."""
        out: list[str] = []
        for n in self.store.names():
            s = segment_name(n)
            if s is not None:
                out.append(s)
        return out
