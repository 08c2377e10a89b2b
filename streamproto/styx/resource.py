"""
The Styx HTTP API on twisted.web, route for route like the reference (styx
0.1.4): statuses, JSON shapes, form fields and defaults.

Embed it::

    from streamproto.log import open_store
    from streamproto.styx.resource import make_site
    site = make_site(open_store("data"))
    endpoints.serverFromString(reactor, "tcp:7123").listen(site)

Requests to C{/logs/{name}/records} with C{Upgrade: styx/0} or C{Upgrade:
websocket} are handed to L{streamproto.styx.stream.upgrade}.
"""

import importlib
import inspect
import io
import json
import os
import tarfile
import tempfile
import time
import urllib.parse

from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server
from twisted.web.resource import Resource
from twisted.web.static import NoRangeStaticProducer
from zope.interface import implementer

from streamproto.core.compat import request_gone, set_read_size
from streamproto.core.auth import ALLOW_ALL
from streamproto.log.config import LogConfig, validate_name
from streamproto.log.errors import LogError, LogExists, RecordTooLarge
from streamproto.log.public import PublicLogStore, check_public_name
from streamproto.styx import access, formats
from streamproto.core.ops import IOutputCounter
from streamproto.core.sendpath import SocketSender
from streamproto.styx.follow import LogFollower
from streamproto.styx.errors import APIError, from_exception, render_error, render_json
from streamproto.styx.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from streamproto.styx.metrics import StyxMetrics
from streamproto.styx.params import parse_read_params

log = Logger()

TIMEOUT_HEADER = b"X-Styx-Timeout"
DEFAULT_TIMEOUT = 30
MIN_TIMEOUT = 2
DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024
DEFAULT_MAX_RESTORE_SIZE = 16 * 1024 * 1024 * 1024
# what one read of the log hands to the transport while streaming a response
READ_CHUNK_BYTES = 1024 * 1024
# how much a streamed produce body is read from its socket at once
STREAMED_BODY_READ_SIZE = 1024 * 1024
# how many records a produce request appends per store call
APPEND_CHUNK_BYTES = 1024 * 1024
APPEND_CHUNK_RECORDS = 16384
# a streamed produce body stops being read while this much waits for fsync
MAX_UNSYNCED_BYTES = 8 * 1024 * 1024
CORS_METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH")
# rs/cors's defaults, plus the long-poll header
CORS_HEADERS = (b"origin", b"accept", b"content-type", b"x-requested-with",
                b"x-styx-timeout")
# longer long-polls are "for ever" (and would overflow the reactor's float time)
MAX_LONG_POLL = 2**31 - 1
INFO_FIELDS = ("name", "status", "record_count", "file_size", "start_position",
               "end_position")


def log_info(the_log):
    """The reference's log-info JSON object (its six fields, in its order)."""
    info = the_log.info()
    return {k: info[k] for k in INFO_FIELDS}


def header(request, name):
    value = request.requestHeaders.getRawHeaders(name)
    return value[0] if value else None


def upgrade_protocol(request):
    """C{b"styx/0"}, C{b"websocket"} or None, from the Upgrade header."""
    value = header(request, b"upgrade")
    if not value:
        return None
    tokens = [t.strip().lower() for t in value.split(b",")]
    for proto in (b"styx/0", b"websocket"):
        if proto in tokens:
            return proto
    return None


# -- bounded request bodies ---------------------------------------------

def path_segments(path):
    """C{b"/logs/a%20b/records?x"} -> C{["logs", "a b", "records"]}."""
    path = path.split(b"?", 1)[0]
    return [urllib.parse.unquote(s.decode("utf-8", "replace")) for s in path.split(b"/")[1:]]


class StyxRequest(server.Request):
    """
    A request whose body is bounded or streamed.

    twisted.web buffers a body (in memory or a temporary file) before
    rendering.  Produce requests in the batch formats (line-delimited,
    binary-records) are not buffered: their body is decoded and appended to
    the log as it arrives (L{StreamedProduce}), and the connection stops
    being read while too many appends wait for their fsync.  Any other body
    larger than the site's C{max_body_size} (C{max_restore_size} for
    restores) is refused at once, with a 413 C{request_too_large} JSON
    error, and the connection closed, without reading the rest.
    """

    _refused = False
    _received = 0
    # a StreamedProduce for batch produce requests, else None
    body_sink = None
    # like the reference, bodiless answers carry no Content-Type
    defaultContentType = None

    def _request_line(self):
        # the request line is parsed before the body arrives; only the
        # channel knows it yet
        return (getattr(self.channel, "_command", b"") or b"",
                getattr(self.channel, "_path", b"") or b"")

    def _max_body_size(self):
        site = self.channel.site
        command, path = self._request_line()
        if path.split(b"?", 1)[0] == b"/logs/restore":
            return getattr(site, "max_restore_size", DEFAULT_MAX_RESTORE_SIZE)
        return getattr(site, "max_body_size", DEFAULT_MAX_BODY_SIZE)

    def _streamed_produce(self):
        """A L{StreamedProduce} if this is a batch produce request."""
        site = self.channel.site
        resource = getattr(site, "resource", None)
        if not isinstance(resource, StyxResource):
            return None
        command, path = self._request_line()
        segments = path_segments(path)
        if (command != b"POST" or len(segments) != 3 or segments[0] != "logs"
                or segments[2] != "records" or not segments[1]
                or upgrade_protocol(self) is not None):
            return None
        try:
            fmt = formats.format_of(header(self, b"content-type"))
        except formats.FormatError:
            return None  # the resource answers it
        if fmt.kind == "record":
            return None
        return StreamedProduce(self, resource, segments[1], fmt)

    def _early_access(self):
        """
        The policy's answer to a request whose body is handled before
        rendering (a streamed produce, a restore): None if allowed, else
        the L{APIError} to answer at once, before the body is read.
        """
        site = self.channel.site
        resource = getattr(site, "resource", None)
        authorizer = getattr(resource, "authorizer", ALLOW_ALL)
        if not authorizer.enabled:
            return None
        command, path = self._request_line()
        segments = path_segments(path)
        if (command != b"POST" or segments[:1] != ["logs"]
                or upgrade_protocol(self) is not None):
            return None
        if not (segments[1:] == ["restore"] or segments[2:] == ["records"]):
            return None
        query = path.split(b"?", 1)[1] if b"?" in path else b""
        args = urllib.parse.parse_qs(query, keep_blank_values=True)
        needed = access.route_access(command, segments, args)
        if needed is None:
            return None
        try:
            access.check(self, authorizer, *needed)
        except APIError as e:
            return e
        return None

    def gotLength(self, length):
        refused = self._early_access()
        if refused is not None:
            self.requestHeaders.removeHeader(b"expect")
            self._refuse_with(refused)
            return
        self.body_sink = self._streamed_produce()
        if self.body_sink is not None:
            self.content = io.BytesIO()  # stays empty: the sink has the body
            # decode and append the body a MiB at a time (see styx/0's
            # PRODUCER_READ_SIZE)
            set_read_size(self.channel.transport, STREAMED_BODY_READ_SIZE)
            return
        if length is not None and length > self._max_body_size():
            # no "100 Continue" for a body we refuse
            self.requestHeaders.removeHeader(b"expect")
            self._refuse(length)
            return
        super().gotLength(length)

    def handleContentChunk(self, data):
        if self._refused:
            return
        if self.body_sink is not None:
            self.body_sink.feed(data)
            return
        self._received += len(data)
        if self._received > self._max_body_size():
            self._refuse(self._received)
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if self._refused:
            return
        if self.body_sink is not None:
            self.body_sink.body_complete()
        super().requestReceived(command, path, version)

    def connectionLost(self, reason):
        if self.body_sink is not None:
            self.body_sink.body_complete(lost=True)
        super().connectionLost(reason)

    def _refuse(self, size):
        limit = self._max_body_size()
        log.warn("refusing a request body of {size} bytes (limit {limit}) from {peer}",
                 size=size, limit=limit, peer=self.getClientAddress())
        self._refuse_with(APIError("request_too_large",
                                   f"api: request body exceeds {limit} bytes"))

    def _refuse_with(self, error):
        """Answer C{error} at once, without reading the body, and close."""
        self._refused = True
        site = self.channel.site
        metrics = getattr(site, "metrics", None)
        if metrics is not None:
            metrics.error(error.code)
        body = render_error(error.code, error.message)
        # written raw (the body is not read), with the CORS headers any
        # answer gets, so that a browser can read the error
        origin = self.requestHeaders.getRawHeaders(b"origin", [None])[0]
        cors = getattr(site.resource, "cors_headers", lambda origin: [])(
            origin.decode("latin-1") if origin is not None else None)
        if error.code == "unauthorized":
            cors = list(cors) + [(b"WWW-Authenticate", access.CHALLENGE)]
        reason = {401: b"Unauthorized", 403: b"Forbidden",
                  413: b"Request Entity Too Large"}.get(error.status, b"Error")
        response = (b"HTTP/1.1 %d %s\r\n" % (error.status, reason)
                    + b"Content-Type: application/json\r\n"
                    + b"".join(name + b": " + value + b"\r\n" for name, value in cors)
                    + b"Connection: close\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        transport = self.channel.transport
        transport.write(response)
        transport.loseConnection()


class StreamedProduce:
    """
    Decodes a batch produce body as it arrives and appends it to the log,
    1 MiB (or 16384 records) per append.  While more than
    C{MAX_UNSYNCED_BYTES} of appended records wait for their fsync, the
    connection is not read (TCP backpressure): the body is never buffered
    whole.  The first error (unknown log, malformed body, record too large,
    storage failure) stops the appending; the rest of the body is read and
    dropped, and the resource answers the error.

    @ivar done: fires with (count, end position) once the body is complete
        and every append durable, or fails with the first error.
    """

    def __init__(self, request, resource, name, fmt):
        self.request = request
        self.resource = resource
        self.name = name
        self.fmt = fmt
        self.log = None
        self.decoder = None
        self.error = None
        self.early = []           # chunks that came before the log was open
        self.batch = []
        self.batch_bytes = 0
        self.count = 0
        self.nbytes = 0
        self.unsynced = 0         # bytes appended, not yet durable
        self.pending = 0          # appends not yet durable
        self.end_position = None
        self.paused = False
        self.complete = False
        self.done = defer.Deferred()
        d = resource.store.get(name)
        d.addCallbacks(self._opened, self._fail)

    # -- body --------------------------------------------------------------
    def feed(self, data):
        if self.error is not None:
            return
        if self.log is None:
            self.early.append(bytes(data))
            self._pause()  # until the log is open
            return
        try:
            if isinstance(self.decoder, formats.BinaryDecoder):
                # binary-records: sizes + one buffer, appended as they are
                batch = self.decoder.feed_batch(data)
                if len(batch):
                    self._flush()
                    self._append(batch, len(batch), batch.nbytes)
                return
            records = self.decoder.feed(data)
        except (formats.FormatError, RecordTooLarge) as e:
            self._fail(e)
            return
        self._add(records)

    def body_complete(self, lost=False):
        """
        The body ended (C{lost}: the connection was lost first; then only
        the complete records received are appended, and nobody waits for
        the answer).
        """
        if self.complete:
            return
        self.complete = True
        self._resume()
        if lost:
            self.done.addErrback(lambda _: None)
        if self.log is not None and self.error is None:
            if not lost:
                try:
                    self._add(self.decoder.close())
                except (formats.FormatError, RecordTooLarge) as e:
                    self._fail(e)
                    return
            self._flush()
        self._maybe_done()

    # -- log -----------------------------------------------------------------
    def _opened(self, the_log):
        self.log = the_log
        self.decoder = self.fmt.decoder(the_log.config.max_record_size)
        early, self.early = self.early, []
        for chunk in early:
            self.feed(chunk)
        if self.complete:
            self.complete = False
            self.body_complete()
        elif not self.unsynced_too_high():
            self._resume()

    def _add(self, records):
        for r in records:
            self.batch.append(r)
            self.batch_bytes += len(r)
            if self.batch_bytes >= APPEND_CHUNK_BYTES or len(self.batch) >= \
                    APPEND_CHUNK_RECORDS:
                self._flush()

    def _flush(self):
        if not self.batch or self.error is not None:
            return
        batch, size = self.batch, self.batch_bytes
        self.batch, self.batch_bytes = [], 0
        self._append(batch, len(batch), size)

    def _append(self, records, count, size):
        self.count += count
        self.nbytes += size
        self.unsynced += size
        self.pending += 1
        self.log.append(records).addBoth(self._synced, size)
        if self.unsynced_too_high():
            self._pause()

    def unsynced_too_high(self):
        return self.unsynced > MAX_UNSYNCED_BYTES

    def _synced(self, result, size):
        self.pending -= 1
        self.unsynced -= size
        if isinstance(result, Failure):
            self._fail(result.value)
        else:
            self.end_position = result.end_position
        if not self.unsynced_too_high() and self.log is not None:
            self._resume()
        self._maybe_done()

    def _fail(self, error):
        if isinstance(error, Failure):
            error = error.value
        if isinstance(error, formats.FormatError):
            error = APIError("invalid_params", f"api: params: malformed body: {error}")
        if self.error is None:
            self.error = error
            self.batch = []
            self.early = []
        self._resume()  # read (and drop) the rest
        self._maybe_done()

    def _maybe_done(self):
        if self.done.called or not self.complete or self.pending:
            return
        if self.count:
            self.resource.metrics.produced(self.name, self.count, self.nbytes)
        if self.error is not None:
            self.done.errback(self.error)
        else:
            self.done.callback((self.count, self.end_position))

    # -- flow control ------------------------------------------------------------
    def _pause(self):
        if not self.paused and not self.complete:
            transport = self.request.channel.transport if self.request.channel else None
            if transport is not None:
                self.paused = True
                transport.pauseProducing()

    def _resume(self):
        if self.paused:
            self.paused = False
            transport = self.request.channel.transport if self.request.channel else None
            if transport is not None:
                transport.resumeProducing()


#: twisted.web's own default
DEFAULT_HTTP_IDLE_TIMEOUT = 60


class StyxSite(server.Site):
    """A L{server.Site} with bounded request bodies (see L{StyxRequest})."""

    requestFactory = StyxRequest

    def __init__(self, resource, max_body_size=DEFAULT_MAX_BODY_SIZE, metrics=None,
                 max_restore_size=DEFAULT_MAX_RESTORE_SIZE, **kw):
        super().__init__(resource, **kw)
        self.max_body_size = max_body_size
        self.max_restore_size = max_restore_size
        self.metrics = metrics


def make_site(store, timeout=DEFAULT_TIMEOUT, default_config=None,
              max_body_size=DEFAULT_MAX_BODY_SIZE, metrics=None, clock=None, upgrade=None,
              cors_origins=("*",), max_restore_size=DEFAULT_MAX_RESTORE_SIZE,
              http_idle_timeout=DEFAULT_HTTP_IDLE_TIMEOUT, authorizer=ALLOW_ALL):
    """
    The Site serving the Styx API over C{store} (an L{ILogStore}).

    @param authorizer: the L{streamproto.core.auth.IAuthorizer} deciding
        who may do what (default: everyone everything).

    @param http_idle_timeout: seconds an HTTP connection may stay silent
        (keep-alive or a slow request) before it is closed; upgraded styx/0
        and WebSocket streams use C{timeout} instead.
    """
    root = StyxResource(store, timeout=timeout, default_config=default_config,
                        metrics=metrics, clock=clock, upgrade=upgrade,
                        cors_origins=cors_origins, authorizer=authorizer)
    site = StyxSite(root, max_body_size=max_body_size, metrics=root.metrics,
                    max_restore_size=max_restore_size, timeout=http_idle_timeout)
    site.displayTracebacks = False
    return site


# -- streaming consume responses ------------------------------------------

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
        if reactor is None:
            from twisted.internet import reactor
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
            sender.write_records(batch.lengths, batch.data, b"")
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
        if self._sender is not None:
            self._sender.close()
        else:
            self.request.unregisterProducer()
        if request_gone(self.request):
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
        # the status line is gone: all we can do is cut the response short
        self.request.channel.transport.abortConnection()

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


# -- the API -----------------------------------------------------------------

class StyxResource(Resource):
    """
    The whole API as one leaf resource routing on the path (like the
    reference's router: unknown paths answer 404 C{not_found}, known paths
    with another method 405 C{method_not_allowed}).

    @ivar store: the L{streamproto.log.ILogStore}, seen through
        L{PublicLogStore}: the servers' internal logs (Pravega's) are not
        part of the API.
    @ivar timeout: the styx/0 heartbeat timeout (seconds) handed to upgrades.
    @ivar default_config: the L{LogConfig} new logs get unless the create
        form says otherwise.
    """

    isLeaf = True

    def __init__(self, store, timeout=DEFAULT_TIMEOUT, default_config=None, metrics=None,
                 clock=None, upgrade=None, cors_origins=("*",), authorizer=ALLOW_ALL):
        super().__init__()
        self.authorizer = authorizer
        # origins allowed to call the API from browsers ("*" wildcards, as
        # in the reference's cors_allowed_origins; empty: no CORS headers)
        self.cors_origins = tuple(cors_origins)
        if timeout < MIN_TIMEOUT:
            raise ValueError(f"timeout must be at least {MIN_TIMEOUT} seconds")
        self.store = store if isinstance(store, PublicLogStore) else PublicLogStore(store)
        self.timeout = timeout
        self.default_config = default_config or LogConfig()
        self.metrics = metrics or StyxMetrics()
        from twisted.internet import reactor
        self.reactor = reactor
        self.clock = clock if clock is not None else reactor
        # callable(request, log, params, **kw) taking over upgraded
        # connections; default: streamproto.styx.stream.upgrade
        self._upgrade_fn = upgrade

    # CORS (the reference wraps its router in rs/cors) ---------------------
    def _allowed_origin(self, origin):
        for pattern in self.cors_origins:
            if pattern == "*":
                return True
            head, star, tail = pattern.partition("*")
            if not star and origin == pattern:
                return True
            if star and origin.startswith(head) and origin.endswith(tail) \
                    and len(origin) >= len(head) + len(tail):
                return True
        return False

    def _cors(self, request):
        """
        Add CORS headers; answer preflights.  @return: True if the request
        was a preflight (answered).
        """
        origin = header(request, b"origin")
        if not self.cors_origins:
            return False
        if origin is None:
            # rs/cors (the reference) marks every response: a shared cache
            # must not serve one made without Origin to a CORS request
            request.responseHeaders.addRawHeader(b"Vary", b"Origin")
            return False
        origin = origin.decode("latin-1")
        asked_method = header(request, b"access-control-request-method")
        if request.method == b"OPTIONS" and asked_method is not None:
            allowed = self._allowed_origin(origin)
            all_origins = "*" in self.cors_origins
            request.responseHeaders.addRawHeader(b"Vary", b"Origin")
            request.responseHeaders.addRawHeader(b"Vary", b"Access-Control-Request-Method")
            request.responseHeaders.addRawHeader(b"Vary", b"Access-Control-Request-Headers")
            if allowed and asked_method.upper() in CORS_METHODS:
                request.setHeader(b"Access-Control-Allow-Origin",
                                  b"*" if all_origins else origin.encode("latin-1"))
                request.setHeader(b"Access-Control-Allow-Methods", asked_method.upper())
                asked_headers = header(request, b"access-control-request-headers")
                if asked_headers:
                    names = [h.strip().lower() for h in asked_headers.split(b",")]
                    if all(h in CORS_HEADERS for h in names if h):
                        request.setHeader(b"Access-Control-Allow-Headers", asked_headers)
            request.setResponseCode(204)
            return True
        for name, value in self.cors_headers(origin):
            request.responseHeaders.addRawHeader(name, value)
        return False

    def cors_headers(self, origin):
        """
        The CORS headers of an answer (not a preflight) to a request from
        C{origin} (a str, or None without an Origin header).
        """
        if not self.cors_origins:
            return []
        headers = [(b"Vary", b"Origin")]
        if origin is not None and self._allowed_origin(origin):
            headers.append((b"Access-Control-Allow-Origin",
                            b"*" if "*" in self.cors_origins else origin.encode("latin-1")))
        return headers

    # routing ------------------------------------------------------------
    def render(self, request):
        if self._cors(request):
            return b""
        # route on what is left below our mount point (all of the path
        # when we are the root); twisted.web has unquoted the segments
        segments = [seg.decode("utf-8", "replace") for seg in request.postpath]
        method = request.method
        handler = self._route(segments, method)
        try:
            self._authorize(request, segments, handler)
        except APIError as e:
            if upgrade_protocol(request) == b"styx/0" and e.code in ("unauthorized",
                                                                      "forbidden"):
                # styx/0 says no its own way: an Error message after the 101
                from streamproto.styx.stream import refuse
                self.metrics.error(e.code)
                refuse(request, e, self.timeout)
            else:
                self._error(Failure(e), request)
            return server.NOT_DONE_YET
        d = defer.maybeDeferred(handler, request, *segments[1:2])
        d.addErrback(self._error, request)
        return server.NOT_DONE_YET

    def _authorize(self, request, segments, handler):
        """
        Check the policy for a routed request, before anything touches the
        store (listing and creation check theirs in their handlers).
        @raise APIError: 401 or 403.
        """
        if not self.authorizer.enabled or handler in (self.not_found, self.not_allowed):
            return
        needed = access.route_access(request.method, segments, request.args)
        if needed is None:
            return
        op, name = needed
        if (op == "read" and upgrade_protocol(request) == b"websocket"
                and (header(request, b"x-http-method-override") or b"").upper() == b"POST"):
            op = "write"  # a browser's WebSocket produce (see consume)
        access.check(request, self.authorizer, op, name)

    def _readable(self, request, names):
        """The names of C{names} the request may read (all without a policy)."""
        if not self.authorizer.enabled:
            return list(names)
        principals = access.request_principals(request, self.authorizer)
        return [n for n in names if self.authorizer.allows(principals, "read", n)]

    def _route(self, segments, method):
        if segments == ["metrics"]:
            return self.render_metrics
        if not segments or segments[0] != "logs" or "" in segments[1:]:
            return self.not_found
        rest = segments[1:]
        if not rest:
            return {b"GET": self.list_logs, b"POST": self.create_log}.get(
                method, self.not_allowed)
        if len(rest) == 1:
            if rest[0] == "restore" and method == b"POST":
                return self.restore_log
            return {b"GET": self.get_log, b"DELETE": self.delete_log}.get(
                method, self.not_allowed)
        if len(rest) == 2:
            action = rest[1]
            if action == "truncate":
                return self.truncate_log if method == b"POST" else self.not_allowed
            if action == "backup":
                return self.backup_log if method == b"GET" else self.not_allowed
            if action == "records":
                return {b"GET": self.consume, b"POST": self.produce}.get(
                    method, self.not_allowed)
        return self.not_found

    # responses ----------------------------------------------------------
    def _json(self, request, value, status=200):
        if request_gone(request):
            return  # the client left while we worked; finish() would raise
        body = render_json(value)
        request.setResponseCode(status)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(body)).encode())
        request.write(body)
        request.finish()

    def _empty(self, request, status=200):
        if request_gone(request):
            return
        request.setResponseCode(status)
        request.setHeader(b"Content-Length", b"0")
        request.finish()

    def _error(self, failure, request):
        error = from_exception(failure.value)
        if error.code == "unknown_error" and isinstance(failure.value, OSError):
            # the data directory's problem (read-only, full): the operator's
            # to fix, told in one line here and in the answer
            log.error("storage error on {method} {path}: {error}", method=request.method,
                      path=request.path, error=failure.value)
        elif error.code == "unknown_error" and not isinstance(failure.value, APIError):
            log.failure("unexpected error on {method} {path}", failure,
                        method=request.method, path=request.path)
        else:
            log.debug("{method} {path}: {code} {message}", method=request.method,
                      path=request.path, code=error.code, message=error.message)
        self.metrics.error(error.code)
        if request.finished or request_gone(request):
            return
        if request.startedWriting:
            # the status line went out already: cut the response short
            request.channel.transport.abortConnection()
            return
        body = error.to_json()
        if error.code == "unauthorized":
            request.setHeader(b"WWW-Authenticate", access.CHALLENGE)
        request.setResponseCode(error.status)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(body)).encode())
        request.write(body)
        request.finish()

    def not_found(self, request, *args):
        raise APIError("not_found")

    def not_allowed(self, request, *args):
        raise APIError("method_not_allowed")

    # /metrics -----------------------------------------------------------
    @defer.inlineCallbacks
    def render_metrics(self, request, *args):
        infos = []
        for name in self._readable(request, self.store.names()):
            try:
                the_log = yield self.store.get(name)
                infos.append(the_log.info())
            except Exception:
                continue  # deleted meanwhile, or unavailable
        body = self.metrics.render(infos)
        if request_gone(request):
            return
        request.setHeader(b"Content-Type", METRICS_CONTENT_TYPE.encode())
        request.setHeader(b"Content-Length", str(len(body)).encode())
        request.write(body)
        request.finish()

    # /logs --------------------------------------------------------------
    @defer.inlineCallbacks
    def list_logs(self, request):
        entries = []
        for name in self._readable(request, self.store.names()):
            try:
                the_log = yield self.store.get(name)
            except Exception:
                continue
            entries.append(log_info(the_log))
        self._json(request, entries)

    def _post_form(self, request):
        """The urlencoded body only, like Go's C{r.PostForm}."""
        ctype = header(request, b"content-type") or b""
        media, _ = formats.parse_media_type(ctype) if ctype else ("", {})
        if media != "application/x-www-form-urlencoded" or request.content is None:
            return {}
        request.content.seek(0)
        raw = request.content.read().decode("utf-8", "replace")
        return {k: v[0] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}

    @defer.inlineCallbacks
    def create_log(self, request):
        form = self._post_form(request)
        name = form.get("name", "")
        if not name:
            raise APIError("invalid_params", "api: params: name is required")
        values = self.default_config.as_dict()
        for field in LogConfig.field_names():
            raw = form.get(field)
            if raw is None or raw == "":
                continue
            try:
                values[field] = int(raw, 10)
            except ValueError:
                raise APIError("invalid_params",
                               f"api: params: {field}: invalid integer {raw!r}")
        try:
            config = LogConfig(**values)
        except ValueError as e:
            raise APIError("invalid_params", f"api: params: {e}")
        access.check(request, self.authorizer, "admin", name)
        the_log = yield self.store.create(name, config)
        log.info("created log {name}", name=name)
        self._json(request, log_info(the_log))

    @defer.inlineCallbacks
    def get_log(self, request, name):
        the_log = yield self.store.get(name)
        self._json(request, log_info(the_log))

    @defer.inlineCallbacks
    def delete_log(self, request, name):
        yield self.store.delete(name)
        self.metrics.forget(name)
        log.info("deleted log {name}", name=name)
        self._empty(request)

    @defer.inlineCallbacks
    def truncate_log(self, request, name):
        # The reference empties the log and starts positions again at 0, so
        # its CLI's default read (origin, position 0) works after a
        # truncate: recreate the log with the same configuration.  Streams
        # open on it end, as on a delete.
        the_log = yield self.store.get(name)
        config = the_log.config
        yield self.store.delete(name)
        yield self.store.create(name, config)
        log.info("truncated log {name}", name=name)
        self._empty(request)

    # backup / restore ---------------------------------------------------
    def _store_path(self):
        path = getattr(self.store, "path", None)
        if not path:
            raise APIError("not_supported",
                           "api: backup and restore need a file-backed log store")
        return str(path)

    def _log_directory(self, name):
        log_path = getattr(self.store, "log_path", None)
        if log_path is not None:
            return log_path(name)
        return os.path.join(self._store_path(), name)

    @defer.inlineCallbacks
    def backup_log(self, request, name):
        the_log = yield self.store.get(name)
        self._store_path()
        yield the_log.sync()
        directory = self._log_directory(name)
        from twisted.internet.threads import deferToThread
        archive = yield deferToThread(_tar_directory, directory)
        if request_gone(request):
            archive.close()
            return
        filename = f"{name}-{int(time.time())}.tar.gz"
        request.setHeader(b"Content-Disposition",
                          f"attachment; filename={filename}".encode())
        request.setHeader(b"Content-Type", b"application/gzip")
        archive.seek(0, os.SEEK_END)
        request.setHeader(b"Content-Length", str(archive.tell()).encode())
        archive.seek(0)
        request.notifyFinish().addBoth(lambda _: archive.close())
        # streams the file as the transport asks for it, then finishes
        NoRangeStaticProducer(request, archive).start()

    @defer.inlineCallbacks
    def restore_log(self, request, *args):
        args = request.args
        name = (args.get(b"name") or [b""])[0].decode("utf-8", "replace")
        if not name:
            raise APIError("invalid_params", "api: params: name is required")
        validate_name(name)
        check_public_name(name)
        root = self._store_path()
        if name in self.store.names():
            raise LogExists(f"log {name!r} exists")
        request.content.seek(0)
        from twisted.internet.threads import deferToThread
        yield deferToThread(_untar_into, request.content, root, name)
        opener = getattr(self.store, "open_log", None) or self.store.get
        try:
            yield opener(name)
        except Exception as e:
            # never leave an unopenable directory behind under the name
            yield deferToThread(_discard_directory, root, name)
            log.warn("restored log {name} cannot be opened: {error}", name=name, error=e)
            raise APIError("invalid_params",
                           f"api: params: restored log cannot be opened: {e}")
        log.info("restored log {name}", name=name)
        self._empty(request)

    # records --------------------------------------------------------------
    def _upgrade_function(self, protocol):
        """
        styx/0 goes to L{streamproto.styx.stream.upgrade}, WebSocket to
        L{streamproto.styx.websocket.upgrade}; None when not available.
        """
        if self._upgrade_fn is not None:
            return self._upgrade_fn
        module = "stream" if protocol == b"styx/0" else "websocket"
        try:
            imported = importlib.import_module(f"streamproto.styx.{module}")
        except ImportError as e:
            if e.name != f"streamproto.styx.{module}":
                raise
            return None
        return getattr(imported, "upgrade", None)

    def _upgrade(self, request, the_log, params, protocol):
        """
        Hand the request to the styx/0 (or WebSocket) upgrade, passing the
        keyword arguments it accepts among C{timeout} (the server's
        heartbeat timeout), C{metrics}, C{protocol} (C{b"styx/0"} or
        C{b"websocket"}) and C{clock}.
        """
        upgrade = self._upgrade_function(protocol)
        kwargs = {"timeout": self.timeout, "metrics": self.metrics, "protocol": protocol,
                  "clock": self.clock}
        try:
            accepted = inspect.signature(upgrade).parameters
        except (TypeError, ValueError):
            accepted = {}
        if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return upgrade(request, the_log, params, **kwargs)

    def _stream_available(self, protocol):
        return self._upgrade_function(protocol) is not None

    @defer.inlineCallbacks
    def produce(self, request, name):
        protocol = upgrade_protocol(request)
        if protocol is not None:
            params = parse_read_params(request.args)
            if not self._stream_available(protocol):
                raise APIError("not_supported",
                               f"api: {protocol.decode()} upgrade not available")
            the_log = yield self.store.get(name)
            yield self._upgrade(request, the_log, params, protocol)
            return
        try:
            fmt = formats.format_of(header(request, b"content-type"))
        except formats.FormatError as e:
            raise APIError("unknown_error", f"api: {e}", status=400)
        if fmt.kind == "record":
            length = header(request, b"content-length")
            if length is None:
                raise APIError("missing_content_length")
            try:
                size = int(length)
            except ValueError:
                raise APIError("unknown_error", "api: invalid content-length", status=400)
            if size == 0:
                # the reference answers an empty single record like this
                self._json(request, {"position": 0, "count": 0})
                return
        sink = getattr(request, "body_sink", None)
        if sink is not None:
            count, end_position = yield sink.done
            if end_position is None:
                end_position = (yield self.store.get(name)).end_position
            self._json(request, {"position": end_position, "count": count})
            return
        the_log = yield self.store.get(name)
        request.content.seek(0)
        if fmt.kind == "record":
            record = request.content.read()
            limit = the_log.config.max_record_size
            if len(record) > limit:
                raise RecordTooLarge(
                    f"record of {len(record)} bytes exceeds max_record_size {limit}")
            result = yield the_log.append([record])
            self.metrics.produced(name, 1, len(record))
            self._json(request, {"position": result.end_position, "count": 1})
            return
        decoder = fmt.decoder(the_log.config.max_record_size)
        count, end_position = yield self._append_stream(the_log, request.content, decoder)
        if end_position is None:
            end_position = the_log.end_position
        self._json(request, {"position": end_position, "count": count})

    @defer.inlineCallbacks
    def _append_stream(self, the_log, body, decoder):
        """
        Decode C{body} in chunks and append as it goes: every append is
        issued at once (the store covers all pending ones with one fsync) and
        the answer waits for all of them, so nothing is acknowledged before
        it is durable.  A bad record fails the request; records of earlier
        complete chunks may already be in the log (as in the reference).
        """
        pending = []
        count = 0
        nbytes = 0
        error = None
        while error is None:
            chunk = body.read(APPEND_CHUNK_BYTES)
            try:
                records = decoder.feed(chunk) if chunk else decoder.close()
            except (formats.FormatError, RecordTooLarge) as e:
                error = e
                break
            for i in range(0, len(records), APPEND_CHUNK_RECORDS):
                part = records[i:i + APPEND_CHUNK_RECORDS]
                pending.append(the_log.append(part))
                count += len(part)
                nbytes += sum(map(len, part))
            if not chunk:
                break
            # let other connections run between megabytes of decoding
            yield deferLater(self.reactor, 0, lambda: None)
        results = yield defer.DeferredList(pending, consumeErrors=True)
        end_position = None
        for ok, value in results:
            if not ok:
                value.raiseException()
            end_position = value.end_position
        self.metrics.produced(the_log.name, count, nbytes)
        if error is not None:
            if isinstance(error, formats.FormatError):
                raise APIError("invalid_params", f"api: params: malformed body: {error}")
            raise error
        return count, end_position

    def _long_poll_timeout(self, request, params):
        """Seconds from X-Styx-Timeout (honoured with follow only), or None."""
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
    def consume(self, request, name):
        params = parse_read_params(request.args)
        protocol = upgrade_protocol(request)
        if protocol is not None:
            if not self._stream_available(protocol):
                raise APIError("not_supported",
                               f"api: {protocol.decode()} upgrade not available")
            the_log = yield self.store.get(name)
            if protocol == b"websocket" and (header(request, b"x-http-method-override")
                                             or b"").upper() == b"POST":
                # browsers cannot POST a WebSocket handshake: the reference
                # routes this GET to the WebSocket producer
                request.method = b"POST"
            yield self._upgrade(request, the_log, params, protocol)
            return
        try:
            fmt = formats.format_of(header(request, b"accept"))
        except formats.FormatError as e:
            raise APIError("unknown_error", f"api: {e}", status=400)
        timeout = self._long_poll_timeout(request, params)
        the_log = yield self.store.get(name)
        position = params.resolve_log(the_log)
        if not the_log.start_position <= position <= the_log.end_position:
            raise APIError(
                "invalid_params",
                f"api: params: position {position} outside "
                f"[{the_log.start_position}, {the_log.end_position}]")
        if fmt.kind == "record":
            yield self._consume_one(request, the_log, position, params, timeout)
            return
        request.setResponseCode(200)
        request.setHeader(b"Content-Type", fmt.media_type().encode())
        RecordStreamer(request, the_log, position, params.count, params.follow, timeout,
                       fmt.encoder(), self.metrics).start()

    @defer.inlineCallbacks
    def _consume_one(self, request, the_log, position, params, timeout):
        """One record as the body; an empty 200 at the end of the log."""
        batch = yield the_log.read(position, max_records=1)
        if not len(batch) and params.follow:
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
            self._empty(request)
            return
        record = bytes(batch.data)
        self.metrics.consumed(the_log.name, 1, len(record))
        request.setHeader(b"Content-Type", b"application/octet-stream")
        request.setHeader(b"Content-Length", str(len(record)).encode())
        request.write(record)
        request.finish()


# -- backup archives (run in a thread) -----------------------------------------

def _tar_directory(directory):
    """
    A gzipped tar of the files of a log directory, flat names as in the
    reference's backups.  Each file is cut at the size it had when the
    backup began, so appends racing the backup never tear an archive
    member; the store's recovery treats the cut tail like any torn write.
    """
    if not os.path.isdir(directory):
        raise APIError("log_not_available", "api: log directory not found")
    entries = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False):
            entries.append((entry.name, entry.stat().st_size))
    archive = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, size in entries:
            path = os.path.join(directory, name)
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                continue  # a segment expired meanwhile
            with f:
                info = tar.gettarinfo(arcname=name, fileobj=f)
                info.size = min(size, info.size)
                tar.addfile(info, _Limited(f, info.size))
    return archive


class _Limited:
    """A file object that reads at most C{size} bytes."""

    def __init__(self, f, size):
        self.f = f
        self.left = size

    def read(self, n=-1):
        if n < 0 or n > self.left:
            n = self.left
        data = self.f.read(n)
        self.left -= len(data)
        return data


def _untar_into(fileobj, root, name):
    """
    Unpack a backup into C{root/name}: members go to a hidden temporary
    directory first (only plain files with flat names are accepted), are
    fsynced, then the directory is renamed into place, so a half-restored
    log is never visible.
    """
    target = os.path.join(root, name)
    if os.path.exists(target):
        raise LogExists(f"log {name!r} exists")
    staging = tempfile.mkdtemp(prefix=f".restore-{name}-", dir=root)
    try:
        try:
            tar = tarfile.open(fileobj=fileobj, mode="r:gz")
        except (tarfile.TarError, OSError, EOFError) as e:
            raise APIError("invalid_params", f"api: params: not a tar.gz archive: {e}")
        with tar:
            try:
                members = list(tar)
            except (tarfile.TarError, OSError, EOFError) as e:
                raise APIError("invalid_params", f"api: params: corrupt archive: {e}")
            for member in members:
                member_name = member.name
                if member.isdir() and member_name.strip("./") == "":
                    continue
                if (not member.isfile() or "/" in member_name or "\\" in member_name
                        or member_name in (".", "..") or member_name.startswith(".")):
                    raise APIError("invalid_params",
                                   f"api: params: unexpected archive member {member_name!r}")
                source = tar.extractfile(member)
                path = os.path.join(staging, member_name)
                with open(path, "wb") as out:
                    while True:
                        block = source.read(1024 * 1024)
                        if not block:
                            break
                        out.write(block)
                    out.flush()
                    os.fsync(out.fileno())
        _check_backup(staging)
        _fsync_dir(staging)
        if os.path.exists(target):
            raise LogExists(f"log {name!r} exists")
        os.rename(staging, target)
        _fsync_dir(root)
    except BaseException:
        _remove_tree(staging)
        raise


#: The member every backup of our log store has (the file store's log
#: configuration).  A backup made by another Styx server (the Go reference
#: keeps C{config}, C{segment-...-records} and C{-index} files) has none.
BACKUP_CONFIG_MEMBER = "config.json"


def _check_backup(staging):
    """
    Refuse an archive that is not a backup of our log store before it
    becomes a log directory: without this a foreign archive (e.g. the Go
    reference's) was renamed into place, could not be opened (404), and
    left a directory behind that blocked the name.
    """
    path = os.path.join(staging, BACKUP_CONFIG_MEMBER)
    if not os.path.isfile(path):
        raise APIError("invalid_params",
                       f"api: params: not a backup of this server's log store (no "
                       f"{BACKUP_CONFIG_MEMBER}); backups of other Styx servers use "
                       f"another storage format")
    try:
        with open(path, "rb") as f:
            LogConfig.from_mapping(json.loads(f.read()))
    except (ValueError, TypeError, AttributeError) as e:
        raise APIError("invalid_params",
                       f"api: params: bad {BACKUP_CONFIG_MEMBER} in backup: {e}")


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard_directory(root, name):
    """Move C{root/name} out of the way (atomically), then delete it."""
    target = os.path.join(root, name)
    doomed = tempfile.mkdtemp(prefix=f".restore-failed-{name}-", dir=root)
    os.rename(target, os.path.join(doomed, name))
    _remove_tree(doomed)


def _remove_tree(path):
    import shutil
    shutil.rmtree(path, ignore_errors=True)


