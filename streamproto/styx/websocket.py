"""
WebSocket produce and consume on C{/logs/{name}/records}, as the reference
has them (autobahn does the WebSocket work):

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
Close 1009 (message too big); a producer outrunning the disk stops being
read (TCP backpressure); a consumer holds at most one batch of the log
while its socket is full.  Storage errors close with 1011.
"""

from autobahn.twisted.resource import WebSocketResource
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET

from streamproto.core.clock import default_reactor
from streamproto.styx.errors import APIError
from streamproto.styx.follow import LogFollower

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
CLOSE_INTERNAL_ERROR = 1011


def is_produce(request):
    """POST, or GET overridden to POST (the reference's browser route)."""
    if request.method == b"POST":
        return True
    override = request.getHeader(b"x-http-method-override")
    return request.method == b"GET" and override is not None \
        and override.strip().upper() == b"POST"


class _GoingAway:
    """gracefulShutdown's bookkeeping, shared by both WebSocket roles."""

    def _when_gone(self):
        d = Deferred()
        if not hasattr(self, "_gone"):
            self._gone = []
        self._gone.append(d)
        return d

    def _fire_gone(self):
        gone, self._gone = getattr(self, "_gone", []), []
        for d in gone:
            d.callback(None)

    def _going_away(self):
        if self.state == self.STATE_OPEN:
            # sendClose refuses 1001 (it allows 1000 and 3000-4999 only)
            self.sendCloseFrame(code=CLOSE_GOING_AWAY, reasonUtf8=SHUTDOWN_REASON.encode())
        elif self.state != self.STATE_CLOSING:
            self.transport.loseConnection()


class ProduceProtocol(_GoingAway, WebSocketServerProtocol):
    """Every message is a record; appended in batches, durable before the
    closing handshake completes."""

    log_ = None
    clock = None
    metrics = None
    max_pending_bytes = DEFAULT_MAX_PENDING_BYTES

    def onOpen(self):
        self._batch = []
        self._batch_bytes = 0
        self._flush_call = None
        self._pending_bytes = 0
        self._appends = 0
        self._paused = False
        self._close_frame = None
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
        if self.state not in (self.STATE_OPEN, self.STATE_CLOSING):
            self.transport.loseConnection()
            return succeed(None)
        gone = self._when_gone()
        self._shutting_down = True
        self._flush()
        if not self._appends:
            self._going_away()
        return gone

    def onMessage(self, payload, isBinary):
        if self._failed or self._close_frame is not None or self._shutting_down:
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
            self.transport.pauseProducing()

    def _appended(self, result, count, nbytes):
        self._appends -= 1
        self._pending_bytes -= nbytes
        self.synced_count += count
        if self.metrics is not None:
            self.metrics.produced(self.log_.name, count, nbytes)
        if self._paused and self._pending_bytes <= self.max_pending_bytes // 2:
            self._paused = False
            self.transport.resumeProducing()
        self._maybe_answer_close()
        if self._shutting_down and not self._appends and self._close_frame is None:
            self._going_away()

    def _append_failed(self, failure, nbytes):
        self._appends -= 1
        self._pending_bytes -= nbytes
        _log.failure("WebSocket producer on {log}: append failed", failure, log=self.log_.name)
        if not self._failed:
            self._failed = True
            self._close_frame = None
            # autobahn's sendClose refuses codes other than 1000 and 3000-4999
            self.sendCloseFrame(code=CLOSE_INTERNAL_ERROR, reasonUtf8=b"log not available")

    def onCloseFrame(self, code, reasonRaw):
        # the closing handshake acknowledges the stream: answer only once
        # every record received before the client's Close is durable
        if self._failed or self.state != self.STATE_OPEN:
            return super().onCloseFrame(code, reasonRaw)
        self._flush()
        if self._appends:
            self._close_frame = (code, reasonRaw)
            return None
        return super().onCloseFrame(code, reasonRaw)

    def _maybe_answer_close(self):
        if self._close_frame is not None and not self._appends:
            code, reason = self._close_frame
            self._close_frame = None
            super().onCloseFrame(code, reason)

    def onClose(self, wasClean, code, reason):
        if getattr(self, "_batch", None):
            # the connection dropped without a closing handshake: what was
            # received is still appended (nobody is told it is durable)
            self._flush()
        self._fire_gone()


class ConsumeProtocol(_GoingAway, WebSocketServerProtocol):
    """Every record is one binary message."""

    log_ = None
    position = 0
    count = -1
    follow = False
    metrics = None
    read_bytes = DEFAULT_READ_BYTES

    def onOpen(self):
        # the follower streams the log in: at most one batch read ahead,
        # nothing more while the transport is full
        self.reader = LogFollower(self.log_, self.position, self.count, self.follow,
                                  self.read_bytes, deliver=self.send_batch,
                                  end=lambda: self.finished(None), failed=self._read_failed)
        self.transport.registerProducer(self.reader, True)
        self.reader.start()

    def send_batch(self, batch):
        send = self.sendMessage
        for record in batch.records():
            send(record, isBinary=True)
        if self.metrics is not None:
            self.metrics.consumed(self.log_.name, len(batch), batch.nbytes)

    def _read_failed(self, failure):
        _log.failure("WebSocket consumer on {log} failed at {position}", failure,
                     log=self.log_.name, position=self.reader.position)
        self.finished(failure)

    def finished(self, failure):
        self.transport.unregisterProducer()
        if failure is None:
            self.sendClose(CLOSE_NORMAL)
        else:
            # autobahn's sendClose refuses codes other than 1000 and 3000-4999
            self.sendCloseFrame(code=CLOSE_INTERNAL_ERROR, reasonUtf8=b"log not available")

    def gracefulShutdown(self):
        """
        The server is stopping: no more records are read, the stream ends
        with 1001 (going away) after the last whole message sent.

        @return: a Deferred firing once the connection is gone.
        """
        reader = getattr(self, "reader", None)
        if reader is None or self.state != self.STATE_OPEN:
            self.transport.loseConnection()
            return succeed(None)
        gone = self._when_gone()
        reader.stop()
        self.transport.unregisterProducer()
        self._going_away()
        return gone

    def onClose(self, wasClean, code, reason):
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.stop()
        self._fire_gone()


def _error_response(request, error):
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", b"application/json")
    request.write(error.to_json())
    request.finish()
    return NOT_DONE_YET


def upgrade(request, log, params=None, timeout=DEFAULT_TIMEOUT, clock=None, metrics=None,
            **options):
    """
    Answer a WebSocket upgrade on C{/logs/{name}/records}: produce (POST, or
    GET with C{X-HTTP-Method-Override: POST}) or consume (GET, reading from
    C{params}, a L{streamproto.styx.params.ReadParams}).

    @param timeout: seconds: autobahn pings an idle peer after this and
        drops it if no pong comes within as long again.
    @return: C{NOT_DONE_YET} (the request is finished or taken over).
    """
    clock = default_reactor(clock)
    limit = log.config.max_record_size
    attrs = {"log_": log, "clock": clock, "metrics": metrics}
    if is_produce(request):
        base = ProduceProtocol
        # autobahn re-reads the request head and accepts only a plain GET
        # (RFC 6455): the produce decision is taken, hide how it was asked
        request.method = b"GET"
        request.requestHeaders.removeHeader(b"x-http-method-override")
        if "max_pending_bytes" in options:
            attrs["max_pending_bytes"] = options["max_pending_bytes"]
    elif request.method == b"GET":
        if params is None:
            from streamproto.styx.params import ReadParams
            params = ReadParams()
        position = params.resolve_log(log)
        if not log.start_position <= position <= log.end_position:
            return _error_response(request, APIError(
                "invalid_params",
                f"api: params: position {position} outside "
                f"[{log.start_position}, {log.end_position}]"))
        base = ConsumeProtocol
        attrs.update(position=position, count=params.count, follow=params.follow)
        if "read_bytes" in options:
            attrs["read_bytes"] = options["read_bytes"]
    else:
        return _error_response(request, APIError("method_not_allowed"))
    protocol_class = type(base.__name__, (base,), attrs)
    factory = WebSocketServerFactory()
    factory.protocol = protocol_class
    factory.setProtocolOptions(
        # one record per message: the log's bound is the message bound
        maxMessagePayloadSize=limit,
        maxFramePayloadSize=limit,
        autoPingInterval=timeout,
        autoPingTimeout=timeout,
        openHandshakeTimeout=timeout,
        closeHandshakeTimeout=timeout,
        # refuse with a Close frame (1009 for an oversized record) rather
        # than a bare TCP drop, so the client learns why
        failByDrop=False,
    )
    # the HTTP channel registered itself as the transport's producer: the
    # WebSocket protocol registers its own (consumers) from now on
    transport = request.channel.transport if request.channel is not None else None
    if transport is not None:
        transport.unregisterProducer()
    # autobahn's resource re-reads the request head and takes the transport over
    result = WebSocketResource(factory).render(request)
    if result is not NOT_DONE_YET:
        request.write(result)
        request.finish()
    return NOT_DONE_YET


#: The name the HTTP resource's brief uses.
websocket_upgrade = upgrade
