"""
The Lumberjack server: L{LumberjackServerFactory} and a thin Protocol that
feeds the bytes it reads to a L{LumberjackServerState} (the connection's
batches, acks, keepalives, shutdown and idle timeout, with no transport)
and carries out what that asks for: write an ack, pause or resume reading,
close, store events in the L{IEventSink}, count them.

All connections share a memory budget (C{max_buffered}: bytes of events
received and not yet stored); past it, a connection opening a new batch
waits, not reading, until others have stored theirs.

Every bound (window, frame size, inflated size, JSON, frame types, idle
time) ends the connection with one log line saying which and why; events
not acked yet are the client's to send again.
"""

from collections import deque
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IAddress, IReactorTime
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.core.clock import default_reactor
from streamproto.core.tcp import set_no_delay
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core import metrics
from streamproto.core.auth import ALLOW_ALL, IAuthorizer, connection_principals, denied
from streamproto.core.observer import OneShotObserver
from streamproto.core.tls import peer_identity
from streamproto.lumberjack.codec import (
    DEFAULT_MAX_DECOMPRESSED, DEFAULT_MAX_FRAME, DEFAULT_MAX_WINDOW, FrameDecoder, encode_ack,
)
from streamproto.lumberjack.server_state import ILumberjackConnection, LumberjackServerState
from streamproto.lumberjack.sink import ConnectionInfo, IEventSink

DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_KEEPALIVE_INTERVAL = 5.0
DEFAULT_FLUSH_BYTES = 4 * 1048576
DEFAULT_MAX_BUFFERED = 256 * 1048576


@implementer(IGracefulShutdown, ILumberjackConnection)
class LumberjackServerProtocol(Protocol):
    """
    One connection from a writer: bytes in go to L{state}, the effects it
    asks for go to the transport, the factory's sink and memory budget.

    @ivar state: the connection's L{LumberjackServerState}.
    @ivar decoder: the L{FrameDecoder} the state reads frames from.
    """

    #: a TCP or TLS transport, also a push producer (pauseProducing):
    #: no one Twisted interface says all that
    transport: Any

    def __init__(self, factory: "LumberjackServerFactory") -> None:
        self.factory = factory
        self.decoder = FrameDecoder(factory.max_frame, factory.max_decompressed,
                                    factory.max_window)
        self.state = LumberjackServerState(
            self, self.decoder, factory.clock, idle_timeout=factory.idle_timeout,
            keepalive_interval=factory.keepalive_interval, flush_bytes=factory.flush_bytes,
            metrics=factory.metrics)
        self.connection: ConnectionInfo | None = None
        self._principals: tuple[str, ...] | None = None
        self.peer = "?"
        self._gone: OneShotObserver[None] = OneShotObserver()  # gracefulShutdown's: fired at connectionLost

    # -- Twisted's side -----------------------------------------------------------
    def connectionMade(self):
        peer = self.transport.getPeer()
        self.peer = f"{getattr(peer, 'host', peer)}:{getattr(peer, 'port', '')}"
        set_no_delay(self.transport)
        self.factory.connections.add(self)
        self.state.connection_made(self.peer)

    def dataReceived(self, data):
        self.state.data_received(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.state.connection_lost()
        self._gone.fire()

    def gracefulShutdown(self) -> Deferred[None]:
        """
        The server is stopping (called by
        L{streamproto.core.ops.TrackingFactory}): see
        L{LumberjackServerState.shutdown}.

        @return: a Deferred firing once the connection is gone.
        """
        if self.state.closed:
            return succeed(None)
        d = self._gone.when_fired()
        self.state.shutdown()
        return d

    def budget_freed(self):
        """Called by the factory: this connection's turn in the memory budget came."""
        self.state.budget_freed()

    # -- ILumberjackConnection: the state's effects ---------------------------------
    def send_ack(self, seq, version):
        self.transport.write(encode_ack(seq, version))

    def pause_reading(self):
        self.factory.metrics.pauses.inc()
        self.transport.pauseProducing()

    def resume_reading(self):
        self.transport.resumeProducing()

    def close(self):
        self.transport.loseConnection()

    def may_write(self):
        """
        Asked at every window (a reloaded policy applies from the next
        batch).
        """
        authorizer = self.factory.authorizer
        if not authorizer.enabled:
            return True
        if self._principals is None:
            self._principals = connection_principals(self.transport)
        resource = getattr(self.factory.sink, "log_name", "lumberjack")
        if authorizer.allows(self._principals, "write", resource):
            return True
        denied(self.factory.server_name, self._principals, "write", resource,
               f"closing {self.peer}")
        return False

    def store(self, events):
        if self.connection is None:
            # by now the TLS handshake is done, so the client certificate is known
            self.connection = ConnectionInfo(self.peer, peer_identity(self.transport))
        return maybeDeferred(self.factory.sink.write, self.connection, events)

    def admit(self):
        factory = self.factory
        if factory.buffered < factory.max_buffered:
            return True
        factory.throttled.append(self)
        return False

    def hold(self, nbytes):
        self.factory.buffered += nbytes

    def events_stored(self, count, nbytes):
        factory = self.factory
        factory.events_persisted += count
        factory.release(nbytes)
        factory.metrics.records_in.inc(count)
        factory.metrics.acks.inc()

    def finished(self, nbytes):
        self.factory.release(nbytes, self)
        self.factory.connections.discard(self)


class LumberjackServerFactory(Factory):
    """
    Serves Lumberjack v1 and v2 on any stream endpoint (TCP, TLS).

    @param sink: an L{IEventSink} (e.g. L{LogStoreSink}).
    @param clock: an IReactorTime for the idle and keepalive timers.
    @param max_window: largest window (batch size) accepted.
    @param max_frame: largest data frame payload, bytes.
    @param max_decompressed: largest compressed frame, compressed and inflated.
    @param idle_timeout: seconds without input before closing (0: never).
    @param keepalive_interval: seconds between C{ACK 0} while a batch is
        pending (0: none).
    @param flush_bytes: persist (and partially ack) a batch in parts of
        about this many bytes.
    @param max_buffered: memory budget shared by all connections: bytes of
        events received and not yet stored.  Past it, a connection that
        opens a new batch waits (not reading) until others have stored.
    @param server_name: the C{server} label of the Prometheus metrics.
    @param authorizer: the L{streamproto.core.auth.IAuthorizer} deciding
        who may write to the sink's log (its C{log_name}); default: everyone.
    """

    protocol = LumberjackServerProtocol

    def __init__(self, sink: IEventSink, clock: IReactorTime | None = None,
                 max_window: int = DEFAULT_MAX_WINDOW, max_frame: int = DEFAULT_MAX_FRAME,
                 max_decompressed: int = DEFAULT_MAX_DECOMPRESSED,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
                 flush_bytes: int = DEFAULT_FLUSH_BYTES, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 server_name: str = "lumberjack-server",
                 authorizer: IAuthorizer = ALLOW_ALL) -> None:
        clock = default_reactor(clock)
        self.sink = sink
        self.authorizer = authorizer
        self.clock = clock
        self.max_window = max_window
        self.max_frame = max_frame
        self.max_decompressed = max_decompressed
        self.idle_timeout = idle_timeout
        self.keepalive_interval = keepalive_interval
        self.flush_bytes = flush_bytes
        self.max_buffered = max_buffered
        self.buffered = 0           # bytes of events received and not yet stored, all connections
        # connections waiting for buffered to drop
        self.throttled: deque[LumberjackServerProtocol] = deque()
        self.connections: set[LumberjackServerProtocol] = set()
        self.events_persisted = 0
        self.server_name = server_name
        self.metrics = metrics.ServerMetrics(server_name)

    def buildProtocol(self, addr: IAddress | None) -> "LumberjackServerProtocol":
        return self.protocol(self)

    def release(self, nbytes: int, gone: "LumberjackServerProtocol | None" = None) -> None:
        """C{nbytes} of events were stored (or dropped): wake throttled connections."""
        self.buffered -= nbytes
        if gone is not None:
            try:
                self.throttled.remove(gone)
            except ValueError:
                pass
        while self.throttled and self.buffered < self.max_buffered:
            self.throttled.popleft().budget_freed()
