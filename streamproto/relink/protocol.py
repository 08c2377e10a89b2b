"""
Thin Twisted protocols for both Relink roles.

Each runs the handshake as an automat state machine and then hands packet
bytes to its L{streamproto.relink.link.Link}.  Everything about links and
channels lives in C{link.py}; everything about bytes in C{codec.py}.
"""

from automat import MethodicalMachine
from twisted.internet.defer import succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.relink import codec
from streamproto.relink.codec import ProtocolError
from streamproto.relink.link import LinkLost


@implementer(IPushProducer)
class _LinkedConnection(Protocol):
    """
    What both roles share once linked: feeding the link, ending cleanly,
    and flow control both ways.  The connection is its transport's
    streaming producer: when the transport's buffer fills (the peer reads
    slower than we send) it pauses us and the link stops transmitting
    messages until it resumes us.  Reading is paused (the transport's own
    producer methods) when the handler has too many unconsumed bytes, and
    for a graceful stop.
    """

    log = Logger()
    link = None
    _timeout_call = None
    _producing = False      # registered as the transport's producer
    _draining = False       # graceful stop: read no more (see gracefulShutdown)

    def _start_timeout(self, seconds):
        self._timeout_call = self.clock.callLater(seconds, self._handshake_timed_out)

    def _cancel_timeout(self):
        if self._timeout_call is not None and self._timeout_call.active():
            self._timeout_call.cancel()
        self._timeout_call = None

    def _handshake_timed_out(self):
        self._timeout_call = None
        self.log.warn("relink handshake timed out with {peer}", peer=self._peer())
        self.transport.abortConnection()

    def _peer(self):
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"

    def _server(self):
        """The listener's factory when it keeps metrics (None on the connector side)."""
        factory = getattr(self, "factory", None)
        return factory if hasattr(factory, "metric_acks") else None

    def _attach(self, link, resumed, rest):
        self.link = link
        server = self._server()
        if server is not None:
            link.ack_counter = server.metric_acks
        self.transport.registerProducer(self, True)
        self._producing = True
        link.attach(self.transport.writeSequence, self._lose_connection, resumed,
                    pause=self._pause, owner=self)
        if rest:
            self._feed(bytes(rest))

    def unregister_producer(self):
        """
        Stop being the transport's producer: call before C{loseConnection}
        (a transport with a producer registered waits for it to be
        unregistered before it closes).
        """
        if self._producing:
            self._producing = False
            self.transport.unregisterProducer()

    def _lose_connection(self):
        self.unregister_producer()
        self.transport.loseConnection()

    def _pause(self, paused):
        # backpressure: the handler has too many bytes unconsumed
        if paused:
            server = self._server()
            if server is not None:
                server.metric_pauses.inc()
            self.transport.pauseProducing()
        elif not self._draining:
            self.transport.resumeProducing()

    # -- IPushProducer: the transport's buffer is full / has room again -------
    def pauseProducing(self):
        link = self.link
        if link is not None and link.owner is self:
            link.pause_transmission(True)

    def resumeProducing(self):
        if getattr(self.transport, "disconnecting", False):
            # someone else called loseConnection (ClientService.stopService):
            # let the transport close now that its buffer is written
            self.unregister_producer()
            return
        link = self.link
        if link is not None and link.owner is self:
            link.pause_transmission(False)

    def stopProducing(self):
        # the connection is going away; connectionLost detaches the link
        self._producing = False

    def _feed(self, data):
        link = self.link
        try:
            link.data_received(data)
        except ProtocolError as e:
            self.log.warn("relink protocol error from {peer}: {error}; discarding link "
                          "{link_id}", peer=self._peer(), error=str(e), link_id=link.link_id)
            self._protocol_error(link, e)
        except Exception as e:
            # a bug of ours: this link's state cannot be trusted any more,
            # but the other links and connections carry on
            self.log.failure("relink: internal error on link {link_id}", link_id=link.link_id)
            self._protocol_error(link, e)

    def _protocol_error(self, link, error):
        server = self._server()
        if server is not None:
            server.count_error("protocol_error" if isinstance(error, ProtocolError)
                               else "internal_error")
        link.discard(LinkLost(f"protocol error: {error}"))
        self._lose_connection()

    def _detach(self):
        self._cancel_timeout()
        if self.link is not None and self.link.attached and self.link.owner is self:
            self.link.detach()


class ListenerProtocol(_LinkedConnection):
    """
    The accepting side.  C{factory} is a L{streamproto.relink.api.ListenerFactory}.
    """

    _machine = MethodicalMachine()

    def __init__(self, factory, clock):
        self.factory = factory
        self.clock = clock
        self._buf = bytearray()

    # -- states --------------------------------------------------------------
    @_machine.state(initial=True)
    def awaiting_version(self):
        "Nothing received yet."

    @_machine.state()
    def awaiting_handshake(self):
        "Versions agreed; waiting for the endpoint name, sizes, flags, epoch, link id."

    @_machine.state()
    def linked(self):
        "Packets flow to the link."

    @_machine.state()
    def closed(self):
        "The connection is over (or being closed)."

    # -- inputs --------------------------------------------------------------
    @_machine.input()
    def version_received(self, version):
        "The connector's version block."

    @_machine.input()
    def handshake_accepted(self, link, resumed, rest):
        "The connector's handshake matches an endpoint."

    @_machine.input()
    def packets(self, data):
        "Bytes after the handshake."

    @_machine.input()
    def refused(self, why):
        "The handshake is unacceptable."

    @_machine.input()
    def lost(self):
        "The connection is gone."

    @_machine.input()
    def drained(self):
        "A graceful stop: the handler is done and every acknowledgement is written."

    # -- outputs -------------------------------------------------------------
    @_machine.output()
    def _reply_version(self, version):
        self.transport.write(codec.encode_version(min(version, codec.PROTOCOL_VERSION)))

    @_machine.input()
    def link_gone(self, epoch):
        "The connector required its old link, which is gone."

    @_machine.output()
    def _accept(self, link, resumed, rest):
        self._cancel_timeout()
        self.transport.write(codec.encode_listener_reply(link.epoch, link.link_id))
        self._attach(link, resumed, rest)

    @_machine.output()
    def _reply_gone(self, epoch):
        # the old link id was required but is gone: reply zero, disconnect
        self.transport.write(codec.encode_listener_reply(epoch, 0))
        self.transport.loseConnection()

    @_machine.output()
    def _feed_packets(self, data):
        self._feed(data)

    @_machine.output()
    def _close(self, why):
        self.log.info("relink: closing {peer}: {why}", peer=self._peer(), why=why)
        server = self._server()
        if server is not None:
            server.count_error("handshake_refused")
        self.transport.loseConnection()

    @_machine.output()
    def _forget(self):
        self._detach()

    @_machine.output()
    def _close_drained(self):
        # what arrives from now on is neither handled nor acknowledged (the
        # connector resends it on its next link); reading again lets a TLS
        # transport see the peer's close_notify, which its close waits for
        self._stage = "closed"
        self.transport.resumeProducing()
        self._lose_connection()

    awaiting_version.upon(version_received, enter=awaiting_handshake, outputs=[_reply_version])
    awaiting_version.upon(refused, enter=closed, outputs=[_close])
    awaiting_version.upon(lost, enter=closed, outputs=[_forget])
    awaiting_handshake.upon(handshake_accepted, enter=linked, outputs=[_accept])
    awaiting_handshake.upon(link_gone, enter=closed, outputs=[_reply_gone])
    awaiting_handshake.upon(refused, enter=closed, outputs=[_close])
    awaiting_handshake.upon(lost, enter=closed, outputs=[_forget])
    linked.upon(packets, enter=linked, outputs=[_feed_packets])
    linked.upon(refused, enter=closed, outputs=[_close])
    linked.upon(lost, enter=closed, outputs=[_forget])
    linked.upon(drained, enter=closed, outputs=[_close_drained])
    closed.upon(packets, enter=closed, outputs=[])
    closed.upon(refused, enter=closed, outputs=[])
    closed.upon(lost, enter=closed, outputs=[_forget])
    closed.upon(drained, enter=closed, outputs=[])

    # -- Twisted -------------------------------------------------------------
    def gracefulShutdown(self):
        """
        The server is stopping (called by the connection tracker): read no
        more, let the handler finish what it has (e.g. appends being
        fsynced), write their acknowledgements, then close.  The link is
        not shut down: the connector reconnects when the server is back.
        """
        link = self.link
        if link is None or not link.attached or link.owner is not self:
            self._lose_connection()
            return succeed(None)
        self._draining = True
        self.transport.pauseProducing()
        d = link.when_idle()
        d.addCallback(lambda _: self.drained())
        return d

    def connectionMade(self):
        self._stage = "version"
        self._start_timeout(self.factory.config.handshake_timeout)

    def dataReceived(self, data):
        if self._stage == "linked":
            self.packets(data)
            return
        if self._stage == "closed":
            return
        self._buf += data
        try:
            if self._stage == "version":
                if len(self._buf) < 8:
                    return
                version = codec.decode_version(bytes(self._buf[:8]))
                del self._buf[:8]
                self._stage = "handshake"
                self.version_received(version)
            if self._stage == "handshake":
                parsed = codec.decode_connector_handshake(self._buf, self.factory.config.limits)
                if parsed is None:
                    return
                handshake, used = parsed
                rest, self._buf = self._buf[used:], bytearray()
                endpoint = self.factory.endpoints.get(handshake.endpoint)
                if endpoint is None:
                    raise ProtocolError(f"unknown endpoint {handshake.endpoint!r}")
                link, resumed = endpoint.accept(handshake, self)
                if link is None:
                    self._stage = "closed"
                    self.link_gone(endpoint.epoch)
                    return
                self._stage = "linked"
                self.handshake_accepted(link, resumed, rest)
        except ProtocolError as e:
            self._stage = "closed"
            self.refused(str(e))

    def connectionLost(self, reason):
        self._stage = "closed"
        self.lost()


class ConnectorProtocol(_LinkedConnection):
    """
    The connecting side.  C{owner} is a L{streamproto.relink.api.Connector}:
    it supplies the handshake and takes the listener's answer.
    """

    _machine = MethodicalMachine()

    def __init__(self, owner, clock):
        self.owner = owner
        self.clock = clock
        self._buf = bytearray()

    @_machine.state(initial=True)
    def awaiting_version(self):
        "Our version sent."

    @_machine.state()
    def awaiting_reply(self):
        "Our handshake sent; waiting for epoch and link id."

    @_machine.state()
    def linked(self):
        "Packets flow to the link."

    @_machine.state()
    def closed(self):
        "Over."

    @_machine.input()
    def version_received(self, version):
        "The listener's version block."

    @_machine.input()
    def reply_received(self, link, resumed, rest):
        "The listener answered with our link (new or resumed)."

    @_machine.input()
    def packets(self, data):
        "Bytes after the handshake."

    @_machine.input()
    def refused(self, why):
        "Unsupported version or a broken reply."

    @_machine.input()
    def lost(self):
        "The connection is gone."

    @_machine.output()
    def _send_handshake(self, version):
        self.transport.write(codec.encode_connector_handshake(self.owner.handshake()))

    @_machine.output()
    def _linked(self, link, resumed, rest):
        self._cancel_timeout()
        self.owner.protocol = self
        self._attach(link, resumed, rest)

    @_machine.output()
    def _feed_packets(self, data):
        self._feed(data)

    @_machine.output()
    def _close(self, why):
        self.log.warn("relink: closing connection to {peer}: {why}", peer=self._peer(), why=why)
        self._lose_connection()

    @_machine.output()
    def _forget(self):
        self._detach()
        self.owner.connection_lost(self)

    awaiting_version.upon(version_received, enter=awaiting_reply, outputs=[_send_handshake])
    awaiting_version.upon(refused, enter=closed, outputs=[_close])
    awaiting_version.upon(lost, enter=closed, outputs=[_forget])
    awaiting_reply.upon(reply_received, enter=linked, outputs=[_linked])
    awaiting_reply.upon(refused, enter=closed, outputs=[_close])
    awaiting_reply.upon(lost, enter=closed, outputs=[_forget])
    linked.upon(packets, enter=linked, outputs=[_feed_packets])
    linked.upon(refused, enter=closed, outputs=[_close])
    linked.upon(lost, enter=closed, outputs=[_forget])
    closed.upon(packets, enter=closed, outputs=[])
    closed.upon(refused, enter=closed, outputs=[])
    closed.upon(lost, enter=closed, outputs=[_forget])

    def connectionMade(self):
        self._stage = "version"
        self._start_timeout(self.owner.config.handshake_timeout)
        self.transport.write(codec.encode_version())

    def dataReceived(self, data):
        if self._stage == "linked":
            self.packets(data)
            return
        self._buf += data
        try:
            if self._stage == "version":
                if len(self._buf) < 8:
                    return
                version = codec.decode_version(bytes(self._buf[:8]))
                del self._buf[:8]
                if version != codec.PROTOCOL_VERSION:
                    raise ProtocolError(f"unsupported listener version {version}")
                self._stage = "reply"
                self.version_received(version)
            if self._stage == "reply":
                if len(self._buf) < 16:
                    return
                epoch, link_id = codec.decode_listener_reply(bytes(self._buf[:16]))
                rest, self._buf = self._buf[16:], bytearray()
                link, resumed = self.owner.linked(epoch, link_id)
                if link is None:
                    raise ProtocolError("the listener lost our link")
                self._stage = "linked"
                self.reply_received(link, resumed, rest)
        except ProtocolError as e:
            self._stage = "closed"
            self.refused(str(e))

    def connectionLost(self, reason):
        self._stage = "closed"
        self.lost()
