"""
L{JetStreamLog}: one log, a JetStream stream, on the reactor thread.

The log holds the acknowledged state, what readers see: where the log
starts and ends (positions, payload offsets, stream sequences) and its
attributes.  Only what JetStream stored changes it, learnt from the stream
leader when the log is opened, from the follower (an ordered consumer of
every new message's headers), from the answers to our own publishes, and
from catching up with the leader after an error or on C{get()}.  A message
that breaks the chain of positions stops the log (C{failed}).

The L{ILog} methods are here, each handing its work to the object that
owns that side: appends to the L{AppendChain}, reads to the
L{MessageReader}, truncation and retention to L{Truncation}; waiters and
closing stay here because they are about the acknowledged state.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from twisted.internet import defer
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.base.observer import SharedCall
from streamproto.log.batch import RecordBatch
from streamproto.log.config import LogConfig
from streamproto.log.errors import (
    AppendConflict, CorruptLog, LogClosed, LogFailed, LogNotFound, RecordTooLarge, StoreUnavailable, skip_conflict,
)
from streamproto.log.gate import AppendRequest, GatedLog
from streamproto.log.interfaces import ILog
from streamproto.log.jetstream.chain import AppendChain, _Append
from streamproto.log.jetstream.common import Patience, _Inline, _store_errors, log
from streamproto.log.jetstream.reading import MessageReader
from streamproto.log.jetstream.truncation import Truncation, stream_age
from streamproto.log.msgindex import MessageIndex
from streamproto.log.natsformat import (
    ATTRS, EXPECTED_LAST_SEQUENCE, MARKER, MSG_ID, BatchInfo, MessageFormatError, decode_info,
    encode_headers, stream_name, subject, subjects_filter,
)
from streamproto.log.natsio import (
    WRONG_LAST_SEQUENCE, NotAvailable, PublishOutcome, StoredMsg, Watch,
)
from streamproto.log.result import AppendResult
from streamproto.log.waiters import Waiters

if TYPE_CHECKING:
    from streamproto.log.bridge import AsyncioThreadBridge
    from streamproto.log.jetstream.views import StoreView as JetStreamLogStore

_T = TypeVar("_T")

#: seconds to wait for the stream leader's answer to "where is the tail?"
CATCH_UP_TIMEOUT = 1.0

#: the message ids of a log's first markers start so; each writer adds its
#: own unique part: the expected sequence 0 lets one marker in, and the
#: unique id tells a writer's own earlier try (a duplicate) from another
#: writer's marker (a wrong last sequence)
INIT_MSG_ID = "streamproto-init"

_log_ids = itertools.count(1)


@implementer(ILog)
class JetStreamLog(GatedLog):
    """One log: a JetStream stream.  Built by L{JetStreamLogStore}."""

    #: appends wait in memory for the quorum
    holds_unsynced = True

    def __init__(self, store: JetStreamLogStore, name: str, config: LogConfig) -> None:
        self.store = store
        self.name = name
        self.config = config
        self.stream = stream_name(store.prefix, name)
        self.failed: BaseException | None = None
        #: a L{StoreUnavailable} while the cluster has not answered for
        #: C{timeout} seconds (appends fail at once), else None
        self.unavailable: StoreUnavailable | None = None
        self._id = next(_log_ids)
        self._clock = store.clock
        self._closed = False
        # the acknowledged state (what readers see)
        self.start_position = 0
        self.start_offset = 0
        self.end_position = 0
        self.end_offset = 0
        self._attributes: dict[str, int] = {}
        self._end_seq = 0
        self._first_seq = 1
        self._index = MessageIndex()
        self._waiters = Waiters(self._clock)
        self._offset_waiters = Waiters(self._clock)
        # the chain of appends (the write side)
        self._chain = AppendChain(self)
        # the read side
        self._reader = MessageReader(self)
        # where the log starts
        self._truncation = Truncation(self, self._chain, self._reader)
        self._watch: Watch | None = None
        self._refreshing: SharedCall[None] = SharedCall(self._catch_up)

    # -- coordinates -----------------------------------------------------
    @property
    def attributes(self) -> dict[str, int]:
        return dict(self._attributes)

    def _subject(self, kind: str) -> str:
        return subject(self.store.prefix, self.name, kind)

    # -- opening ---------------------------------------------------------
    @defer.inlineCallbacks
    def _recover(self, stream_info: dict[str, Any]) -> _Inline[None]:
        """Learn the acknowledged state from the stream (the leader's answers)."""
        state = stream_info.get("state", {})
        first_seq, last_seq = state.get("first_seq", 0), state.get("last_seq", 0)
        if last_seq == 0:
            # a stream without its first marker: its creator may be writing
            # it now, and a marker of ours first would make that create
            # fail as "exists" (seen in CI: a reader polling for a log the
            # store copy was creating).  Finished here only once the
            # creator had its whole timeout; until then not there yet.
            age = stream_age(stream_info)
            if age is not None and age < self.store.timeout:
                raise LogNotFound(f"log {self.name!r} is being created")
            yield self._write_init()
            stream_info = yield self.store._call(self.store.io.stream_info, self.stream)
            if stream_info is None:
                raise LogNotFound(f"log {self.name!r} not found")
            state = stream_info.get("state", {})
            first_seq, last_seq = state.get("first_seq", 0), state.get("last_seq", 0)
        self._first_seq = max(1, first_seq)
        io = self.store.io
        last = yield self.store._call(io.get, self.stream, last_seq)
        if last is None:
            raise CorruptLog(f"log {self.name}: stream {self.stream} lost its last message "
                             f"({last_seq}): positions cannot be recovered")
        last_info = self._decode(last)
        snapshot = yield self._latest_snapshot(last_info.seq)
        first = yield self.store._call(io.get, self.stream, seq=first_seq or 1,
                                       next=subjects_filter(self.store.prefix, self.name))
        self._jump(last_info, snapshot)
        if first is not None:
            first_info = self._decode(first)
            self._index.add(first_info)
            if first_info.kind != MARKER and first_info.position > self.start_position:
                # purged behind our back: what is gone is gone
                self.start_position, self.start_offset = first_info.position, first_info.offset

    @defer.inlineCallbacks
    def _latest_snapshot(
        self, upto_seq: int,
    ) -> _Inline[tuple[BatchInfo | None, BatchInfo | None]]:
        """The newest C{.a} or C{.m} message at or below C{upto_seq} (or newer), as a BatchInfo."""
        io = self.store.io
        got = yield defer.gatherResults([
            self.store._call(io.get, self.stream, last=self._subject(ATTRS)),
            self.store._call(io.get, self.stream, last=self._subject(MARKER)),
        ], consumeErrors=True)
        infos = [self._decode(m) for m in got if m is not None]
        for info in infos:
            self._index.add(info)
        markers = [i for i in infos if i.kind == MARKER]
        snapshot = max(infos, key=lambda i: i.seq) if infos else None
        marker = markers[0] if markers else None
        return snapshot, marker

    def _decode(self, msg: StoredMsg) -> BatchInfo:
        try:
            return decode_info(msg.seq, msg.subject, msg.headers)
        except MessageFormatError as e:
            raise CorruptLog(f"log {self.name}: {e}")

    def _jump(self, last_info: BatchInfo,
              snapshot: tuple[BatchInfo | None, BatchInfo | None]) -> None:
        """Take the tail the leader reported (may skip messages not seen yet)."""
        snap, marker = snapshot
        self._index.add(last_info)
        candidates = [last_info] + [i for i in (snap, marker) if i is not None]
        newest = max(candidates, key=lambda i: i.seq)
        if newest.seq <= self._end_seq:
            return
        self._end_seq = newest.seq
        self.end_position = newest.end_position
        self.end_offset = newest.end_offset
        if snap is not None:
            self._attributes = dict(snap.attributes or {})
        if marker is not None and marker.start is not None:
            self._apply_start(marker.start)
        self._chain.resolve(last_info)
        self._wake()

    @defer.inlineCallbacks
    def _write_init(self) -> _Inline[PublishOutcome]:
        """
        The first marker: position 0, no attributes, expected sequence 0.

        A stream just added has no leader until its replicas elect one:
        its publishes are answered "no responders" (503) meanwhile, seen
        right after a cluster started on a loaded machine.  The marker is
        sent again until the store's timeout rather than leaving a stream
        without it.  Its message id is this call's own, so a try that was
        stored though its answer was lost comes back as a duplicate (ours),
        while another writer's marker comes back as a wrong last sequence.

        @return: the last try's outcome, C{duplicate} meaning this call's
            own marker; a wrong last sequence is returned, not raised.
        """
        headers = dict(encode_headers(0, 0, 0, 0, 0, {}, (0, 0)),
                       **{MSG_ID: f"{INIT_MSG_ID}-{uuid.uuid4().hex}",
                          EXPECTED_LAST_SEQUENCE: "0"})
        patience = Patience(self.store)
        while True:
            outcome: PublishOutcome = yield self._publish_direct(
                self._subject(MARKER), headers, b"")
            if not isinstance(outcome.error, NotAvailable) or not (yield patience.pause()):
                break
        if outcome.error is not None and getattr(outcome.error, "err_code", None) not in (
                WRONG_LAST_SEQUENCE,):
            raise outcome.error
        return outcome

    def _publish_direct(self, subject_name: str, headers: dict[str, str],
                        body: bytes) -> Deferred[PublishOutcome]:
        d: Deferred[PublishOutcome] = defer.Deferred()
        self.store.bridge.call_soon(self.store.io.publish, subject_name, headers, body,
                                    d.callback)
        return d

    def _start_watch(self) -> Deferred[None]:
        d = self.store._call(self.store.io.watch, self.stream,
                             subjects_filter(self.store.prefix, self.name), self._end_seq + 1,
                             self._watched)

        def started(watch: Watch) -> None:
            if self._closed:
                self.store.bridge.call_soon(_spawn, self.store.bridge, watch.stop)
            else:
                self._watch = watch

        def failed(f: Failure) -> None:
            log.warn("log {name}: follower not started: {error}", name=self.name,
                     error=f.getErrorMessage())
        return d.addCallbacks(started, failed)

    def _watched(self, events: list[tuple[int, str, dict[str, str]]]) -> None:
        if self._closed:
            return
        for seq, subject_name, headers in events:
            try:
                info = decode_info(seq, subject_name, headers)
            except MessageFormatError as e:
                self._fail_stop(CorruptLog(f"log {self.name}: {e}"))
                return
            self._learn(info)

    # -- learning the acknowledged state ----------------------------------
    def _learn(self, info: BatchInfo) -> None:
        """A stored message, from an ack, the follower or a fetch."""
        if info.seq <= self._end_seq:
            self._index.add(info)
            self._chain.resolve(info)
            return
        if info.seq == self._end_seq + 1 and (info.position != self.end_position
                                              or info.offset != self.end_offset) \
                and not self._is_skip(info):
            self._fail_stop(CorruptLog(
                f"log {self.name}: message {info.seq} says position {info.position} offset "
                f"{info.offset}, the log ends at {self.end_position}/{self.end_offset}"))
            return
        self._end_seq = info.seq
        self.end_position = info.end_position
        self.end_offset = info.end_offset
        if info.attributes is not None:
            self._attributes = dict(info.attributes)
        if info.start is not None:
            self._apply_start(info.start)
        self._index.add(info)
        self._chain.resolve(info)
        self._wake()

    def _is_skip(self, info: BatchInfo) -> bool:
        """
        Whether C{info} is the marker of an L{ILog.skip_to}: it starts the
        log where it stands itself, ahead of an empty log's end.
        """
        return (info.kind == MARKER and info.start == (info.position, info.offset)
                and self.start_position == self.end_position
                and skip_conflict(self.name, self.start_position, self.end_position,
                                  self.end_offset, info.position, info.offset) is None)

    def _apply_start(self, start: tuple[int, int]) -> None:
        position, offset = start
        if position > self.start_position:
            self.start_position = position
        if offset > self.start_offset:
            self.start_offset = offset

    def _wake(self) -> None:
        self._waiters.advance(self.end_position)
        self._offset_waiters.advance(self.end_offset)

    # -- appending -------------------------------------------------------
    def _append_refusal(self) -> Exception | None:
        if self.unavailable is not None:
            return self.refusal() or StoreUnavailable(str(self.unavailable))
        return self.refusal()

    def _append(self, request: AppendRequest) -> Deferred[AppendResult]:
        lengths, data = request.lengths, request.data
        room = self.store.max_message_bytes - 4
        if len(lengths) and max(lengths) > room:
            return fail(RecordTooLarge(
                f"record of {max(lengths)} bytes exceeds what one JetStream message holds "
                f"here ({room} bytes: raise max_payload on the NATS servers)"))
        if not len(lengths) and not request.attributes:
            return succeed(AppendResult(self.end_position, self.end_position, self.end_offset))
        if request.expected_position is not None and len(lengths) and \
                sum(lengths) + 4 * len(lengths) > self.store.max_message_bytes:
            return fail(RecordTooLarge("a conditional append must fit in one JetStream "
                                       f"message ({self.store.max_message_bytes} bytes)"))
        a = _Append(lengths, bytes(data) if isinstance(data, memoryview) else data,
                    dict(request.attributes) if request.attributes else None,
                    self.store.monotonic() + self.store.timeout, expected=request.expected_position,
                    expected_attributes=dict(request.expected_attributes)
                    if request.expected_attributes else None)
        return self._chain.enqueue(a)

    @defer.inlineCallbacks
    def _catch_up(self, resolving: bool = False) -> _Inline[None]:
        """
        Read the tail from the leader and learn it; when messages of ours
        may be among those not seen yet, read their headers too.
        """
        io = self.store.io
        call = self.store._call
        # a short wait: while the stream elects a leader nobody answers, and
        # asking again soon ends the stall sooner than one long wait
        last = yield call(io.get, self.stream,
                          last=subjects_filter(self.store.prefix, self.name),
                          timeout=CATCH_UP_TIMEOUT)
        if last is None:
            return
        last_info = self._decode(last)
        if last_info.seq <= self._end_seq:
            return
        whole = resolving or last_info.seq - self._end_seq <= 64
        # the headers read one by one, in order: every one not seen yet
        # (small gaps, or when our own messages may be there); else only
        # where a message of ours not known to be stored may stand (it is
        # recognised there, or its place is seen taken)
        seqs = range(self._end_seq + 1, last_info.seq) if whole else \
            self._chain.ghost_places(self._end_seq, last_info.seq - 1)
        for seq in seqs:
            got = yield call(io.get, self.stream, seq)
            if got is not None:
                self._learn(self._decode(got))
        if whole:
            self._learn(last_info)
            return
        snapshot = yield self._latest_snapshot(last_info.seq)
        log.info("log {name}: {gap} messages stored elsewhere since sequence {seq}: "
                 "taking the tail at {last}", name=self.name, gap=last_info.seq - self._end_seq,
                 seq=self._end_seq, last=last_info.seq)
        self._jump(last_info, snapshot)

    def _refresh(self) -> Deferred[None]:
        """Catch up with the leader (C{get()} of an open log): shared by concurrent callers."""
        return self._refreshing()

    def _fail_stop(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
            log.error("log {name} stopped: {error}", name=self.name, error=error)
        for a in list(self._chain.pending):
            self._chain.fail_append(a, LogFailed(str(error)))

    # -- reading ---------------------------------------------------------
    @_store_errors
    def read(self, position: int, max_records: int = -1,
             max_bytes: int = 1048576) -> Deferred[RecordBatch]:
        return self._reader.read(position, max_records, max_bytes)

    @_store_errors
    def read_bytes(self, offset: int, max_bytes: int = 1048576) -> Deferred[bytes]:
        return self._reader.read_bytes(offset, max_bytes)

    @_store_errors
    def position_of_offset(self, offset: int) -> Deferred[int]:
        return self._reader.position_of_offset(offset)

    @_store_errors
    def offset_of_position(self, position: int) -> Deferred[int]:
        return self._reader.offset_of_position(position)

    @_store_errors
    def skip_to(self, position: int, offset: int) -> Deferred[int]:
        refused = self.refusal()
        if refused is not None:
            return fail(refused)
        conflict = skip_conflict(self.name, self.start_position, self.end_position,
                                 self.end_offset, position, offset)
        if conflict is None and self._chain.pending:
            conflict = skip_conflict(self.name, 0, 1, 0, position, offset)  # appends on their way
        if conflict is not None:
            return fail(conflict)
        if (position, offset) == (self.end_position, self.end_offset):
            return succeed(self.end_position)
        return self._skip(position, offset)

    @defer.inlineCallbacks
    def _skip(self, position: int, offset: int) -> _Inline[int]:
        """
        The skip marker, published after the last message this log knows
        (not through the chain, which numbers what it sends from the tail):
        another writer's message in between makes it fail, writing nothing.
        """
        headers = encode_headers(position, offset, 0, 0, 0, self._attributes, (position, offset))
        headers[MSG_ID] = f"{self.store.writer_id}.{self._id}.skip.{self._end_seq}"
        headers[EXPECTED_LAST_SEQUENCE] = str(self._end_seq)
        outcome: PublishOutcome = yield self._publish_direct(self._subject(MARKER), headers, b"")
        if outcome.error is not None:
            if getattr(outcome.error, "err_code", None) == WRONG_LAST_SEQUENCE:
                raise AppendConflict(f"log {self.name}: another writer appended; not skipped")
            raise outcome.error
        self._learn(BatchInfo(outcome.seq, MARKER, position, offset, 0, 0, 0,
                              dict(self._attributes), (position, offset), headers[MSG_ID]))
        return self.end_position

    # -- waiting -----------------------------------------------------------
    # -- truncation and retention ----------------------------------------
    @_store_errors
    def truncate(self, position: int | None = None) -> Deferred[int]:
        return self._truncation.truncate(position)

    @_store_errors
    def truncate_offset(self, offset: int) -> Deferred[int]:
        return self._truncation.truncate_offset(offset)

    def retain(self) -> Deferred[int]:
        """Apply the retention limits (L{Truncation.retain})."""
        return self._truncation.retain()

    # -- the rest --------------------------------------------------------
    def info(self) -> dict[str, Any]:
        if self.failed is None:
            status = "ok" if self.unavailable is None else "unavailable"
        elif isinstance(self.failed, CorruptLog):
            status = "corrupt"
        else:
            status = "failed"
        return self._info(status, self.end_position - self.start_position,
                          self.end_offset - self.start_offset)

    def sync(self) -> Deferred[int]:
        pending = [a.deferred for a in self._chain.pending]
        if not pending:
            return succeed(self.end_position)
        waits: list[Deferred[None]] = []
        for d in pending:
            w: Deferred[None] = defer.Deferred()

            def passed(result: _T, w: Deferred[None] = w) -> _T:
                w.callback(None)
                return result
            d.addBoth(passed)
            waits.append(w)

        def done(_: object) -> int:
            if self.failed is not None:
                raise LogFailed(str(self.failed))
            if self.unavailable is not None:
                raise StoreUnavailable(str(self.unavailable))
            return self.end_position
        return defer.gatherResults(waits).addCallback(done)

    def _close(self, reason: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        reason = reason or LogClosed(self.name)
        self._chain.close(reason)
        self._waiters.fail_all(LogClosed(self.name))
        self._offset_waiters.fail_all(LogClosed(self.name))
        self._chain.cancel_deadlines()
        self.store.cache.drop_log(self._id)
        watch, self._watch = self._watch, None
        if watch is not None:
            try:
                self.store.bridge.call_soon(_spawn, self.store.bridge, watch.stop)
            except Exception:
                pass


def _spawn(bridge: AsyncioThreadBridge,
           coroutine_function: Callable[[], Coroutine[Any, Any, object]]) -> None:
    bridge.loop.create_task(coroutine_function())
