"""
The Pravega segment-store server: a thin Protocol over L{codec} and
L{segments}.

One connection carries any number of writers (each SetupAppend names a
writer id and a segment) and any number of reads.  Commands are handled in
arrival order; a command that must wait for storage before the next may run
(SetupAppend, the admin commands) holds the queue, while appends are issued
to the log at once and acknowledged later, and reads wait on their own.

Flow control: reading from the socket is paused while the connection's
unacknowledged append bytes exceed C{max_outstanding_bytes}, while too many
commands are queued, while too many reads are in flight, and while the
transport's send buffer is full (we are registered as its producer, so a
slow reader stops the reading of the log rather than growing a buffer).
"""

from collections import deque
from typing import TYPE_CHECKING, Any

from twisted.internet import defer
from twisted.internet.interfaces import IAddress, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.errors import log_failure
from streamproto.core.idle import IdleTimeout
from streamproto.core.observer import Observers
from streamproto.core import metrics
from streamproto.core.auth import ALLOW_ALL, IAuthorizer
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.tcp import set_no_delay
from streamproto.log.errors import AppendConflict, LogError
from streamproto.log.interfaces import ILogStore
from streamproto.pravega import codec
from streamproto.pravega.codec import NULL_EVENT_NUMBER, OLDEST_COMPATIBLE_VERSION, WIRE_VERSION
from streamproto.pravega.segments import SegmentNotFound, SegmentStore, transient_name
from streamproto.pravega.replies import (  # named here too: the server's public API
    UNSPECIFIED as UNSPECIFIED,
    ILLEGAL_ARGUMENT as ILLEGAL_ARGUMENT,
    TOKEN_CHECK_FAILED as TOKEN_CHECK_FAILED,
    FINAL_STORAGE_ERRORS as FINAL_STORAGE_ERRORS,
    storage_failure_message as storage_failure_message,
    storage_failure as storage_failure,
    ERROR_REPLIES as ERROR_REPLIES,
    APPEND_ERROR_REPLIES as APPEND_ERROR_REPLIES,
    error_reply as error_reply,
    replying as replying,
)
from streamproto.pravega.tables import TableStore

if TYPE_CHECKING:
    from streamproto.pravega.auth import DelegationTokens

#: The reference reads at most this much per ReadSegment.
MAX_READ_SIZE = 2 * 1024 * 1024
#: Most entries one TableEntriesDeltaRead, TableKeysRead or TableEntriesRead
#: carries (the Rust client asks for 10).
MAX_TABLE_READ_ENTRIES = 1000
#: Error replies, counted by name in the protocol error metric.
_ERROR_TYPES: frozenset[type] = frozenset(codec.FAILURES)


class _WriterState:
    """A writer set up on this connection: its segment and its ack level."""

    __slots__ = ("segment", "acked", "failed")

    def __init__(self, segment, acked):
        self.segment = segment
        self.acked = acked
        self.failed = False     # told the writer its log failed: drop what it sends


@implementer(IPushProducer, IGracefulShutdown)
class PravegaServerProtocol(Protocol):
    log = Logger()
    #: a TCP or TLS transport, also a producer and consumer
    #: (registerProducer, pauseProducing): no one Twisted interface says all that
    transport: Any

    def __init__(self, factory):
        self.factory = factory
        self.decoder = codec.Decoder(factory.max_frame_size)
        self.assembler = codec.AppendAssembler()
        self.writers = {}               # writer id -> _WriterState
        self._queue: deque[Any] = deque()
        self._busy = False
        self._pause_reasons = set()
        self._outstanding_bytes = 0
        self._reads = set()             # Deferreds of reads in flight
        self._idle = IdleTimeout(factory.clock, factory.idle_timeout, self._idle_expired)
        self._shutdown = None           # Deferred while shutting down gracefully
        self._send_waiters: Observers[None] = Observers()  # reads waiting for buffer room
        self._read_counters = {}        # segment -> codec.EventCounter of a reader
        self.transients = set()         # transient segments made on this connection
        self._principals = None         # the client certificate's, once asked
        self._producing = False         # registered as the transport's producer
        self.closed = False

    # -- connection ------------------------------------------------------
    def connectionMade(self):
        set_no_delay(self.transport)
        self.peer = str(self.transport.getPeer())
        self.transport.registerProducer(self, True)
        self._producing = True
        self._idle.start()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed = True
        self._idle.cancel()
        for d in list(self._reads):
            d.cancel()
        self._queue.clear()
        self.factory.connections.discard(self)
        self._delete_transients()
        if self._shutdown is not None and not self._shutdown.called:
            self._shutdown.callback(None)

    def _delete_transients(self):
        """Transient segments live as long as the connection that made them."""
        for name in self.transients:
            d = self.factory.segments.delete(name)
            d.addErrback(lambda f: f.trap(SegmentNotFound))   # merged, or deleted already
            d.addErrback(lambda f, name=name: self.log.failure(
                "deleting transient segment {segment}", f, segment=name))
        self.transients = set()

    def gracefulShutdown(self) -> defer.Deferred[None]:
        """
        Stop reading, finish the commands already received, wait until every
        append is durable and acknowledged, end waiting reads, then close.

        @return: Deferred firing when the connection is closed.
        """
        if self._shutdown is None:
            self._shutdown = defer.Deferred()
            self._pause("shutdown")
            self._maybe_finish_shutdown()
        return self._shutdown

    def _maybe_finish_shutdown(self):
        if self._shutdown is None or self._busy or self._queue or self._outstanding_bytes:
            return
        for d in list(self._reads):
            d.cancel()
        if not self.closed:
            self.log.info("closing connection from {peer} for shutdown", peer=self.peer)
            self._close()

    def _close(self):
        """Close: input is ignored from now on, but read on (see below)."""
        self.closed = True
        # TLS starts its close only once no producer is registered, and it
        # completes only once the peer's close_notify is read
        if self._producing:
            self._producing = False
            self.transport.unregisterProducer()
        if self._pause_reasons:
            self._pause_reasons.clear()
            self.transport.resumeProducing()
        self.transport.loseConnection()

    def _idle_expired(self):
        if self.closed:
            return
        if self._reads or self._outstanding_bytes or self._busy:
            # the client is waiting for us (a read, an append being stored): not idle
            self._idle.start()
            return
        self.log.info("closing idle connection from {peer}", peer=self.peer)
        self.factory.metrics.error("idle_timeout")
        self._close()

    def send(self, cmd):
        if not self.closed:
            if type(cmd) in _ERROR_TYPES:
                self.factory.metrics.error(type(cmd).__name__)
            self.transport.write(codec.encode(cmd))

    def _abort(self, why, code, **kw):
        """Close the connection for C{why}, counted as protocol error C{code}."""
        self.log.warn("closing connection from {peer}: " + why, peer=self.peer, **kw)
        self.factory.metrics.error(code)
        self._queue.clear()
        self._close()

    # -- flow control ----------------------------------------------------
    def _pause(self, reason):
        if self.closed:
            return      # closing: reading on is how a TLS close completes
        if not self._pause_reasons:
            self.transport.pauseProducing()
        if reason == "storage" and reason not in self._pause_reasons:
            self.factory.metrics.pauses.inc()
        self._pause_reasons.add(reason)

    def _unpause(self, reason):
        if reason in self._pause_reasons:
            self._pause_reasons.discard(reason)
            if not self._pause_reasons and not self.closed:
                self.transport.resumeProducing()

    def pauseProducing(self):
        # the send buffer is full: stop taking requests until it drains
        self._pause("send buffer")

    def resumeProducing(self):
        self._unpause("send buffer")
        self._send_waiters.fire(None)
        self._drain()

    def _send_buffer_room(self):
        """Fire when the transport takes data again (at once if it does)."""
        if "send buffer" not in self._pause_reasons:
            return defer.succeed(None)
        return self._send_waiters.when()

    def stopProducing(self):
        pass

    # -- input -----------------------------------------------------------
    def dataReceived(self, data):
        if self.closed:
            return
        self._idle.reset()
        try:
            commands = self.decoder.feed(data)
        except codec.ProtocolError as e:
            self._abort("protocol error: {error}", "protocol_error", error=str(e))
            return
        self._queue.extend(commands)
        self._drain()

    def _drain(self):
        queue = self._queue
        while queue and not self._busy and not self.closed and \
                "send buffer" not in self._pause_reasons and \
                len(self._reads) < self.factory.max_pending_reads:
            cmd = queue.popleft()
            try:
                cmd = self.assembler.process(cmd)
            except codec.ProtocolError as e:
                self._abort("protocol error: {error}", "protocol_error", error=str(e))
                return
            if cmd is None:
                continue
            try:
                d = self.dispatch(cmd)
            except Exception:
                self.log.failure("handling {command!r} from {peer}", command=cmd, peer=self.peer)
                self._abort("internal error", "internal_error")
                return
            if d is not None:
                self._busy = True
                d.addErrback(self._internal_error, cmd)
                d.addBoth(self._done)
        if len(queue) > self.factory.max_queued_commands:
            self._pause("queue")
        elif not queue:
            self._unpause("queue")
            self._maybe_finish_shutdown()

    def _done(self, _):
        self._busy = False
        self._drain()

    def _internal_error(self, f, cmd):
        log_failure(self.log, f, "handling {command!r} from {peer}", command=cmd,
                    peer=self.peer)
        if not self.closed:
            if f.check(LogError):
                # the store could not answer (a cluster electing a leader):
                # the client reconnects and tries again
                self._abort("storage unavailable", "storage_failure")
            else:
                self._abort("internal error", "internal_error")

    def _reply_error(self, f, cmd):
        """Answer a failed request with its error reply (see L{ERROR_REPLIES})."""
        reply = error_reply(cmd, f.value)
        if reply is None:
            return f        # on to _internal_error
        if isinstance(f.value, FINAL_STORAGE_ERRORS):
            self.log.error("{command} from {peer}: {error}", command=type(cmd).__name__,
                           peer=self.peer, error=f.value)
        self.send(reply)
        return None

    def dispatch(self, cmd):
        """Handle one command; a returned Deferred holds the queue until it fires."""
        if type(cmd) is codec.Append:
            return self.append(cmd)
        if self.factory.authorizer.enabled and not self._authorized(cmd):
            return None
        handler = self._handlers.get(type(cmd))
        if handler is None:
            if isinstance(cmd, codec.UnsupportedCommand):
                self.send(codec.OperationUnsupported(cmd.request_id, f"command {cmd.type}", ""))
                return None
            self._abort("unexpected {command}", "unexpected_command",
                        command=type(cmd).__name__)
            return None
        return handler(self, cmd)

    # -- authorization ---------------------------------------------------
    def _authorized(self, cmd):
        """
        Whether the policy lets this command's principals (its delegation
        token's, and the connection's client certificate's) do its
        operation on its segments' streams (L{streamproto.pravega.auth}).
        If not, the client gets C{AuthTokenCheckFailed} and nothing is
        touched.
        """
        from streamproto.core.auth import ANONYMOUS, connection_principals, denied
        from streamproto.pravega.auth import TokenError, command_access
        access = command_access(cmd)
        if access is None:
            return True
        op, resources = access
        if self._principals is None:
            own = connection_principals(self.transport)
            self._principals = () if own == (ANONYMOUS,) else own
        principals = self._principals
        token = getattr(cmd, "delegation_token", "")
        why, code = "", TOKEN_CHECK_FAILED
        if token:
            try:
                principals = principals + self.factory.tokens.verify(token)
            except TokenError as e:
                why, code = str(e), e.code
        principals = principals or (ANONYMOUS,)
        if not why:
            refused = [r for r in resources
                       if not self.factory.authorizer.allows(principals, op, r)]
            if not refused:
                return True
            resources = refused
        denied(self.factory.server_name, principals, op, resources[0], why)
        if type(cmd) is codec.SetupAppend:
            self.assembler.forget(cmd.writer_id)
        self.factory.metrics.error("AuthTokenCheckFailed")
        self.send(codec.AuthTokenCheckFailed(
            cmd.request_id, why or f"{op} on {resources[0]} denied", code))
        return False

    # -- session ---------------------------------------------------------
    def hello(self, cmd):
        self.send(codec.Hello(WIRE_VERSION, OLDEST_COMPATIBLE_VERSION))
        if cmd.low_version > WIRE_VERSION or cmd.high_version < OLDEST_COMPATIBLE_VERSION:
            self._abort("incompatible wire versions {high}..{low}", "incompatible_version",
                        high=cmd.high_version, low=cmd.low_version)

    def keep_alive(self, cmd):
        self.send(cmd)

    # -- appends ---------------------------------------------------------
    @replying
    def setup_append(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            # earlier connections of this writer may still have appends in
            # flight: once they settle the stored event number is final
            yield seg.settle()
            failure = storage_failure(seg)
        except Exception:
            self.assembler.forget(cmd.writer_id)
            raise
        if failure is not None:
            # the log will take nothing until the server restarts: say so at
            # once rather than take the writer's data and drop the connection
            self.assembler.forget(cmd.writer_id)
            self.log.error("refusing writer {writer} on {segment}: {error}",
                           writer=cmd.writer_id, segment=cmd.segment, error=failure)
            self.send(codec.ErrorMessage(cmd.request_id, cmd.segment, failure, UNSPECIFIED))
            return
        last = seg.durable_event_number(cmd.writer_id, NULL_EVENT_NUMBER)
        self.writers[cmd.writer_id] = _WriterState(seg, last)
        self.log.debug("writer {writer} set up on {segment} at {last}",
                       writer=cmd.writer_id, segment=cmd.segment, last=last)
        self.send(codec.AppendSetup(cmd.request_id, cmd.segment, cmd.writer_id, last))

    def append(self, append):
        state = self.writers.get(append.writer_id)
        if state is None:
            # SetupAppend failed (no such segment) and the client appends anyway
            self.send(codec.NoSuchSegment(append.request_id, append.segment, "", -1))
            return None
        if state.failed:
            return None
        seg = state.segment
        writer_id = append.writer_id
        last = seg.last_event_number(writer_id, NULL_EVENT_NUMBER)
        data = append.data
        if append.event_number <= last:
            self.log.debug("dropping duplicate events up to {n} of {writer}",
                           n=append.event_number, writer=writer_id)
            if append.event_number > state.acked:
                # a resend of events stored through another connection: ack
                # them here once durable, or the writer would wait for ever
                seg.settle().addCallback(self._ack_duplicate, state, append)
            return None
        first = append.event_number - append.event_count + 1
        events = append.event_count
        if first <= last:
            # a resend overlapping what we have: keep only the new events
            try:
                data = memoryview(data)[codec.skip_events(data, last - first + 1):]
            except codec.ProtocolError as e:
                self.send(codec.InvalidEventNumber(writer_id, append.request_id, str(e),
                                                   append.event_number))
                self._abort("bad resend from {writer}: {error}", "bad_resend",
                            writer=writer_id, error=str(e))
                return None
            events = append.event_number - last
        size = len(data)
        self._outstanding_bytes += size
        if self._outstanding_bytes > self.factory.max_outstanding_bytes:
            self._pause("storage")
        d = seg.append(data, writer_id, append.event_number, append.expected_offset)
        d.addCallbacks(self._appended, self._append_failed,
                       (state, append, events), None, (state, append), None)
        d.addBoth(self._append_settled, size)
        return None

    def _appended(self, end_offset, state, append, events=0):
        self.factory.metrics.records_in.inc(events)
        # acks go out in order and only when the writer's ack level advances
        if append.event_number > state.acked:
            previous = state.acked
            state.acked = append.event_number
            self.factory.metrics.acks.inc()
            self.send(codec.DataAppended(append.writer_id, append.event_number, previous,
                                         append.request_id, end_offset))

    def _ack_duplicate(self, _, state, append):
        durable = state.segment.durable_event_number(append.writer_id, NULL_EVENT_NUMBER)
        if state.acked < append.event_number <= durable:
            self._appended(state.segment.log_.end_offset, state, append)

    def _append_failed(self, f, state, append):
        reply = error_reply(append, f.value, APPEND_ERROR_REPLIES)
        if reply is not None:
            self.send(reply)
        elif f.check(*FINAL_STORAGE_ERRORS) or storage_failure(state.segment) is not None:
            # the log fail-stopped: it takes nothing more until a restart.
            # Tell the writer once (its later appends are dropped); its other
            # writers on this connection carry on.
            if not state.failed:
                state.failed = True
                log_failure(self.log, f, "append to {segment} failed", segment=append.segment)
                self.send(codec.ErrorMessage(append.request_id, append.segment,
                                             storage_failure_message(f.value), UNSPECIFIED))
        elif f.check(AppendConflict) and not self.closed:
            # the writer's event number in the log is not the one its
            # events were checked against: an append whose outcome was
            # unknown was stored after all, or another front-end took the
            # writer.  Close: the writer sets up again on the stored event
            # number and resends only what is not there
            self.log.info("writer {writer} on {segment}: {error}; closing so that it "
                          "resynchronises", writer=append.writer_id, segment=append.segment,
                          error=f.value)
            self._abort("event numbers changed", "append_conflict")
        elif not self.closed:
            # a transient storage error (a write that failed and was rolled
            # back, the store closing): close, so that the writer reconnects
            # and resends what was not acknowledged
            log_failure(self.log, f, "append to {segment} failed", segment=append.segment)
            self._abort("storage failure", "storage_failure")

    def _append_settled(self, _, size):
        self._outstanding_bytes -= size
        if self._outstanding_bytes <= self.factory.max_outstanding_bytes // 2:
            self._unpause("storage")
        self._maybe_finish_shutdown()

    # -- reads -----------------------------------------------------------
    def read_segment(self, cmd):
        d = self._read(cmd)
        self._reads.add(d)
        if len(self._reads) >= self.factory.max_pending_reads:
            self._pause("reads")

        def finished(result):
            self._reads.discard(d)
            if len(self._reads) < self.factory.max_pending_reads:
                self._unpause("reads")
                self._drain()   # commands queued behind the read limit
            return result

        d.addBoth(finished)
        d.addErrback(lambda f: f.trap(defer.CancelledError))
        d.addErrback(self._internal_error, cmd)
        return None

    @replying
    def _read(self, cmd):
        size = min(MAX_READ_SIZE, max(codec.HEADER_SIZE, cmd.suggested_length))
        clock = self.factory.clock
        deadline = clock.seconds() + self.factory.read_wait
        seg = yield self.factory.segments.get(cmd.segment)
        while True:
            # a reader that does not keep up stops us reading the log
            yield self._send_buffer_room()
            data, at_tail, end = yield seg.read(cmd.offset, size)
            remaining = deadline - clock.seconds()
            if data or end or remaining <= 0:
                break
            yield seg.wait_for_data(cmd.offset, remaining)
        # room again now that the data is here: reads that started together
        # must not all write at once to a peer that does not read
        while "send buffer" in self._pause_reasons and not self.closed:
            yield self._send_buffer_room()
        if data and not self.closed:
            self._count_events_out(cmd.segment, cmd.offset, data)
        self.send(codec.SegmentRead(cmd.segment, cmd.offset, at_tail, end, data, cmd.request_id))

    def _count_events_out(self, segment, offset, data):
        """
        Count the events a SegmentRead delivers.  Reads may cut events
        anywhere, so each reader's segment has an L{codec.EventCounter} that
        carries the cut over to the read that continues it; a read from
        anywhere else is taken to start at an event.
        """
        counters = self._read_counters
        counter = counters.get(segment)
        if counter is None or counter.offset != offset:
            if len(counters) >= 64:
                counters.clear()     # bounded: readers of many segments recount
            counter = counters[segment] = codec.EventCounter(offset)
        self.factory.metrics.records_out.inc(counter.feed(data))

    # -- admin -----------------------------------------------------------
    @replying
    def create_segment(self, cmd):
        yield self.factory.segments.create(cmd.segment)
        self.log.info("created segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentCreated(cmd.request_id, cmd.segment))

    @replying
    def create_transient_segment(self, cmd):
        """
        A segment for one large event of C{writer_id} (the Rust and Java
        writers' large-event path: append it here, then merge it into the
        parent).  It is deleted when this connection closes, merged or not.
        """
        yield self.factory.segments.get(cmd.parent_segment)
        name = transient_name(cmd.parent_segment, cmd.writer_id)
        yield self.factory.segments.create(name)
        if self.closed:
            # the connection went while we created it: nobody will merge it
            yield self.factory.segments.delete(name)
            return
        self.transients.add(name)
        self.log.debug("created transient segment {segment}", segment=name)
        self.send(codec.SegmentCreated(cmd.request_id, name))

    @replying
    def segment_info(self, cmd):
        seg = yield self.factory.segments.get(cmd.segment)
        i = seg.info()
        self.send(codec.StreamSegmentInfo(cmd.request_id, cmd.segment, True, i["sealed"], False,
                                          i["last_modified"], i["write_offset"],
                                          i["start_offset"]))

    @replying
    def get_attribute(self, cmd):
        seg = yield self.factory.segments.get(cmd.segment)
        value = seg.attribute(cmd.attribute_id, codec.NULL_ATTRIBUTE_VALUE)
        self.send(codec.SegmentAttribute(cmd.request_id, value))

    @replying
    def update_attribute(self, cmd):
        seg = yield self.factory.segments.get(cmd.segment)
        ok = yield seg.update_attribute(cmd.attribute_id, cmd.new_value, cmd.expected_value,
                                        codec.NULL_ATTRIBUTE_VALUE)
        self.send(codec.SegmentAttributeUpdated(cmd.request_id, ok))

    @replying
    def seal_segment(self, cmd):
        seg = yield self.factory.segments.get(cmd.segment)
        yield seg.seal()
        self.log.info("sealed segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentSealed(cmd.request_id, cmd.segment))

    @replying
    def truncate_segment(self, cmd):
        seg = yield self.factory.segments.get(cmd.segment)
        yield seg.truncate(cmd.truncation_offset)
        self.send(codec.SegmentTruncated(cmd.request_id, cmd.segment))

    @replying
    def delete_segment(self, cmd):
        yield self.factory.segments.delete(cmd.segment)
        self.transients.discard(cmd.segment)
        self.log.info("deleted segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentDeleted(cmd.request_id, cmd.segment))

    @replying
    def merge_segments(self, cmd):
        end = yield self.factory.segments.merge(cmd.target, cmd.source)
        self.transients.discard(cmd.source)
        self.send(codec.SegmentsMerged(cmd.request_id, cmd.target, cmd.source, end))

    # -- table segments --------------------------------------------------
    @replying
    def create_table_segment(self, cmd):
        yield self.factory.tables.create(cmd.segment)
        self.log.info("created table segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentCreated(cmd.request_id, cmd.segment))

    @replying
    def delete_table_segment(self, cmd):
        yield self.factory.tables.delete(cmd.segment, cmd.must_be_empty)
        self.log.info("deleted table segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentDeleted(cmd.request_id, cmd.segment))

    @replying
    def update_table_entries(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        versions = yield table.update(cmd.entries)
        self.send(codec.TableEntriesUpdated(cmd.request_id, tuple(versions)))

    @replying
    def remove_table_keys(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        yield table.remove(cmd.keys)
        self.send(codec.TableKeysRemoved(cmd.request_id, cmd.segment))

    @replying
    def read_table(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        self.send(codec.TableRead(cmd.request_id, cmd.segment, tuple(table.read(cmd.keys))))

    @replying
    def read_table_delta(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        entries, reached_end, last = table.delta(
            cmd.from_position, min(cmd.suggested_entry_count, MAX_TABLE_READ_ENTRIES))
        self.send(codec.TableEntriesDeltaRead(cmd.request_id, cmd.segment, tuple(entries),
                                              False, reached_end, last))

    @replying
    def read_table_keys(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        items, token = table.page(cmd.continuation_token,
                                  min(cmd.suggested_key_count, MAX_TABLE_READ_ENTRIES),
                                  cmd.from_key, cmd.to_key)
        self.send(codec.TableKeysRead(cmd.request_id, cmd.segment,
                                      tuple(key for key, _ in items), token))

    @replying
    def read_table_entries(self, cmd):
        table = yield self.factory.tables.get(cmd.segment)
        items, token = table.page(cmd.continuation_token,
                                  min(cmd.suggested_entry_count, MAX_TABLE_READ_ENTRIES),
                                  cmd.from_key, cmd.to_key)
        self.send(codec.TableEntriesRead(cmd.request_id, cmd.segment, tuple(items), token))

    _handlers = {
        codec.CreateTableSegment: create_table_segment,
        codec.DeleteTableSegment: delete_table_segment,
        codec.UpdateTableEntries: update_table_entries,
        codec.RemoveTableKeys: remove_table_keys,
        codec.ReadTable: read_table,
        codec.ReadTableEntriesDelta: read_table_delta,
        codec.ReadTableKeys: read_table_keys,
        codec.ReadTableEntries: read_table_entries,
        codec.MergeSegments: merge_segments,
        codec.CreateTransientSegment: create_transient_segment,
        codec.Hello: hello,
        codec.KeepAlive: keep_alive,
        codec.SetupAppend: setup_append,
        codec.ReadSegment: read_segment,
        codec.CreateSegment: create_segment,
        codec.GetStreamSegmentInfo: segment_info,
        codec.SealSegment: seal_segment,
        codec.TruncateSegment: truncate_segment,
        codec.DeleteSegment: delete_segment,
        codec.GetSegmentAttribute: get_attribute,
        codec.UpdateSegmentAttribute: update_attribute,
    }


class PravegaServerFactory(Factory):
    """
    Serves the segments of C{store} (an L{ILogStore}).

    @param read_wait: seconds a ReadSegment at the tail waits for data (the
        reference waits 1 minute).
    @param max_frame_size: largest frame accepted (at most 0x00FFFFFF).
    @param max_outstanding_bytes: unacknowledged append bytes per connection
        above which reading from it pauses.
    @param idle_timeout: seconds without input (and nothing in flight) after
        which a connection is closed; 0 disables.  Java clients send a
        KeepAlive every 10 s.
    @param server_name: the C{server} label of the Prometheus metrics.
    @param authorizer: the L{streamproto.core.auth.IAuthorizer} (default:
        everyone may do everything).
    @param tokens: the L{streamproto.pravega.auth.DelegationTokens} whose
        tokens the commands carry (shared with the controller).
    """

    log = Logger()

    protocol = PravegaServerProtocol

    def __init__(self, store: ILogStore, clock: IReactorTime | None = None,
                 read_wait: float = 60.0, max_frame_size: int = codec.MAX_FRAME_SIZE,
                 max_outstanding_bytes: int = 32 * 1024 * 1024,
                 max_queued_commands: int = 4096, max_pending_reads: int = 64,
                 idle_timeout: float = 300.0, server_name: str = "pravega-server",
                 authorizer: IAuthorizer = ALLOW_ALL,
                 tokens: "DelegationTokens | None" = None) -> None:
        clock = default_reactor(clock)
        from streamproto.pravega.auth import DelegationTokens
        self.authorizer = authorizer
        self.tokens = tokens or DelegationTokens(authorizer)
        self.clock = clock
        self.store = store
        self.segments = SegmentStore(store)
        self.tables = TableStore(store)
        self.read_wait = read_wait
        self.max_frame_size = max_frame_size
        self.max_outstanding_bytes = max_outstanding_bytes
        self.max_queued_commands = max_queued_commands
        self.max_pending_reads = max_pending_reads
        self.idle_timeout = idle_timeout
        self.connections: set[PravegaServerProtocol] = set()
        self.server_name = server_name
        #: errors are counted by command name (an error reply) or by reason
        #: (a closed connection)
        self.metrics = metrics.ServerMetrics(server_name)

    def startFactory(self) -> None:
        # transient segments die with their connection: after a crash, with
        # the server (the connections are all gone)
        self.segments.delete_transients().addErrback(
            lambda f: self.log.failure("deleting leftover transient segments", f))

    def buildProtocol(self, addr: IAddress | None) -> PravegaServerProtocol:
        p = self.protocol(self)
        p.factory = self
        self.connections.add(p)
        return p
