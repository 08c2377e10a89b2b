"""
The parts of the Lumberjack client that both of its modes share
(L{streamproto.lumberjack.client}): the events waiting to be sent
(L{EventQueue}), and one connection to one host sending batches taken from
it (L{HostSender}).

A client has one queue and one sender per host (and per C{worker}): the
single-host client and Filebeat's failover mode (several addresses behind
one L{streamproto.core.failover.FailoverEndpoint}) have one sender; the
load-balancing client one per host, all taking batches from the same
queue.  A batch is made when a sender has room for it (C{pipelining}
batches in flight), so a fast host takes more than a slow one, and a host
that is down takes none.

What a sender does on its connection, as Filebeat does:

- a batch is a window frame, then the events as JSON frames, by default in
  one zlib-compressed frame (level 3);
- up to C{pipelining} batches are in flight at once;
- slow start: the batch size starts at 10, grows x1.5 after every fully
  acked batch up to C{bulk_max_size}, and halves after an error (its own
  window: each host's connection starts slow on its own);
- a batch not fully acked within C{timeout} seconds (keepalive C{ACK 0}
  frames and partial acks restart the clock) counts as an error: the
  connection is dropped, every unacked event goes back to the front of the
  queue (for this sender after it reconnects, or for any other connected
  one first) and the sender reconnects with exponential backoff (its own
  L{streamproto.core.reconnect.Reconnector}): at least once.

Each batch is numbered 1..n, as Filebeat does.  That makes the two ack
conventions in the wild agree: logstash-input-beats acks the highest
sequence number received, go-lumber's server acks the count of events
received, and for a batch numbered from 1 both are "the first k events".
"""

import json
from collections import deque

from msgspec.json import encode as _fast_encode  # ~8x the stdlib, same compact UTF-8
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol

from streamproto.core.errors import describe
from streamproto.core.reconnect import Reconnector
from streamproto.core.tcp import set_no_delay
from streamproto.lumberjack.codec import Ack, FrameDecoder, ProtocolError, encode_batch


class ClientClosed(Exception):
    """The client was closed before these events were acked."""


class _Request:
    """One C{send} call: fires once all its events are acked."""

    __slots__ = ("total", "remaining", "deferred")

    def __init__(self, total):
        self.total = total
        self.remaining = total
        self.deferred = Deferred()

    def credit(self, n):
        self.remaining -= n
        if self.remaining == 0:
            self.deferred.callback(self.total)


class _Batch:
    """
    Events sent together.  C{owners} is a list of [request, count] in event
    order, so that acks credit the right C{send} calls (a call's events may
    be spread over batches, and the batches over hosts).
    """

    __slots__ = ("payloads", "owners", "acked")

    def __init__(self, payloads, owners):
        self.payloads = payloads
        self.owners = owners
        self.acked = 0

    def credit(self, upto):
        """Mark events C{acked..upto} as acked, crediting their owners."""
        n = upto - self.acked
        self.acked = upto
        owners = self.owners
        while n and owners:
            owner = owners[0]
            take = min(n, owner[1])
            owner[1] -= take
            n -= take
            if owner[1] == 0:
                owners.pop(0)
            owner[0].credit(take)


def _stdlib_encode(event):
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def encode_event(event):
    """JSON bytes for an event: bytes and str are taken as already-encoded JSON."""
    if isinstance(event, (bytes, bytearray)):
        return bytes(event)
    if isinstance(event, str):
        return event.encode("utf-8")
    try:
        return _fast_encode(event)
    except (TypeError, ValueError):  # e.g. non-str keys, which the stdlib turns into str
        return _stdlib_encode(event)


class EventQueue:
    """
    The events of a client not sent yet (or sent and given back), oldest
    first, each with the C{send} call it came from.

    @ivar queued: how many events.
    """

    def __init__(self):
        self._segments = deque()   # [payloads, start index, request]
        self.queued = 0

    def __len__(self):
        return self.queued

    def put(self, payloads, request):
        """Queue C{payloads} (encoded events) of C{request} at the back."""
        self._segments.append([payloads, 0, request])
        self.queued += len(payloads)

    def take(self, n):
        """Up to C{n} payloads from the front, and their owners (see L{_Batch})."""
        payloads = []
        owners = []
        queue = self._segments
        while n and queue:
            segment = queue[0]
            events, start, request = segment
            take = min(n, len(events) - start)
            payloads += events[start:start + take] if start or take < len(events) else events
            owners.append([request, take])
            n -= take
            if start + take == len(events):
                queue.popleft()
            else:
                segment[1] = start + take
        self.queued -= len(payloads)
        return payloads, owners

    def give_back(self, batches):
        """Put the unacked events of C{batches} back at the front, in order."""
        segments = []
        for batch in batches:
            start = batch.acked
            for request, count in batch.owners:
                segments.append([batch.payloads[start:start + count], 0, request])
                start += count
        for segment in reversed(segments):
            self._segments.appendleft(segment)
            self.queued += len(segment[0])

    def fail_all(self, error):
        """
        Empty the queue, failing every C{send} call with events in it.

        @param error: makes the exception each call fails with (one each).
        """
        requests = [segment[2] for segment in self._segments]
        self._segments.clear()
        self.queued = 0
        seen = set()
        for request in requests:
            if id(request) not in seen and not request.deferred.called:
                seen.add(id(request))
                request.deferred.errback(error())


class _ClientProtocol(Protocol):
    def __init__(self, sender):
        self.sender = sender
        self.decoder = FrameDecoder(max_frame=1024, max_decompressed=1024, validate=False)

    def connectionMade(self):
        set_no_delay(self.transport)

    def dataReceived(self, data):
        self.decoder.feed(data)
        try:
            frames = self.decoder.decode()
            for frame in frames:
                if type(frame) is not Ack:
                    raise ProtocolError(f"server sent {frame!r}, not an ack")
                self.sender._ack(self, frame.seq)
        except ProtocolError as e:
            self.sender._protocol_error(self, str(e))

    def connectionLost(self, reason):
        self.sender._disconnected(self, reason)


class HostSender:
    """
    One connection (a worker, in Filebeat's words) to one host: takes
    batches from the client's L{EventQueue} while it has room for them,
    sends them, credits their acks, and gives back what was not acked when
    the connection ends.

    @param endpoint: where to connect (an IStreamClientEndpoint).
    @param queue: the client's L{EventQueue}.
    @param name: the host, for the log (None: the client's only one).
    @param policy: the reconnection backoff (L{streamproto.core.reconnect.backoff_policy}).
    @param window: the first batch size (slow start), or C{bulk_max_size}.
    @param log: the client's Logger (bound to it: its warnings name the
        client as their source, which the command line watches).
    @param returned: called with this sender after it gave events back to
        the queue (its connection failed), so that other senders take them.

    The other parameters are the client's (L{streamproto.lumberjack.client}).

    @ivar events_acked: events this sender had acked.
    @ivar connections_made: connections this sender made.
    """

    def __init__(self, endpoint, queue, name, clock, policy, bulk_max_size,
                 compression_level, pipelining, timeout, window, log, returned):
        self.log = log
        self._returned = returned
        self.endpoint = endpoint
        self.queue = queue
        self.name = name
        self.clock = clock
        self.bulk_max_size = bulk_max_size
        self.compression_level = compression_level
        self.pipelining = max(1, pipelining)
        self.timeout = timeout
        self.window = float(window)
        self._host = f"{name}: " if name else ""
        self._inflight = deque()    # batches sent on the current connection
        self._protocol = None
        self._timeout_call = None
        self._stopping = False
        self._reconnector = Reconnector(
            lambda: endpoint.connect(Factory.forProtocol(lambda: _ClientProtocol(self))),
            clock, policy, connected=self._adopt, cannot_connect=self._cannot_connect)
        self.events_acked = 0
        self.connections_made = 0

    @property
    def batch_size(self):
        return int(self.window)

    @property
    def connected(self):
        return self._protocol is not None

    @property
    def unacked(self):
        """Events sent on the current connection and not acked yet."""
        return sum(len(b.payloads) - b.acked for b in self._inflight)

    def wake(self):
        """There are events in the queue: send some, or connect to send them."""
        if self._stopping:
            return
        if self._protocol is not None:
            self._pump()
        else:
            self._reconnector.start()

    def stop(self):
        """
        Stop reconnecting and drop the connection; what was in flight goes
        back to the queue.

        @return: a Deferred firing once disconnected.
        """
        self._stopping = True
        return self._reconnector.stop()

    # -- the connection (see L{Reconnector}) -------------------------------------
    def _adopt(self, protocol):
        self._protocol = protocol
        self.connections_made += 1
        if self.name:
            self.log.info("lumberjack client: connected to {host}", host=self.name)
        self._pump()

    def _cannot_connect(self, reason, delay):
        self.log.warn("lumberjack client: {host}cannot connect: {error}",
                      host=self._host, error=reason.value)

    def _disconnected(self, protocol, reason):
        if protocol is not self._protocol:
            return
        self._protocol = None
        self._cancel_timeout()
        returned = bool(self._inflight)
        if returned:
            # whatever was not acked goes out again, first: here or elsewhere
            self._shrink()
            self.queue.give_back(self._inflight)
            self._inflight.clear()
        if not self.queue:
            # nothing to send: connect again on the next send()
            self._reconnector.lost(reason, reconnect=False)
            return
        if not self._stopping:
            # a TLS refusal (wrong CA, no client certificate) shows up here, as a
            # connection lost right after it was made: say why before retrying
            self.log.warn("lumberjack client: {host}connection lost ({reason}); "
                          "reconnecting", host=self._host, reason=describe(reason))
        self._reconnector.lost(reason)
        if returned:
            self._returned(self)

    # -- sending ----------------------------------------------------------------
    def _pump(self):
        protocol = self._protocol
        if protocol is None:
            return
        chunks = []
        queue = self.queue
        while queue.queued and len(self._inflight) < self.pipelining:
            payloads, owners = queue.take(self.batch_size)
            self._inflight.append(_Batch(payloads, owners))
            chunks.append(encode_batch(payloads, self.compression_level))
        if chunks:
            protocol.transport.writeSequence(chunks)
            if self._timeout_call is None and self.timeout:
                self._timeout_call = self.clock.callLater(self.timeout, self._timed_out)

    def _ack(self, protocol, seq):
        if protocol is not self._protocol:
            return
        if self._timeout_call is not None:
            self._timeout_call.reset(self.timeout)
        if seq == 0:
            return  # keepalive: the server is still working on it
        if not self._inflight:
            self._protocol_error(protocol, f"ack {seq} with no batch in flight")
            return
        batch = self._inflight[0]
        size = len(batch.payloads)
        if seq > size:
            self._protocol_error(protocol, f"ack {seq} for a batch of {size} events")
            return
        if seq <= batch.acked:
            return  # a repeated partial ack
        self.events_acked += seq - batch.acked
        batch.credit(seq)
        if seq == size:
            self._inflight.popleft()
            self._reconnector.progress()
            self.window = min(float(self.bulk_max_size), self.window * 1.5)
            if not self._inflight:
                self._cancel_timeout()
            self._pump()

    def _shrink(self):
        self.window = max(1.0, self.window / 2)

    def _protocol_error(self, protocol, message):
        self.log.warn("lumberjack client: {host}{message}; reconnecting",
                      host=self._host, message=message)
        protocol.transport.abortConnection()

    def _timed_out(self):
        self._timeout_call = None
        if self._protocol is not None:
            self.log.warn("lumberjack client: {host}no ack within {timeout} s; "
                          "reconnecting", host=self._host, timeout=self.timeout)
            self._protocol.transport.abortConnection()

    def _cancel_timeout(self):
        if self._timeout_call is not None:
            if self._timeout_call.active():
                self._timeout_call.cancel()
            self._timeout_call = None
