"""
Pravega segment-store client: admin calls, a segment writer and a segment
reader, all over one codec (L{streamproto.pravega.codec}).

    proto = yield connect(endpoint)
    yield proto.create_segment("scope/stream/0.#epoch.0")

    writer = SegmentWriter(endpoint, "scope/stream/0.#epoch.0")
    yield writer.write(b"event")                 # one Deferred per event
    yield writer.write_batch([b"a", b"b", b"c"])  # or per batch
    yield writer.close()

    reader = SegmentReader(endpoint, "scope/stream/0.#epoch.0")
    events = yield reader.read()                 # waits at the tail

The writer numbers its events (per writer id) and keeps every event until
the server's DataAppended covers it.  After a dropped connection it
reconnects, learns the last durable event number from AppendSetup, forgets
what that covers and resends the rest with the same numbers: the server
drops anything at or below its stored number, so nothing is lost or
duplicated.  An error reply fails the writer at once instead: for
instance the C{ErrorMessage} of a server whose log fail-stopped (a
L{ServerError} saying why); a new writer with the same writer id resumes
after the durable events once the server is back (L{SegmentWriter.when_set_up}).
"""

import random
import uuid
from collections import deque

from automat import MethodicalMachine
from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.observer import Observers
from streamproto.core.machine import ignore
from streamproto.core.reconnect import DEFAULT_JITTER, Reconnector, backoff_policy
from streamproto.core.tcp import set_no_delay
from streamproto.pravega import codec
from streamproto.pravega.blocks import MAX_EVENT_SIZE, EventChunk, event_frames, pack_blocks
from streamproto.pravega.codec import NULL_EVENT_NUMBER
from streamproto.pravega.errors import (
    ERRORS, AuthTokenCheckFailedError, ConditionalCheckFailedError, IncompatibleVersionError,
    InvalidEventNumberError, NoSuchSegmentError, OperationUnsupportedError, PravegaError,
    SegmentExistsError, SegmentSealedError, SegmentTruncatedError, ServerError, WriterClosed,
    WrongHostError,
)

__all__ = [
    # the client
    "PravegaClientProtocol", "SegmentReader", "SegmentWriter", "connect",
    # from streamproto.pravega.errors and .blocks, where they live
    "ERRORS", "MAX_EVENT_SIZE", "AuthTokenCheckFailedError", "ConditionalCheckFailedError",
    "IncompatibleVersionError", "InvalidEventNumberError", "NoSuchSegmentError",
    "OperationUnsupportedError", "PravegaError", "SegmentExistsError", "SegmentSealedError",
    "SegmentTruncatedError", "ServerError", "WriterClosed", "WrongHostError", "pack_blocks",
]

class PravegaClientProtocol(Protocol):
    """
    One connection to a segment store.  Sends Hello on connect; C{ready}
    fires with the protocol once the server's Hello arrived and the
    versions overlap.  Replies are matched to requests by request id;
    replies about a writer (DataAppended, ...) go to the writer registered
    for that writer id.
    """

    log = Logger()

    def __init__(self):
        self.decoder = codec.Decoder()
        self.ready = defer.Deferred()
        self.closed = defer.Deferred()
        self.server_versions = None
        self._requests = {}
        self._next_request_id = 1
        self.writers = {}     # writer id -> object with reply(cmd)
        self.writer_requests = {}   # SetupAppend request id -> writer

    def connectionMade(self):
        set_no_delay(self.transport)
        self.send(codec.Hello(codec.WIRE_VERSION, codec.OLDEST_COMPATIBLE_VERSION))

    def send(self, cmd):
        self.transport.write(codec.encode(cmd))

    def next_request_id(self):
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    def request(self, cmd):
        """Send C{cmd} (with a request id); fire with its reply."""
        d = defer.Deferred()
        self._requests[cmd.request_id] = d
        self.send(cmd)
        return d

    def dataReceived(self, data):
        try:
            replies = self.decoder.feed(data)
        except codec.ProtocolError as e:
            self.log.warn("protocol error from server: {error}", error=str(e))
            self.transport.loseConnection()
            return
        for reply in replies:
            self._reply(reply)

    def _reply(self, reply):
        t = type(reply)
        if t is codec.Hello:
            self.server_versions = (reply.high_version, reply.low_version)
            if reply.low_version > codec.WIRE_VERSION or \
                    reply.high_version < codec.OLDEST_COMPATIBLE_VERSION:
                if not self.ready.called:
                    self.ready.errback(IncompatibleVersionError(repr(reply)))
                self.transport.loseConnection()
            elif not self.ready.called:
                self.ready.callback(self)
            return
        if t is codec.KeepAlive:
            return
        rid = getattr(reply, "request_id", None)
        d = self._requests.pop(rid, None)
        if d is not None:
            if t in ERRORS:
                d.errback(ERRORS[t](reply))
            else:
                d.callback(reply)
            return
        # DataAppended and append errors: by writer id, or by the request id
        # of the writer's SetupAppend (what the server echoes)
        writer = self.writers.get(getattr(reply, "writer_id", None)) or \
            self.writer_requests.get(rid)
        if writer is not None:
            writer.reply(reply)
        else:
            self.log.debug("unmatched reply {reply!r}", reply=reply)

    def connectionLost(self, reason):
        requests, self._requests = self._requests, {}
        for d in requests.values():
            d.errback(reason)
        if not self.ready.called:
            self.ready.errback(reason)
        for writer in list(self.writers.values()):
            writer.lost(self, reason)
        self.closed.callback(None)

    # -- admin -----------------------------------------------------------
    def create_segment(self, segment, token=""):
        return self.request(codec.CreateSegment(self.next_request_id(), segment, 0, 0, token, 0))

    def segment_info(self, segment, token=""):
        """Fire with the L{codec.StreamSegmentInfo} reply."""
        return self.request(codec.GetStreamSegmentInfo(self.next_request_id(), segment, token))

    def create_transient_segment(self, parent, writer_id, token=""):
        """
        Create a transient segment of C{parent} for C{writer_id}; fire with
        the L{codec.SegmentCreated} reply, which names it.  It is deleted
        when this connection closes: append to it and merge it into
        C{parent} (L{merge_segments}) on this connection.
        """
        return self.request(codec.CreateTransientSegment(self.next_request_id(), writer_id,
                                                         parent, token))

    def merge_segments(self, target, source, token=""):
        """Append all of C{source} to C{target} and delete it; fire with L{codec.SegmentsMerged}."""
        return self.request(codec.MergeSegments(self.next_request_id(), target, source, token))

    def seal_segment(self, segment, token=""):
        return self.request(codec.SealSegment(self.next_request_id(), segment, token))

    def truncate_segment(self, segment, offset, token=""):
        return self.request(codec.TruncateSegment(self.next_request_id(), segment, offset, token))

    def delete_segment(self, segment, token=""):
        return self.request(codec.DeleteSegment(self.next_request_id(), segment, token))

    def get_attribute(self, segment, attribute_id, token=""):
        """Fire with the L{codec.SegmentAttribute} reply (Long.MIN_VALUE if unset)."""
        return self.request(codec.GetSegmentAttribute(self.next_request_id(), segment,
                                                      attribute_id, token))

    def update_attribute(self, segment, attribute_id, new_value,
                         expected_value=codec.NULL_ATTRIBUTE_VALUE, token=""):
        """Compare-and-set; fire with the L{codec.SegmentAttributeUpdated} reply."""
        return self.request(codec.UpdateSegmentAttribute(self.next_request_id(), segment,
                                                         attribute_id, new_value,
                                                         expected_value, token))

    def read_segment(self, segment, offset, suggested_length=1024 * 1024, token=""):
        """Fire with the L{codec.SegmentRead} reply."""
        return self.request(codec.ReadSegment(segment, offset, suggested_length, token,
                                              self.next_request_id()))

    def setup_append(self, writer_id, segment, token=""):
        """Fire with the L{codec.AppendSetup} reply."""
        return self.request(codec.SetupAppend(self.next_request_id(), writer_id, segment, token))


@defer.inlineCallbacks
def connect(endpoint):
    """Connect and exchange Hellos; fire with the L{PravegaClientProtocol}."""
    proto = yield endpoint.connect(Factory.forProtocol(PravegaClientProtocol))
    try:
        yield proto.ready
    except Exception:
        proto.transport.loseConnection()
        raise
    return proto


def _fire(done):
    for d, value in done:
        d.callback(value)


class SegmentWriter:
    """
    Appends events to one segment with one writer id, packing many events
    per AppendBlock.

    @param endpoint: client endpoint of the segment store (reconnected on
        failure).
    @param block_size: bytes of events per AppendBlock; an event crossing
        the block end is split: its head ends the block as a PartialEvent,
        its tail travels in the AppendBlockEnd (as the reference does).
    @param window_events, window_bytes: at most this many events / bytes sent
        and not yet acknowledged (one chunk may exceed it alone).
    @param max_retries: consecutive failed connection attempts before every
        pending Deferred fails.
    @param retry_delay, max_retry_delay: the wait after a failure, doubling
        up to C{max_retry_delay}; each drawn up to C{jitter} (a fraction)
        longer, with C{rng} (see L{streamproto.core.reconnect.backoff_policy}).
    """

    log = Logger()
    _machine = MethodicalMachine()

    def __init__(self, endpoint, segment, writer_id=None, clock=None, block_size=256 * 1024,
                 window_events=100000, window_bytes=16 * 1024 * 1024, max_retries=20,
                 retry_delay=0.05, max_retry_delay=2.0, keepalive_interval=10.0, token="",
                 jitter=DEFAULT_JITTER, rng=random):
        clock = default_reactor(clock)
        if not 8 <= block_size <= codec.MAX_FRAME_SIZE - 64:
            raise ValueError("block_size out of range")
        self.endpoint = endpoint
        self.segment = segment
        self.writer_id = writer_id or uuid.uuid4()
        self.clock = clock
        self.block_size = block_size
        self.window_events = window_events
        self.window_bytes = window_bytes
        self.token = token
        self.keepalive_interval = keepalive_interval
        self._keepalive = None
        self.next_event_number = 0
        self.acked_event_number = NULL_EVENT_NUMBER
        self.connections = 0          # successful setups, for tests and stats
        self.setups = []              # last event number each AppendSetup reported
        self._queue = deque()         # chunks not yet numbered / sent
        self._unacked = deque()       # chunks sent, waiting for DataAppended
        self._unacked_events = 0
        self._unacked_bytes = 0
        self._proto = None            # set while ready
        self._setup_request = -1
        self._flush_call = None
        self._idle_waiters: Observers[None] = Observers()
        self._setup_waiters: Observers[int] = Observers()
        self.error = None
        # the connection's failures count until a DataAppended (or a setup
        # with nothing to resend): see reply() and _start_appending
        self._reconnector = Reconnector(
            lambda: connect(endpoint), clock,
            backoff_policy(retry_delay, max_retry_delay, 2.0, jitter, rng),
            connected=self.connected, cannot_connect=self._retrying, gave_up=self._give_up,
            max_retries=max_retries)
        self.start()

    # -- state machine -----------------------------------------------------
    @_machine.state(initial=True)
    def idle(self):
        "Not started."

    @_machine.state()
    def dialing(self):
        "Connecting (and exchanging Hellos), or waiting before the next attempt."

    @_machine.state()
    def setting_up(self):
        "SetupAppend sent, waiting for AppendSetup."

    @_machine.state()
    def ready(self):
        "Appending."

    @_machine.state()
    def stopped(self):
        "Closed or failed for good."

    @_machine.input()
    def start(self):
        "Begin connecting."

    @_machine.input()
    def connected(self, proto):
        "The connection and Hello exchange succeeded."

    @_machine.input()
    def setup_done(self, reply):
        "AppendSetup arrived."

    @_machine.input()
    def connection_lost(self, reason):
        "The connection dropped."

    @_machine.input()
    def stop(self, error):
        "Close (error None) or fail for good."

    @_machine.output()
    def _dial(self):
        self._reconnector.start()

    @_machine.output()
    def _send_setup(self, proto):
        proto.writers[self.writer_id] = self
        self._setup_proto = proto
        rid = proto.next_request_id()
        proto.writer_requests[rid] = self
        d = proto.request(codec.SetupAppend(rid, self.writer_id, self.segment, self.token))
        self._setup_request = -1
        d.addCallbacks(self.setup_done, self._setup_failed, errbackArgs=(proto,))

    def _setup_failed(self, f, proto):
        if isinstance(f.value, PravegaError):
            self.stop(f.value)
        # a lost connection arrives through lost()

    @_machine.output()
    def _start_appending(self, reply):
        proto = self._setup_proto
        if not self._unacked:
            # nothing to prove: a setup is progress enough.  Otherwise only a
            # DataAppended resets the count, so a server that takes the
            # connection but never the data cannot hold us in a loop
            self._reconnector.progress()
        self.connections += 1
        self._setup_request = reply.request_id
        last = reply.last_event_number
        self.setups.append(last)
        done = []
        if last != NULL_EVENT_NUMBER:
            done = self._acknowledge(last, fire=False)
            self.next_event_number = max(self.next_event_number, last + 1)
        self._proto = proto
        done.extend((d, last) for d in self._setup_waiters.take())
        if self.keepalive_interval:
            # like the Java client, so that idle writers are not timed out
            self._keepalive = task.LoopingCall(proto.send, codec.KeepAlive())
            self._keepalive.clock = self.clock
            self._keepalive.start(self.keepalive_interval, now=False)
        # resend what the server has not made durable, same event numbers
        self._send(list(self._unacked))
        self._flush()
        # last: callbacks may write, flush or close the writer
        _fire(done)

    def _stop_keepalive(self):
        if self._keepalive is not None and self._keepalive.running:
            self._keepalive.stop()
        self._keepalive = None

    @_machine.output()
    def _redial(self, reason):
        self._stop_keepalive()
        self._proto = None
        self._retrying(reason, self._reconnector.lost(reason))

    def _retrying(self, reason, delay):
        if delay is not None:
            self.log.info("writer {writer}: reconnecting in {delay}s", writer=self.writer_id,
                          delay=delay)

    def _give_up(self, reason):
        self.log.warn("writer {writer}: giving up after {n} attempts: {reason}",
                      writer=self.writer_id, n=self._reconnector.failures, reason=reason)
        self.stop(ConnectionError(str(reason)))

    @_machine.output()
    def _halt(self, error):
        self.error = error or WriterClosed(f"writer {self.writer_id} closed")
        self._stop_keepalive()
        self._proto = None
        # cancels the attempt or the wait, closes the connection
        self._reconnector.stop()
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        proto = getattr(self, "_setup_proto", None)
        if proto is not None:
            proto.writers.pop(self.writer_id, None)
            for rid in [r for r, w in proto.writer_requests.items() if w is self]:
                del proto.writer_requests[rid]
        self._fail_all(self.error)

    idle.upon(start, enter=dialing, outputs=[_dial])
    idle.upon(stop, enter=stopped, outputs=[_halt])
    dialing.upon(connected, enter=setting_up, outputs=[_send_setup])
    dialing.upon(stop, enter=stopped, outputs=[_halt])
    setting_up.upon(setup_done, enter=ready, outputs=[_start_appending])
    setting_up.upon(connection_lost, enter=dialing, outputs=[_redial])
    setting_up.upon(stop, enter=stopped, outputs=[_halt])
    ready.upon(connection_lost, enter=dialing, outputs=[_redial])
    ready.upon(stop, enter=stopped, outputs=[_halt])
    ignore(stopped, setup_done, connection_lost, stop)

    # -- called by the protocol ------------------------------------------
    def lost(self, proto, reason):
        if proto is getattr(self, "_setup_proto", None):
            proto.writers.pop(self.writer_id, None)
            self.connection_lost(reason)

    def reply(self, reply):
        t = type(reply)
        if t is codec.DataAppended:
            self._reconnector.progress()
            self._acknowledge(reply.event_number)
            self._flush()
        elif t is codec.ConditionalCheckFailed:
            self._conditional_failed(reply)
        elif t in ERRORS:
            self.stop(ERRORS[t](reply))
        else:
            self.log.debug("writer {writer}: unexpected {reply!r}", writer=self.writer_id,
                           reply=reply)

    # -- public API --------------------------------------------------------
    def write(self, event):
        """
        Queue one event (bytes-like, not to be modified afterwards); the
        Deferred fires with its event number once it is durable.
        """
        return self._enqueue([event])

    def write_batch(self, events):
        """
        Queue many events; one Deferred fires (with the last event number)
        once all are durable.
        """
        return self._enqueue(events if isinstance(events, list) else list(events))

    def write_conditional(self, event, expected_offset):
        """
        Append one event only if the segment is C{expected_offset} bytes
        long; fails with L{ConditionalCheckFailedError} otherwise.
        """
        return self._enqueue([event], expected_offset)

    def when_set_up(self):
        """
        Fire once the writer is set up on a connection, with the last event
        number the server holds for this writer id (Long.MIN_VALUE for a new
        one): what a new writer that takes over a failed one's id resumes
        after.  Fails with the writer's error if it stops first.
        """
        if self.error is not None:
            return defer.fail(self.error)
        if self._proto is not None:
            return defer.succeed(self.setups[-1])
        return self._setup_waiters.when()

    def flush(self):
        """Fire once everything written so far is acknowledged."""
        if self.error is not None:
            return defer.fail(self.error)
        if not self._queue and not self._unacked:
            return defer.succeed(None)
        return self._idle_waiters.when()

    @defer.inlineCallbacks
    def close(self):
        """Wait for every event to be acknowledged, then disconnect."""
        if isinstance(self.error, WriterClosed):
            return
        try:
            yield self.flush()
        finally:
            self.stop(None)
            proto = getattr(self, "_setup_proto", None)
            if proto is not None and not proto.closed.called:
                yield proto.closed

    @property
    def pending(self):
        """Events written and not yet acknowledged."""
        return self._unacked_events + sum(c.count for c in self._queue)

    # -- internals -----------------------------------------------------------
    def _enqueue(self, events, expected_offset=None):
        if self.error is not None:
            return defer.fail(self.error)
        if not events:
            return defer.succeed(None)
        try:
            data, ends = event_frames(events)
        except ValueError as e:
            return defer.fail(e)
        d = defer.Deferred()
        self._queue.append(EventChunk(data, ends, d, expected_offset))
        if self._proto is not None and self._flush_call is None:
            self._flush_call = self.clock.callLater(0, self._flush)
        return d

    def _flush(self):
        self._flush_call = None
        proto = self._proto
        if proto is None:
            return
        batch = []
        queue = self._queue
        while queue and (not self._unacked or (
                self._unacked_events < self.window_events and
                self._unacked_bytes < self.window_bytes)):
            chunk = queue.popleft()
            chunk.last = self.next_event_number + chunk.count - 1
            self.next_event_number = chunk.last + 1
            self._unacked.append(chunk)
            self._unacked_events += chunk.count
            self._unacked_bytes += chunk.size
            batch.append(chunk)
        if batch:
            self._send(batch)

    def _send(self, chunks):
        """Write C{chunks} as blocks (conditional ones as ConditionalAppend)."""
        proto = self._proto
        if proto is None or not chunks:
            return
        proto.transport.write(b"".join(
            pack_blocks(chunks, self.writer_id, self._setup_request, self.block_size)))

    def _acknowledge(self, event_number, fire=True):
        """
        Forget what C{event_number} covers.  The Deferreds to fire are fired
        after the bookkeeping (their callbacks may write or close), or
        returned when C{fire} is false.
        """
        done = []
        if event_number > self.acked_event_number:
            self.acked_event_number = event_number
            unacked = self._unacked
            while unacked:
                chunk = unacked[0]
                if chunk.last <= event_number:
                    unacked.popleft()
                    self._unacked_events -= chunk.count
                    self._unacked_bytes -= chunk.size
                    done.append((chunk.deferred, chunk.last))
                elif chunk.first <= event_number:
                    k = event_number - chunk.first + 1
                    before = chunk.size
                    chunk.drop_first(k)
                    self._unacked_events -= k
                    self._unacked_bytes -= before - chunk.size
                    break
                else:
                    break
            if not unacked and not self._queue:
                done.extend((d, None) for d in self._idle_waiters.take())
        if not fire:
            return done
        _fire(done)

    def _conditional_failed(self, reply):
        failed = None
        for chunk in self._unacked:
            if chunk.last == reply.event_number and chunk.expected_offset is not None:
                failed = chunk
                break
        idle = []
        if failed is not None:
            self._unacked.remove(failed)
            self._unacked_events -= failed.count
            self._unacked_bytes -= failed.size
            if not self._unacked and not self._queue:
                idle = self._idle_waiters.take()
        self._flush()
        if failed is not None:
            failed.deferred.errback(ConditionalCheckFailedError(reply))
        _fire([(d, None) for d in idle])

    def _fail_all(self, error):
        self._setup_waiters.fail(error)
        chunks = list(self._unacked) + list(self._queue)
        self._unacked.clear()
        self._queue.clear()
        self._unacked_events = self._unacked_bytes = 0
        for chunk in chunks:
            chunk.deferred.errback(error)
        self._idle_waiters.fail(error)


class SegmentReader:
    """
    Reads the events of a segment from C{offset}, following the tail: each
    L{read} fires with the next events (waiting at the tail for new ones),
    or with an empty list once the segment is sealed and fully read
    (C{end_of_segment} is then true).  Reconnects after a dropped
    connection and carries on from the same offset.
    """

    log = Logger()

    def __init__(self, endpoint, segment, offset=0, read_size=1024 * 1024, token="",
                 max_retries=5):
        self.endpoint = endpoint
        self.segment = segment
        self.offset = offset          # offset of the next unread event
        self.read_size = read_size
        self.token = token
        self.max_retries = max_retries
        self.end_of_segment = False
        self._buffer = b""
        self._proto = None

    @defer.inlineCallbacks
    def _connection(self):
        if self._proto is None or self._proto.closed.called:
            self._proto = yield connect(self.endpoint)
        return self._proto

    @defer.inlineCallbacks
    def read(self):
        failures = 0
        while True:
            if self.end_of_segment:
                return []
            try:
                proto = yield self._connection()
                reply = yield proto.read_segment(self.segment, self.offset + len(self._buffer),
                                                 self.read_size, self.token)
            except (ConnectionLost, ConnectionDone, ConnectionError) as e:
                failures += 1
                if failures > self.max_retries:
                    raise
                self.log.info("reader of {segment}: reconnecting after {error}",
                              segment=self.segment, error=e)
                self._proto = None
                continue
            buf = self._buffer + reply.data if self._buffer else reply.data
            events, used = codec.split_events(buf)
            self._buffer = buf[used:]
            self.offset += used
            if events:
                return events
            if reply.end_of_segment and not reply.data:
                self.end_of_segment = True
                if self._buffer:
                    raise codec.ProtocolError("segment ends inside an event")
                return []

    def close(self):
        proto, self._proto = self._proto, None
        if proto is not None and not proto.closed.called:
            proto.transport.loseConnection()
            return proto.closed
        return defer.succeed(None)
