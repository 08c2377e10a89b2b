"""
Operating the servers: connection tracking and logging, graceful drain,
the metrics/health HTTP endpoint, JSON logs.

Every server's factory is wrapped in a L{TrackingFactory} by
L{streamproto.core.tap.server_service}, which gives it, without help from
the protocol: connections open/total and bytes in/out in the metrics, one
structured log event per connection open and close (peer, TLS identity,
bytes, reason), and a graceful drain on shutdown.
"""

import datetime
import json
import time

from twisted.internet import defer
from twisted.internet.interfaces import IHalfCloseableProtocol, IProtocolNegotiationFactory
from twisted.logger import ILogObserver, Logger, formatEvent
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.web import resource
from twisted.web.server import Site
from zope.interface import Interface, alsoProvides, implementer

from streamproto.core import metrics
from streamproto.core.tls import peer_identity


class IOutputCounter(Interface):
    """A connection wrapper that counts its output, told of bytes sent past it
    (by a L{streamproto.core.sendpath.SocketSender})."""

    def count_output(nbytes):
        """C{nbytes} more were sent on the connection."""


@implementer(IHalfCloseableProtocol, IOutputCounter)
class TrackedConnection(ProtocolWrapper):
    """
    Counts bytes and reports the connection's life; forwards everything,
    half-closes included (a styx/0 producer half-closes and then waits for
    its final ack).
    """

    def readConnectionLost(self):
        p = IHalfCloseableProtocol(self.wrappedProtocol, None)
        if p is not None:
            p.readConnectionLost()
        else:
            self.transport.loseConnection()

    def writeConnectionLost(self):
        # our side finished sending (a half-close the protocol asked for):
        # tell the protocol if it cares, and keep reading either way
        p = IHalfCloseableProtocol(self.wrappedProtocol, None)
        if p is not None:
            p.writeConnectionLost()

    def makeConnection(self, transport):
        self.opened = time.monotonic()
        self.bytes_in = self.bytes_out = 0
        super().makeConnection(transport)

    def connectionMade(self):
        f = self.factory
        f.log.info("{server}: connection from {peer}", server=f.name,
                   peer=_peer(self.transport))
        metrics.CONNECTIONS_OPEN.labels(f.name).inc()
        metrics.CONNECTIONS_TOTAL.labels(f.name).inc()
        super().connectionMade()

    def dataReceived(self, data):
        self.bytes_in += len(data)
        self.factory.bytes_in.inc(len(data))
        self.wrappedProtocol.dataReceived(data)

    def write(self, data):
        self.bytes_out += len(data)
        self.factory.bytes_out.inc(len(data))
        self.transport.write(data)

    def count_output(self, nbytes):
        self.bytes_out += nbytes
        self.factory.bytes_out.inc(nbytes)

    def writeSequence(self, data):
        n = sum(map(len, data))
        self.bytes_out += n
        self.factory.bytes_out.inc(n)
        self.transport.writeSequence(data)

    def connectionLost(self, reason):
        f = self.factory
        metrics.CONNECTIONS_OPEN.labels(f.name).dec()
        f.log.info("{server}: connection from {peer} closed after {seconds:.1f}s "
                   "({bytes_in} bytes in, {bytes_out} out, tls={tls}): {reason}",
                   server=f.name, peer=_peer(self.transport),
                   seconds=time.monotonic() - self.opened, bytes_in=self.bytes_in,
                   bytes_out=self.bytes_out, tls=self.tls_identity,
                   reason=reason.getErrorMessage())
        super().connectionLost(reason)

    @property
    def tls_identity(self):
        return peer_identity(self.transport)


def _peer(transport):
    try:
        peer = transport.getPeer()
        return f"{peer.host}:{peer.port}"
    except Exception:  # noqa: BLE001 - a transport without addresses (tests)
        return "?"


class TrackingFactory(WrappingFactory):
    """
    Wraps a server factory: see the module docstring.

    On L{drain}, every connection's protocol gets a chance to finish: if it
    has a C{gracefulShutdown()} method (returning a Deferred that fires when
    its in-flight work is acknowledged and it has said goodbye the protocol's
    way), that is called; otherwise the connection is closed once its
    pending writes are flushed.  Connections still open at the deadline are
    aborted.
    """

    protocol = TrackedConnection
    log = Logger()

    def __init__(self, wrapped, name):
        super().__init__(wrapped)
        self.name = name
        self.bytes_in = metrics.BYTES_IN.labels(name)
        self.bytes_out = metrics.BYTES_OUT.labels(name)
        if IProtocolNegotiationFactory.providedBy(wrapped):
            # TLS asks the factory it wraps (this one) for the ALPN protocols; without
            # them a client offering ALPN (curl, browsers, Go's net/http) gets a TLS
            # "internal error" alert.  acceptableProtocols() is forwarded by __getattr__.
            alsoProvides(self, IProtocolNegotiationFactory)

    def __getattr__(self, name):
        # the wrapped factory's public attributes (store, options) stay reachable
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wrappedFactory, name)

    def drain(self, clock, timeout):
        connections = list(self.protocols)
        if not connections:
            return defer.succeed(None)
        waits = []
        for conn in connections:
            closed = defer.Deferred()
            conn._drained = closed
            shutdown = getattr(conn.wrappedProtocol, "gracefulShutdown", None)
            try:
                if shutdown is not None:
                    defer.maybeDeferred(shutdown).addErrback(
                        lambda f: self.log.failure("graceful shutdown failed", f))
                else:
                    conn.loseConnection()
            except Exception:
                self.log.failure("{server}: error while draining", server=self.name)
            waits.append(closed)
        done = defer.DeferredList(waits)

        def deadline():
            for conn in list(self.protocols):
                self.log.warn("{server}: aborting {peer} at the shutdown deadline",
                              server=self.name, peer=_peer(conn.transport))
                conn.transport.abortConnection()
        timer = clock.callLater(timeout, deadline)
        return done.addBoth(lambda _: timer.active() and timer.cancel())

    def unregisterProtocol(self, p):
        super().unregisterProtocol(p)
        closed = getattr(p, "_drained", None)
        if closed is not None and not closed.called:
            closed.callback(None)


class HealthResource(resource.Resource):
    """C{/health}: the process answers.  C{/ready}: every store is usable."""

    isLeaf = True

    def __init__(self, ready_check):
        super().__init__()
        self.ready_check = ready_check

    def render_GET(self, request):
        path = request.path.rstrip(b"/")
        request.setHeader(b"content-type", b"application/json")
        if path.endswith(b"/ready"):
            problems = self.ready_check()
            request.setResponseCode(503 if problems else 200)
            return json.dumps({"ready": not problems, "problems": problems}).encode()
        return json.dumps({"alive": True}).encode()


#: other reasons not to be ready: callables returning lists of problems
#: (see L{add_readiness_check})
_READINESS_CHECKS = []


def add_readiness_check(check):
    """
    Make C{/ready} also report C{check()} (a list of problems, empty when
    fine): a server part that fail-stopped on its own (the Pravega
    controller on damaged state) says so.  @return: a callable removing it.
    """
    _READINESS_CHECKS.append(check)

    def remove():
        if check in _READINESS_CHECKS:
            _READINESS_CHECKS.remove(check)
    return remove


def store_problems(stores):
    """
    Why the server is not ready (empty when it is): each store's
    L{ILogStore.problems}, then every registered readiness check.
    """
    problems = []
    for store in stores:
        problems += store.problems()
    for check in list(_READINESS_CHECKS):
        problems += check()
    return problems


def metrics_site(stores, clock=None):
    """
    A twisted.web Site serving /metrics, /health, /ready and the status page at /.

    @param clock: times the status page's history (default: the global reactor).
    """
    from prometheus_client.twisted import MetricsResource

    root = resource.Resource()
    root.putChild(b"metrics", MetricsResource())
    health = HealthResource(lambda: store_problems(stores))
    root.putChild(b"health", health)
    root.putChild(b"ready", health)
    from streamproto.core.statuspage import install_status_page
    install_status_page(root, clock)     # / and /status.json
    return Site(root)


@implementer(ILogObserver)
class JSONLinesObserver:
    """
    C{--log-format json}: one JSON object per line, the shape log shippers
    (Filebeat's ndjson parser, Vector, C{jq}) read: C{timestamp} (ISO 8601,
    UTC), C{level}, C{namespace}, C{message} (rendered), C{failure} (the
    traceback as text, when there is one), then the event's own fields.
    Twisted's C{jsonFileLogObserver} writes records that start with an
    ASCII RS byte, nest the level in an object and leave the message
    unrendered, which those tools cannot read.
    """

    def __init__(self, stream):
        self._stream = stream

    def __call__(self, event):
        self._stream.write(format_json_line(event))
        self._stream.flush()


def format_json_line(event):
    """One log event as a line of JSON (with its newline)."""
    when = event.get("log_time")
    record = {
        "timestamp": datetime.datetime.fromtimestamp(
            when if when is not None else time.time(), datetime.timezone.utc
        ).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": getattr(event.get("log_level"), "name", "info"),
        "namespace": event.get("log_namespace", "-"),
        "message": formatEvent(event),
    }
    failure = event.get("log_failure")
    if failure is not None:
        record["failure"] = failure.getTraceback()
    for key, value in event.items():
        if key.startswith("log_") or key in record or key == "format":
            continue
        record[key] = _jsonable(value)
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


def _jsonable(value):
    """C{value} when JSON can carry it as it is, else its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return str(value)


def json_log_observer(stream):
    """One JSON object per line: C{--log-format json} (see L{JSONLinesObserver})."""
    return JSONLinesObserver(stream)

