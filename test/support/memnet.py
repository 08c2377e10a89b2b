"""
The in-memory network of the protocol tests: two protocols joined by
Twisted's iosim (L{twisted.test.iosim.FakeTransport} and
L{twisted.test.iosim.IOPump}), with what the fault-injection tests need and
iosim does not model:

  - bytes move in pieces of any size (C{size}), one piece each way a step;
  - a protocol that paused its transport (it stopped reading) is given
    nothing until it resumes;
  - a transport with a C{limit} flow-controls its streaming producer as a
    real one does: paused while more than C{limit} bytes wait, resumed once
    they are all taken;
  - a connection can be cut at any byte: what is in flight is lost, or a
    chosen prefix of it arrives first; a side can be told much later
    (half-open connections);
  - C{abortConnection} loses what is in flight and reports the loss on the
    next reactor turn (iosim treats it as C{loseConnection});
  - C{loseWriteConnection} (half-close) ends the connection once what was
    written has arrived, as it does over TCP when the peer is not an
    L{IHalfCloseableProtocol} (iosim ignores it);
  - writes made after C{loseConnection} are still sent, as a real transport
    sends them (iosim drops them).

iosim is Twisted's own test module: it is used here only, so a change there
touches this module alone.  TLS negotiation (C{startTLS}) and pull
producers are not supported.
"""

from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

SERVER = "server"
CLIENT = "client"


@implementer(IPushProducer)
@implementer(IPushProducer)
class RecordingProducer:
    """A push producer that records what a transport asks of it, in order."""

    def __init__(self):
        self.events = []

    def pauseProducing(self):
        self.events.append("pause")

    def resumeProducing(self):
        self.events.append("resume")

    def stopProducing(self):
        self.events.append("stop")


class MemoryTransport(iosim.FakeTransport):
    """
    One end of a L{Connection}: what its protocol writes waits in flight
    (C{value}) until the connection moves it to the peer.

    Like L{twisted.internet.testing.StringTransport}, it holds its protocol
    to the producer rules: registering two producers, unregistering none,
    and pausing or resuming reading after C{loseConnection} are errors
    (unless C{lenient}).

    @ivar producerState: C{"producing"}, C{"paused"} (the protocol stopped
        reading: the connection delivers nothing to it) or C{"stopped"}.
    @ivar limit: with a number, a registered streaming producer is paused
        while more than C{limit} bytes wait in flight and resumed once they
        have all been taken; L{None}: no flow control.
    @ivar largest: the most bytes that ever waited in flight.
    @ivar producer_paused: whether this transport paused its producer.
    @ivar write_closed: C{loseWriteConnection} was called.
    @ivar disconnected: the connection is gone (cut, closed or aborted):
        writes are dropped.
    @ivar connected: true until the protocol is told the connection is
        lost (as on a real transport).
    @ivar connection: the L{Connection} this transport is one end of.
    """

    producerState = "producing"
    largest = 0
    producer_paused = False
    write_closed = False
    disconnected = False
    connection = None

    def __init__(self, protocol, isServer, hostAddress=None, peerAddress=None, limit=None,
                 lenient=False):
        super().__init__(protocol, isServer, hostAddress, peerAddress)
        self.limit = limit
        self.lenient = lenient
        self.outgoing = bytearray()
        self.connected = True

    # ITransport
    def write(self, data):
        if self.disconnected or self.write_closed:
            return
        self.outgoing += data
        self.largest = max(self.largest, len(self.outgoing))
        if (self.limit is not None and len(self.outgoing) > self.limit
                and self.producer is not None and self.streamingProducer
                and not self.producer_paused):
            self.producer_paused = True
            self.producer.pauseProducing()

    def abortConnection(self):
        """Lose what is in flight; the loss is reported on the next turn."""
        self.disconnecting = True
        self.disconnected = True
        self.outgoing.clear()
        if self.connection is not None:
            self.connection.aborted(self)

    def loseWriteConnection(self):
        self.write_closed = True

    # IConsumer
    def registerProducer(self, producer, streaming):
        if self.producer is not None:
            raise RuntimeError("Cannot register two producers")
        super().registerProducer(producer, streaming)

    def unregisterProducer(self):
        if self.producer is None:
            raise RuntimeError("Cannot unregister a producer unless one is registered")
        super().unregisterProducer()
        self.producer_paused = False

    # IPushProducer: the protocol stops and starts reading
    def _check_state(self):
        if self.disconnecting and not self.lenient:
            raise RuntimeError("Cannot resume producing after loseConnection")
        if self.producerState == "stopped":
            raise RuntimeError("Cannot resume a stopped producer")

    def pauseProducing(self):
        self._check_state()
        self.producerState = "paused"

    def resumeProducing(self):
        self._check_state()
        self.producerState = "producing"

    def stopProducing(self):
        self.producerState = "stopped"
        self.loseConnection()

    # what the tests and the connection use
    def value(self):
        """
        @return: the bytes written and still in flight.
        """
        return bytes(self.outgoing)

    def take(self, size=None):
        """
        Remove bytes in flight (as the peer reads them).

        @param size: how many at most; L{None}: all.
        @return: the bytes taken.
        """
        if size is None:
            size = len(self.outgoing)
        data = bytes(self.outgoing[:size])
        del self.outgoing[:size]
        if not self.outgoing and self.producer_paused:
            # the buffer drained: a real transport resumes its producer
            self.producer_paused = False
            if self.producer is not None:
                self.producer.resumeProducing()
        return data

    def clear(self):
        """Lose the bytes in flight."""
        self.take()

    def getOutBuffer(self):
        """iosim's way to take everything in flight (L{None}: nothing)."""
        return self.take() or None


class Connection(iosim.IOPump):
    """
    A server and a client protocol joined by two L{MemoryTransport}s; the
    test moves the bytes (L{step}, L{send}) and breaks the connection
    (L{cut}).  C{flush} (iosim's) steps until nothing moves.

    @ivar server: the server protocol; C{client}: the client's.
    @ivar server_transport: the server's L{MemoryTransport};
        C{client_transport}: the client's.
    @ivar up: until the connection is cut or closed.
    @ivar honour_pauses: deliver nothing to a protocol that paused reading
        (else bytes are delivered whatever it asked).
    @ivar delivered: bytes delivered so far, by receiving side
        (C{"server"}, C{"client"}).
    """

    def __init__(self, server, client, clock=None, *, server_address=None,
                 client_address=None, server_limit=None, client_limit=None,
                 honour_pauses=True, lenient=False):
        """
        Connect: the server's C{makeConnection} first, then the client's (as
        L{iosim.connect} does).

        @param clock: the clock advanced by iosim's C{pump}; abort reports
            are scheduled on it (iosim's C{MemoryReactorClock} by default).
        @param server_address: the server's host address and the client's
            peer (L{iosim.FakeAddress} by default); C{client_address}
            likewise.
        @param server_limit: the server transport's flow-control C{limit};
            C{client_limit} likewise.
        @param lenient: see L{MemoryTransport}.
        """
        # one address object per side, so that one's host is the other's peer
        if server_address is None:
            server_address = iosim.FakeAddress()
        if client_address is None:
            client_address = iosim.FakeAddress()
        self.server_transport = MemoryTransport(server, True, server_address, client_address,
                                                limit=server_limit, lenient=lenient)
        self.client_transport = MemoryTransport(client, False, client_address, server_address,
                                                limit=client_limit, lenient=lenient)
        super().__init__(client, server, self.client_transport, self.server_transport,
                         debug=False, clock=clock)
        self.server_transport.connection = self.client_transport.connection = self
        self.honour_pauses = honour_pauses
        self.up = True
        self.delivered = {SERVER: 0, CLIENT: 0}
        self._told = set()
        self._eof_sent = set()
        server.makeConnection(self.server_transport)
        client.makeConnection(self.client_transport)

    def _ends(self, to):
        """@return: (source transport, sink transport, sink protocol) towards C{to}."""
        if to == SERVER:
            return self.client_transport, self.server_transport, self.server
        return self.server_transport, self.client_transport, self.client

    def send(self, to, size=None):
        """
        Deliver one piece of what is in flight towards C{to}, unless the
        connection is gone, the receiver is closing (a Twisted transport
        stops reading on C{loseConnection}) or it paused reading.

        @param to: C{"server"} or C{"client"}.
        @param size: the piece's size at most: a number, a callable giving
            one (called only when a piece moves), or L{None} for all.
        @return: the number of bytes delivered.
        """
        source, sink, protocol = self._ends(to)
        if (not self.up or sink.disconnecting or not source.outgoing
                or (self.honour_pauses and sink.producerState == "paused")):
            return 0
        if callable(size):
            size = size()
        data = source.take(size)
        self.delivered[to] += len(data)
        protocol.dataReceived(data)
        return len(data)

    def step(self, size=None):
        """
        One piece each way (to the server first), then end the connection
        if a side asked to close and what it wrote has arrived.

        @param size: as for L{send}.
        @return: whether anything happened.
        """
        moved = bool(self.send(SERVER, size))
        moved = bool(self.send(CLIENT, size)) or moved
        return self.finish_close() or moved

    def pump(self, debug=False, advanceClock=True):
        """iosim's pump: a turn of the clock, then a L{step} moving everything."""
        if advanceClock:
            self.clock.advance(0)
        return self.step()

    def finish_close(self):
        """
        Close if a side called C{loseConnection} (or C{loseWriteConnection})
        and all it wrote has arrived: both sides are told (the server
        first) and what the other side had in flight is lost, as a closing
        Twisted transport stops reading.

        @return: whether the connection closed (or a half-close was seen).
        """
        if not self.up:
            return False
        for transport, peer_side in ((self.server_transport, CLIENT),
                                     (self.client_transport, SERVER)):
            if transport.outgoing:
                continue
            if transport.disconnecting:
                self.cut(reason=Failure(ConnectionDone()))
                return True
            if transport.write_closed and peer_side not in self._eof_sent:
                self._eof_sent.add(peer_side)
                peer = self._ends(peer_side)[2]
                half_closeable = IHalfCloseableProtocol(peer, None)
                if half_closeable is None:
                    self.cut(reason=Failure(ConnectionDone()))
                else:
                    half_closeable.readConnectionLost()
                return True
        return False

    def cut(self, to_server=0, to_client=0, reason=None, tell=(SERVER, CLIENT)):
        """
        The connection breaks: the bytes in flight are lost, but for a
        prefix each way that arrives first.  On a connection already gone,
        tell the sides not told yet.

        @param to_server: how much of what the client has in flight reaches
            the server first: a number, L{None} (all), or a callable given
            those bytes and returning a number.  C{to_client} likewise
            (delivered after).
        @param reason: a L{Failure} for C{connectionLost}
            (L{ConnectionLost} by default).
        @param tell: the sides told now, in order; the others stay
            unaware (a half-open connection) until L{notify}.
        """
        if self.up:
            self.up = False
            for to, how_much in ((SERVER, to_server), (CLIENT, to_client)):
                source, sink, protocol = self._ends(to)
                if callable(how_much):
                    how_much = how_much(source.value())
                if how_much is None or how_much > 0:
                    data = source.take(how_much)
                    if data:
                        self.delivered[to] += len(data)
                        protocol.dataReceived(data)
            for transport in (self.server_transport, self.client_transport):
                transport.disconnected = True
                transport.outgoing.clear()
        if reason is None:
            reason = Failure(ConnectionLost("cut by the network"))
        for side in tell:
            self.notify(side, reason)

    def notify(self, side, reason=None):
        """
        Tell C{side} (C{"server"} or C{"client"}) that its connection is
        lost, unless it was told already.
        """
        if side in self._told:
            return
        self._told.add(side)
        if reason is None:
            reason = Failure(ConnectionLost("cut by the network"))
        transport = self.server_transport if side == SERVER else self.client_transport
        transport.disconnected = True
        transport.connected = False
        transport.protocol.connectionLost(reason)

    def aborted(self, transport):
        """
        C{transport}'s protocol aborted: the connection is cut now (nothing
        more arrives) and both sides are told on the next turn of the
        clock, as a reactor reports an abort.
        """
        self.cut(tell=())
        self.clock.callLater(0, self._report_abort, transport)

    def _report_abort(self, transport):
        for side, end in ((SERVER, self.server_transport), (CLIENT, self.client_transport)):
            if end is transport:
                self.notify(side, Failure(ConnectionAborted()))
            else:
                self.notify(side, Failure(ConnectionLost("aborted by the peer")))
