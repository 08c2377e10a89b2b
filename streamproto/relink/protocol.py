"""
Thin Twisted protocols for both Relink roles.

Each feeds the events of its connection (bytes read, connection made and
lost, a graceful stop, the transport's flow control) to a connection
state (L{streamproto.relink.connection_state}), which decides what to do
and asks it of the protocol through L{IConnectionEffects}: write, close,
abort, register as the transport's producer, pause reading.  Everything
about links lives in C{link.py} (their channels in C{channels.py});
everything about bytes in C{codec.py}.
"""

from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from zope.interface import implementer

from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.tcp import set_no_delay
from streamproto.relink.connection_state import ConnectorState, IConnectionEffects, ListenerState


@implementer(IPushProducer, IConnectionEffects)
class _LinkedConnection(Protocol):
    """
    What both roles share: the transport side of L{IConnectionEffects}, and
    the events fed to C{state} (a L{ListenerState} or L{ConnectorState},
    made by the role).  The connection is its transport's streaming
    producer: when the transport's buffer fills (the peer reads slower than
    we send) it pauses us and the link stops transmitting messages until it
    resumes us.
    """

    state = None
    _producing = False      # registered as the transport's producer

    @property
    def link(self):
        """The L{streamproto.relink.link.Link} this connection carries (None before the handshake)."""
        return self.state.link

    # -- IConnectionEffects ----------------------------------------------------
    def write(self, data):
        self.transport.write(data)

    def write_sequence(self, chunks):
        self.transport.writeSequence(chunks)

    def lose_connection(self):
        self.unregister_producer()
        self.transport.loseConnection()

    def abort_connection(self):
        self.transport.abortConnection()

    def register_producer(self):
        self.transport.registerProducer(self, True)
        self._producing = True

    def unregister_producer(self):
        """
        Stop being the transport's producer: call before C{loseConnection}
        (a transport with a producer registered waits for it to be
        unregistered before it closes).
        """
        if self._producing:
            self._producing = False
            self.transport.unregisterProducer()

    def pause_reading(self):
        self.transport.pauseProducing()

    def resume_reading(self):
        self.transport.resumeProducing()

    def peer(self):
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"

    def principals(self):
        from streamproto.core.auth import connection_principals
        return connection_principals(self.transport)

    # -- IPushProducer: the transport's buffer is full / has room again -------
    def pauseProducing(self):
        self.state.pause_transmission(True)

    def resumeProducing(self):
        if getattr(self.transport, "disconnecting", False):
            # someone else called loseConnection (the connector stopping):
            # let the transport close now that its buffer is written
            self.unregister_producer()
            return
        self.state.pause_transmission(False)

    def stopProducing(self):
        # the connection is going away; connectionLost detaches the link
        self._producing = False

    # -- Twisted -------------------------------------------------------------
    def connectionMade(self):
        set_no_delay(self.transport)
        self.state.connection_made()

    def dataReceived(self, data):
        self.state.data_received(data)

    def connectionLost(self, reason):
        self.state.connection_lost()


@implementer(IGracefulShutdown)
class ListenerProtocol(_LinkedConnection):
    """
    The accepting side.  C{factory} is a L{streamproto.relink.api.ListenerFactory}.
    """

    def __init__(self, factory, clock):
        self.factory = factory
        self.state = ListenerState(factory, self, clock)

    def gracefulShutdown(self):
        """
        The server is stopping (called by the connection tracker): see
        L{ListenerState.graceful_shutdown}.
        """
        return self.state.graceful_shutdown()


class ConnectorProtocol(_LinkedConnection):
    """
    The connecting side.  C{owner} is a L{streamproto.relink.api.Connector}:
    it supplies the handshake and takes the listener's answer.
    """

    def __init__(self, owner, clock):
        self.owner = owner
        self.state = ConnectorState(owner, self, clock)
