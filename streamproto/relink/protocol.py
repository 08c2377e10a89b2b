"""
Thin Twisted protocols for both Relink roles.

Both run the handshake as one automat state machine (on their common base)
and then hand packet bytes to their L{streamproto.relink.link.Link}.
Everything about links lives in C{link.py} (their channels in
C{channels.py}); everything about bytes in C{codec.py}.
"""

from automat import MethodicalMachine
from twisted.internet.defer import succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from streamproto.core.interfaces import IGracefulShutdown
from streamproto.relink import codec
from streamproto.relink.codec import ProtocolError
from streamproto.relink.errors import LinkLost


@implementer(IPushProducer)
class _LinkedConnection(Protocol):
    """
    What both roles share: the connection's state machine (version,
    handshake, linked, closed; each role supplies the hooks that differ),
    feeding the link, ending cleanly, and flow control both ways.  The
    connection is its transport's streaming producer: when the transport's
    buffer fills (the peer reads slower than we send) it pauses us and the
    link stops transmitting messages until it resumes us.  Reading is
    paused (the transport's own producer methods) when the handler has too
    many unconsumed bytes, and for a graceful stop.
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

    # -- the connection's life, the same for both roles ------------------------
    # A connection exchanges version blocks, then the handshake (the listener
    # reads the connector's handshake and answers with epoch and link id),
    # then carries its link's packets until it is closed.  The methods named
    # in "role hooks" below are what each role does differently.

    _machine = MethodicalMachine()

    @_machine.state(initial=True)
    def awaiting_version(self):
        "Waiting for the peer's version block (the connector sends its own first)."

    @_machine.state()
    def awaiting_handshake(self):
        "Versions agreed; the listener awaits the handshake, the connector the reply."

    @_machine.state()
    def linked(self):
        "Packets flow to the link."

    @_machine.state()
    def closed(self):
        "The connection is over (or being closed)."

    @_machine.input()
    def version_received(self, version):
        "The peer's version block."

    @_machine.input()
    def link_established(self, link, resumed, rest):
        "The handshake is done: this connection carries the link (new or resumed)."

    @_machine.input()
    def link_gone(self, epoch):
        "(Listener) The connector required its old link, which is gone."

    @_machine.input()
    def packets(self, data):
        "Bytes after the handshake."

    @_machine.input()
    def refused(self, why):
        "An unacceptable handshake, an unsupported version or a broken reply."

    @_machine.input()
    def lost(self):
        "The connection is gone."

    @_machine.input()
    def drained(self):
        "(Listener) A graceful stop: the handler is done and every acknowledgement is written."

    @_machine.output()
    def _answer_version(self, version):
        self._version_agreed(version)

    @_machine.output()
    def _link(self, link, resumed, rest):
        self._cancel_timeout()
        self._announce_link(link)
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
        self._note_refusal(why)
        self._lose_connection()

    @_machine.output()
    def _forget(self):
        self._detach()
        self._forgotten()

    @_machine.output()
    def _close_drained(self):
        # what arrives from now on is neither handled nor acknowledged (the
        # connector resends it on its next link); reading again lets a TLS
        # transport see the peer's close_notify, which its close waits for
        self._stage = "closed"
        self.transport.resumeProducing()
        self._lose_connection()

    awaiting_version.upon(version_received, enter=awaiting_handshake, outputs=[_answer_version])
    awaiting_version.upon(refused, enter=closed, outputs=[_close])
    awaiting_version.upon(lost, enter=closed, outputs=[_forget])
    awaiting_handshake.upon(link_established, enter=linked, outputs=[_link])
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

    # -- role hooks -----------------------------------------------------------
    def _check_version(self, version):
        """Raise L{ProtocolError} if the peer's C{version} is unacceptable."""

    def _version_agreed(self, version):
        """Send what follows the peer's version block."""
        raise NotImplementedError

    def _take_handshake(self):
        """
        Parse the rest of the handshake from C{self._buf}: C{None} while it
        is incomplete (or when the handshake ended otherwise), else the
        C{(link, resumed, rest)} this connection carries from now on.
        """
        raise NotImplementedError

    def _announce_link(self, link):
        """The handshake is done: tell whoever must know, before packets flow."""

    def _note_refusal(self, why):
        """Log (and count) a refused handshake."""
        raise NotImplementedError

    def _forgotten(self):
        """The connection is gone and its link detached."""

    # -- Twisted -------------------------------------------------------------
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
                self._check_version(version)
                self._stage = "handshake"
                self.version_received(version)
            if self._stage == "handshake":
                established = self._take_handshake()
                if established is None:
                    return
                self._stage = "linked"
                self.link_established(*established)
        except ProtocolError as e:
            self._stage = "closed"
            self.refused(str(e))

    def connectionLost(self, reason):
        self._stage = "closed"
        self.lost()


@implementer(IGracefulShutdown)
class ListenerProtocol(_LinkedConnection):
    """
    The accepting side.  C{factory} is a L{streamproto.relink.api.ListenerFactory}.
    """

    def __init__(self, factory, clock):
        self.factory = factory
        self.clock = clock
        self._buf = bytearray()

    def _version_agreed(self, version):
        self.transport.write(codec.encode_version(min(version, codec.PROTOCOL_VERSION)))

    def _take_handshake(self):
        parsed = codec.decode_connector_handshake(self._buf, self.factory.config.limits)
        if parsed is None:
            return None
        handshake, used = parsed
        rest, self._buf = self._buf[used:], bytearray()
        endpoint = self.factory.endpoints.get(handshake.endpoint)
        if endpoint is None:
            raise ProtocolError(f"unknown endpoint {handshake.endpoint!r}")
        principals = self._authorize(endpoint.name)
        link, resumed = endpoint.accept(handshake, self)
        if link is not None:
            # what the handler may do with it (the log bridge's logs) is
            # decided for this connection's principals, resumed or not
            link.principals = principals
        if link is None:
            self._stage = "closed"
            self.link_gone(endpoint.epoch)
            return None
        return link, resumed, rest

    def _authorize(self, name):
        """
        The connection's principals, if the policy lets them link to
        endpoint C{name} (the resource C{relink:NAME}, operation write).
        @raise ProtocolError: ends the handshake (the connection is closed
            before any link exists or is resumed).
        """
        from streamproto.core.auth import connection_principals, denied
        authorizer = getattr(self.factory, "authorizer", None)
        principals = connection_principals(self.transport)
        if authorizer is None or not authorizer.enabled:
            return principals
        resource = f"relink:{name}"
        if not authorizer.allows(principals, "write", resource):
            denied(self.factory.server_name, principals, "write", resource,
                   f"handshake from {self._peer()} ended")
            raise ProtocolError(f"forbidden: endpoint {name!r}")
        # a handler that knows already what the link may not do (the log
        # bridge writing every channel to one log) says so now
        link_denied = getattr(self.factory.endpoints[name].handler, "link_denied", None)
        why = link_denied(principals) if link_denied is not None else None
        if why:
            raise ProtocolError(f"forbidden: {why}")
        return principals

    def _announce_link(self, link):
        self.transport.write(codec.encode_listener_reply(link.epoch, link.link_id))

    def _note_refusal(self, why):
        self.log.info("relink: closing {peer}: {why}", peer=self._peer(), why=why)
        server = self._server()
        if server is not None:
            server.count_error("handshake_refused")

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


class ConnectorProtocol(_LinkedConnection):
    """
    The connecting side.  C{owner} is a L{streamproto.relink.api.Connector}:
    it supplies the handshake and takes the listener's answer.
    """

    def __init__(self, owner, clock):
        self.owner = owner
        self.clock = clock
        self._buf = bytearray()

    def _check_version(self, version):
        if version != codec.PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported listener version {version}")

    def _version_agreed(self, version):
        self.transport.write(codec.encode_connector_handshake(self.owner.handshake()))

    def _take_handshake(self):
        if len(self._buf) < 16:
            return None
        epoch, link_id = codec.decode_listener_reply(bytes(self._buf[:16]))
        rest, self._buf = self._buf[16:], bytearray()
        link, resumed = self.owner.linked(epoch, link_id)
        if link is None:
            raise ProtocolError("the listener lost our link")
        return link, resumed, rest

    def _announce_link(self, link):
        self.owner.protocol = self

    def _note_refusal(self, why):
        self.log.warn("relink: closing connection to {peer}: {why}", peer=self._peer(), why=why)

    def _forgotten(self):
        self.owner.connection_lost(self)

    def connectionMade(self):
        self._stage = "version"
        self._start_timeout(self.owner.config.handshake_timeout)
        self.transport.write(codec.encode_version())
