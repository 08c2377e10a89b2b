"""
WebSocket produce and consume on C{/logs/{name}/records}, as the reference
has them:

- produce: C{POST}, or C{GET} with C{X-HTTP-Method-Override: POST} (what
  browsers can send), with C{Upgrade: websocket}.  Every message (binary or
  text) is one record.  Like the reference we send no ack messages; beyond
  it, the closing handshake is the ack: the server answers the client's
  Close (1000) only once every record received before it is durable.
- consume: C{GET} with C{Upgrade: websocket} and the read parameters
  (C{whence}, C{position}, C{count}, C{follow}).  Every record is one binary
  message; after C{count} records, or at the end of the log when not
  following, the server closes with 1000.

Bounds: a message larger than the log's C{max_record_size} is refused with
Close 1009 (message too big) as soon as its frame headers announce it; a
producer outrunning the disk stops being read (TCP backpressure); a
consumer holds at most one batch of the log while its socket is full.
Storage errors close with 1011.

The frames are wsproto's (sans-IO RFC 6455, what C{twisted.web.websocket}
is built on); the Twisted side is L{_WebSocketStream}.  Twisted 26.10's
C{twisted.web.websocket} itself does not fit: it answers a Close at once
(the closing handshake could not be the produce ack) and buffers a message
whole, without bound, before handing it over (doc/styx-stream.rst, "Why
wsproto").
"""

from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET
from wsproto import ConnectionType
from wsproto.connection import Connection, ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Message, Ping, TextMessage
from wsproto.extensions import Extension
from wsproto.frame_protocol import CloseReason, Opcode, RsvBits
from wsproto.utilities import generate_accept_token
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.observer import OneShotObserver
from streamproto.styx.errors import APIError
from streamproto.styx.follow import LogFollower
from streamproto.styx.params import read_start
from streamproto.styx.stream import _early_bytes, take_over

_log = Logger()

DEFAULT_TIMEOUT = 30
#: Records handed to one log.append at most.
APPEND_BATCH_RECORDS = 16384
APPEND_BATCH_BYTES = 1024 * 1024
#: Undurable bytes at which the producer stops being read.
DEFAULT_MAX_PENDING_BYTES = 16 * 1024 * 1024
DEFAULT_READ_BYTES = 256 * 1024

CLOSE_NORMAL = 1000
#: RFC 6455 "going away": the server is shutting down
CLOSE_GOING_AWAY = 1001
SHUTDOWN_REASON = "server shutting down"
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011

_OPEN = ConnectionState.OPEN
_REMOTE_CLOSING = ConnectionState.REMOTE_CLOSING
_CLOSED = ConnectionState.CLOSED


def is_produce(request):
    """POST, or GET overridden to POST (the reference's browser route)."""
    if request.method == b"POST":
        return True
    override = request.getHeader(b"x-http-method-override")
    return request.method == b"GET" and override is not None \
        and override.strip().upper() == b"POST"


class _MessageSizeLimit(Extension):
    """
    Refuses a message as soon as its frame headers announce more than
    C{limit} bytes (Close 1009), before any of its payload is buffered.

    A frame header is seen only by a wsproto extension: this one is never
    negotiated (L{offer} nothing; it uses no RSV bit), it only looks.
    """

    name = "streamproto-message-size-limit"
    _NO_RSV = RsvBits(False, False, False)

    def __init__(self, limit):
        self.limit = limit
        self._announced = 0

    def enabled(self):
        return True

    def offer(self):
        return False

    def frame_inbound_header(self, proto, opcode, rsv, payload_length):
        if opcode.iscontrol():
            return self._NO_RSV
        if opcode is Opcode.CONTINUATION:
            self._announced += payload_length
        else:
            self._announced = payload_length
        if self._announced > self.limit:
            return CloseReason.MESSAGE_TOO_BIG
        return self._NO_RSV


class _WebSocketStream(Protocol):
    """
    One server-side WebSocket connection, past the opening handshake: the
    frames (wsproto), messages bounded in size, the idle ping and the
    closing handshake.  What the messages mean is a subclass's job
    (L{opened}, L{message_received}, L{close_received}, L{closed}).

    @ivar gone: fires once the connection is gone.
    """

    def __init__(self, clock, timeout, max_message_size):
        """
        @param timeout: seconds: a peer silent this long is pinged; one
            silent as long again is dropped, and so is one that leaves our
            Close unanswered that long.
        @param max_message_size: bytes: a larger message is refused with
            Close 1009.
        """
        self.clock = clock
        self.timeout = timeout
        self.gone = OneShotObserver()
        self._ws = Connection(ConnectionType.SERVER, [_MessageSizeLimit(max_message_size)])
        self._message = []
        self._last_heard = clock.seconds()
        self._pinged_at = None   # when the unanswered Ping went out
        self._reading_paused = False
        self._idle_call = None
        self._close_call = None
        self._failed = False    # wsproto refused the peer's bytes: read none

    # -- what a subclass does --------------------------------------------------
    def opened(self):
        """The connection is open."""

    def message_received(self, payload):
        """A whole message (bytes; a text message as UTF-8) arrived while open."""

    def close_received(self, code, reason):
        """
        The peer sent Close.

        @return: whether to answer it now; if not, call L{answer_close}
            later.
        """
        return True

    def closed(self):
        """The connection is gone."""

    # -- what a subclass calls -------------------------------------------------
    @property
    def is_open(self):
        """Messages can be sent and are received: no Close either way yet."""
        return self._ws.state is _OPEN

    def send_messages(self, payloads):
        """Send every payload (bytes) as one binary message, while open."""
        if self._ws.state is _OPEN and not self.gone.fired:
            send = self._ws.send
            self.transport.writeSequence([send(BytesMessage(p)) for p in payloads])

    def close(self, code, reason=""):
        """
        Start the closing handshake (or answer a held Close with C{code}):
        messages received from now on are dropped; the connection is
        dropped if the peer does not answer within the timeout.
        """
        state = self._ws.state
        if self.gone.fired or state not in (_OPEN, _REMOTE_CLOSING):
            return
        self.transport.write(self._ws.send(CloseConnection(code, reason)))
        if state is _REMOTE_CLOSING:
            self._disconnect()
        else:
            self._abort_later()

    def answer_close(self):
        """Answer the peer's held Close, echoing its code: the handshake is done."""
        if self._ws.state is _REMOTE_CLOSING and not self.gone.fired:
            self.transport.write(self._ws.send(self._held_close.response()))
            self._disconnect()

    @property
    def close_held(self):
        """Whether the peer's Close waits for L{answer_close}."""
        return self._ws.state is _REMOTE_CLOSING

    def pause_reading(self):
        """Stop reading (and do not hold the silence that follows against the peer)."""
        self._reading_paused = True
        self.transport.pauseProducing()

    def resume_reading(self):
        self._reading_paused = False
        self._last_heard = self.clock.seconds()
        self.transport.resumeProducing()

    # -- IProtocol ---------------------------------------------------------------
    def connectionMade(self):
        self._idle_call = self.clock.callLater(self.timeout, self._idle_check)
        self.opened()

    def early_data_received(self, data):
        """What came behind the opening handshake (see L{take_over})."""
        if data:
            self.dataReceived(data)

    def dataReceived(self, data):
        ws = self._ws
        if ws.state is _CLOSED or self._failed:
            return
        self._last_heard = self.clock.seconds()
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, Message):
                self._message_part(event)
            elif isinstance(event, Ping):
                if ws.state is _OPEN:
                    self.transport.write(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self._close_event(event)
            # a Pong only tells us the peer is there: _last_heard says so already

    def connectionLost(self, reason):
        for call in (self._idle_call, self._close_call):
            if call is not None and call.active():
                call.cancel()
        self._message = []
        self.closed()
        self.gone.fire(None)

    # -- internals ---------------------------------------------------------------
    def _message_part(self, event):
        if self._ws.state is not _OPEN:
            return      # after our Close: dropped
        data = event.data.encode("utf-8") if isinstance(event, TextMessage) else event.data
        if not event.message_finished:
            self._message.append(data)
            return
        if self._message:
            self._message.append(data)
            data = b"".join(self._message)
            self._message = []
        self.message_received(data)

    def _close_event(self, event):
        state = self._ws.state
        if state is _REMOTE_CLOSING:
            self._held_close = event
            if self.close_received(event.code, event.reason):
                self.answer_close()
        elif state is _CLOSED:
            # the answer to our Close: the handshake is complete
            self._disconnect()
        else:
            # wsproto refused what the peer sent (1002 broken frames, 1007 a
            # text message not UTF-8, 1009 too big) and reads no further:
            # fail the connection (RFC 6455 7.1.7), Close then TCP close
            self._failed = True
            if state is _OPEN:
                reason = "message too big" if event.code == CLOSE_MESSAGE_TOO_BIG \
                    else event.reason
                self.transport.write(self._ws.send(CloseConnection(event.code, reason)))
            self._disconnect()

    def _idle_check(self):
        # one timer per period, rather than one reset per read
        now = self.clock.seconds()
        if self._reading_paused or self._ws.state is not _OPEN:
            # our own pause, or a closing handshake (timed by close()):
            # not the peer's silence
            self._last_heard = now
        if self._pinged_at is not None:
            if self._last_heard < self._pinged_at:
                _log.info("WebSocket peer silent for {seconds:.0f} s: dropped",
                          seconds=now - self._last_heard)
                self._idle_call = None
                self._abort()
                return
            self._pinged_at = None      # answered (anything will do)
        quiet = now - self._last_heard
        if quiet >= self.timeout:
            self._pinged_at = now
            self.transport.write(self._ws.send(Ping(b"")))
            delay = self.timeout
        else:
            delay = self.timeout - quiet
        self._idle_call = self.clock.callLater(delay, self._idle_check)

    def _disconnect(self):
        """
        The closing handshake is over (or failed): close TCP, the server's
        part (RFC 6455 7.1.1), even if the peer reads no more.
        """
        self.transport.loseConnection()
        self._abort_later()

    def _abort_later(self):
        """Drop the connection if it is still there after the timeout."""
        if self._close_call is None:
            self._close_call = self.clock.callLater(self.timeout, self._abort)

    def _abort(self):
        self.transport.abortConnection()


@implementer(IGracefulShutdown)
class ProduceProtocol(_WebSocketStream):
    """Every message is a record; appended in batches, durable before the
    closing handshake completes."""

    def __init__(self, log, clock, metrics=None, timeout=DEFAULT_TIMEOUT,
                 max_pending_bytes=DEFAULT_MAX_PENDING_BYTES):
        super().__init__(clock, timeout, log.config.max_record_size)
        self.log_ = log
        self.metrics = metrics
        self.max_pending_bytes = max_pending_bytes
        self._batch = []
        self._batch_bytes = 0
        self._flush_call = None
        self._pending_bytes = 0
        self._appends = 0
        self._paused = False
        self._failed = False
        self._shutting_down = False
        self.received_count = 0
        self.synced_count = 0

    def gracefulShutdown(self):
        """
        The server is stopping (called by
        L{streamproto.core.ops.TrackingFactory}): messages arriving from now
        on are dropped, the ones received are appended, and once they are
        durable the server closes with 1001 (going away).  WebSocket
        produce has no per-record acks: only a closing handshake the
        client started and the server answered with 1000 acknowledges the
        stream, so a client told 1001 sends again what it was not sure of.

        @return: a Deferred firing once the connection is gone.
        """
        self._shutting_down = True
        self._flush()
        if not self._appends:
            self.close(CLOSE_GOING_AWAY, SHUTDOWN_REASON)
        return self.gone.when_fired()

    def message_received(self, payload):
        if self._failed or self._shutting_down:
            return
        self._batch.append(payload)
        self._batch_bytes += len(payload)
        self.received_count += 1
        if len(self._batch) >= APPEND_BATCH_RECORDS or self._batch_bytes >= APPEND_BATCH_BYTES:
            self._flush()
        elif self._flush_call is None:
            # messages of one read arrive in one reactor turn: append them together
            self._flush_call = self.clock.callLater(0, self._flush)

    def _flush(self):
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        if not self._batch:
            return
        batch, nbytes = self._batch, self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        self._appends += 1
        self._pending_bytes += nbytes
        d = self.log_.append(batch)
        d.addCallbacks(self._appended, self._append_failed,
                       callbackArgs=(len(batch), nbytes), errbackArgs=(nbytes,))
        if self._pending_bytes > self.max_pending_bytes and not self._paused:
            self._paused = True
            if self.metrics is not None:
                self.metrics.paused()
            self.pause_reading()

    def _appended(self, result, count, nbytes):
        self._appends -= 1
        self._pending_bytes -= nbytes
        self.synced_count += count
        if self.metrics is not None:
            self.metrics.produced(self.log_.name, count, nbytes)
        if self._paused and self._pending_bytes <= self.max_pending_bytes // 2:
            self._paused = False
            self.resume_reading()
        if self._appends:
            return
        if self.close_held:
            self.answer_close()
        elif self._shutting_down:
            self.close(CLOSE_GOING_AWAY, SHUTDOWN_REASON)

    def _append_failed(self, failure, nbytes):
        self._appends -= 1
        self._pending_bytes -= nbytes
        _log.failure("WebSocket producer on {log}: append failed", failure, log=self.log_.name)
        if not self._failed:
            self._failed = True
            # a Close the client sent is answered with this one
            self.close(CLOSE_INTERNAL_ERROR, "log not available")

    def close_received(self, code, reason):
        # the closing handshake acknowledges the stream: answer only once
        # every record received before the client's Close is durable
        if self._failed:
            return True
        self._flush()
        return not self._appends

    def closed(self):
        if self._batch:
            # the connection dropped without a closing handshake: what was
            # received is still appended (nobody is told it is durable)
            self._flush()


@implementer(IGracefulShutdown)
class ConsumeProtocol(_WebSocketStream):
    """Every record is one binary message."""

    def __init__(self, log, position, count, follow, clock, metrics=None,
                 timeout=DEFAULT_TIMEOUT, read_bytes=DEFAULT_READ_BYTES):
        super().__init__(clock, timeout, log.config.max_record_size)
        self.log_ = log
        self.metrics = metrics
        # the follower streams the log in: at most one batch read ahead,
        # nothing more while the transport is full
        self.reader = LogFollower(log, position, count, follow, read_bytes,
                                  deliver=self.send_batch, end=lambda: self.finished(None),
                                  failed=self._read_failed)
        self._reading = False

    def opened(self):
        self._reading = True
        self.transport.registerProducer(self.reader, True)
        self.reader.start()

    def _stop_reading(self):
        self.reader.stop()
        if self._reading:
            self._reading = False
            self.transport.unregisterProducer()

    def send_batch(self, batch):
        self.send_messages(batch.records())
        if self.metrics is not None:
            self.metrics.consumed(self.log_.name, len(batch), batch.nbytes)

    def _read_failed(self, failure):
        _log.failure("WebSocket consumer on {log} failed at {position}", failure,
                     log=self.log_.name, position=self.reader.position)
        self.finished(failure)

    def finished(self, failure):
        self._stop_reading()
        if failure is None:
            self.close(CLOSE_NORMAL)
        else:
            self.close(CLOSE_INTERNAL_ERROR, "log not available")

    def gracefulShutdown(self):
        """
        The server is stopping: no more records are read, the stream ends
        with 1001 (going away) after the last whole message sent.

        @return: a Deferred firing once the connection is gone.
        """
        self._stop_reading()
        self.close(CLOSE_GOING_AWAY, SHUTDOWN_REASON)
        return self.gone.when_fired()

    def close_received(self, code, reason):
        self._stop_reading()
        return True

    def closed(self):
        self._stop_reading()


def _error_response(request, error, headers=()):
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", b"application/json")
    for name, value in headers:
        request.setHeader(name, value)
    request.write(error.to_json())
    request.finish()
    return NOT_DONE_YET


def _handshake_error(request):
    """
    What makes C{request} no WebSocket opening handshake (RFC 6455 4.2.1;
    the resource checked C{Upgrade: websocket}): an L{APIError} and the
    headers to answer it with, or None.
    """
    connection = request.getHeader(b"connection") or b""
    if b"upgrade" not in [t.strip().lower() for t in connection.split(b",")]:
        return APIError("invalid_params", "websocket: missing Connection: Upgrade"), ()
    if request.getHeader(b"sec-websocket-version") != b"13":
        return (APIError("invalid_params", "websocket: only Sec-WebSocket-Version 13",
                         status=426), [(b"sec-websocket-version", b"13")])
    if not request.getHeader(b"sec-websocket-key"):
        return APIError("invalid_params", "websocket: missing Sec-WebSocket-Key"), ()
    return None


def upgrade(request, log, params=None, timeout=DEFAULT_TIMEOUT, clock=None, metrics=None,
            **options):
    """
    Answer a WebSocket upgrade on C{/logs/{name}/records}: produce (POST, or
    GET with C{X-HTTP-Method-Override: POST}) or consume (GET, reading from
    C{params}, a L{streamproto.styx.params.ReadParams}).

    @param timeout: seconds: an idle peer is pinged after this and dropped
        if nothing comes within as long again (see L{_WebSocketStream}).
    @param options: C{max_pending_bytes} (produce), C{read_bytes}
        (consume); others (C{protocol}) are ignored.
    @return: C{NOT_DONE_YET} (the request is finished or taken over).
    """
    clock = default_reactor(clock)
    if request.channel is None or request.channel.transport is None:
        return _error_response(request, APIError(
            "not_supported", "api: WebSocket needs an HTTP/1.1 connection"))
    if is_produce(request):
        protocol = ProduceProtocol(log, clock, metrics, timeout, **{
            k: v for k, v in options.items() if k == "max_pending_bytes"})
    elif request.method == b"GET":
        try:
            params, position = read_start(params, log)
        except APIError as e:
            return _error_response(request, e)
        protocol = ConsumeProtocol(log, position, params.count, params.follow, clock, metrics,
                                   timeout, **{k: v for k, v in options.items()
                                               if k == "read_bytes"})
    else:
        return _error_response(request, APIError("method_not_allowed"))
    refused = _handshake_error(request)
    if refused is not None:
        return _error_response(request, *refused)

    accept = generate_accept_token(request.getHeader(b"sec-websocket-key"))
    early = _early_bytes(request)
    transport = take_over(request, protocol)
    transport.write(b"HTTP/1.1 101 Switching Protocols\r\n"
                    b"Upgrade: websocket\r\n"
                    b"Connection: Upgrade\r\n"
                    b"Sec-WebSocket-Accept: %s\r\n\r\n" % accept)
    # twisted.web may have paused reading while it handled the request
    transport.resumeProducing()
    protocol.makeConnection(transport)
    protocol.early_data_received(early)
    return NOT_DONE_YET


#: The name the HTTP resource's brief uses.
websocket_upgrade = upgrade
