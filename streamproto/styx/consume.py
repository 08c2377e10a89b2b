"""
Consume over plain HTTP (C{GET /logs/{name}/records} without an upgrade):
L{RecordStreamer} streams a batch format's records into the response,
L{consume_one} answers the single-record format, and
L{long_poll_timeout} reads the reference's long-poll header.
"""

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.compat import request_gone
from streamproto.core.ops import IOutputCounter
from streamproto.core.sendpath import SocketSender
from streamproto.log.errors import LogError
from streamproto.styx import formats
from streamproto.styx.errors import APIError, from_exception
from streamproto.styx.follow import LogFollower
from streamproto.styx.httputil import header, respond_empty

# the HTTP API's log lines keep the namespace they had in one module
log = Logger(namespace="streamproto.styx.resource")

TIMEOUT_HEADER = b"X-Styx-Timeout"
# longer long-polls are "for ever" (and would overflow the reactor's float time)
MAX_LONG_POLL = 2**31 - 1
# what one read of the log hands to the transport while streaming a response
READ_CHUNK_BYTES = 1024 * 1024
#: Seconds a response cut short by a failed read has to deliver what was
#: queued before it, before the connection is aborted.
CUT_TIMEOUT = 10


def long_poll_timeout(request, params):
    """
    Seconds from X-Styx-Timeout (honoured with follow only), or None.

    @param params: the request's L{streamproto.styx.params.ReadParams}.
    @raise APIError: the header is not an integer.
    """
    raw = header(request, TIMEOUT_HEADER)
    if not params.follow or raw is None or raw == b"":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise APIError("unknown_error", "api: invalid X-Styx-Timeout header", status=400)
    if value < 0 or value > MAX_LONG_POLL:
        return None  # -1 is the reference's "no timeout"
    return value


@defer.inlineCallbacks
def consume_one(request, the_log, position, follow, timeout, metrics):
    """
    One record as the body; an empty 200 at the end of the log (after
    waiting up to C{timeout} seconds for one when C{follow}).

    @param metrics: the L{streamproto.styx.metrics.StyxMetrics} counting
        the record consumed.
    """
    batch = yield the_log.read(position, max_records=1)
    if not len(batch) and follow:
        wait = the_log.wait(position, timeout)
        request.notifyFinish().addErrback(lambda _: wait.cancel())
        try:
            yield wait
        except defer.CancelledError:
            return
        batch = yield the_log.read(position, max_records=1)
    if request_gone(request):
        return
    if not len(batch):
        respond_empty(request)
        return
    record = bytes(batch.data)
    metrics.consumed(the_log.name, 1, len(record))
    request.setHeader(b"Content-Type", b"application/octet-stream")
    request.setHeader(b"Content-Length", str(len(record)).encode())
    request.write(record)
    request.finish()


@implementer(IPushProducer)
class RecordStreamer:
    """
    Streams records of a log into an HTTP response, as a push producer
    registered with the request: the transport pauses it when its buffer is
    full, so a slow consumer stops the reading of the log instead of making
    the server buffer it.

    Follows the reference's loop: stop after C{count} records; at the end of
    the log stop unless following; when following, wait for records (up to
    C{timeout} seconds, or for ever when None) only while nothing has been
    sent yet: a response that has sent a record returns as soon as it would
    block.
    """

    def __init__(self, request, the_log, position, count, follow, timeout, encode,
                 metrics=None):
        self.request = request
        self.log = the_log
        self.position = position
        self.remaining = count  # -1: no limit
        self.follow = follow
        self.timeout = timeout
        self.encode = encode
        self.metrics = metrics
        self.sent = 0
        self.sent_bytes = 0
        self.paused = False
        self.done = False
        self._follower = None
        self._wait = None      # the long poll in progress
        self._waited = False

    #: on plain TCP, send the body with L{SocketSender} rather than through
    #: twisted.web's and the transport's buffers
    direct_send = True
    _sender = None
    _direct = False
    _chunked = False

    def start(self, reactor=None):
        if self.metrics is not None:
            self.metrics.active_streams.labels("http_consume").inc()
        transport = self.request.channel.transport if self.request.channel else None
        reactor = default_reactor(reactor)
        self._reactor = reactor
        self._direct = self.direct_send and transport is not None and \
            SocketSender.usable(transport, reactor)
        self.request.registerProducer(self, True)
        self.request.notifyFinish().addErrback(self._lost)
        self._read_from(self.position)

    def _read_from(self, position):
        # the reading (one batch read ahead while the socket is busy) is a
        # LogFollower's; this class keeps the reference's stop rules
        self._follower = LogFollower(self.log, position, self.remaining, follow=False,
                                     read_bytes=READ_CHUNK_BYTES, deliver=self._deliver,
                                     end=self._at_end, failed=self._fail)
        if self.paused:
            self._follower.pauseProducing()
        self._follower.start()

    def _start_sender(self):
        """
        Send the rest of the body with a L{SocketSender}, framed here
        (twisted.web writes the last chunk once it has drained).  Called
        when the transport has just sent everything it held (it resumes
        its producer only then), so nothing written through twisted.web
        (the status line, the headers, the first records) can come after
        bytes the sender sends.
        """
        self.request.unregisterProducer()
        self._chunked = bool(self.request.chunked)
        transport = self.request.channel.transport
        counter = IOutputCounter(transport, None)
        self._sender = SocketSender(transport, self._reactor,
                                    on_sent=counter and counter.count_output)
        self._sender.registerProducer(self)

    # IPushProducer
    def pauseProducing(self):
        self.paused = True
        if self._follower is not None:
            self._follower.pauseProducing()

    def resumeProducing(self):
        if self.paused and not self.done:
            self.paused = False
            if self._direct and self._sender is None and self.request.startedWriting:
                self._start_sender()
            if self._follower is not None:
                self._follower.resumeProducing()

    def stopProducing(self):
        self._stop()

    def _lost(self, reason):
        self._stop()

    def _stop(self):
        if self.done:
            return
        self._done()
        if self._follower is not None:
            self._follower.stop()
        if self._sender is not None:
            self._sender.close()
        wait, self._wait = self._wait, None
        if wait is not None:
            wait.cancel()

    def _deliver(self, batch):
        if self.done:
            return
        n = len(batch)
        if self._sender is not None:
            self._send_direct(batch)
        else:
            self.request.write(self.encode(batch))
        self.position = batch.next_position
        self.sent += n
        self.sent_bytes += batch.nbytes
        if self.remaining > 0:
            self.remaining -= n
        if self.metrics is not None:
            self.metrics.consumed(self.log.name, n, batch.nbytes)

    def _send_direct(self, batch):
        sender = self._sender
        if self.encode is formats.encode_binary:
            # frames straight from the read buffer (sendmsg iovecs)
            size = batch.nbytes + 4 * len(batch)
            body = None
        else:
            body = self.encode(batch)
            size = len(body)
        if self._chunked:
            sender.write(b"%x\r\n" % size)
        if body is None:
            sender.write_batch(batch, b"")
        else:
            sender.write(body)
        if self._chunked:
            sender.write(b"\r\n")
        self.request.sentLength += size     # the access log's byte count

    def _at_end(self):
        """The follower read everything asked for, or reached the synced end."""
        if self.done:
            return
        if self.remaining == 0 or not self.follow or self.sent > 0 or self._waited:
            self._finish()
            return
        self._wait = self.log.wait(self.position, self.timeout)
        self._wait.addCallbacks(self._woken, self._fail)

    def _woken(self, end_position):
        self._wait = None
        if self.done:
            return
        if end_position <= self.position:
            # the long-poll timed out with nothing new
            self._waited = True
        self._read_from(self.position)

    def _fail(self, failure):
        if failure.check(defer.CancelledError) or self.done:
            return
        self._wait = None
        if failure.check(LogError):
            # deleted, closed or fail-stopped under the reader: expected
            log.warn("consume of {log} ended at position {position}: {error}",
                     log=self.log.name, position=self.position, error=failure.value)
        else:
            log.failure("consume of {log} failed at position {position}", failure,
                        log=self.log.name, position=self.position)
        self._done()
        sender = self._sender
        if sender is not None:
            sender.unregisterProducer()
        else:
            self.request.unregisterProducer()
        if request_gone(self.request):
            if sender is not None:
                sender.close()
            return
        if not self.request.startedWriting:
            # nothing sent yet: the client still gets a proper JSON error
            error = from_exception(failure.value)
            if self.metrics is not None:
                self.metrics.error(error.code)
            body = error.to_json()
            self.request.setResponseCode(error.status)
            self.request.setHeader(b"Content-Type", b"application/json")
            self.request.setHeader(b"Content-Length", str(len(body)).encode())
            self.request.write(body)
            self.request.finish()
            return
        # the status line is gone: all we can do is cut the response short.
        # What was queued are whole records read before the failure: they go
        # out first (a read can fail in the very turn the previous one was
        # queued), then the connection closes without the last chunk, which
        # tells the client the body is incomplete.  A client that stopped
        # reading is cut off after CUT_TIMEOUT seconds.
        transport = self.request.channel.transport

        def give_up():
            if sender is not None:
                sender.close()      # its duplicate descriptor would keep the socket open
            transport.abortConnection()
        abort = self._reactor.callLater(CUT_TIMEOUT, give_up)
        # the request is not gone yet (see above): this fires once it is
        self.request.notifyFinish().addBoth(
            lambda _: abort.cancel() if abort.active() else None)

        def cut(_=None):
            if sender is not None:
                sender.close()
            transport.loseConnection()
        if sender is not None:
            sender.when_drained().addCallback(cut)
        else:
            cut()

    def _done(self):
        self.done = True
        if self.metrics is not None:
            self.metrics.active_streams.labels("http_consume").dec()

    def _finish(self):
        if self.done:
            return
        self._done()
        if self._sender is None:
            self.request.unregisterProducer()
            self.request.finish()
            return
        # the body's last bytes go out before twisted.web's last chunk
        sender = self._sender
        sender.unregisterProducer()
        sender.when_drained().addCallback(lambda _: self._finish_after(sender))

    def _finish_after(self, sender):
        sender.close()
        if sender.failed is None and not request_gone(self.request):
            self.request.finish()
