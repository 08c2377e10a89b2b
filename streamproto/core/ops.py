"""
Operating the servers: connection tracking and logging, graceful drain,
the metrics/health HTTP endpoint, JSON logs.

Every server's factory is wrapped in a L{TrackingFactory} by
L{streamproto.core.tap.server_service}, which gives it, without help from
the protocol: connections open/total and bytes in/out in the metrics, one
structured log event per connection open and close (peer, TLS identity,
bytes, reason), and a graceful drain on shutdown.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from twisted.internet import defer
from twisted.internet.interfaces import (
    IHalfCloseableProtocol, IProtocolFactory, IProtocolNegotiationFactory, IReactorTime,
    ITransport,
)
from twisted.logger import ILogObserver, Logger, LogEvent, formatEvent
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web import resource
from twisted.web.server import Request, Site
from zope.interface import Interface, alsoProvides, implementer

from streamproto.core import accelerator, metrics
from streamproto.core.interfaces import IGracefulShutdown, IReadiness
from streamproto.core.tls import peer_identity


class IOutputCounter(Interface):
    """A connection wrapper that counts its output, told of bytes sent past it
    (by a L{streamproto.core.sendpath.SocketSender})."""

    def count_output(nbytes: int) -> None:
        """C{nbytes} more were sent on the connection."""


@implementer(IHalfCloseableProtocol, IOutputCounter)
class TrackedConnection(ProtocolWrapper):
    """
    Counts bytes and reports the connection's life; forwards everything,
    half-closes included (a styx/0 producer half-closes and then waits for
    its final ack).
    """

    factory: TrackingFactory
    transport: ITransport
    #: fired when the connection is gone, while the factory drains
    _drained: defer.Deferred[None]
    opened: float
    bytes_in: int
    bytes_out: int

    #: the connection's own address, asked for once
    _host: Any = None

    def getHost(self) -> Any:
        # twisted.web asks for it on every request (Request.process), one
        # getsockname system call each; a connection's address never changes
        if self._host is None:
            self._host = self.transport.getHost()
        return self._host

    def readConnectionLost(self) -> None:
        p = IHalfCloseableProtocol(self.wrappedProtocol, None)
        if p is not None:
            p.readConnectionLost()
        else:
            self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        # our side finished sending (a half-close the protocol asked for):
        # tell the protocol if it cares, and keep reading either way
        p = IHalfCloseableProtocol(self.wrappedProtocol, None)
        if p is not None:
            p.writeConnectionLost()

    def makeConnection(self, transport: ITransport) -> None:
        self.opened = time.monotonic()
        self.bytes_in = self.bytes_out = 0
        super().makeConnection(transport)  # type: ignore[no-untyped-call]  # untyped in Twisted

    def connectionMade(self) -> None:
        f = self.factory
        f.log.info("{server}: connection from {peer}", server=f.name,
                   peer=_peer(self.transport))
        metrics.CONNECTIONS_OPEN.labels(f.name).inc()
        metrics.CONNECTIONS_TOTAL.labels(f.name).inc()
        super().connectionMade()  # type: ignore[no-untyped-call]  # untyped in Twisted

    def dataReceived(self, data: bytes) -> None:
        self.bytes_in += len(data)
        self.factory.bytes_in.inc(len(data))
        self.wrappedProtocol.dataReceived(data)

    def write(self, data: bytes) -> None:
        self.bytes_out += len(data)
        self.factory.bytes_out.inc(len(data))
        self.transport.write(data)

    def count_output(self, nbytes: int) -> None:
        self.bytes_out += nbytes
        self.factory.bytes_out.inc(nbytes)

    def writeSequence(self, data: Sequence[bytes]) -> None:
        n = sum(map(len, data))
        self.bytes_out += n
        self.factory.bytes_out.inc(n)
        self.transport.writeSequence(data)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        f = self.factory
        metrics.CONNECTIONS_OPEN.labels(f.name).dec()
        f.log.info("{server}: connection from {peer} closed after {seconds:.1f}s "
                   "({bytes_in} bytes in, {bytes_out} out, tls={tls}): {reason}",
                   server=f.name, peer=_peer(self.transport),
                   seconds=time.monotonic() - self.opened, bytes_in=self.bytes_in,
                   bytes_out=self.bytes_out, tls=self.tls_identity,
                   reason=reason.getErrorMessage())
        super().connectionLost(reason)  # type: ignore[no-untyped-call]  # untyped in Twisted

    @property
    def tls_identity(self) -> dict[str, str] | None:
        return peer_identity(self.transport)


def _peer(transport: ITransport | None) -> str:
    try:
        peer: Any = transport.getPeer()  # type: ignore[union-attr]  # None: "?" below
        return f"{peer.host}:{peer.port}"
    except Exception:  # noqa: BLE001 - a transport without addresses (tests)
        return "?"


class TrackingFactory(WrappingFactory):
    """
    Wraps a server factory: see the module docstring.

    On L{drain}, every connection's protocol gets a chance to finish: if it
    provides L{IGracefulShutdown}, its C{gracefulShutdown()} is called (its
    Deferred fires when its in-flight work is acknowledged and it has said
    goodbye the protocol's way); otherwise the connection is closed once its
    pending writes are flushed.  Connections still open at the deadline are
    aborted.
    """

    protocol = TrackedConnection
    log = Logger()

    protocols: dict[TrackedConnection, int]

    def __init__(self, wrapped: IProtocolFactory, name: str) -> None:
        super().__init__(wrapped)  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.name = name
        self.bytes_in = metrics.BYTES_IN.labels(name)
        self.bytes_out = metrics.BYTES_OUT.labels(name)
        if IProtocolNegotiationFactory.providedBy(wrapped):
            # TLS asks the factory it wraps (this one) for the ALPN protocols; without
            # them a client offering ALPN (curl, browsers, Go's net/http) gets a TLS
            # "internal error" alert.  acceptableProtocols() is forwarded by __getattr__.
            alsoProvides(self, IProtocolNegotiationFactory)

    def __getattr__(self, name: str) -> Any:
        # the wrapped factory's public attributes (store, options) stay reachable
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wrappedFactory, name)

    def drain(self, clock: IReactorTime, timeout: float) -> defer.Deferred[None]:
        connections = list(self.protocols)
        if not connections:
            return defer.succeed(None)
        waits: list[defer.Deferred[None]] = []
        for conn in connections:
            closed: defer.Deferred[None] = defer.Deferred()
            conn._drained = closed
            protocol = conn.wrappedProtocol
            try:
                if IGracefulShutdown.providedBy(protocol):
                    defer.maybeDeferred(protocol.gracefulShutdown).addErrback(
                        lambda f: self.log.failure("graceful shutdown failed", f))
                else:
                    conn.loseConnection()  # type: ignore[no-untyped-call]  # untyped in Twisted
            except Exception:
                self.log.failure("{server}: error while draining", server=self.name)
            waits.append(closed)
        done = defer.DeferredList(waits)

        def deadline() -> None:
            for conn in list(self.protocols):
                self.log.warn("{server}: aborting {peer} at the shutdown deadline",
                              server=self.name, peer=_peer(conn.transport))
                conn.transport.abortConnection()  # type: ignore[attr-defined]  # a TCP one
        timer = clock.callLater(timeout, deadline)

        def stop_timer(_: object) -> None:
            if timer.active():
                timer.cancel()
        return done.addBoth(stop_timer)

    def unregisterProtocol(self, p: TrackedConnection) -> None:
        super().unregisterProtocol(p)  # type: ignore[no-untyped-call]  # untyped in Twisted
        closed = getattr(p, "_drained", None)
        if closed is not None and not closed.called:
            closed.callback(None)


class HealthResource(resource.Resource):
    """
    C{/health}: the process answers.  C{/ready}: every store is usable
    (C{ready}, C{problems}), with C{warnings} (the C accelerator missing)
    and C{details} (the accelerator's state,
    L{streamproto.core.accelerator.details}).
    """

    isLeaf = True

    def __init__(self, ready_check: Callable[[], list[str]]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.ready_check = ready_check

    def render_GET(self, request: Request) -> bytes:
        path = request.path.rstrip(b"/")
        request.setHeader(b"content-type", b"application/json")
        if path.endswith(b"/ready"):
            problems = self.ready_check()
            request.setResponseCode(503 if problems else 200)
            # not a reason to refuse traffic, but what an operator should see
            details = {"accelerator": accelerator.details()}
            warnings = [w for w in [accelerator.warning()] if w]
            return json.dumps({"ready": not problems, "problems": problems,
                               "warnings": warnings, "details": details}).encode()
        return json.dumps({"alive": True}).encode()


#: other reasons not to be ready: callables returning lists of problems
#: (see L{add_readiness_check})
_READINESS_CHECKS: list[Callable[[], list[str]]] = []


def add_readiness_check(check: Callable[[], list[str]]) -> Callable[[], None]:
    """
    Make C{/ready} also report C{check()} (a list of problems, empty when
    fine): a server part that fail-stopped on its own (the Pravega
    controller on damaged state) says so.  @return: a callable removing it.
    """
    _READINESS_CHECKS.append(check)

    def remove() -> None:
        if check in _READINESS_CHECKS:
            _READINESS_CHECKS.remove(check)
    return remove


def store_problems(stores: Iterable[IReadiness]) -> list[str]:
    """
    Why the server is not ready (empty when it is): each store's
    L{IReadiness.problems<streamproto.core.interfaces.IReadiness.problems>}
    (an L{ILogStore<streamproto.log.interfaces.ILogStore>} is one), then
    every registered readiness check.
    """
    problems: list[str] = []
    for store in stores:
        problems += store.problems()
    for check in list(_READINESS_CHECKS):
        problems += check()
    return problems


def metrics_site(stores: Iterable[object], clock: IReactorTime | None = None) -> Site:
    """
    A twisted.web Site serving /metrics, /health, /ready and the status page at /.

    @param stores: the L{IReadiness} providers C{/ready} asks (the server's
        L{ILogStore<streamproto.log.interfaces.ILogStore>}s).
    @param clock: times the status page's history (default: the global reactor).
    @raise TypeError: for a store that does not provide L{IReadiness} (at
        start-up, not at the first C{/ready}).
    """
    from prometheus_client.twisted import MetricsResource

    ready = [IReadiness(store) for store in stores]
    root = resource.Resource()
    root.putChild(b"metrics", MetricsResource())
    health = HealthResource(lambda: store_problems(ready))
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

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, event: LogEvent) -> None:
        self._stream.write(format_json_line(event))
        self._stream.flush()


def format_json_line(event: LogEvent) -> str:
    """One log event as a line of JSON (with its newline)."""
    when = event.get("log_time")
    record: dict[str, Any] = {
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


def _jsonable(value: object) -> object:
    """C{value} when JSON can carry it as it is, else its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return str(value)


def json_log_observer(stream: TextIO) -> JSONLinesObserver:
    """One JSON object per line: C{--log-format json} (see L{JSONLinesObserver})."""
    return JSONLinesObserver(stream)

