"""
styx/0 clients: L{StyxProducer} writes records and learns when they are
durable, L{StyxConsumer} receives records in batches.

Both open a TCP (or TLS) connection, send the HTTP upgrade request for
C{/logs/{name}/records} (POST to produce, GET to consume), and switch to the
styx/0 codec once the server answers 101.  A server that refuses the
upgrade answers an HTTP API JSON error, raised here as
L{streamproto.styx.errors.APIError} with the server's code and status.

Example::

    producer = yield StyxProducer.connect(reactor, "127.0.0.1", 7123, "mylog")
    ack = yield producer.writeMany([b"a", b"b"])     # durable now
    yield producer.whenWritable()                     # backpressure
    final = yield producer.close()

    def got(records):
        ...                      # a list of bytes; may return a Deferred
    consumer = yield StyxConsumer.connect(reactor, "127.0.0.1", 7123, "mylog", got,
                                          whence="start", follow=True)
    total = yield consumer.done   # when the server ends the stream
"""

import json
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator, IPushProducer, IReactorTime,
)
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from streamproto.core.clock import default_reactor
from streamproto.core.observer import Observers
from streamproto.core.sweeper import shared_sweeper
from streamproto.core.tls import client_endpoint, client_tls_options
from streamproto.core.tcp import set_no_delay
from streamproto.log.batch import RecordBatch
from streamproto.styx.codec import (
    ACK, ERROR, HEARTBEAT_BYTES, HEARTBEAT_TYPE, MAX_WIRE_RECORD_SIZE, RECORD, Ack, ErrorCode,
    ErrorMessage, StyxDecoder, StyxProtocolError, encode_error, encode_records,
)
from streamproto.styx.errors import APIError
from streamproto.styx.handshake import (
    HandshakeError, ResponseHead, remote_timeout, request_head, upgraded,
)

_log = Logger()

DEFAULT_TIMEOUT = 30
#: Bytes of records written but not yet acked before writes are held back.
DEFAULT_WINDOW_BYTES = 32 * 1024 * 1024
MAX_ERROR_BODY = 1024 * 1024


class StyxStreamError(Exception):
    """The server ended the stream with an Error message (or we did)."""

    def __init__(self, code, message=None):
        try:
            self.code = ErrorCode(code)
            name = self.code.name
        except ValueError:
            self.code = code
            name = f"code {code}"
        super().__init__(message or f"styx/0 stream error: {name}")


class StyxConnectionLost(Exception):
    """The connection closed before the stream completed."""


def _dechunk(body):
    """@return: the decoded body, or None while incomplete."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        start = eol + 2
        if len(body) < start + size + 2:
            return None
        out.append(body[start:start + size])
        pos = start + size + 2


def _api_error(status, body):
    try:
        value = json.loads(body.decode("utf-8"))
        return APIError(value.get("code", "unknown_error"), value.get("message"), status=status)
    except (ValueError, AttributeError):
        return APIError("unknown_error", f"HTTP {status}", status=status)


class _StyxClientProtocol(Protocol):
    """
    The client side of one styx/0 connection: the HTTP handshake, then the
    codec, heartbeats and the idle timeout.  The owner (L{StyxProducer} or
    L{StyxConsumer}) gets C{_messages(records, others)} and
    C{_ended(reason)}.
    """

    #: a TCP or TLS transport, also a producer (pauseProducing) whose
    #: connected and disconnecting flags are read: no one Twisted interface
    #: says all that
    transport: Any
    #: the response's headers, once its head is read
    _headers: Any
    ready: "Deferred[_StyxClientProtocol] | None"

    def __init__(self, owner, head, accept, timeout, clock):
        self._owner = owner
        self._head = head
        self.timeout = timeout
        self._clock = clock
        self._response_head = ResponseHead()
        self._response = bytearray()    # an error body, after the head
        self._status = None
        self._headers = None
        self._decoder = StyxDecoder(MAX_WIRE_RECORD_SIZE, accept=accept)
        self.upgraded = False
        self.reading_paused = False
        #: hand records over as (lengths, payloads) batches
        self.batch_mode = False
        self.ready = Deferred()
        self.heartbeat_interval = None
        self._last_received = self._last_sent = 0.0
        # on the clock's shared sweeper: one reactor call for every
        # connection of a client holding many (streamproto.core.sweeper)
        sweeper = shared_sweeper(clock)
        self._idle_call = sweeper.deadline(self._check_idle)
        self._heartbeat_call = sweeper.deadline(self._check_heartbeat)
        self._failure = None

    def connectionMade(self):
        set_no_delay(self.transport)
        self.transport.write(self._head)

    def dataReceived(self, data):
        if self.upgraded:
            self._last_received = self._clock.seconds()
            self._feed(data)
            return
        if self._status is None:
            try:
                rest = self._response_head.feed(data)
            except HandshakeError as e:
                self._fail_handshake(APIError("unknown_error", str(e)))
                return
            if rest is None:
                return
            head = self._response_head
            self._status, self._headers = head.status, head.headers
            self._response += rest
            if self._status == 101:
                if not upgraded(self._status, self._headers):
                    self._fail_handshake(APIError("unknown_error", "server did not switch to styx/0"))
                    return
                self._switch()
                return
        else:
            self._response += data
        self._maybe_error_body()

    def _maybe_error_body(self):
        body = bytes(self._response)
        if len(body) > MAX_ERROR_BODY:
            self._fail_handshake(_api_error(self._status, b""))
            return
        if "chunked" in self._headers.get("transfer-encoding", "").lower():
            try:
                decoded = _dechunk(body)
            except ValueError:
                decoded = body
            if decoded is not None:
                self._fail_handshake(_api_error(self._status, decoded))
            return
        length = self._headers.get("content-length")
        if length is not None and len(body) >= int(length):
            self._fail_handshake(_api_error(self._status, body[:int(length)]))

    def _fail_handshake(self, error):
        self._failure = error
        self.transport.loseConnection()

    def _switch(self):
        self.upgraded = True
        remote = int(remote_timeout(self._headers, DEFAULT_TIMEOUT))
        self.remote_timeout = remote
        # heartbeat within both timeouts: the Go server closes after its own
        # tcp_timeout even when it announces a longer X-Styx-Timeout
        self.heartbeat_interval = max(1.0, min(remote, self.timeout) / 2.0)
        now = self._clock.seconds()
        self._last_received = self._last_sent = now
        self._idle_call.arm(self.timeout)
        self._heartbeat_call.arm(self.heartbeat_interval)
        leftover = bytes(self._response)
        self._response = bytearray()   # not used after the upgrade
        ready, self.ready = self.ready, None
        assert ready is not None  # set until the handshake ends
        ready.callback(self)
        if leftover and self.transport is not None and not self.transport.disconnecting:
            self._feed(leftover)

    def _feed(self, data):
        try:
            if self.batch_mode:
                lengths, payload, others = self._decoder.feed_batch(data)
                self._owner._batch(lengths, payload, others)
                return
            records, others = self._decoder.feed_split(data)
        except StyxProtocolError as e:
            _log.info("styx/0 client: protocol error from server: {e}", e=e)
            messages = e.messages
            self._owner._messages([m for m in messages if type(m) is bytes],
                                  [m for m in messages if type(m) is not bytes])
            self.abort(e.code, StyxStreamError(e.code, str(e)))
            return
        self._owner._messages(records, others)

    def write(self, data):
        self._last_sent = self._clock.seconds()
        self.transport.write(data)

    def abort(self, code, failure):
        """Send an Error message and close."""
        if self._failure is None:
            self._failure = failure
        if self.transport is not None and self.transport.connected:
            self.transport.write(encode_error(code))
            self.transport.loseConnection()

    def _check_idle(self):
        now = self._clock.seconds()
        if self.reading_paused:
            # we are not reading: the server's silence is ours
            self._last_received = now
        elapsed = now - self._last_received
        if elapsed >= self.timeout:
            self.abort(ErrorCode.TIMEOUT, StyxStreamError(
                ErrorCode.TIMEOUT, f"no message from the server for {self.timeout} s"))
            return
        self._idle_call.arm(self.timeout - elapsed)

    def _check_heartbeat(self):
        elapsed = self._clock.seconds() - self._last_sent
        if elapsed >= self.heartbeat_interval:
            self.write(HEARTBEAT_BYTES)
            elapsed = 0
        self._heartbeat_call.arm(self.heartbeat_interval - elapsed)

    def connectionLost(self, reason=None):
        self._idle_call.cancel()
        self._heartbeat_call.cancel()
        if self.ready is not None:
            ready, self.ready = self.ready, None
            ready.errback(self._failure or StyxConnectionLost(
                f"connection closed during the handshake: {reason.getErrorMessage()}"))
            return
        self._owner._ended(self._failure, reason)


class _OneShotFactory(Factory):
    def __init__(self, protocol):
        self._protocol = protocol

    def buildProtocol(self, addr):
        return self._protocol


def _connect(reactor, host, port, tls, protocol):
    endpoint = client_endpoint(reactor, host, port, tls)
    d = endpoint.connect(_OneShotFactory(protocol))
    d.addCallback(lambda _: protocol.ready)
    return d


def split_url(url: str, tls: IOpenSSLClientConnectionCreator | None = None
              ) -> tuple[str, int, IOpenSSLClientConnectionCreator | None]:
    """
    C{http://host:port} or C{https://host:port} -> C{(host, port, tls)};
    https without explicit C{tls} options verifies the server against the
    platform's trust store.
    """
    parts = urlsplit(url if "//" in url else "http://" + url)
    secure = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if secure else 80)
    if secure and tls is None:
        tls = client_tls_options(host)
    return host, port, tls


class StyxProducer:
    """
    Writes records over styx/0; each write's Deferred fires with the
    L{Ack} that made it durable.

    At most C{window_bytes} of records are on the wire unacknowledged;
    further writes wait in a local backlog until acks open the window.
    Callers that produce faster than the server syncs should wait for
    L{whenWritable} (or L{registerProducer} an C{IPushProducer}, paused
    while the window is full) so that the backlog stays small.
    """

    def __init__(self, name: str, timeout: float = DEFAULT_TIMEOUT,
                 window_bytes: int = DEFAULT_WINDOW_BYTES,
                 clock: IReactorTime | None = None) -> None:
        clock = default_reactor(clock)
        self.name = name
        self.window_bytes = window_bytes
        self.sent_count = 0          # records handed to the transport
        self.written_count = 0       # records accepted by write/writeMany
        self.acked_count = 0
        self.last_ack: Ack | None = None
        self._sent_bytes = 0
        self._acked_bytes = 0
        # (count threshold, cumulative bytes, deferred)
        self._inflight: deque[tuple[int, int, Deferred[Ack | None]]] = deque()
        # (encoded, count, nbytes, deferred)
        self._backlog: deque[tuple[Any, int, int, Deferred[Ack | None]]] = deque()
        self._backlog_bytes = 0
        self._writable_waiters: Observers[None] = Observers()
        self._producer: IPushProducer | None = None
        self._producer_paused = False
        self._closing: bool | None = None
        self._error: Exception | None = None
        # set by connect, before anyone else sees the producer
        self._protocol: Any = None
        self._timeout = timeout
        self._clock = clock
        self._close_waiters: Observers[Ack | None] = Observers()
        # (error or None,) once the connection is gone
        self._ended_with: tuple[Exception | None] | None = None

    @classmethod
    def connect(cls, reactor: Any, host: str, port: int, name: str,
                tls: IOpenSSLClientConnectionCreator | None = None,
                timeout: float = DEFAULT_TIMEOUT, window_bytes: int = DEFAULT_WINDOW_BYTES,
                token: str | None = None) -> "Deferred[StyxProducer]":
        """
        @param reactor: an C{IReactorTCP} and C{IReactorTime} (the
            connection and its timers).
        @param tls: client TLS options (L{streamproto.core.tls.client_tls_options})
            or None for plain TCP.
        @param token: a bearer token for a server's C{--auth-policy}, or None.
        @return: Deferred firing with a connected L{StyxProducer}; fails with
            L{APIError} if the server refuses the upgrade.
        """
        self = cls(name, timeout, window_bytes, reactor)
        head = request_head("POST", f"{host}:{port}", name, None, timeout, token)
        self._protocol = _StyxClientProtocol(self, head, (ACK, HEARTBEAT_TYPE, ERROR),
                                             timeout, reactor)
        d = _connect(reactor, host, port, tls, self._protocol)
        d.addCallback(lambda _: self)
        return d

    @classmethod
    def connect_url(cls, reactor: Any, url: str, name: str,
                    tls: IOpenSSLClientConnectionCreator | None = None,
                    **kwargs: Any) -> "Deferred[StyxProducer]":
        host, port, tls = split_url(url, tls)
        return cls.connect(reactor, host, port, name, tls, **kwargs)

    # -- writing ---------------------------------------------------------
    @property
    def in_flight_bytes(self) -> int:
        return self._sent_bytes - self._acked_bytes

    @property
    def writable(self) -> bool:
        return not self._backlog and self.in_flight_bytes < self.window_bytes

    def write(self, record: bytes) -> Deferred[Ack | None]:
        """@return: Deferred firing with the L{Ack} covering C{record}."""
        return self.writeMany([record])

    def writeMany(self, records: Iterable[bytes]) -> Deferred[Ack | None]:
        """
        @param records: a list of bytes-like records.
        @return: Deferred firing with the first L{Ack} covering all of them.
        """
        if self._error is not None:
            return fail(self._error)
        if self._closing is not None:
            return fail(StyxConnectionLost("producer is closing"))
        if not records:
            return succeed(self.last_ack)
        records = list(records)
        d: Deferred[Ack | None] = Deferred()
        nbytes = sum(map(len, records))
        self.written_count += len(records)
        encoded = encode_records(records)
        if not self._backlog and (self.in_flight_bytes + nbytes <= self.window_bytes
                                  or self.in_flight_bytes == 0):
            self._send(encoded, len(records), nbytes, d)
        else:
            self._backlog.append((encoded, len(records), nbytes, d))
            self._backlog_bytes += nbytes
        self._update_producer()
        return d

    def _send(self, encoded, count, nbytes, d):
        self.sent_count += count
        self._sent_bytes += nbytes
        self._inflight.append((self.sent_count, self._sent_bytes, d))
        self._protocol.write(encoded)

    def whenWritable(self) -> Deferred[None]:
        """@return: Deferred firing once the window has room."""
        if self._error is not None:
            return fail(self._error)
        if self.writable:
            return succeed(None)
        return self._writable_waiters.when()

    def registerProducer(self, producer: IPushProducer, streaming: bool = True) -> None:
        """C{producer} is paused while the window is full."""
        self._producer = producer
        self._producer_paused = False
        self._update_producer()

    def unregisterProducer(self) -> None:
        self._producer = None

    def _update_producer(self):
        if self._producer is None:
            return
        if self.writable:
            if self._producer_paused:
                self._producer_paused = False
                self._producer.resumeProducing()
        elif not self._producer_paused:
            self._producer_paused = True
            self._producer.pauseProducing()

    # -- from the protocol -----------------------------------------------
    def _messages(self, records, others):
        if records:
            self._protocol.abort(ErrorCode.UNEXPECTED_MESSAGE, StyxStreamError(
                ErrorCode.UNEXPECTED_MESSAGE, "server sent records to a producer"))
            return
        for message in others:
            if isinstance(message, Ack):
                self._acked(message)
            elif isinstance(message, ErrorMessage):
                self._error = StyxStreamError(message.code)
                self._protocol._failure = self._error

    def _acked(self, ack):
        self.last_ack = ack
        self.acked_count = ack.count
        inflight = self._inflight
        fire = []
        while inflight and inflight[0][0] <= ack.count:
            _, cumulative, d = inflight.popleft()
            self._acked_bytes = cumulative
            fire.append(d)
        while self._backlog and (self.in_flight_bytes + self._backlog[0][2] <= self.window_bytes
                                 or self.in_flight_bytes == 0):
            encoded, count, nbytes, d = self._backlog.popleft()
            self._backlog_bytes -= nbytes
            self._send(encoded, count, nbytes, d)
        for d in fire:
            d.callback(ack)
        if self.writable:
            self._writable_waiters.fire()
        self._update_producer()
        self._maybe_closed()

    def _maybe_closed(self):
        if (self._closing is not None and not self._backlog
                and self.acked_count >= self.sent_count and self._protocol.transport):
            self._protocol.transport.loseConnection()

    def close(self) -> Deferred[Ack | None]:
        """
        Wait until every record written is acked, then close.

        @return: Deferred firing with the final L{Ack} (None if nothing was
            ever acked).
        """
        if self._ended_with is not None:
            error = self._ended_with[0]
            return fail(error) if error is not None else succeed(self.last_ack)
        d = self._close_waiters.when()
        if self._closing is None:
            self._closing = True
            if self._error is None:
                self._maybe_closed()
            else:
                self._protocol.transport.loseConnection()
        return d

    def abort(self) -> None:
        """Close now; unacked writes fail."""
        self._protocol.abort(ErrorCode.UNKNOWN, StyxConnectionLost("aborted by the client"))

    def _ended(self, failure, reason):
        error = failure or self._error
        unacked = bool(self._inflight or self._backlog)
        if error is None and unacked:
            error = StyxConnectionLost(
                f"connection closed with {self.sent_count - self.acked_count} records unacked")
        if error is None and self._closing is None and not reason.check(ConnectionDone):
            error = StyxConnectionLost(reason.getErrorMessage())
        if error is not None:
            self._error = error
            pending = [d for _, _, d in self._inflight] + [e[3] for e in self._backlog]
            self._inflight.clear()
            self._backlog.clear()
            for d in pending:
                d.errback(error)
            self._writable_waiters.fail(error)
        self._ended_with = (error,)
        if error is not None:
            self._close_waiters.fail(error)
        else:
            self._close_waiters.fire(self.last_ack)


class StyxConsumer:
    """
    Receives records over styx/0 and hands them to C{on_records} a batch (a
    list of bytes) at a time.  If C{on_records} returns a Deferred, reading
    from the socket stops until it fires: a slow consumer slows the server
    down through TCP instead of buffering.

    @ivar done: Deferred firing with the number of records received when
        the server ends the stream (after C{count} records, or at the end of
        the log when not following), or failing with L{StyxStreamError}.
    """

    def __init__(self, name: str,
                 on_records: Callable[[list[bytes] | RecordBatch], Deferred[Any] | None],
                 clock: IReactorTime | None = None, batches: bool = False) -> None:
        self.name = name
        self._on_records = on_records
        self._batches = batches
        self.received_count = 0
        self.done: Deferred[int] = Deferred()
        # set by connect, before anyone else sees the consumer
        self._protocol: Any = None
        self._error: Exception | None = None
        self._closing = False
        self._blocked = 0

    @classmethod
    def connect(cls, reactor: Any, host: str, port: int, name: str,
                on_records: Callable[[list[bytes] | RecordBatch], Deferred[Any] | None],
                whence: str = "origin", position: int = 0, count: int = -1,
                follow: bool = False, tls: IOpenSSLClientConnectionCreator | None = None,
                timeout: float = DEFAULT_TIMEOUT, batches: bool = False,
                token: str | None = None) -> "Deferred[StyxConsumer]":
        """
        @param reactor: an C{IReactorTCP} and C{IReactorTime} (the
            connection and its timers).
        @param batches: hand C{on_records} a L{RecordBatch} (an
            C{array('I')} of sizes plus the concatenated payloads, see
            L{streamproto.log.batch}) rather than a list of bytes: no Python
            code runs per record (with the C accelerator).  Its C{position}
            counts records from the start of this stream.
        @param token: a bearer token for a server's C{--auth-policy}, or None.
        @return: Deferred firing with a connected L{StyxConsumer}.
        """
        self = cls(name, on_records, reactor, batches)
        query = {"whence": whence, "position": str(position), "count": str(count),
                 "follow": "true" if follow else "false"}
        head = request_head("GET", f"{host}:{port}", name, query, timeout, token)
        self._protocol = _StyxClientProtocol(self, head, (RECORD, HEARTBEAT_TYPE, ERROR),
                                             timeout, reactor)
        self._protocol.batch_mode = batches
        d = _connect(reactor, host, port, tls, self._protocol)
        d.addCallback(lambda _: self)
        return d

    @classmethod
    def connect_url(cls, reactor: Any, url: str, name: str,
                    on_records: Callable[[list[bytes] | RecordBatch], Deferred[Any] | None],
                    tls: IOpenSSLClientConnectionCreator | None = None,
                    **kwargs: Any) -> "Deferred[StyxConsumer]":
        host, port, tls = split_url(url, tls)
        return cls.connect(reactor, host, port, name, on_records, tls=tls, **kwargs)

    def _batch(self, lengths, payload, others):
        if lengths:
            batch = RecordBatch(self.received_count, lengths, payload)
            self._deliver(batch, len(lengths))
        self._others(others)

    def _messages(self, records, others):
        if records:
            self._deliver(records, len(records))
        self._others(others)

    def _deliver(self, records, count):
        self.received_count += count
        result = self._on_records(records)
        if isinstance(result, Deferred):
            self._blocked += 1
            if self._blocked == 1:
                self._protocol.reading_paused = True
                self._protocol.transport.pauseProducing()
            result.addBoth(self._unblock)

    def _others(self, others):
        for message in others:
            if isinstance(message, ErrorMessage):
                self._error = StyxStreamError(message.code)
                self._protocol._failure = self._error

    def _unblock(self, result):
        self._blocked -= 1
        if self._blocked == 0 and self._protocol.transport is not None:
            self._protocol.reading_paused = False
            # the idle clock must not count the time we were paused
            self._protocol._last_received = self._protocol._clock.seconds()
            self._protocol.transport.resumeProducing()
        if isinstance(result, Exception) or hasattr(result, "getErrorMessage"):
            _log.failure("styx/0 consumer callback failed", result)
            self.close()
        return None

    def close(self) -> Deferred[int]:
        """Stop consuming now."""
        self._closing = True
        if self._protocol.transport is not None:
            self._protocol.transport.loseConnection()
        return self.done

    def _ended(self, failure, reason):
        error = failure or self._error
        if error is None and not self._closing and not reason.check(ConnectionDone):
            error = StyxConnectionLost(reason.getErrorMessage())
        if error is not None and not self._closing:
            self.done.errback(error)
        else:
            self.done.callback(self.received_count)
