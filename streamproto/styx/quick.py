"""
One-record produce requests answered without twisted.web's C{Request}.

Most requests a Styx server gets are one record each, C{POST
/logs/NAME/records} with a small body.  twisted.web spends more of the
server's time on each than the store does (doc/performance.rst: the
C{Request} object, its headers, its finish, the next pipelined request
parsed inside it, a pause of the connection while one request is
answered), and it answers a connection's pipelined requests one at a
time, so one connection's requests never share an fsync.

L{QuickChannel} is the protocol of a L{streamproto.styx.resource.StyxSite}
connection.  It reads requests itself while they are plainly one-record
produce requests (L{parse_head}): it appends each as soon as its body is
complete, up to L{MAX_PIPELINED} at once (or L{MAX_PIPELINED_BYTES} of
bodies), so that a connection's pipelined records share a group commit,
and answers them in order, each once durable, the way the resource does
(same statuses, JSON, CORS headers, authorization, metrics and log
lines).  The answer a connection owes next, when it is a plain one, is
made before its fsync and held for the store's fsync thread to send the
moment the record is durable (C{ILog.append}'s C{prepare_answers}, on
the file store with the accelerator): at low load that answer then does
not wait for the reactor's wake-up (doc/performance.rst, run P).  At the first request
that is anything else (another route or method, a batch body, an
upgrade, C{Expect}, chunked or large bodies, HTTP/1.0, a head it does not
understand), it waits until every answer is written and hands the
connection, with the bytes it has not consumed, to twisted.web's
C{HTTPChannel} for good (L{QuickChannel.hand_over}).  A server that never
gets one-record produce requests pays for one parse of one request head
per connection.

Splitting the head is L{parse_head}'s job alone (no I/O: fuzzed with
hypothesis); the protocol frames, dispatches and writes.
"""

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.http_headers import Headers
from zope.interface import implementer

from streamproto.core.compat import replace_protocol
from streamproto.core.clock import wall_seconds
from streamproto.core.idle import IdleTimeout
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.ops import IOutputCounter
from streamproto.core.sendpath import SocketSender
from streamproto.core.tcp import set_no_delay
from streamproto.log.errors import RecordTooLarge
from streamproto.styx import access, formats
from streamproto.styx.errors import APIError, render_produced, report
from streamproto.styx.httputil import raw_json_answer

#: The longest request head (request line and headers) read here: what
#: twisted.web accepts in all (C{HTTPChannel.totalHeadersSize}); a longer
#: head goes to twisted.web, which answers it.
MAX_HEAD = 16384
#: The largest body read here: bigger records go through twisted.web,
#: which spools them (and refuses them past the site's limit).
MAX_BODY = 65536
#: Requests of one connection appended and not yet answered; past this the
#: connection is not read until answers go out.  Enough for a client's
#: pipeline to fill a group commit.
MAX_PIPELINED = 64
#: The same bound in bytes of their bodies: what a client can make the
#: server hold for it at once (one more body may take it past).
MAX_PIPELINED_BYTES = 1024 * 1024

_OK_PREFIX = b"HTTP/1.1 200 OK\r\nServer: " + server.version + b"\r\nDate: "
_JSON_HEAD = b"\r\nContent-Type: application/json\r\nContent-Length: "
_PREFIX = b"/logs/"
_SUFFIX = b"/records"
# the characters a one-record request's log name may have here: anything
# else (percent-escapes, a query, a fragment) is left to twisted.web's
# unquoting and routing
_NAME_REJECT = frozenset(b"/%?#")


class Head(NamedTuple):
    """
    A one-record produce request's head, as L{parse_head} found it.

    @ivar name: the log's name (str).
    @ivar length: the body's length in bytes.
    @ivar close: whether the client asked to close after the answer.
    @ivar origin: the Origin header (bytes), or None.
    @ivar authorization: the Authorization headers (bytes), in order.
    @ivar path: the request target (bytes), for log lines.
    """
    name: str
    length: int
    close: bool
    origin: bytes | None
    authorization: tuple[bytes, ...]
    path: bytes


def parse_head(head: bytes, max_body: int = MAX_BODY) -> Head | None:
    """
    The L{Head} of a one-record produce request, from its head without the
    blank line that ends it; None for any other request, or any head this
    parser does not plainly understand (twisted.web gets those).

    A one-record produce request here is C{POST /logs/NAME/records
    HTTP/1.1} (a name without C{/ % ? #}), with one C{Content-Length} of
    at most C{max_body}, a Content-Type that means a single record (none,
    or any but the batch formats), and no C{Upgrade}, C{Expect},
    C{Transfer-Encoding} or folded header line.
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        return None
    method, target, version = parts
    if (method != b"POST" or version != b"HTTP/1.1" or not target.startswith(_PREFIX)
            or not target.endswith(_SUFFIX)):
        return None
    raw_name = target[len(_PREFIX):-len(_SUFFIX)]
    if not raw_name or not _NAME_REJECT.isdisjoint(raw_name):
        return None
    length = None
    close = False
    origin = None
    authorization = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip(b" \t"):
            return None  # no colon, a folded line, or space before the colon
        name = name.lower()
        value = value.strip(b" \t")
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name in (b"transfer-encoding", b"expect", b"upgrade"):
            return None
        elif name == b"connection":
            tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            close = close or b"close" in tokens
        elif name == b"content-type":
            try:
                if formats.format_of(value).kind != "record":
                    return None
            except formats.FormatError:
                return None
        elif name == b"origin":
            if origin is not None:
                return None
            origin = value
        elif name == b"authorization":
            authorization.append(value)
    if length is None or length > max_body:
        return None
    return Head(raw_name.decode("utf-8", "replace"), length, close, origin,
                tuple(authorization), target)


class AppendBatcher:
    """
    Appends the records of one reactor turn to each log in one append.

    Requests that arrive together (one C{epoll} wake-up's reads, on any of
    the site's connections) are appended at the end of that turn as one
    batch: one write, and one group commit, instead of one append (and a
    C{writev}) each, the first of which would start an fsync that the
    others then wait behind.  Each record's Deferred fires with the
    batch's L{streamproto.log.result.AppendResult} (its C{end_position} is
    the synced end, as for any append acknowledged in a group commit).
    Costs a record one pass of the event loop at most.

    @ivar on_appended: called as C{(log name, records, bytes)} once a
        batch is acknowledged: the server's metrics, counted once a batch
        rather than once a record (each count takes a lock, and a labelled
        counter a lookup as well).
    """

    def __init__(self, reactor: Any,
                 on_appended: Callable[[str, int, int], object] | None = None) -> None:
        self.reactor = reactor
        self.on_appended = on_appended
        # log -> (records, their Deferreds, their answers' hooks), in arrival order
        self._batches: dict[Any, tuple[list[bytes], list[Deferred[Any]], list[_Prepare]]] = {}
        self._call: Any = None

    def append(self, the_log: Any, record: bytes,
               prepare_answer: "_Prepare | None" = None) -> "Deferred[Any]":
        """
        Append C{record} to C{the_log} with this turn's others.

        @param prepare_answer: the record's share of the batch's
            C{prepare_answers} (L{streamproto.log.interfaces.ILog.append}).
        """
        batch = self._batches.get(the_log)
        if batch is None:
            batch = self._batches[the_log] = ([], [], [])
            if self._call is None:
                self._call = self.reactor.callLater(0, self._flush)
        d: Deferred[Any] = Deferred()
        batch[0].append(record)
        batch[1].append(d)
        if prepare_answer is not None:
            batch[2].append(prepare_answer)
        return d

    def _flush(self) -> None:
        self._call = None
        batches, self._batches = self._batches, {}
        for the_log, (records, waiting, prepares) in batches.items():
            # one log's exception is its own records' error, not the others'
            if prepares:
                d = maybeDeferred(the_log.append, records,
                                  prepare_answers=_batch_answers(prepares))
            else:
                d = maybeDeferred(the_log.append, records)
            d.addBoth(self._done, the_log, records, waiting)

    def _done(self, result: Any, the_log: Any, records: list[bytes],
              waiting: list["Deferred[Any]"]) -> None:
        for d in waiting:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)
        # counted once the answers are out: not in their latency
        if self.on_appended is not None and not isinstance(result, Failure):
            self.on_appended(the_log.name, len(records), sum(map(len, records)))


_Prepare = Callable[[Any], Sequence[Any]]


def _batch_answers(prepares: list[_Prepare]) -> _Prepare:
    """One batch's C{prepare_answers}: each record's, in order."""
    def prepare(result: Any) -> list[Any]:
        return [held for one in prepares for held in one(result)]
    return prepare


class _Answer:
    """One request's place in its connection's line of answers."""

    __slots__ = ("data", "close", "size", "held", "held_size")

    def __init__(self, close: bool, size: int) -> None:
        self.data: bytes | None = None
        self.close = close
        #: the body's length, held for the connection until answered
        self.size = size
        #: the answer held for the fsync's thread to send (and its length),
        #: until the reactor learns whether it went
        self.held: Any = None
        self.held_size = 0


class _Credentials:
    """
    What L{streamproto.styx.access} reads of a request (its Authorization
    headers and its connection), for a request that has no C{Request}.
    """

    def __init__(self, head: Head, channel: "QuickChannel") -> None:
        self.requestHeaders = Headers({b"authorization": list(head.authorization)})
        self.channel = channel


@implementer(IPushProducer, IGracefulShutdown)
class QuickChannel(Protocol):
    """
    A Styx API connection while its requests are one-record produce
    requests; twisted.web's C{HTTPChannel} after the first that is not (see
    the module's docstring).

    Registered as its transport's producer: while the client does not read
    its answers, its requests are not read either.  When the server stops
    (L{gracefulShutdown}), the requests already read are answered before
    the connection closes.

    @ivar site: the L{streamproto.styx.resource.StyxSite}.
    """

    def __init__(self, site: Any, addr: Any) -> None:
        self.site = site
        self.addr = addr
        self.resource = site.resource
        self.max_body = min(MAX_BODY, site.max_body_size)
        self._buffer = bytearray()
        self._answers: deque[_Answer] = deque()
        self._unanswered_bytes = 0
        self._reading = True
        self._write_blocked = False
        self._handing_over = False
        self._closing = False
        self._parsing = False
        self._gone = False
        # the CORS headers of an answer to a request without Origin (the
        # reference marks every answer with Vary: Origin)
        self._plain_headers = b"".join(
            name + b": " + value + b"\r\n" for name, value in self.resource.cors_headers(None))
        self._wall = wall_seconds(self.resource.clock)
        self._date_second = -1
        self._date = b""
        self._idle: IdleTimeout | None = None
        self._shutdown: Deferred[None] | None = None
        #: on plain TCP, what sends the answers (L{SocketSender})
        self._sender: SocketSender | None = None

    # -- connection ----------------------------------------------------------
    def connectionMade(self) -> None:
        # answers are small and latency-bound: with Nagle's algorithm an
        # answer waited for the ACK of the one before, which the client
        # sends with its next request (doc/performance.rst, run M)
        set_no_delay(self.transport)
        reactor = self.resource.reactor
        if SocketSender.usable(self.transport, reactor):
            # plain TCP: each answer goes out in one send, now, rather than
            # on the reactor's next turn after registering the socket for
            # writing and then removing it (two epoll_ctl calls an answer),
            # and from the native send thread where there is one (half the
            # reactor's time was these sends: streamproto.core.sendthread)
            counter = IOutputCounter(self.transport, None)
            self._sender = SocketSender(self.transport, reactor, high_water=65536,
                                        on_sent=counter and counter.count_output,
                                        eager=True, native=True)
            self._sender.registerProducer(self)
        else:
            self.transport.registerProducer(self, True)
        self._idle = IdleTimeout(self.resource.clock, self.site.timeOut, self._idle_expired)
        self._idle.start()

    def dataReceived(self, data: bytes) -> None:
        if self._gone or self._closing:
            return  # after a request that asked to close, nothing more is read
        self._buffer += data
        if self._handing_over:
            return
        if self._idle is not None:
            self._idle.reset()
        self._parse()

    def gracefulShutdown(self) -> "Deferred[None]":
        """
        Read no more requests; close once those read are answered (each
        after its fsync).  @return: a Deferred firing when the connection
        is gone.
        """
        self._shutdown = Deferred()
        if self._gone:
            self._shutdown.callback(None)
            return self._shutdown
        self._closing = True
        if not self._answers:
            self._close()
        return self._shutdown

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if self._shutdown is not None and not self._shutdown.called:
            self._shutdown.callback(None)
        self._gone = True
        self._stop_idle()
        if self._sender is not None:
            self._sender.unregisterProducer()  # no cycle left for the collector
            self._sender.close()
        # appends still in flight complete (they are durable); their
        # answers have nobody to go to
        self._answers.clear()
        self._unanswered_bytes = 0
        self._buffer.clear()

    def _stop_idle(self) -> None:
        # the countdown's callback is a method of ours: a cycle a server
        # would leave to its rare full collections (core.gcpolicy)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_expired(self) -> None:
        if self._write_blocked:
            # a client that reads nothing would keep a graceful close open
            if self._sender is not None:
                self._sender.close()
            self.transport.abortConnection()
        else:
            self._close()

    def _close(self) -> None:
        """Close once every answer is sent."""
        sender = self._sender
        if sender is None:
            # a TLS transport shuts down only once its producer is gone
            # (as twisted.web's channel, unregister before closing)
            self.transport.unregisterProducer()
            self.transport.loseConnection()
            return

        def drained(_: object) -> None:
            # the duplicate descriptor first: the FIN goes once both are closed
            sender.close()
            if not self._gone:
                self.transport.loseConnection()
        sender.when_drained().addCallback(drained)

    # -- IPushProducer: the transport's write buffer ------------------------
    def pauseProducing(self) -> None:
        self._write_blocked = True
        self._update_reading()

    def resumeProducing(self) -> None:
        self._write_blocked = False
        self._update_reading()
        self._parse()

    def stopProducing(self) -> None:
        pass  # the connection is going: connectionLost follows

    def _update_reading(self) -> None:
        reading = not (self._write_blocked or self._handing_over
                       or self._full())
        if reading != self._reading and not self._gone:
            self._reading = reading
            if reading:
                self.transport.resumeProducing()
            else:
                self.transport.pauseProducing()

    # -- requests ---------------------------------------------------------
    def _full(self) -> bool:
        """Whether the unanswered requests are as many as a connection may have."""
        return (len(self._answers) >= MAX_PIPELINED
                or self._unanswered_bytes >= MAX_PIPELINED_BYTES)

    def _parse(self) -> None:
        if self._parsing or self._gone:
            return
        self._parsing = True
        try:
            buf = self._buffer
            while (buf and not self._handing_over and not self._closing
                   and not self._write_blocked and not self._full()):
                end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        self.hand_over()
                    break
                head = parse_head(bytes(buf[:end]), self.max_body)
                if head is None:
                    self.hand_over()
                    break
                start = end + 4
                stop = start + head.length
                if len(buf) < stop:
                    break
                body = bytes(buf[start:stop])
                del buf[:stop]
                self._request(head, body)
        finally:
            self._parsing = False
        self._update_reading()

    def _request(self, head: Head, body: bytes) -> None:
        answer = _Answer(head.close, len(body))
        if not self._answers and self._idle is not None:
            self._idle.pause()  # answering is not the client's silence
        self._answers.append(answer)
        self._unanswered_bytes += answer.size
        if head.close:
            self._closing = True
        resource = self.resource
        try:
            if resource.authorizer.enabled:
                access.check(_Credentials(head, self), resource.authorizer, "write", head.name)
        except APIError as e:
            # as twisted.web's path does, which refuses before the body:
            # a denied connection is closed after its answer
            answer.close = self._closing = True
            self._failed(Failure(e), head, answer)
            return
        if not body:
            # the reference answers an empty single record like this
            self._ready(answer, 200, render_produced(0, 0), head)
            return
        # a store that raises instead of failing its Deferred must not take
        # the connection (and the requests pipelined behind) with it
        d = maybeDeferred(resource.store.get, head.name)
        d.addCallback(self._append, head, body, answer)
        d.addCallbacks(self._appended, self._failed, (head, answer),
                       errbackArgs=(head, answer))

    def _append(self, the_log: Any, head: Head, body: bytes, answer: _Answer) -> Any:
        if self._gone:
            # the client left while the store looked the log up (a slow
            # JetStream cluster): nobody waits for this record, which
            # twisted.web's path would not append either
            return None
        limit = the_log.config.max_record_size
        if len(body) > limit:
            raise RecordTooLarge(f"record of {len(body)} bytes exceeds max_record_size {limit}")
        prepare = None
        if self._sender is not None and head.origin is None and not answer.close:
            # the plain answer, which needs nothing but the append's result:
            # the fsync's thread may send it (_hold)
            prepare = lambda result: self._hold(result, head, answer)  # noqa: E731
        return self.site.append_batcher.append(the_log, body, prepare)

    def _hold(self, result: Any, head: Head, answer: _Answer) -> Sequence[Any]:
        """
        The answer to C{head}, made now for the thread that runs its fsync
        to send (L{streamproto.core.sendpath.SocketSender.hold}): when it
        is the next this connection owes, and the sender can hold it.
        Otherwise nothing, and it is written once the append is acknowledged.
        """
        if self._gone or self._sender is None or not self._answers \
                or self._answers[0] is not answer:
            return ()
        data = self._response(200, render_produced(result.end_position, 1), head, False, None)
        held = self._sender.hold(data)
        if held is None:
            return ()
        answer.held, answer.held_size = held, len(data)
        return (held,)

    def _held_sent(self, answer: _Answer) -> bool:
        """Once the append's outcome is known: whether its held answer went out
        (then it is the answer, whatever the outcome says)."""
        held, answer.held = answer.held, None
        if held is None or self._sender is None:
            return False
        return self._sender.finish_held(held, answer.held_size)

    def _appended(self, result: Any, head: Head, answer: _Answer) -> None:
        if result is None:
            return
        if self._held_sent(answer):
            self._place(answer, b"")
            return
        # counted in the metrics by the batcher, once a batch
        self._ready(answer, 200, render_produced(result.end_position, 1), head)

    def _failed(self, failure: Failure, head: Head, answer: _Answer) -> None:
        if self._held_sent(answer):
            # durable after all: the fsync succeeded before the log failed
            # (a later write's error), and the client has its answer
            self._place(answer, b"")
            return
        error = report(failure, b"POST", head.path, self.resource.metrics)
        extra = [(b"WWW-Authenticate", access.CHALLENGE)] if error.code == "unauthorized" else []
        self._ready(answer, error.status, error.to_json(), head, extra)

    # -- answers ------------------------------------------------------------
    def _ready(self, answer: _Answer, status: int, body: bytes, head: Head,
               extra: list[tuple[bytes, bytes]] | None = None) -> None:
        if not self._gone:
            self._place(answer, self._response(status, body, head, answer.close, extra))

    def _place(self, answer: _Answer, data: bytes) -> None:
        """C{answer} is C{data} (empty: it went out from the fsync's thread);
        written with those before it once it is the first due."""
        if self._gone:
            return
        answer.data = data
        if self._answers[0] is answer:
            self._write_answers()

    def _response(self, status: int, body: bytes, head: Head, close: bool,
                  extra: list[tuple[bytes, bytes]] | None) -> bytes:
        if status == 200 and head.origin is None and not close:
            # most answers: raw_json_answer's, with its constant parts made once
            return b"".join((_OK_PREFIX, self._date_header(), _JSON_HEAD,
                             b"%d\r\n" % len(body), self._plain_headers, b"\r\n", body))
        origin = None if head.origin is None else head.origin.decode("latin-1")
        headers = self.resource.cors_headers(origin) + list(extra or ())
        if close:
            headers.append((b"Connection", b"close"))
        return raw_json_answer(status, body, headers, self._date_header())

    def _date_header(self) -> bytes:
        now = int(self._wall())
        if now != self._date_second:
            self._date_second = now
            self._date = http.datetimeToString(now)
        return self._date

    def _write_answers(self) -> None:
        answers = self._answers
        out = []
        close = False
        while answers and answers[0].data is not None:
            answer = answers.popleft()
            self._unanswered_bytes -= answer.size
            out.append(answer.data)
            if answer.close:
                close = True
                break
        if not out:
            return
        data = b"".join(out)
        if not data:
            pass    # sent from the fsync's thread
        elif self._sender is not None:
            self._sender.write(data)
        else:
            self.transport.write(data)
        if close or (self._shutdown is not None and not answers):
            self._close()
            return
        if answers:
            return
        if self._handing_over:
            self._finish_hand_over()
            return
        if self._idle is not None:
            self._idle.resume()
        self._update_reading()
        self._parse()

    # -- twisted.web --------------------------------------------------------
    def hand_over(self) -> None:
        """
        Give the connection, and what it sent that was not read yet, to
        twisted.web's C{HTTPChannel}, once every answer is written (the
        connection is not read meanwhile).
        """
        self._handing_over = True
        if self._answers:
            self._update_reading()
            return
        self._finish_hand_over()

    def _finish_hand_over(self) -> None:
        sender = self._sender
        if sender is not None:
            if not sender.drained:
                # every byte in order: twisted.web writes once ours are sent
                sender.when_drained().addCallback(lambda _: self._finish_hand_over())
                return
            sender.close()
            self._sender = None
        else:
            self.transport.unregisterProducer()
        if self._gone:
            return
        transport = self.transport
        self._stop_idle()
        channel = self.site.build_http_channel(self.addr)
        replace_protocol(transport, channel)
        self._gone = True  # from here on, nothing of the connection is ours
        if not self._reading:
            transport.resumeProducing()
        channel.makeConnection(transport)
        data = bytes(self._buffer)
        self._buffer.clear()
        if data:
            # the channel may pause the transport while it answers: after
            # resuming it above, not before
            channel.dataReceived(data)
