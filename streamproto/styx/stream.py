"""
The styx/0 stream on C{/logs/{name}/records}, server side.

The HTTP resource calls L{upgrade} for a request carrying C{Upgrade:
styx/0}: POST produces (the client sends records, the server acks them once
durable), GET consumes (the server sends records as they become durable).
L{upgrade} answers C{101 Switching Protocols} and takes the TCP (or TLS)
connection over from twisted.web (the mechanics are in
L{streamproto.styx.upgrading}, named here too): from then on a L{ProducerStream} or
L{ConsumerStream} is the transport's protocol, a thin layer between the
sans-IO L{streamproto.styx.codec} and the log.

Timeouts follow the reference: the server closes a stream that sent no
message for its own timeout (announced in its C{X-Styx-Timeout}), and sends
a heartbeat whenever it has sent nothing for half the client's timeout (the
client's C{X-Styx-Timeout}).
"""

from automat import MethodicalMachine
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer, ISSLTransport
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.errors import log_failure
from streamproto.core.machine import ignore
from streamproto.core.idle import IdleTimeout
from streamproto.core.sweeper import shared_sweeper
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.compat import set_read_size
from streamproto.core.ops import IOutputCounter
from streamproto.core.sendpath import SocketSender
from streamproto.core.tcp import set_no_delay
from streamproto.log.errors import (
    CorruptLog, LogClosed, LogFailed, LogNotFound, PositionOutOfRange, RecordTooLarge,
    StoreUnavailable, WriteFailed,
)
from streamproto.log.batch import RecordBatch
from streamproto.styx.codec import (
    ERROR, HEARTBEAT_BYTES, HEARTBEAT_TYPE, MAX_WIRE_RECORD_SIZE, RECORD, RECORD_PREFIX, ErrorCode,
    ErrorMessage, StyxDecoder, StyxProtocolError, encode_ack, encode_batch, encode_error,
)
from streamproto.styx.errors import APIError
from streamproto.styx.follow import LogFollower
from streamproto.styx.params import read_start
from streamproto.styx.upgrading import (  # named here too: the stream's public API
    PROTOCOL_NAME as PROTOCOL_NAME,
    TIMEOUT_HEADER as TIMEOUT_HEADER,
    DEFAULT_TIMEOUT as DEFAULT_TIMEOUT,
    MIN_TIMEOUT as MIN_TIMEOUT,
    DEFAULT_CONSUMER_START_DELAY as DEFAULT_CONSUMER_START_DELAY,
    OWN_CLIENT_AGENT as OWN_CLIENT_AGENT,
    GO_HTTP_AGENT as GO_HTTP_AGENT,
    GO_HTTP_READ_BUFFER as GO_HTTP_READ_BUFFER,
    is_styx_upgrade as is_styx_upgrade,
    take_over as take_over,
    switching_head as switching_head,
    consumer_start as consumer_start,
    refuse as refuse,
    _error_response as _error_response,
    _early_bytes as _early_bytes,
)

_log = Logger()

#: A producer stream stops reading from its socket while more than this
#: many bytes are decoded but not yet durable, and resumes as soon as they
#: are back within it: the pause lasts one fsync (waiting for half of it
#: to be durable spanned two, 10-40 ms each on a busy disk, in which the
#: stream read nothing).  This bound holds for logs that keep what waits
#: for durability in memory (L{ILog.holds_unsynced}: JetStream).
DEFAULT_MAX_PENDING_BYTES = 16 * 1024 * 1024
#: The bound for logs that hand appends to the OS at once (the file
#: store), where what waits for fsync costs the server no memory: a burst
#: of 100 MB (the reference's benchmark phase) is taken in while fsync
#: catches up, as the Go server does (it has no bound), instead of the
#: stream stopping for each fsync of a disk slower than the socket.
DEFAULT_MAX_PENDING_OS_BYTES = 128 * 1024 * 1024
#: A consumer stream reads the log in batches of at most this many bytes.
DEFAULT_READ_BYTES = 1024 * 1024
#: A producer stream reads up to this many bytes from its socket at once
#: (Twisted's default is 64 KiB): each read is decoded, appended and
#: written to the log as one batch, so per-read costs (a Deferred, a
#: writev, the decoder's call) are paid per MiB instead of per 64 KiB.
#: The Go reference reads through 1 MiB buffers too.
PRODUCER_READ_SIZE = 1024 * 1024


def error_code_for(failure_or_exception):
    """The styx/0 L{ErrorCode} for a log store error."""
    exc = getattr(failure_or_exception, "value", failure_or_exception)
    if isinstance(exc, LogNotFound):
        return ErrorCode.LOG_NOT_FOUND
    if isinstance(exc, (LogClosed, LogFailed, CorruptLog, WriteFailed, StoreUnavailable)):
        # WriteFailed: the disk is full; the append was rolled back
        return ErrorCode.LOG_NOT_AVAILABLE
    if isinstance(exc, PositionOutOfRange):
        return ErrorCode.POSITION_OUT_OF_RANGE
    if isinstance(exc, RecordTooLarge):
        return ErrorCode.RECORD_TOO_LARGE
    return ErrorCode.UNKNOWN


@implementer(IHalfCloseableProtocol, IGracefulShutdown)
class _StyxStream(Protocol):
    """
    What producer and consumer streams share: the decoder, heartbeats, the
    idle timeout, and the lifecycle::

        streaming --end--> draining --drained--> closing --lost--> closed

    C{end} stops reading input (end of input, a protocol error, a timeout,
    a storage error); C{drained} comes once the work still pending (appends
    not yet durable) is done, then the last messages (final ack, error) are
    sent and the connection is closed.
    """

    _machine = MethodicalMachine()
    _accept = ()
    role = "stream"
    #: half-close first when ending (see _send_last_and_close): for streams
    #: whose client may still be sending
    _linger_on_close = False

    def __init__(self, log, timeout=DEFAULT_TIMEOUT, remote_timeout=None, clock=None,
                 metrics=None):
        self._log = log
        self._metrics = metrics
        self.timeout = max(MIN_TIMEOUT, int(timeout))
        remote = self.timeout if remote_timeout is None else remote_timeout
        #: heartbeat period: half the peer's timeout, at least a second
        self.heartbeat_interval = max(1.0, remote / 2.0)
        self._clock = default_reactor(clock)
        self._decoder = StyxDecoder(
            min(log.config.max_record_size, MAX_WIRE_RECORD_SIZE), accept=self._accept)
        self._error_code = None
        #: the server's timeout: no message (heartbeats count) for that long
        #: closes with TIMEOUT; paused while we are not reading (the peer
        #: cannot be blamed for that silence)
        self._idle = IdleTimeout(self._clock, self.timeout, self._timed_out)
        #: on the clock's shared sweeper, like the idle timeout: not one
        #: reactor call per connection (streamproto.core.sweeper)
        self._heartbeat = shared_sweeper(self._clock).deadline(self._check_heartbeat)
        self._abort_call = None
        #: fires (with None) once the connection is gone
        self.closed = Deferred()
        self._last_sent = 0.0
        self._reading_paused = False
        #: the peer half-closed: it sends nothing more
        self._peer_done_sending = False

    # -- lifecycle (automat) ----------------------------------------------
    @_machine.state(initial=True)
    def streaming(self):
        "Messages flow."

    @_machine.state()
    def draining(self):
        "Input is over; waiting for pending work before the last messages."

    @_machine.state()
    def closing(self):
        "The last messages are written; the transport is closing."

    @_machine.state()
    def closed(self):
        "The connection is gone."

    @_machine.input()
    def end(self):
        "No more input will be processed (the reason is in _error_code)."

    @_machine.input()
    def drained(self):
        "Nothing is pending any more."

    @_machine.input()
    def lost(self):
        "The connection is gone."

    @_machine.output()
    def _stop_input(self):
        self._state = "draining"
        self._stop_timers()
        self._on_end()

    @_machine.output()
    def _send_last_and_close(self):
        self._state = "closing"
        self._on_drained()
        if self._error_code is not None:
            self._write(encode_error(self._error_code))
            if self._metrics is not None and self._error_code != ErrorCode.SHUTDOWN:
                self._metrics.stream_error(self._error_code.name)
        # from now on input is dropped; reading must go on so that a TLS
        # close (the peer's close_notify) or the peer's FIN can complete it
        self._resume_reading()
        # a peer that never reads would keep the last bytes (and us) forever
        self._abort_call = self._clock.callLater(self.timeout, self._abort)
        if self._sender is not None:
            # the last bytes go out through the sender before the close
            sender = self._sender
            sender.when_drained().addCallback(lambda _: self._close_transport(sender))
        else:
            self._close_transport(None)

    def _close_transport(self, sender):
        if sender is not None:
            sender.close()
        if self._state != "closing":
            return      # lost meanwhile
        half_close = getattr(self.transport, "loseWriteConnection", None)
        if (self._linger_on_close and half_close is not None
                and not self._peer_done_sending
                and not ISSLTransport.providedBy(self.transport)):
            # a lingering close: closing the socket while the client's
            # records are still arriving would answer them with a TCP reset,
            # and a reset can destroy our last Ack and Error before the
            # client reads them (on Linux, its next write fails with EPIPE
            # and a client that writes before it reads never sees them).
            # So only our side is closed, we go on reading (and dropping)
            # until the client closes its side once it has read them
            # (readConnectionLost), or the timer aborts.  Not needed when
            # the client already half-closed (nothing more can arrive).
            # Not under TLS: the half-close would shut the TCP stream below
            # the TLS layer, before its close_notify (and TLS waits for the
            # peer's close_notify anyway, which lingers the same way).
            half_close()
        else:
            self.transport.loseConnection()

    def _abort(self):
        self._abort_call = None
        if self._sender is not None:
            self._sender.close()
        self.transport.abortConnection()

    @_machine.output()
    def _release(self):
        self._state = "closed"
        self._stop_timers()
        self._count_stream(-1)
        self._on_lost()
        self.closed.callback(None)

    streaming.upon(end, enter=draining, outputs=[_stop_input])
    ignore(streaming, drained)
    streaming.upon(lost, enter=closed, outputs=[_release])
    ignore(draining, end)
    draining.upon(drained, enter=closing, outputs=[_send_last_and_close])
    draining.upon(lost, enter=closed, outputs=[_release])
    ignore(closing, end, drained)
    closing.upon(lost, enter=closed, outputs=[_release])
    ignore(closed, end, drained, lost)

    # hooks for the subclasses
    def _on_end(self):
        pass

    def _on_drained(self):
        pass

    def _on_lost(self):
        pass

    def _pending(self):
        """True while work must finish before the stream may close."""
        return False

    def _maybe_drained(self):
        if not self._pending():
            self.drained()

    def finish(self, code=None):
        """End the stream: stop reading, finish pending work, send the
        final messages (and an Error with C{code} if given), close."""
        if code is not None and self._error_code is None:
            self._error_code = ErrorCode(code)
        self.end()
        self._maybe_drained()

    def gracefulShutdown(self):
        """
        The server is stopping (called by
        L{streamproto.core.ops.TrackingFactory}): stop reading, let the
        appends in flight become durable, send the final Ack and
        C{Error(SHUTDOWN)}, close.  Records the client sent after this are
        neither stored nor acked: the client sends them again elsewhere.

        @return: a Deferred firing once the connection is gone.
        """
        gone = Deferred()

        def fire(result):
            gone.callback(None)
            return result
        self.closed.addBoth(fire)
        self.finish(ErrorCode.SHUTDOWN)
        return gone

    # -- Protocol ---------------------------------------------------------
    def _count_stream(self, delta):
        gauge = getattr(self._metrics, "active_streams", None)
        if gauge is not None:
            gauge.labels(f"styx0_{self.role}").inc(delta)

    def connectionMade(self):
        # as Go does for every TCP connection: an ack, a heartbeat or the
        # last piece of a consumer's batch goes out at once instead of
        # waiting for the peer's (possibly delayed) ACK of what went before
        set_no_delay(self.transport)
        self._count_stream(1)
        self._last_sent = self._clock.seconds()
        self._idle.start()
        self._heartbeat.arm(self.heartbeat_interval)

    def early_data_received(self, data):
        """Bytes the client sent before the 101 was complete."""
        if data:
            _log.info("styx/0 {role} on {log}: {n} bytes before the 101 completed",
                      role=self.role, log=self._log.name, n=len(data))
            self.finish(ErrorCode.EARLY_DATA)

    def dataReceived(self, data):
        if self._state != "streaming":
            return
        self._idle.reset()
        try:
            # lengths + one buffer, handed to the store as is: no per-record work
            lengths, payload, others = self._decoder.feed_batch(data)
            records = RecordBatch(0, lengths, payload)
        except StyxProtocolError as e:
            records = RecordBatch.from_records(0, [m for m in e.messages if type(m) is bytes])
            others = [m for m in e.messages if type(m) is not bytes]
            error = e
        else:
            error = None
        if len(records):
            self._records_received(records)
        for message in others:
            if isinstance(message, ErrorMessage):
                _log.info("styx/0 {role} on {log}: client sent error {code}",
                          role=self.role, log=self._log.name, code=message.code)
                self.finish()
                return
            # heartbeats only reset the idle timeout
        if error is not None:
            _log.info("styx/0 {role} on {log}: protocol error {code}: {error}",
                      role=self.role, log=self._log.name, code=error.code.name, error=str(error))
            self.finish(error.code)

    def _records_received(self, records):
        raise NotImplementedError

    def readConnectionLost(self):
        # the client half-closed (the Go producer's Close does): finish the
        # pending appends and send the final ack before closing
        self._peer_done_sending = True
        if self._state == "closing":
            self.transport.loseConnection()     # the end of a lingering close
            return
        self.finish()

    def writeConnectionLost(self):
        # our half-close of a lingering close is done.  Closing the socket
        # now would bring back the reset the half-close avoids: wait for the
        # client's side to close too (readConnectionLost), unless it
        # already has.
        if self._peer_done_sending:
            self.transport.loseConnection()

    def connectionLost(self, reason=None):
        self.lost()

    # automat keeps its state private: the outputs of the transitions that
    # change it mirror it here for cheap checks on the hot path
    _state = "streaming"

    # -- writing, timers --------------------------------------------------
    #: a L{SocketSender} carrying all output on plain TCP (consumers)
    _sender = None

    def _write(self, data):
        self._last_sent = self._clock.seconds()
        if self._sender is not None:
            self._sender.write(data)
        else:
            self.transport.write(data)

    def _timed_out(self):
        _log.info("styx/0 {role} on {log}: no message for {t} s, closing",
                  role=self.role, log=self._log.name, t=self.timeout)
        self.finish(ErrorCode.TIMEOUT)

    def _check_heartbeat(self):
        now = self._clock.seconds()
        elapsed = now - self._last_sent
        if elapsed >= self.heartbeat_interval:
            self._write(HEARTBEAT_BYTES)
            elapsed = 0
        self._heartbeat.arm(self.heartbeat_interval - elapsed)

    def _stop_timers(self):
        self._idle.cancel()
        self._heartbeat.cancel()
        call, self._abort_call = self._abort_call, None
        if call is not None and call.active():
            call.cancel()

    def _pause_reading(self):
        if not self._reading_paused:
            self._reading_paused = True
            self._idle.pause()
            self.transport.pauseProducing()

    def _resume_reading(self):
        if self._reading_paused:
            self._reading_paused = False
            self._idle.resume()
            self.transport.resumeProducing()


class ProducerStream(_StyxStream):
    """
    POST: the client sends records; they are appended to the log a whole
    received chunk at a time, and acked after each fsync that covers them.

    Ack(position, count): C{position} is the synced end of the log,
    C{count} the records of this stream made durable so far.
    """

    role = "producer"
    _accept = (RECORD, HEARTBEAT_TYPE, ERROR)
    _linger_on_close = True

    def __init__(self, log, timeout=DEFAULT_TIMEOUT, remote_timeout=None, clock=None,
                 metrics=None, max_pending_bytes=None):
        super().__init__(log, timeout, remote_timeout, clock, metrics)
        if max_pending_bytes is None:
            max_pending_bytes = (DEFAULT_MAX_PENDING_BYTES if getattr(log, "holds_unsynced", True)
                                 else DEFAULT_MAX_PENDING_OS_BYTES)
        self.max_pending_bytes = max_pending_bytes
        self.received_count = 0       # records decoded
        self.synced_count = 0         # records durable
        self.synced_position = log.end_position
        self._pending_bytes = 0       # decoded, not yet durable
        self._appends_in_flight = 0
        self._acked_count = 0
        self._ack_call = None
        self._append_lost = False     # an append failed: count nothing after it

    def _records_received(self, records):
        count = len(records)
        nbytes = records.nbytes
        self.received_count += count
        self._pending_bytes += nbytes
        self._appends_in_flight += 1
        d = self._log.append(records)
        d.addCallbacks(self._appended, self._append_failed,
                       callbackArgs=(count, nbytes), errbackArgs=(nbytes,))
        if self._pending_bytes > self.max_pending_bytes:
            # storage lags: let TCP slow the client down
            if not self._reading_paused and self._metrics is not None:
                self._metrics.paused()
            self._pause_reading()

    def _appended(self, result, count, nbytes):
        self._appends_in_flight -= 1
        self._pending_bytes -= nbytes
        if self._append_lost:
            # an Ack's count says the stream's first N records are stored:
            # after a failed append (a JetStream timeout) a later one may
            # still be stored, and counting it would acknowledge the lost
            # records in its place.  The final Ack stops before the loss.
            self._maybe_drained()
            return
        self.synced_count += count
        if self._metrics is not None:
            self._metrics.produced(self._log.name, count, nbytes)
        if result.end_position > self.synced_position:
            self.synced_position = result.end_position
        if self._state == "streaming":
            if self._pending_bytes <= self.max_pending_bytes:
                self._resume_reading()
            # every append completed by one fsync fires in the same reactor
            # turn: one ack after them covers the whole group
            if self._ack_call is None:
                self._ack_call = self._clock.callLater(0, self._send_ack)
        else:
            self._maybe_drained()

    def _append_failed(self, failure, nbytes):
        self._appends_in_flight -= 1
        self._pending_bytes -= nbytes
        self._append_lost = True
        code = error_code_for(failure)
        log_failure(_log, failure, "styx/0 producer on {log}: append failed", log=self._log.name)
        self.finish(code)

    def _send_ack(self):
        self._ack_call = None
        if self._state == "streaming" and self._acked_count != self.synced_count:
            self._acked_count = self.synced_count
            self._write(encode_ack(self.synced_position, self.synced_count))
            if self._metrics is not None:
                self._metrics.ack_sent()

    def _pending(self):
        return self._appends_in_flight > 0

    def _on_drained(self):
        if self._ack_call is not None and self._ack_call.active():
            self._ack_call.cancel()
        self._ack_call = None
        if self._acked_count != self.synced_count or self._error_code is None:
            # the final ack: the client learns exactly what is durable
            self._acked_count = self.synced_count
            self._write(encode_ack(self.synced_position, self.synced_count))
            if self._metrics is not None:
                self._metrics.ack_sent()

    def _on_lost(self):
        if self._ack_call is not None and self._ack_call.active():
            self._ack_call.cancel()
        self._ack_call = None


@implementer(IPushProducer)
class ConsumerStream(_StyxStream):
    """
    GET: the server sends the log's records from a position, as they become
    durable, in batches of whole records, as fast as the client reads them.

    Registered as a streaming producer on the transport: while the socket's
    send buffer is full it holds at most one batch read ahead (so the next
    write does not wait for the disk) and reads nothing more, so a slow
    consumer never makes the server buffer the log (the reading is a
    L{LogFollower}'s).
    """

    role = "consumer"
    _accept = (HEARTBEAT_TYPE, ERROR)
    #: on plain TCP, send records with L{SocketSender} (sendmsg straight
    #: from the read buffer) rather than through the transport's buffer
    direct_send = True
    _direct = False

    def __init__(self, log, position, count=-1, follow=False, timeout=DEFAULT_TIMEOUT,
                 remote_timeout=None, clock=None, metrics=None, read_bytes=DEFAULT_READ_BYTES,
                 start_delay=DEFAULT_CONSUMER_START_DELAY):
        super().__init__(log, timeout, remote_timeout, clock, metrics)
        self.follow = follow
        self.read_bytes = read_bytes
        self._follower = LogFollower(log, position, count, follow, read_bytes,
                                     deliver=self._send, end=self.finish, failed=self._failed)
        self._start_delay = start_delay
        self._start_call = None

    @property
    def position(self):
        """The next record to read."""
        return self._follower.position

    @property
    def remaining(self):
        """Records still to read; -1: no limit."""
        return self._follower.remaining

    @property
    def sent_count(self):
        """Records sent so far."""
        return self._follower.delivered

    def connectionMade(self):
        super().connectionMade()
        # plain TCP: records go out from the read buffer by sendmsg, once
        # the transport has sent what it holds (see resumeProducing)
        self._direct = self.direct_send and SocketSender.usable(self.transport, self._clock)
        self.transport.registerProducer(self, True)
        if self._start_delay > 0:
            self._start_call = self._clock.callLater(self._start_delay, self._start)
        else:
            self._start()

    def _start(self):
        self._start_call = None
        self._follower.start()

    # IPushProducer, driven by the transport
    def pauseProducing(self):
        self._follower.pauseProducing()

    def resumeProducing(self):
        if self._direct and self._sender is None and self._state == "streaming":
            # the transport resumes its producer only once it has sent all
            # it held (the 101, the first records): from here on every byte
            # goes through the sender, so none can overtake another
            self.transport.unregisterProducer()
            counter = IOutputCounter(self.transport, None)
            self._sender = SocketSender(self.transport, self._clock,
                                        on_sent=counter and counter.count_output)
            self._sender.registerProducer(self)
        self._follower.resumeProducing()

    def stopProducing(self):
        # the connection is going: connectionLost stops the follower
        self._follower.pauseProducing()

    def _records_received(self, records):
        raise AssertionError("the decoder refuses records on a consumer stream")

    def _send(self, batch):
        self._last_sent = self._clock.seconds()
        if self._sender is not None:
            self._sender.write_batch(batch, RECORD_PREFIX)
        else:
            self.transport.write(encode_batch(batch))
        if self._metrics is not None:
            self._metrics.consumed(self._log.name, len(batch), batch.nbytes)

    def _failed(self, failure):
        code = error_code_for(failure)
        log_failure(_log, failure, "styx/0 consumer on {log} failed at {position}",
                    log=self._log.name, position=self.position)
        self.finish(code)

    def _on_end(self):
        if self._start_call is not None and self._start_call.active():
            self._start_call.cancel()
        self._start_call = None
        self._follower.stop()

    def _on_drained(self):
        if self._sender is not None:
            self._sender.unregisterProducer()
        else:
            self.transport.unregisterProducer()

    def _on_lost(self):
        self._on_end()
        if self._sender is not None:
            self._sender.close()
        else:
            self.transport.unregisterProducer()


# -- the upgrade --------------------------------------------------------

def upgrade(request, log, params=None, timeout=DEFAULT_TIMEOUT, clock=None, metrics=None,
            **options):
    """
    Answer a styx/0 upgrade request on C{/logs/{name}/records}.

    POST starts a L{ProducerStream}, GET a L{ConsumerStream} reading from
    C{params} (a L{streamproto.styx.params.ReadParams}).  Errors found
    before the 101 (a malformed C{X-Styx-Timeout}, an out-of-range position)
    are answered as the HTTP API's JSON errors.  Call it from a resource's
    C{render} (or later, from a Deferred); it finishes the request itself.

    @param timeout: the server's X-Styx-Timeout (seconds, at least 2).
    @param metrics: a L{streamproto.styx.metrics.StyxMetrics} or None.
    @param options: passed to the stream (C{max_pending_bytes},
        C{read_bytes}, C{start_delay}); others (C{protocol}) are ignored.
    @return: C{NOT_DONE_YET}.
    """
    timeout = max(MIN_TIMEOUT, int(timeout))
    pad_to = 0
    raw_timeout = request.getHeader(TIMEOUT_HEADER)
    remote_timeout = timeout
    if raw_timeout is not None and raw_timeout.strip():
        try:
            remote_timeout = int(raw_timeout.strip(), 10)
        except ValueError:
            # the reference answers a malformed timeout with unknown_error
            return _error_response(request, APIError("unknown_error", status=400))
    if request.channel is None or request.channel.transport is None:
        return _error_response(request, APIError("not_supported",
                                                 "api: styx/0 needs an HTTP/1.1 connection"))
    if request.method == b"POST":
        protocol = ProducerStream(log, timeout, remote_timeout, clock, metrics,
                                  **{k: v for k, v in options.items()
                                     if k == "max_pending_bytes"})
    elif request.method == b"GET":
        try:
            params, position = read_start(params, log)
        except APIError as e:
            return _error_response(request, e)
        stream_options = {k: v for k, v in options.items()
                          if k in ("read_bytes", "start_delay")}
        if "start_delay" not in stream_options:
            stream_options["start_delay"], pad_to = consumer_start(request)
        protocol = ConsumerStream(log, position, params.count, params.follow, timeout,
                                  remote_timeout, clock, metrics, **stream_options)
    else:
        return _error_response(request, APIError("method_not_allowed"))

    early = _early_bytes(request)
    transport = take_over(request, protocol)
    transport.write(switching_head(timeout, pad_to))
    # twisted.web may have paused reading while it handled the request (the
    # stream may pause it again, and may even be done, once connected)
    transport.resumeProducing()
    if isinstance(protocol, ProducerStream):
        set_read_size(transport, PRODUCER_READ_SIZE)
    protocol.makeConnection(transport)
    _log.debug("styx/0 {role} stream on {log} started", role=protocol.role, log=log.name)
    protocol.early_data_received(early)
    return NOT_DONE_YET
