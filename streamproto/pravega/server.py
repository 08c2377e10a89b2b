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

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.pravega import codec
from streamproto.pravega.codec import NULL_EVENT_NUMBER, OLDEST_COMPATIBLE_VERSION, WIRE_VERSION
from streamproto.pravega.tables import (
    KeyBadVersion, KeyDoesNotExist, TableError, TableNotEmpty, TableStore,
)
from streamproto.pravega.segments import (
    BadOffset, MergeTooLarge, SegmentExists, SegmentNotFound, SegmentSealed, SegmentStore, SegmentTruncated,
)

#: The reference reads at most this much per ReadSegment.
MAX_READ_SIZE = 2 * 1024 * 1024
#: Most entries one TableEntriesDeltaRead carries (the Rust client asks for 10).
MAX_TABLE_READ_ENTRIES = 1000


class _WriterState:
    """A writer set up on this connection: its segment and its ack level."""

    __slots__ = ("segment", "acked")

    def __init__(self, segment, acked):
        self.segment = segment
        self.acked = acked


@implementer(IPushProducer)
class PravegaServerProtocol(Protocol):
    log = Logger()

    def __init__(self, factory):
        self.factory = factory
        self.decoder = codec.Decoder(factory.max_frame_size)
        self.assembler = codec.AppendAssembler()
        self.writers = {}               # writer id -> _WriterState
        self._queue = deque()
        self._busy = False
        self._pause_reasons = set()
        self._outstanding_bytes = 0
        self._reads = set()             # Deferreds of reads in flight
        self._idle_timer = None
        self._shutdown = None           # Deferred while shutting down gracefully
        self._send_waiters = []         # reads waiting for room in the send buffer
        self.closed = False

    # -- connection ------------------------------------------------------
    def connectionMade(self):
        self.peer = str(self.transport.getPeer())
        self.transport.registerProducer(self, True)
        self._arm_idle()

    def connectionLost(self, reason):
        self.closed = True
        if self._idle_timer is not None and self._idle_timer.active():
            self._idle_timer.cancel()
        for d in list(self._reads):
            d.cancel()
        self._queue.clear()
        self.factory.connections.discard(self)
        if self._shutdown is not None and not self._shutdown.called:
            self._shutdown.callback(None)

    def gracefulShutdown(self):
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
            self.closed = True
            self.transport.loseConnection()

    def _arm_idle(self):
        timeout = self.factory.idle_timeout
        if timeout:
            self._idle_timer = self.factory.clock.callLater(timeout, self._idle)

    def _idle(self):
        if self._reads or self._outstanding_bytes or self._busy:
            self._arm_idle()
            return
        self.log.info("closing idle connection from {peer}", peer=self.peer)
        self.transport.loseConnection()

    def send(self, cmd):
        if not self.closed:
            self.transport.write(codec.encode(cmd))

    def _abort(self, why, **kw):
        self.log.warn("closing connection from {peer}: " + why, peer=self.peer, **kw)
        self.closed = True
        self._queue.clear()
        self.transport.loseConnection()

    # -- flow control ----------------------------------------------------
    def _pause(self, reason):
        if not self._pause_reasons:
            self.transport.pauseProducing()
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
        waiters, self._send_waiters = self._send_waiters, []
        for d in waiters:
            d.callback(None)
        self._drain()

    def _send_buffer_room(self):
        """Fire when the transport takes data again (at once if it does)."""
        if "send buffer" not in self._pause_reasons:
            return defer.succeed(None)
        d = defer.Deferred()
        self._send_waiters.append(d)
        return d

    def stopProducing(self):
        pass

    # -- input -----------------------------------------------------------
    def dataReceived(self, data):
        if self.closed:
            return
        if self._idle_timer is not None and self._idle_timer.active():
            self._idle_timer.reset(self.factory.idle_timeout)
        try:
            commands = self.decoder.feed(data)
        except codec.ProtocolError as e:
            self._abort("protocol error: {error}", error=str(e))
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
                self._abort("protocol error: {error}", error=str(e))
                return
            if cmd is None:
                continue
            try:
                d = self.dispatch(cmd)
            except Exception:
                self.log.failure("handling {command!r} from {peer}", command=cmd, peer=self.peer)
                self._abort("internal error")
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
        self.log.failure("handling {command!r} from {peer}", f, command=cmd, peer=self.peer)
        if not self.closed:
            self._abort("internal error")

    def dispatch(self, cmd):
        """Handle one command; a returned Deferred holds the queue until it fires."""
        if type(cmd) is codec.Append:
            return self.append(cmd)
        handler = self._handlers.get(type(cmd))
        if handler is None:
            if isinstance(cmd, codec.UnsupportedCommand):
                self.send(codec.OperationUnsupported(cmd.request_id, f"command {cmd.type}", ""))
                return None
            self._abort("unexpected {command}", command=type(cmd).__name__)
            return None
        return handler(self, cmd)

    # -- session ---------------------------------------------------------
    def hello(self, cmd):
        self.send(codec.Hello(WIRE_VERSION, OLDEST_COMPATIBLE_VERSION))
        if cmd.low_version > WIRE_VERSION or cmd.high_version < OLDEST_COMPATIBLE_VERSION:
            self._abort("incompatible wire versions {high}..{low}",
                        high=cmd.high_version, low=cmd.low_version)

    def keep_alive(self, cmd):
        self.send(cmd)

    # -- appends ---------------------------------------------------------
    @defer.inlineCallbacks
    def setup_append(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            # earlier connections of this writer may still have appends in
            # flight: once they settle the stored event number is final
            yield seg.settle()
        except SegmentNotFound:
            self.assembler.forget(cmd.writer_id)
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
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
        if first <= last:
            # a resend overlapping what we have: keep only the new events
            try:
                data = memoryview(data)[codec.skip_events(data, last - first + 1):]
            except codec.ProtocolError as e:
                self.send(codec.InvalidEventNumber(writer_id, append.request_id, str(e),
                                                   append.event_number))
                self._abort("bad resend from {writer}: {error}", writer=writer_id, error=str(e))
                return None
        size = len(data)
        self._outstanding_bytes += size
        if self._outstanding_bytes > self.factory.max_outstanding_bytes:
            self._pause("storage")
        d = seg.append(data, writer_id, append.event_number, append.expected_offset)
        d.addCallbacks(self._appended, self._append_failed,
                       (state, append), None, (state, append), None)
        d.addBoth(self._append_settled, size)
        return None

    def _appended(self, end_offset, state, append):
        # acks go out in order and only when the writer's ack level advances
        if append.event_number > state.acked:
            previous = state.acked
            state.acked = append.event_number
            self.send(codec.DataAppended(append.writer_id, append.event_number, previous,
                                         append.request_id, end_offset))

    def _ack_duplicate(self, _, state, append):
        durable = state.segment.durable_event_number(append.writer_id, NULL_EVENT_NUMBER)
        if state.acked < append.event_number <= durable:
            self._appended(state.segment.log_.end_offset, state, append)

    def _append_failed(self, f, state, append):
        if f.check(BadOffset):
            self.send(codec.ConditionalCheckFailed(append.writer_id, append.event_number,
                                                   append.request_id))
        elif f.check(SegmentSealed):
            self.send(codec.SegmentIsSealed(append.request_id, append.segment, "",
                                            append.event_number))
        elif f.check(SegmentNotFound):
            self.send(codec.NoSuchSegment(append.request_id, append.segment, "", -1))
        elif not self.closed:
            # the log failed: close so the writer reconnects and resends
            self.log.failure("append to {segment} failed", f, segment=append.segment)
            self._abort("storage failure")

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

    @defer.inlineCallbacks
    def _read(self, cmd):
        size = min(MAX_READ_SIZE, max(codec.HEADER_SIZE, cmd.suggested_length))
        clock = self.factory.clock
        deadline = clock.seconds() + self.factory.read_wait
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            while True:
                # a reader that does not keep up stops us reading the log
                yield self._send_buffer_room()
                data, at_tail, end = yield seg.read(cmd.offset, size)
                remaining = deadline - clock.seconds()
                if data or end or remaining <= 0:
                    break
                yield seg.wait_for_data(cmd.offset, remaining)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", cmd.offset))
            return
        except SegmentTruncated as e:
            self.send(codec.SegmentIsTruncated(cmd.request_id, cmd.segment, e.start_offset, "",
                                               cmd.offset))
            return
        # room again now that the data is here: reads that started together
        # must not all write at once to a peer that does not read
        while "send buffer" in self._pause_reasons and not self.closed:
            yield self._send_buffer_room()
        self.send(codec.SegmentRead(cmd.segment, cmd.offset, at_tail, end, data, cmd.request_id))

    # -- admin -----------------------------------------------------------
    @defer.inlineCallbacks
    def create_segment(self, cmd):
        try:
            yield self.factory.segments.create(cmd.segment)
        except SegmentExists:
            self.send(codec.SegmentAlreadyExists(cmd.request_id, cmd.segment, ""))
            return
        self.log.info("created segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentCreated(cmd.request_id, cmd.segment))

    @defer.inlineCallbacks
    def segment_info(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        i = seg.info()
        self.send(codec.StreamSegmentInfo(cmd.request_id, cmd.segment, True, i["sealed"], False,
                                          i["last_modified"], i["write_offset"],
                                          i["start_offset"]))

    @defer.inlineCallbacks
    def get_attribute(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            value = seg.attribute(cmd.attribute_id, codec.NULL_ATTRIBUTE_VALUE)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        self.send(codec.SegmentAttribute(cmd.request_id, value))

    @defer.inlineCallbacks
    def update_attribute(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            ok = yield seg.update_attribute(cmd.attribute_id, cmd.new_value, cmd.expected_value,
                                            codec.NULL_ATTRIBUTE_VALUE)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        except SegmentSealed:
            self.send(codec.SegmentIsSealed(cmd.request_id, cmd.segment, "", -1))
            return
        self.send(codec.SegmentAttributeUpdated(cmd.request_id, ok))

    @defer.inlineCallbacks
    def seal_segment(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            yield seg.seal()
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        except SegmentSealed:
            self.send(codec.SegmentIsSealed(cmd.request_id, cmd.segment, "", -1))
            return
        self.log.info("sealed segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentSealed(cmd.request_id, cmd.segment))

    @defer.inlineCallbacks
    def truncate_segment(self, cmd):
        try:
            seg = yield self.factory.segments.get(cmd.segment)
            yield seg.truncate(cmd.truncation_offset)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "",
                                          cmd.truncation_offset))
            return
        except BadOffset as e:
            self.send(codec.SegmentIsTruncated(cmd.request_id, cmd.segment, e.expected, "",
                                               cmd.truncation_offset))
            return
        self.send(codec.SegmentTruncated(cmd.request_id, cmd.segment))

    @defer.inlineCallbacks
    def delete_segment(self, cmd):
        try:
            yield self.factory.segments.delete(cmd.segment)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        self.log.info("deleted segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentDeleted(cmd.request_id, cmd.segment))

    # -- table segments --------------------------------------------------
    @defer.inlineCallbacks
    def create_table_segment(self, cmd):
        try:
            yield self.factory.tables.create(cmd.segment)
        except SegmentExists:
            self.send(codec.SegmentAlreadyExists(cmd.request_id, cmd.segment, ""))
            return
        self.log.info("created table segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentCreated(cmd.request_id, cmd.segment))

    @defer.inlineCallbacks
    def delete_table_segment(self, cmd):
        try:
            yield self.factory.tables.delete(cmd.segment, cmd.must_be_empty)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
            return
        except TableNotEmpty:
            self.send(codec.TableSegmentNotEmpty(cmd.request_id, cmd.segment, ""))
            return
        self.log.info("deleted table segment {segment}", segment=cmd.segment)
        self.send(codec.SegmentDeleted(cmd.request_id, cmd.segment))

    @defer.inlineCallbacks
    def _table_call(self, cmd, operation):
        """Run C{operation(table)} and map table errors to their replies."""
        try:
            table = yield self.factory.tables.get(cmd.segment)
            result = yield operation(table)
        except SegmentNotFound:
            self.send(codec.NoSuchSegment(cmd.request_id, cmd.segment, "", -1))
        except KeyBadVersion:
            self.send(codec.TableKeyBadVersion(cmd.request_id, cmd.segment, ""))
        except KeyDoesNotExist:
            self.send(codec.TableKeyDoesNotExist(cmd.request_id, cmd.segment, ""))
        except TableError as e:
            self.send(codec.ErrorMessage(cmd.request_id, cmd.segment, str(e), -1))
        else:
            self.send(result)

    def update_table_entries(self, cmd):
        return self._table_call(cmd, lambda t: t.update(cmd.entries).addCallback(
            lambda versions: codec.TableEntriesUpdated(cmd.request_id, tuple(versions))))

    def remove_table_keys(self, cmd):
        return self._table_call(cmd, lambda t: t.remove(cmd.keys).addCallback(
            lambda _: codec.TableKeysRemoved(cmd.request_id, cmd.segment)))

    def read_table(self, cmd):
        return self._table_call(cmd, lambda t: defer.succeed(
            codec.TableRead(cmd.request_id, cmd.segment, tuple(t.read(cmd.keys)))))

    def read_table_delta(self, cmd):
        def read(table):
            entries, reached_end, last = table.delta(
                cmd.from_position, min(cmd.suggested_entry_count, MAX_TABLE_READ_ENTRIES))
            return defer.succeed(codec.TableEntriesDeltaRead(
                cmd.request_id, cmd.segment, tuple(entries), False, reached_end, last))
        return self._table_call(cmd, read)

    @defer.inlineCallbacks
    def merge_segments(self, cmd):
        try:
            end = yield self.factory.segments.merge(cmd.target, cmd.source)
        except SegmentNotFound as e:
            self.send(codec.NoSuchSegment(cmd.request_id, str(e.args[0]) if e.args else cmd.source,
                                          "", -1))
            return
        except SegmentSealed:
            self.send(codec.SegmentIsSealed(cmd.request_id, cmd.target, "", -1))
            return
        except MergeTooLarge as e:
            self.send(codec.ErrorMessage(cmd.request_id, cmd.source, str(e), -1))
            return
        self.send(codec.SegmentsMerged(cmd.request_id, cmd.target, cmd.source, end))

    _handlers = {
        codec.CreateTableSegment: create_table_segment,
        codec.DeleteTableSegment: delete_table_segment,
        codec.UpdateTableEntries: update_table_entries,
        codec.RemoveTableKeys: remove_table_keys,
        codec.ReadTable: read_table,
        codec.ReadTableEntriesDelta: read_table_delta,
        codec.MergeSegments: merge_segments,
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
    """

    protocol = PravegaServerProtocol

    def __init__(self, store, clock=None, read_wait=60.0, max_frame_size=codec.MAX_FRAME_SIZE,
                 max_outstanding_bytes=32 * 1024 * 1024, max_queued_commands=4096,
                 max_pending_reads=64, idle_timeout=300.0):
        if clock is None:
            from twisted.internet import reactor as clock
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
        self.connections = set()

    def buildProtocol(self, addr):
        p = self.protocol(self)
        p.factory = self
        self.connections.add(p)
        return p
