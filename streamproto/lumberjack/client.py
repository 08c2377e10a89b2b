"""
A Lumberjack v2 client with Filebeat's sending behaviour.

- Events queue up and go out in batches: a window frame, then the events as
  JSON frames, by default in one zlib-compressed frame (level 3).
- Up to C{pipelining} batches are in flight on the connection at once.
- Slow start: the batch size starts at 10, grows x1.5 after every fully
  acked batch up to C{bulk_max_size}, and halves after an error.
- A batch not fully acked within C{timeout} seconds (keepalive C{ACK 0}
  frames and partial acks restart the clock) counts as an error: the
  connection is dropped, and every unacked event goes back to the front of
  the queue.  The client reconnects with exponential backoff (jittered, see
  L{streamproto.core.reconnect}) and sends them again (at least once).

Each batch is numbered 1..n, as Filebeat does.  That makes the two ack
conventions in the wild agree: logstash-input-beats acks the highest
sequence number received, go-lumber's server acks the count of events
received, and for a batch numbered from 1 both are "the first k events".
"""

import json
import random
from collections import deque

from msgspec.json import encode as _fast_encode  # ~8x the stdlib, same compact UTF-8
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.errors import describe
from streamproto.core.observer import OneShotObserver
from streamproto.core.reconnect import DEFAULT_JITTER, Reconnector, backoff_policy
from streamproto.lumberjack.codec import Ack, FrameDecoder, ProtocolError, encode_batch
from streamproto.core.tcp import set_no_delay


class ClientClosed(Exception):
    """The client was closed before these events were acked."""


class _Request:
    """One L{LumberjackClient.send} call: fires once all its events are acked."""

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
    order, so that acks credit the right L{send} calls.
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


class _ClientProtocol(Protocol):
    def __init__(self, client):
        self.client = client
        self.decoder = FrameDecoder(max_frame=1024, max_decompressed=1024, validate=False)
        self.lost = Deferred()

    def connectionMade(self):
        set_no_delay(self.transport)

    def dataReceived(self, data):
        self.decoder.feed(data)
        try:
            frames = self.decoder.decode()
            for frame in frames:
                if type(frame) is not Ack:
                    raise ProtocolError(f"server sent {frame!r}, not an ack")
                self.client._ack(self, frame.seq)
        except ProtocolError as e:
            self.client._protocol_error(self, str(e))

    def connectionLost(self, reason):
        self.client._disconnected(self, reason)
        self.lost.callback(None)


class LumberjackClient:
    """
    @param endpoint: an IStreamClientEndpoint, e.g. from
        L{streamproto.core.tls.client_endpoint} (TCP or TLS).
    @param clock: IReactorTime for timeouts and backoff.
    @param bulk_max_size: largest batch (events).
    @param compression_level: zlib level 1-9, 0 for uncompressed frames.
    @param pipelining: batches in flight at once (at least 1).
    @param timeout: seconds to wait for an ack before dropping the connection.
    @param slow_start: start at 10 events a batch and grow, as Filebeat does;
        otherwise every batch is C{bulk_max_size}.
    @param backoff_initial: first reconnect delay, doubled per failure up to
        C{backoff_max}.
    @param jitter: each reconnect delay is drawn between the nominal one
        and this fraction more (0: exact); see
        L{streamproto.core.reconnect.backoff_policy}.
    @param rng: the random source of the jitter (C{random()} in [0, 1)).
    """

    log = Logger()

    def __init__(self, endpoint, clock=None, bulk_max_size=2048, compression_level=3,
                 pipelining=2, timeout=30.0, slow_start=True, initial_window=10,
                 backoff_initial=1.0, backoff_max=60.0, jitter=DEFAULT_JITTER, rng=random):
        clock = default_reactor(clock)
        self.endpoint = endpoint
        self.clock = clock
        self.bulk_max_size = bulk_max_size
        self.compression_level = compression_level
        self.pipelining = max(1, pipelining)
        self.timeout = timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.window = float(min(initial_window, bulk_max_size) if slow_start else bulk_max_size)
        self._queue = deque()       # [payloads, start index, request] segments not sent
        self._queued = 0
        self._inflight = deque()    # batches sent on the current connection
        self._protocol = None
        self._timeout_call = None
        self._loss_reason = None    # why the last connection ended (for the log)
        self._closed_event = OneShotObserver()
        self._stopped = False
        # connects only while there are events to send (start() in send())
        self._reconnector = Reconnector(
            lambda: endpoint.connect(Factory.forProtocol(lambda: _ClientProtocol(self))),
            clock, backoff_policy(backoff_initial, backoff_max, 2.0, jitter, rng),
            connected=self._adopt, cannot_connect=self._cannot_connect)
        self.events_acked = 0
        self.connections_made = 0

    @property
    def batch_size(self):
        return int(self.window)

    @property
    def pending(self):
        """Events not acked yet (queued or in flight)."""
        return self._queued + sum(len(b.payloads) - b.acked for b in self._inflight)

    # -- public API -------------------------------------------------------------
    def send(self, events):
        """
        Queue C{events} (dicts, or bytes / str of JSON) for sending.

        @return: a Deferred firing with their number once the server acked
            them all; failing with L{ClientClosed} if L{close} came first.
        """
        if self._stopped:
            raise ClientClosed("client is closed")
        payloads = [encode_event(e) for e in events]
        request = _Request(len(payloads))
        if not payloads:
            request.deferred.callback(0)
            return request.deferred
        self._queue.append([payloads, 0, request])
        self._queued += len(payloads)
        if self._protocol is not None:
            self._pump()
        else:
            self._reconnector.start()
        return request.deferred

    def close(self):
        """
        Stop: drop the connection, stop reconnecting, and fail every send
        not acked yet with L{ClientClosed}.

        @return: a Deferred firing once disconnected.
        """
        if not self._stopped:
            self._stopped = True
            self._reconnector.stop().addCallback(self._finish)
        return self._closed_event.when_fired()

    # -- the connection (see L{Reconnector}) -------------------------------------
    def _adopt(self, protocol):
        self._protocol = protocol
        self.connections_made += 1
        self._pump()

    def _cannot_connect(self, reason, delay):
        self.log.warn("lumberjack client: cannot connect: {error}", error=reason.value)

    def _finish(self, ignored=None):
        self._fail_pending()
        self._closed_event.fire()

    # -- called by the protocol ---------------------------------------------------
    def _disconnected(self, protocol, reason):
        if protocol is not self._protocol:
            return
        self._protocol = None
        self._loss_reason = describe(reason)   # one line, never a repr
        self._cancel_timeout()
        if self._inflight:
            # whatever was not acked goes out again, first
            self._shrink()
            self._requeue()
        if not self._queued:
            # nothing to send: connect again on the next send()
            self._reconnector.lost(reason, reconnect=False)
            return
        if not self._stopped:
            # a TLS refusal (wrong CA, no client certificate) shows up here, as a
            # connection lost right after it was made: say why before retrying
            self.log.warn("lumberjack client: connection lost ({reason}); reconnecting",
                          reason=self._loss_reason)
        self._reconnector.lost(reason)

    def _requeue(self):
        segments = []
        for batch in self._inflight:
            start = batch.acked
            for request, count in batch.owners:
                segments.append([batch.payloads[start:start + count], 0, request])
                start += count
        self._inflight.clear()
        for segment in reversed(segments):
            self._queue.appendleft(segment)
            self._queued += len(segment[0])

    def _fail_pending(self):
        requests = [seg[2] for seg in self._queue]
        for batch in self._inflight:
            requests.extend(owner[0] for owner in batch.owners)
        self._queue.clear()
        self._inflight.clear()
        self._queued = 0
        seen = set()
        for request in requests:
            if id(request) not in seen and not request.deferred.called:
                seen.add(id(request))
                request.deferred.errback(ClientClosed("client closed before the server acked"))

    # -- sending ----------------------------------------------------------------
    def _take(self, n):
        """Up to C{n} queued payloads and their owners."""
        payloads = []
        owners = []
        queue = self._queue
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
        self._queued -= len(payloads)
        return payloads, owners

    def _pump(self):
        protocol = self._protocol
        if protocol is None:
            return
        chunks = []
        while self._queued and len(self._inflight) < self.pipelining:
            payloads, owners = self._take(self.batch_size)
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
        self.log.warn("lumberjack client: {message}; reconnecting", message=message)
        protocol.transport.abortConnection()

    def _timed_out(self):
        self._timeout_call = None
        if self._protocol is not None:
            self.log.warn("lumberjack client: no ack within {timeout} s; reconnecting",
                          timeout=self.timeout)
            self._protocol.transport.abortConnection()

    def _cancel_timeout(self):
        if self._timeout_call is not None:
            if self._timeout_call.active():
                self._timeout_call.cancel()
            self._timeout_call = None
