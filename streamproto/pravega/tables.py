"""
Pravega table segments (key/value segments with versioned keys) on the log
store.

A table segment is one log (named like a stream segment, through
L{streamproto.pravega.segments.log_name}, so the two share one namespace,
as in Pravega) whose records are the updates and removals, in order; its
C{table} attribute is 1.  Opening it replays the records into a dict.

Record layout:

- update: C{b"U"}, then per entry C{int32 key length, int32 value length,
  key, value};
- removal: C{b"R"}, then per key C{int32 key length, key}.

A key's version is the payload byte offset of its entry in the log (as the
reference uses the entry's offset in the segment): unique, increasing, and
the same after a replay.  L{Table.delta} returns the live entries whose
version is at or beyond a position, in version order, which is what the
Rust client's reader-group synchronizer polls with C{ReadTableEntriesDelta}.

L{Table.page} serves C{ReadTableKeys} / C{ReadTableEntries}: the live
entries in key order (bytewise), a page at a time.  The continuation token
is opaque to clients: C{0x01} then the last key returned, so a page
continues strictly after it even if that key was removed meanwhile; keys
added behind the cursor are not seen by that iteration (as in Pravega,
iteration is not a snapshot).  The optional from / to keys bound the
iteration, both inclusive.

Operations on one table run one at a time (a L{DeferredLock}): the in-memory
state changes only once the record is durable, so a reply never reports
something a crash could take back, and conditional checks see every
acknowledged update.

Several front-ends of one shared store (C{--store nats://...}) may serve
one table.  Each applies the log's records in order, its own and the
others' alike (L{Table.catch_up}, before every operation: the store tells a
log of other front-ends' appends), and each update or removal is appended
only if it lands right after the last record applied (C{expected_position},
judged by the store where the record lands).  If another front-end's
record got there first, the table catches up and checks the keys' versions
again: two front-ends never both succeed on the same version.
"""

import bisect
import struct

from twisted.internet.defer import DeferredLock, fail, inlineCallbacks, returnValue, succeed
from twisted.logger import Logger

from streamproto.log.errors import AppendConflict, LogExists, LogNotFound
from streamproto.pravega.codec import TableKey
from streamproto.pravega.segments import (
    SEGMENT_LOG_CONFIG, SegmentExists, SegmentNotFound, log_name,
)

_II = struct.Struct(">ii")
_I = struct.Struct(">i")
UPDATE = b"U"
REMOVE = b"R"
#: Largest record we write: updates bigger than this are refused.
MAX_UPDATE_BYTES = 8 * 1024 * 1024
#: Bytes of entries a delta read returns (at least one entry).
MAX_READ_BYTES = 4 * 1024 * 1024
#: Times an update is checked and tried again after another front-end's
#: record took its place, before it fails with L{TableBusy}.
MAX_CONFLICT_RETRIES = 16


class TableError(Exception):
    pass


class KeyBadVersion(TableError):
    """A conditional update or removal named a version the key does not have."""


class KeyDoesNotExist(TableError):
    """A conditional update or removal named a key that does not exist."""


class TableNotEmpty(TableError):
    pass


class UpdateTooLarge(TableError):
    pass


class BadContinuationToken(TableError, ValueError):
    """A continuation token this server did not make."""


#: first byte of the continuation tokens we hand out (a format version)
TOKEN_V1 = b"\x01"


class TableBusy(TableError):
    """Other front-ends' updates kept taking this one's place in the log."""


class Table:
    """
    One open table segment: C{entries} maps key -> (version, value), as of
    the log's records up to C{applied_position} (at payload offset
    C{applied_offset}).
    """

    def __init__(self, name, log):
        self.name = name
        self.log_ = log
        self.entries = {}
        self.lock = DeferredLock()
        self.deleted = False
        self._sorted_keys = None    # sorted(entries), rebuilt after keys come or go
        # tables are never truncated: record offsets are running sums
        self.applied_position = log.start_position
        self.applied_offset = log.start_offset

    def catch_up(self):
        """
        Apply the records the log holds beyond those applied (at open: all
        of them; later: other front-ends' updates).

        @return: Deferred firing with the table once it is current.
        """
        if self.applied_position >= self.log_.end_position and not self.lock.locked:
            return succeed(self)
        return self._locked(self._catch_up).addCallback(lambda _: self)

    @inlineCallbacks
    def _catch_up(self):
        log = self.log_
        while self.applied_position < log.end_position:
            batch = yield log.read(self.applied_position, 4096, 4 * 1024 * 1024)
            if not len(batch):
                break
            for record in batch.records():
                self.apply(self.applied_offset, record)
                self.applied_offset += len(record)
            self.applied_position = batch.next_position

    def apply(self, offset, record):
        """Replay one record stored at payload C{offset}; @return: versions."""
        record = memoryview(record)
        kind = bytes(record[:1])
        pos = 1
        versions = []
        entries = self.entries
        if kind == UPDATE:
            while pos < len(record):
                klen, vlen = _II.unpack_from(record, pos)
                version = offset + pos
                pos += 8
                key = bytes(record[pos:pos + klen])
                pos += klen
                if key not in entries:
                    self._sorted_keys = None
                entries[key] = (version, bytes(record[pos:pos + vlen]))
                pos += vlen
                versions.append(version)
        elif kind == REMOVE:
            while pos < len(record):
                (klen,) = _I.unpack_from(record, pos)
                pos += 4
                if entries.pop(bytes(record[pos:pos + klen]), None) is not None:
                    self._sorted_keys = None
                pos += klen
        else:
            raise TableError(f"table {self.name}: bad record at offset {offset}")
        return versions

    def _check(self, key):
        """Check one conditional key against the current state."""
        expected = key.version
        if expected == TableKey.NO_VERSION:
            return
        current = self.entries.get(key.data)
        if expected == TableKey.NOT_EXISTS:
            if current is not None:
                raise KeyBadVersion(self.name)
        elif current is None:
            raise KeyDoesNotExist(self.name)
        elif current[0] != expected:
            raise KeyBadVersion(self.name)

    @inlineCallbacks
    def _write(self, check, record):
        """
        Append C{record} right after the last record applied, once C{check}
        (which raises a L{TableError}) passes; when another front-end's
        record took that place, catch up and check again.

        @return: Deferred firing with the versions the record gave.
        """
        for _ in range(MAX_CONFLICT_RETRIES):
            if self.deleted:
                raise SegmentNotFound(self.name)
            yield self._catch_up()
            check()
            try:
                yield self.log_.append([record], expected_position=self.applied_position)
            except AppendConflict:
                continue
            versions = self.apply(self.applied_offset, record)
            self.applied_offset += len(record)
            self.applied_position += 1
            return versions
        raise TableBusy(f"table {self.name}: other front-ends kept updating it")

    def _locked(self, fn, *args):
        return self.lock.run(fn, *args)

    def update(self, entries):
        """
        Apply C{entries} (a sequence of (L{TableKey}, value)) all or none.

        @return: Deferred firing with the new versions, in order; fails with
            L{KeyBadVersion}, L{KeyDoesNotExist} or L{UpdateTooLarge}.
        """
        return self._locked(self._update, entries)

    def _update(self, entries):
        parts = [UPDATE]
        for key, value in entries:
            parts += (_II.pack(len(key.data), len(value)), key.data, value)
        record = b"".join(parts)
        if len(record) > MAX_UPDATE_BYTES:
            return fail(UpdateTooLarge(self.name))

        def check():
            for key, _ in entries:
                self._check(key)
        return self._write(check, record)

    def remove(self, keys):
        """Remove C{keys} (L{TableKey}s, conditional on their versions) all or none."""
        return self._locked(self._remove, keys)

    def _remove(self, keys):
        parts = [REMOVE]
        for key in keys:
            parts += (_I.pack(len(key.data)), key.data)

        def check():
            for key in keys:
                if key.version != TableKey.NOT_EXISTS:
                    self._check(key)
        return self._write(check, b"".join(parts)).addCallback(lambda _: None)

    def read(self, keys):
        """@return: [(TableKey with the current version, value)]; missing keys get -1 and b""."""
        out = []
        for key in keys:
            current = self.entries.get(key.data)
            if current is None:
                out.append((TableKey(key.data, TableKey.NOT_EXISTS), b""))
            else:
                out.append((TableKey(key.data, current[0]), current[1]))
        return out

    def page(self, token, max_items, from_key=b"", to_key=b""):
        """
        One page of a key-ordered iteration.

        @param token: the continuation token of the previous page (empty to
            start).
        @param from_key, to_key: inclusive bounds (empty: unbounded).
        @return: C{(items, token)}: up to C{max_items} (at least one) of
            C{(TableKey with its version, value)} in key order, stopping
            early past L{MAX_READ_BYTES}, and the token to continue with
            (the given one when the page is empty: the iteration is over).
        @raise BadContinuationToken: for a token we did not make.
        """
        keys = self._sorted_keys
        if keys is None:
            keys = self._sorted_keys = sorted(self.entries)
        if token:
            if token[:1] != TOKEN_V1:
                raise BadContinuationToken(f"table {self.name}: unknown continuation token")
            start = bisect.bisect_right(keys, bytes(token[1:]))
        else:
            start = 0
        if from_key:
            start = max(start, bisect.bisect_left(keys, from_key))
        items = []
        size = 0
        for key in keys[start:start + max(1, max_items)]:
            if to_key and key > to_key:
                break
            if items and size > MAX_READ_BYTES:
                break
            version, value = self.entries[key]
            items.append((TableKey(key, version), value))
            size += len(key) + len(value) + 24
        if not items:
            return [], bytes(token)
        return items, TOKEN_V1 + items[-1][0].data

    def delta(self, from_position, max_entries):
        """
        @return: C{(entries, reached_end, last_position)}: up to
            C{max_entries} live entries with a version at or beyond
            C{from_position} in version order, and the position to ask from
            next time (just past the last entry returned).
        """
        found = sorted((version, key, value) for key, (version, value) in self.entries.items()
                       if version >= from_position)
        page = []
        size = 0
        for item in found:
            # a reply must stay far below the frame limit
            if len(page) >= max(1, max_entries) or (page and size > MAX_READ_BYTES):
                break
            page.append(item)
            size += len(item[1]) + len(item[2]) + 24
        reached_end = len(page) == len(found)
        if page:
            last_position = page[-1][0] + 1
        else:
            last_position = max(from_position, 0)
        return ([(TableKey(key, version), value) for version, key, value in page],
                reached_end, last_position)


class TableStore:
    """The table segments of one server, opened lazily and shared."""

    log = Logger()

    def __init__(self, store, config=SEGMENT_LOG_CONFIG):
        self.store = store
        self.config = config
        self._open = {}
        self._opening = {}

    @inlineCallbacks
    def get(self, name):
        """
        @return: Deferred firing with the L{Table}, current with its log
            (other front-ends' updates applied); fails with
            L{SegmentNotFound}.
        """
        table = self._open.get(name)
        if table is None:
            table = yield self._load(name)
        table = yield table.catch_up()
        returnValue(table)

    @inlineCallbacks
    def _load(self, name):
        lock = self._opening.get(name)
        if lock is None:
            lock = self._opening[name] = DeferredLock()
        yield lock.acquire()
        try:
            table = self._open.get(name)
            if table is None:
                try:
                    log = yield self.store.get(log_name(name))
                except LogNotFound:
                    raise SegmentNotFound(name)
                if not log.attributes.get("table"):
                    raise SegmentNotFound(name)
                table = Table(name, log)
                yield table.catch_up()
                self._open[name] = table
            returnValue(table)
        finally:
            lock.release()
            if not lock.locked and not lock.waiting:
                self._opening.pop(name, None)

    @inlineCallbacks
    def create(self, name):
        """Create a table segment; fails with L{SegmentExists}."""
        try:
            log = yield self.store.create(log_name(name), self.config)
        except LogExists:
            log = yield self._unfinished(name)
        # The marker is a second step (a log is created without attributes):
        # when it fails the client is told so and retries, and the retry
        # finishes this log rather than finding it "existing" but no table.
        try:
            yield log.append([], {"table": 1}, expected_attributes={"table": None})
        except AppendConflict:
            raise SegmentExists(name)   # another front-end finished it first
        self._open[name] = Table(name, log)

    @inlineCallbacks
    def _unfinished(self, name):
        """
        The log of a table whose creation stopped between the log and its
        marker (the marker's append failed), to be finished; anything else
        of that name fails with L{SegmentExists}.
        """
        try:
            log = yield self.store.get(log_name(name))
        except LogNotFound:
            raise SegmentExists(name)   # deleted meanwhile: still not ours to make
        if log.attributes or log.end_position or log.end_offset:
            raise SegmentExists(name)
        returnValue(log)

    @inlineCallbacks
    def delete(self, name, must_be_empty):
        """Delete a table segment; fails with L{SegmentNotFound} or L{TableNotEmpty}."""
        table = yield self.get(name)
        if must_be_empty and table.entries:
            raise TableNotEmpty(name)
        table.deleted = True
        self._open.pop(name, None)
        try:
            yield self.store.delete(log_name(name))
        except LogNotFound:
            raise SegmentNotFound(name)
