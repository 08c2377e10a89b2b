"""
The life of one Relink connection, without a transport.

A connection exchanges version blocks, then the handshake (the listener
reads the connector's handshake and answers with epoch and link id), then
carries its link's packets until it is closed.  L{ListenerState} and
L{ConnectorState} hold that life as one automat machine (on their common
base) and are fed its events by a thin Twisted protocol
(L{streamproto.relink.protocol}): the bytes read, the connection made and
lost, a graceful stop, the transport's flow control.  What they do to the
connection they ask of an L{IConnectionEffects} (the protocol in
production, a recorder in tests); their only timer, the handshake timeout,
runs on the clock they are given.  This is the shape of
magic-wormhole-transit-relay's C{server_state}: the decisions can be
tested with a fake effects object and a L{twisted.internet.task.Clock}.

Bytes are cut by L{streamproto.relink.codec}: the version block and the
handshake here, the packets by the L{streamproto.relink.link.Link}'s own
L{codec.PacketDecoder} (a link outlives its connections and renews its
decoder on each attach, so the tail of a lost connection never meets the
bytes of the next).
"""

from automat import MethodicalMachine
from twisted.internet.defer import succeed
from twisted.logger import Logger
from zope.interface import Interface

from streamproto.core.machine import ignore
from streamproto.relink import codec
from streamproto.relink.codec import ProtocolError
from streamproto.relink.errors import LinkLost

__all__ = ["ConnectorState", "IConnectionEffects", "ListenerState"]


class IConnectionEffects(Interface):
    """
    What a connection state (L{ListenerState}, L{ConnectorState}) does to
    its connection.  A link attached to the connection writes and closes
    through it too, and names it as its C{owner}; a listener endpoint keeps
    it as the connection carrying a link (and aborts it when the connector
    comes back on another).
    """

    def write(data):
        """Send C{data} (bytes) to the peer."""

    def write_sequence(chunks):
        """Send each bytes of the list C{chunks} to the peer, in order."""

    def lose_connection():
        """
        Close the connection once what was written is sent (stop being the
        transport's producer first, see L{unregister_producer}).
        """

    def abort_connection():
        """Close the connection now, dropping what is not sent yet."""

    def register_producer():
        """
        Become the transport's streaming producer: a link is attached, and
        stops transmitting messages while the transport's buffer is full.
        """

    def unregister_producer():
        """
        Stop being the transport's producer (a transport with a producer
        registered waits for it to be unregistered before it closes).
        """

    def pause_reading():
        """Read no more bytes until L{resume_reading}."""

    def resume_reading():
        """Read bytes again."""

    def peer():
        """@return: the peer's address, as a string for logs."""

    def principals():
        """
        @return: the connection's principals
            (L{streamproto.core.auth.connection_principals}), for the
            listener's authorization of the handshake.
        """


class _ConnectionState:
    """
    What both roles share: the connection's state machine (version,
    handshake, linked, closed; each role supplies the hooks that differ),
    feeding the link, ending cleanly, and flow control both ways.  Reading
    is paused when the link's handler has too many unconsumed bytes, and
    for a graceful stop.

    @ivar link: the L{streamproto.relink.link.Link} this connection carries
        once the handshake is done (None before).
    """

    log = Logger()
    link = None
    _timeout_call = None
    _draining = False       # graceful stop: read no more (see ListenerState.graceful_shutdown)

    def __init__(self, effects, clock):
        """
        @param effects: the L{IConnectionEffects} of this connection.
        @param clock: an C{IReactorTime} for the handshake timeout.
        """
        self._effects = effects
        self._clock = clock
        self._buf = bytearray()
        # where the handshake parser is: "version", "handshake", "linked" or
        # "closed".  It moves before the machine's input that follows (the
        # machine's state cannot be asked), and routes the bytes read.
        self._stage = "version"

    # -- events, fed by the protocol -------------------------------------------
    def connection_made(self):
        """The connection is up: the handshake must complete in time."""
        self._timeout_call = self._clock.callLater(self._handshake_timeout(),
                                                   self._handshake_timed_out)

    def data_received(self, data):
        """
        Bytes read from the connection: the version block and the handshake,
        then packets for the link.
        """
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

    def connection_lost(self):
        """The connection is gone."""
        self._stage = "closed"
        self.lost()

    def pause_transmission(self, paused):
        """
        The transport's buffer is full (C{paused}) or has room again: the
        link stops (or resumes) transmitting messages.
        """
        link = self.link
        if link is not None and link.owner is self._effects:
            link.pause_transmission(paused)

    # -- what the machine's outputs use ----------------------------------------
    def _handshake_timed_out(self):
        self._timeout_call = None
        self.timed_out()

    def _cancel_timeout(self):
        if self._timeout_call is not None and self._timeout_call.active():
            self._timeout_call.cancel()
        self._timeout_call = None

    def _attach(self, link, resumed, rest):
        self.link = link
        ack_counter = self._ack_counter()
        if ack_counter is not None:
            link.ack_counter = ack_counter
        effects = self._effects
        effects.register_producer()
        link.attach(effects.write_sequence, effects.lose_connection, resumed,
                    pause=self._pause_reading, owner=effects)
        if rest:
            self._feed(bytes(rest))

    def _pause_reading(self, paused):
        # backpressure: the handler has too many bytes unconsumed
        if paused:
            self._count_pause()
            self._effects.pause_reading()
        elif not self._draining:
            self._effects.resume_reading()

    def _feed(self, data):
        link = self.link
        try:
            link.data_received(data)
        except ProtocolError as e:
            self.log.warn("relink protocol error from {peer}: {error}; discarding link "
                          "{link_id}", peer=self._effects.peer(), error=str(e),
                          link_id=link.link_id)
            self._protocol_error(link, e)
        except Exception as e:
            # a bug of ours: this link's state cannot be trusted any more,
            # but the other links and connections carry on
            self.log.failure("relink: internal error on link {link_id}", link_id=link.link_id)
            self._protocol_error(link, e)

    def _protocol_error(self, link, error):
        self._count_error("protocol_error" if isinstance(error, ProtocolError)
                          else "internal_error")
        link.discard(LinkLost(f"protocol error: {error}"))
        self._effects.lose_connection()

    def _detach(self):
        self._cancel_timeout()
        link = self.link
        if link is not None and link.attached and link.owner is self._effects:
            link.detach()

    # -- the machine -----------------------------------------------------------
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
    def timed_out(self):
        "The handshake did not complete in time."

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
        self._effects.write(codec.encode_listener_reply(epoch, 0))
        self._effects.lose_connection()

    @_machine.output()
    def _feed_packets(self, data):
        self._feed(data)

    @_machine.output()
    def _close(self, why):
        self._note_refusal(why)
        self._effects.lose_connection()

    @_machine.output()
    def _abort(self):
        self.log.warn("relink handshake timed out with {peer}", peer=self._effects.peer())
        self._effects.abort_connection()

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
        self._effects.resume_reading()
        self._effects.lose_connection()

    awaiting_version.upon(version_received, enter=awaiting_handshake, outputs=[_answer_version])
    awaiting_version.upon(refused, enter=closed, outputs=[_close])
    awaiting_version.upon(timed_out, enter=closed, outputs=[_abort])
    awaiting_version.upon(lost, enter=closed, outputs=[_forget])
    awaiting_handshake.upon(link_established, enter=linked, outputs=[_link])
    awaiting_handshake.upon(link_gone, enter=closed, outputs=[_reply_gone])
    awaiting_handshake.upon(refused, enter=closed, outputs=[_close])
    awaiting_handshake.upon(timed_out, enter=closed, outputs=[_abort])
    awaiting_handshake.upon(lost, enter=closed, outputs=[_forget])
    linked.upon(packets, enter=linked, outputs=[_feed_packets])
    linked.upon(refused, enter=closed, outputs=[_close])
    linked.upon(lost, enter=closed, outputs=[_forget])
    linked.upon(drained, enter=closed, outputs=[_close_drained])
    ignore(closed, packets, refused)
    # a refused handshake's connection that does not close (the peer reads
    # nothing, so the farewell is never sent) is aborted at the timeout
    closed.upon(timed_out, enter=closed, outputs=[_abort])
    closed.upon(lost, enter=closed, outputs=[_forget])
    ignore(closed, drained)

    # -- role hooks -----------------------------------------------------------
    def _handshake_timeout(self):
        """@return: the seconds the handshake may take."""
        raise NotImplementedError

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

    def _ack_counter(self):
        """@return: the counter of acknowledgements written, or None."""

    def _count_pause(self):
        """Reading was paused for backpressure."""

    def _count_error(self, code):
        """An error ended the link (C{code}: the metric's label)."""


class ListenerState(_ConnectionState):
    """
    The accepting side's connection.

    @ivar factory: the L{streamproto.relink.api.ListenerFactory} (its
        endpoints, config, authorizer and metrics).
    """

    def __init__(self, factory, effects, clock):
        """C{effects} and C{clock} as L{_ConnectionState}'s."""
        _ConnectionState.__init__(self, effects, clock)
        self.factory = factory

    def _server(self):
        """The factory when it keeps metrics (a test's may not)."""
        factory = self.factory
        return factory if hasattr(factory, "metrics") else None

    def graceful_shutdown(self):
        """
        The server is stopping: read no more, let the handler finish what it
        has (e.g. appends being fsynced), write their acknowledgements, then
        close.  The link is not shut down: the connector reconnects when the
        server is back.

        @return: a Deferred firing once the connection is being closed.
        """
        link = self.link
        if link is None or not link.attached or link.owner is not self._effects:
            self._effects.lose_connection()
            return succeed(None)
        self._draining = True
        self._effects.pause_reading()
        d = link.when_idle()
        d.addCallback(self._drained)
        return d

    def _drained(self, _):
        self.drained()
        # the machine's input returns its outputs' results: not for the caller
        return None

    def _handshake_timeout(self):
        return self.factory.config.handshake_timeout

    def _version_agreed(self, version):
        self._effects.write(codec.encode_version(min(version, codec.PROTOCOL_VERSION)))

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
        link, resumed = endpoint.accept(handshake, self._effects)
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
        from streamproto.core.auth import denied
        authorizer = getattr(self.factory, "authorizer", None)
        principals = self._effects.principals()
        if authorizer is None or not authorizer.enabled:
            return principals
        resource = f"relink:{name}"
        if not authorizer.allows(principals, "write", resource):
            denied(self.factory.server_name, principals, "write", resource,
                   f"handshake from {self._effects.peer()} ended")
            raise ProtocolError(f"forbidden: endpoint {name!r}")
        # a handler that knows already what the link may not do (the log
        # bridge writing every channel to one log) says so now
        link_denied = getattr(self.factory.endpoints[name].handler, "link_denied", None)
        why = link_denied(principals) if link_denied is not None else None
        if why:
            raise ProtocolError(f"forbidden: {why}")
        return principals

    def _announce_link(self, link):
        self._effects.write(codec.encode_listener_reply(link.epoch, link.link_id))

    def _note_refusal(self, why):
        self.log.info("relink: closing {peer}: {why}", peer=self._effects.peer(), why=why)
        self._count_error("handshake_refused")

    def _ack_counter(self):
        server = self._server()
        return server.metrics.acks if server is not None else None

    def _count_pause(self):
        server = self._server()
        if server is not None:
            server.metrics.pauses.inc()

    def _count_error(self, code):
        server = self._server()
        if server is not None:
            server.count_error(code)


class ConnectorState(_ConnectionState):
    """
    The connecting side's connection.

    @ivar owner: the L{streamproto.relink.api.Connector}: it supplies the
        handshake and takes the listener's answer; its C{protocol} is the
        connection (the L{IConnectionEffects}) carrying its link.
    """

    def __init__(self, owner, effects, clock):
        """C{effects} and C{clock} as L{_ConnectionState}'s."""
        _ConnectionState.__init__(self, effects, clock)
        self.owner = owner

    def connection_made(self):
        """The connection is up: the connector speaks first."""
        _ConnectionState.connection_made(self)
        self._effects.write(codec.encode_version())

    def _handshake_timeout(self):
        return self.owner.config.handshake_timeout

    def _check_version(self, version):
        if version != codec.PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported listener version {version}")

    def _version_agreed(self, version):
        self._effects.write(codec.encode_connector_handshake(self.owner.handshake()))

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
        self.owner.protocol = self._effects

    def _note_refusal(self, why):
        self.log.warn("relink: closing connection to {peer}: {why}",
                      peer=self._effects.peer(), why=why)

    def _forgotten(self):
        self.owner.connection_lost(self._effects)
