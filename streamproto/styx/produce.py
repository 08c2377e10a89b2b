"""
Produce request bodies of the Styx HTTP API: bounded, or decoded and
appended as they arrive.

L{StyxRequest} is the request class of L{streamproto.styx.resource.StyxSite}:
it hands a batch produce body (line-delimited, binary-records) to a
L{StreamedProduce} as it arrives instead of letting twisted.web buffer it,
and refuses an oversized (or unauthorized) body before reading it.
L{append_body} appends a body twisted.web did buffer (the resource mounted
on a site with another request class).
"""

import io
import urllib.parse

from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import server

from streamproto.core.auth import ALLOW_ALL
from streamproto.core.compat import request_line, set_read_size
from streamproto.log.errors import RecordTooLarge
from streamproto.styx import access, formats
from streamproto.styx.errors import APIError, render_error
from streamproto.styx.httputil import header, path_segments, raw_json_answer, upgrade_protocol
from streamproto.styx.interfaces import IProduceTarget

# the HTTP API's log lines keep the namespace they had in one module
log = Logger(namespace="streamproto.styx.resource")

DEFAULT_MAX_BODY_SIZE = 64 * 1024 * 1024
DEFAULT_MAX_RESTORE_SIZE = 16 * 1024 * 1024 * 1024
# how much a streamed produce body is read from its socket at once
STREAMED_BODY_READ_SIZE = 1024 * 1024
# how many records a produce request appends per store call
APPEND_CHUNK_BYTES = 1024 * 1024
APPEND_CHUNK_RECORDS = 16384
# a streamed produce body stops being read while this much waits for fsync
MAX_UNSYNCED_BYTES = 8 * 1024 * 1024


# -- bounded request bodies ---------------------------------------------

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
        return request_line(self.channel)

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
        if not IProduceTarget.providedBy(resource):
            return None
        command, path = self._request_line()
        if command != b"POST":
            return None
        # the format first: a one-record body (most requests) is no batch,
        # whatever its path
        try:
            fmt = formats.format_of(header(self, b"content-type"))
        except formats.FormatError:
            return None  # the resource answers it
        if fmt.kind == "record":
            return None
        segments = path_segments(path)
        if (len(segments) != 3 or segments[0] != "logs" or segments[2] != "records"
                or not segments[1] or upgrade_protocol(self) is not None):
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
        transport = self.channel.transport
        transport.write(raw_json_answer(error.status, body,
                                        list(cors) + [(b"Connection", b"close")]))
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
        self.lost = False
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
        the answer).  Before the log is open this only notes it: the
        early chunks are appended, and the answer given, once it is.
        """
        if self.complete:
            return
        self.complete = True
        self.lost = lost
        self._resume()
        if lost:
            self.done.addErrback(lambda _: None)
        if self.log is not None:
            self._finish()
        self._maybe_done()

    def _finish(self):
        """The body is complete and the log open: append what is left."""
        if self.error is None:
            if not self.lost:
                try:
                    self._add(self.decoder.close())
                except (formats.FormatError, RecordTooLarge) as e:
                    self._fail(e)
                    return
            self._flush()

    # -- log -----------------------------------------------------------------
    def _opened(self, the_log):
        self.log = the_log
        self.decoder = self.fmt.decoder(the_log.config.max_record_size)
        early, self.early = self.early, []
        for chunk in early:
            self.feed(chunk)
        if self.complete:
            self._finish()
            self._maybe_done()
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
        # an answer stands for the appends of the whole body: none is given
        # before the log is open and every append durable (the log opens
        # asynchronously on JetStream, after a small body is complete)
        if self.done.called or not self.complete or self.pending:
            return
        if self.log is None and self.error is None:
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


@defer.inlineCallbacks
def append_body(the_log, body, decoder, metrics, reactor):
    """
    Decode C{body} (a file, the buffered body of a batch produce request)
    in chunks and append as it goes: every append is issued at once (the
    store covers all pending ones with one fsync) and the answer waits for
    all of them, so nothing is acknowledged before it is durable.  A bad
    record fails the request; records of earlier complete chunks may
    already be in the log (as in the reference).

    @param decoder: the body format's decoder.
    @param metrics: the L{streamproto.styx.metrics.StyxMetrics} counting
        the records produced.
    @param reactor: yielded to between megabytes of decoding.
    @return: Deferred firing with (count, end position or None).
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
        yield deferLater(reactor, 0, lambda: None)
    results = yield defer.DeferredList(pending, consumeErrors=True)
    end_position = None
    for ok, value in results:
        if not ok:
            value.raiseException()
        end_position = value.end_position
    metrics.produced(the_log.name, count, nbytes)
    if error is not None:
        if isinstance(error, formats.FormatError):
            raise APIError("invalid_params", f"api: params: malformed body: {error}")
        raise error
    return count, end_position
