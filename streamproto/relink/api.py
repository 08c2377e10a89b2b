"""
The public Twisted API of Relink.

Listener side: a L{ListenerFactory} hosts named L{RelinkEndpoint}s; each
endpoint has an L{IChannelHandler} and keeps its links (by link id) across
reconnections for C{link_timeout} seconds.

Connector side: a L{Connector} keeps one L{Link} alive over a client
endpoint, reconnecting (with back-off) and resuming the link.

Sending, on either side: C{link.channel(id).send(parts, ack=CONSUMED)}
returns a Deferred that fires when the peer acknowledged the message at that
level; C{send_many} is the bulk path (one Deferred for a batch).
"""

import itertools
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

from streamproto.core.clock import default_reactor, wall_seconds
from streamproto.core import metrics
from streamproto.core.observer import Observers
from streamproto.core.reconnect import Reconnector, backoff_policy
from streamproto.relink.codec import ConnectorHandshake, ProtocolError
from streamproto.relink.config import LinkConfig
from streamproto.relink.errors import LinkLost
from streamproto.relink.link import Link
from streamproto.relink.protocol import ConnectorProtocol, ListenerProtocol

if TYPE_CHECKING:
    from streamproto.core.auth import IAuthorizer

#: the C{server} label of the relink server in the suite-wide metrics
SERVER_NAME = "relink-server"


class IChannelHandler(Interface):
    """What an endpoint (or a connector) does with what its peer sends."""

    def link_attached(link: Link, resumed: bool) -> None:
        """A connection carries C{link} now (C{resumed}: an old link id was agreed)."""

    def messages_received(link: Link, channel_id: int, messages: list[tuple[bytes, ...]]
                          ) -> Deferred[Any] | None:
        """
        Messages arrived on a channel without transactions (in order, a batch
        of everything one read brought).

        @param messages: list of messages, each a tuple of bytes parts.
        @return: None if they are consumed already, else a Deferred firing
            when they are: that fires the C{consumed} acknowledgement.  A
            failure discards the link (the sender learns it on reconnect).
        """

    def commit_received(link: Link, channel_id: int, messages: list[tuple[bytes, ...]]
                        ) -> bool | Deferred[bool]:
        """
        The peer committed these messages (on a channel with transactions).

        @return: True (committed) or False (uncommitted), or a Deferred of
            it; a failure counts as uncommitted.
        """

    def channel_closed(link: Link, channel_id: int) -> None:
        """The peer closed a channel (every message on it was consumed)."""

    def peer_shutdown(link: Link) -> None:
        """The peer will open no more channels."""

    def link_closed(link: Link, reason: LinkLost) -> None:
        """The link state is gone (L{LinkLost} with why)."""


@implementer(IChannelHandler)
class ChannelHandler:
    """Defaults: consume at once, refuse commits, ignore the rest."""

    def link_attached(self, link: Link, resumed: bool) -> None:
        pass

    def messages_received(self, link: Link, channel_id: int, messages: list[tuple[bytes, ...]]
                          ) -> Deferred[Any] | None:
        return None

    def commit_received(self, link: Link, channel_id: int, messages: list[tuple[bytes, ...]]
                        ) -> bool | Deferred[bool]:
        return False

    def channel_closed(self, link: Link, channel_id: int) -> None:
        pass

    def peer_shutdown(self, link: Link) -> None:
        pass

    def link_closed(self, link: Link, reason: LinkLost) -> None:
        pass


#: the random start of each endpoint's link ids (see L{RelinkEndpoint})
_link_ids = random.SystemRandom()


def _epoch_now(clock):
    return max(1, int(wall_seconds(clock)() * 1_000_000))


class _LinkTerms:
    """
    What both ends of a link agree on, kept alike by the listener's
    L{RelinkEndpoint} and the L{Connector}: the endpoint's name and handler,
    each side's channel id size and transaction support (the handshake's
    terms, named from the connector's and listener's side), the link
    configuration and the clock.
    """

    def _agree(self, name: str, handler: IChannelHandler, connector_id_size: int,
               listener_id_size: int, connector_transactions: bool,
               listener_transactions: bool, config: LinkConfig | None,
               clock: IReactorTime) -> None:
        self.name = name
        self.handler = IChannelHandler(handler)
        self.connector_id_size = connector_id_size
        self.listener_id_size = listener_id_size
        self.connector_transactions = connector_transactions
        self.listener_transactions = listener_transactions
        self.config = config or LinkConfig()
        self.clock = clock

    def _link_terms(self, role: str) -> dict[str, Any]:
        """The terms as the L{Link} of side C{role} ("connector" or "listener") holds them."""
        sizes = (self.connector_id_size, self.listener_id_size)
        transactions = (self.connector_transactions, self.listener_transactions)
        mine = 0 if role == "connector" else 1
        return dict(role=role, own_id_size=sizes[mine], peer_id_size=sizes[1 - mine],
                    own_transactions=transactions[mine],
                    peer_transactions=transactions[1 - mine], config=self.config)


class RelinkEndpoint(_LinkTerms):
    """
    A named service on a listener: the handshake parameters it accepts, its
    handler, and the links of its connectors.

    @param connector_id_size: channel id size of the connector's channels.
    @param listener_id_size: channel id size of ours.
    @param first_link_id: the first link id handed out (then counting up);
        default a random one below 2^62, so that two listener instances
        with the same epoch (started within one microsecond: front-ends
        started in parallel) still do not hand out the same ids, and a
        connector moving between them never resumes a link that is not
        its own.
    """

    log = Logger()

    def __init__(self, name: str, handler: IChannelHandler, *, connector_id_size: int = 0,
                 listener_id_size: int = 0, connector_transactions: bool = False,
                 listener_transactions: bool = False, config: LinkConfig | None = None,
                 clock: IReactorTime | None = None, first_link_id: int | None = None) -> None:
        clock = default_reactor(clock)
        self._agree(name, handler, connector_id_size, listener_id_size, connector_transactions,
                    listener_transactions, config, clock)
        self.epoch = _epoch_now(clock)
        self.links: dict[int, _ListenerLink] = {}
        if first_link_id is None:
            first_link_id = _link_ids.randrange(1, 1 << 62)
        self._ids = itertools.count(first_link_id)
        self._expiry: dict[int, IDelayedCall] = {}
        # link id -> the IConnectionEffects of the connection carrying it
        self._connections: dict[int, Any] = {}
        #: set by L{close}: links still attached then are discarded when
        #: their connection ends instead of being kept for resumption
        self.closed = False

    def accept(self, hs, connection):
        """
        Match a handshake: @return: C{(link, resumed)}; link None when the
        old link was required and is gone.  @raise ProtocolError: mismatch.

        @param connection: the L{streamproto.relink.connection_state.IConnectionEffects}
            of the connection that would carry the link.
        """
        if (hs.connector_id_size, hs.listener_id_size) != (self.connector_id_size,
                                                           self.listener_id_size):
            raise ProtocolError("channel id sizes differ")
        if (hs.connector_transactions, hs.listener_transactions) != (
                self.connector_transactions, self.listener_transactions):
            raise ProtocolError("transaction flags differ")
        link = None
        if hs.epoch == self.epoch and hs.link_id:
            link = self.links.get(hs.link_id)
        if link is not None:
            old = self._connections.get(link.link_id)
            if old is not None and old is not connection and link.attached:
                # the connector came back before we noticed the old connection die
                link.detach()
                old.abort_connection()
            self._cancel_expiry(link.link_id)
            self._connections[link.link_id] = connection
            return link, True
        if hs.require_old_link:
            return None, False
        if len(self.links) >= self.config.max_links and self._expiry:
            # make room by giving up the link disconnected the longest (the
            # expiry timers are in the order the links were detached), so
            # that a flood of abandoned handshakes cannot lock clients out
            oldest = self.links.get(next(iter(self._expiry)))
            if oldest is not None:
                self.log.info("relink: endpoint {name} at max_links: discarding "
                              "disconnected link {link_id}", name=self.name,
                              link_id=oldest.link_id)
                oldest.discard(LinkLost("discarded to make room for a new link"))
        if len(self.links) >= self.config.max_links:
            raise ProtocolError("too many links")
        link_id = next(self._ids)
        link = _ListenerLink(self, self.handler, self.clock, **self._link_terms("listener"),
                             link_id=link_id, epoch=self.epoch)
        self.links[link_id] = link
        self._connections[link_id] = connection
        return link, False

    def _detached(self, link: "_ListenerLink") -> None:
        if self.closed:
            link.discard(LinkLost("endpoint closed"))
            return
        if self.links.get(link.link_id) is link and link.lost is None:
            self._cancel_expiry(link.link_id)
            self._expiry[link.link_id] = self.clock.callLater(
                self.config.link_timeout, self._expire, link)

    def _expire(self, link):
        self._expiry.pop(link.link_id, None)
        if not link.attached:
            self.log.info("relink: link {link_id} of endpoint {name} expired",
                          link_id=link.link_id, name=self.name)
            link.discard(LinkLost("link expired while disconnected"))

    def _discarded(self, link: "_ListenerLink") -> None:
        self._cancel_expiry(link.link_id)
        if self.links.get(link.link_id) is link:
            del self.links[link.link_id]
        self._connections.pop(link.link_id, None)

    def _cancel_expiry(self, link_id):
        call = self._expiry.pop(link_id, None)
        if call is not None and call.active():
            call.cancel()

    def open(self) -> None:
        """Keep links for resumption again (the factory is listening again)."""
        self.closed = False

    def close(self) -> None:
        """
        The server stopped listening: discard every detached link now (no
        connector can come back to resume it) and every attached one when
        its connection ends.  Attached links are not discarded here: their
        connections are still draining (a graceful stop lets the handler
        finish and writes the acknowledgements of what it stored), and
        discarding would drop those acknowledgements.
        """
        self.closed = True
        for link in list(self.links.values()):
            if not link.attached:
                link.discard(LinkLost("endpoint closed"))


class _ListenerLink(Link):
    """A link that tells its endpoint when it is detached or discarded."""

    def __init__(self, endpoint, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.endpoint = endpoint

    def detach(self):
        was = self.attached
        super().detach()
        if was:
            self.endpoint._detached(self)

    def discard(self, reason):
        super().discard(reason)
        self.endpoint._discarded(self)


class ListenerFactory(Factory):
    """
    Serves the named endpoints: C{endpoint.listen(ListenerFactory([...]))}.
    """

    def __init__(self, endpoints: Iterable[RelinkEndpoint], config: LinkConfig | None = None,
                 clock: IReactorTime | None = None, server_name: str = SERVER_NAME,
                 authorizer: "IAuthorizer | None" = None) -> None:
        clock = default_reactor(clock)
        from streamproto.core.auth import ALLOW_ALL
        #: the L{streamproto.core.auth.IAuthorizer}: who may link to which
        #: endpoint (resource C{relink:NAME}, operation write)
        self.authorizer = authorizer or ALLOW_ALL
        self.clock = clock
        self.config = config or LinkConfig()
        self.endpoints = {e.name: e for e in endpoints}
        #: the C{server} label of the suite-wide Prometheus metrics
        self.server_name = server_name
        self.metrics = metrics.ServerMetrics(server_name)

    def count_error(self, code: str) -> None:
        self.metrics.error(code)

    def buildProtocol(self, addr: IAddress | None) -> ListenerProtocol:
        p = ListenerProtocol(self, self.clock)
        p.factory = self
        return p

    def startFactory(self) -> None:
        for e in self.endpoints.values():
            e.open()

    def stopFactory(self) -> None:
        # called when the last listening port closes, which a graceful stop
        # does *before* draining the connections (streamproto.core.tap):
        # attached links must live on until their connection ends
        for e in self.endpoints.values():
            e.close()


class Relinked(NamedTuple):
    """
    What L{Connector.when_relinked} reports: the link moved to a listener
    that did not know it (another front-end, a restarted listener, or one
    that discarded the link), and everything not acknowledged consumed was
    sent again on the new link id.
    """

    #: the listener instance and link id before
    old_epoch: int
    old_link_id: int
    #: the listener instance and link id now
    epoch: int
    link_id: int
    #: messages sent again (accepted by C{send} and not acknowledged
    #: consumed by the old listener), in order per channel
    resent: int
    #: channels with something sent again (messages or operations)
    channels: int


class Connector(_LinkTerms):
    """
    The connecting peer of one link, reconnecting and resuming it.

    @param endpoint: an C{IStreamClientEndpoint} (see
        L{streamproto.core.tls.client_endpoint} for TCP or TLS).
    @param name: the listener's endpoint name.
    @param handler: the L{IChannelHandler} for the listener's channels.
    """

    log = Logger()

    def __init__(self, endpoint: IStreamClientEndpoint, name: str,
                 handler: IChannelHandler | None = None, *, connector_id_size: int = 0,
                 listener_id_size: int = 0, connector_transactions: bool = False,
                 listener_transactions: bool = False, require_old_link: bool = False,
                 config: LinkConfig | None = None, clock: IReactorTime | None = None,
                 retry_policy: Callable[[int], float] | None = None,
                 failover: bool = True) -> None:
        clock = default_reactor(clock)
        #: on a listener that does not know our link (see L{linked}): True
        #: sends everything unacknowledged again on the new link (the same
        #: L{Link} object goes on); False discards the link (its Deferreds
        #: fail with L{LinkLost}) and starts a fresh one
        self.failover = failover
        #: how many times the link moved to a new listener (L{Relinked})
        self.relinks = 0
        #: the last L{Relinked}, or None
        self.last_relink: Relinked | None = None
        #: messages sent again on new links, in all
        self.resent = 0
        self._relink_waiters: Observers[Relinked] = Observers()
        # (link, its peer_consumed_total) when the current connection linked:
        # whether the connection brought progress, for the back-off
        self._mark: tuple[Link | None, int] = (None, 0)
        self._agree(name, handler or ChannelHandler(), connector_id_size, listener_id_size,
                    connector_transactions, listener_transactions, config, clock)
        self.require_old_link = require_old_link
        self.link = self._new_link()
        self._linked_waiters: Observers[Link] = Observers()
        # the connection's driver while started; while stopping, the one
        # that waits to hear the connection is gone
        self._reconnector: Reconnector | None = None
        self._stopping: Reconnector | None = None
        self._endpoint = endpoint
        self._retry_policy = retry_policy
        self.protocol: ConnectorProtocol | None = None

    def _new_link(self):
        return Link(self.handler, self.clock, **self._link_terms("connector"))

    # -- life cycle ----------------------------------------------------------
    def start(self) -> "Connector":
        """Connect (and keep reconnecting until L{stop} or a completed shutdown)."""
        if self._reconnector is None:
            factory = Factory.forProtocol(lambda: ConnectorProtocol(self, self.clock))
            # the suite's one reconnecting client (core.reconnect); the delays
            # are Twisted ClientService's defaults (1 s growing by 1.5 to
            # 60 s), with jitter in proportion
            policy = self._retry_policy or backoff_policy(1.0, 60.0, 1.5)
            endpoint = self._endpoint
            self._reconnector = Reconnector(lambda: endpoint.connect(factory), self.clock,
                                            policy, connected=lambda protocol: None)
            self._reconnector.start()
        return self

    def stop(self) -> Deferred[None]:
        """Stop reconnecting and close the connection; the link state is kept."""
        reconnector, self._reconnector = self._reconnector, None
        if reconnector is None:
            d: Deferred[None] = Deferred()
            d.callback(None)
            return d
        if self.protocol is not None:
            # the reconnector closes the transport, which waits for its producer
            self.protocol.unregister_producer()
        self._stopping = reconnector
        stopped = reconnector.stop()

        def done(result: object) -> object:
            if self._stopping is reconnector:
                self._stopping = None
            return result
        return stopped.addBoth(done)

    def when_linked(self) -> Deferred[Link]:
        """A Deferred firing with the L{Link} once a handshake completed."""
        if self.link.attached:
            return succeed(self.link)
        return self._linked_waiters.when()

    def when_relinked(self) -> Deferred[Relinked]:
        """
        A Deferred firing with a L{Relinked} the next time the link moves to
        a listener that did not know it (and its unacknowledged messages
        are sent again).
        """
        return self._relink_waiters.when()

    def shutdown(self, timeout: float | None = None) -> Deferred[Any]:
        """
        Shut the link down (see L{Link.shutdown}), then stop reconnecting.

        A listener may never answer (it lost our shutdown, or keeps its end
        open): after C{timeout} seconds (default C{config.shutdown_timeout})
        the link is discarded and the Deferred fails with L{LinkLost}
        saying so, rather than waiting for ever.
        """
        link = self.link
        d = link.shutdown()
        if timeout is None:
            timeout = self.config.shutdown_timeout
        if not d.called:
            def give_up():
                self.log.warn("relink: no shutdown from the listener in {timeout} s; "
                              "discarding link {link_id}", timeout=timeout,
                              link_id=link.link_id)
                link.discard(LinkLost(
                    f"the listener did not complete the shutdown within {timeout:g} s "
                    "(messages not yet acknowledged may not have been consumed)"))
            timer = self.clock.callLater(timeout, give_up)
            d.addBoth(_cancelling(timer))
        d.addBoth(self._after_shutdown)
        return d

    def _after_shutdown(self, result):
        stopped = self.stop()
        stopped.addCallback(lambda _: result)
        return stopped

    # -- called by ConnectorProtocol -------------------------------------------
    def handshake(self):
        link = self.link
        return ConnectorHandshake(self.name, self.connector_id_size, self.listener_id_size,
                                  self.connector_transactions, self.listener_transactions,
                                  self.require_old_link and bool(link.link_id),
                                  link.epoch if link.link_id else 0, link.link_id)

    def linked(self, epoch, link_id):
        """The listener answered; @return: (link or None, resumed)."""
        link = self.link
        if link_id == 0:
            self.log.warn("relink: listener no longer knows link {link_id}",
                          link_id=link.link_id)
            reason = LinkLost("the listener lost the link")
            link.discard(reason)
            self.link = self._new_link()
            self.stop()
            self._linked_waiters.fail(reason)
            return None, False
        resumed = link.link_id != 0 and (link.epoch, link.link_id) == (epoch, link_id)
        relinked = None
        if not resumed:
            if link.link_id != 0 and link.lost is None and self.failover:
                # another front-end, or a listener that restarted or lost
                # the link: the same Link goes on, resending what the old
                # listener did not acknowledge consumed
                old_epoch, old_id = link.epoch, link.link_id
                resent, channels = link.relink(epoch, link_id)
                relinked = Relinked(old_epoch, old_id, epoch, link_id, resent, channels)
                self.relinks += 1
                self.resent += resent
                self.last_relink = relinked
                self.log.info(
                    "relink: link re-established on a new listener (link {old} of epoch "
                    "{old_epoch} -> link {link_id} of epoch {epoch}); {resent} messages "
                    "resent on {channels} channel(s) (any the old listener consumed "
                    "without its acknowledgement reaching us are delivered twice)",
                    old=old_id, old_epoch=old_epoch, link_id=link_id, epoch=epoch,
                    resent=resent, channels=channels)
            elif link.link_id != 0 or link.lost is not None:
                self.log.info("relink: new link {link_id} (was {old}); old state discarded",
                              link_id=link_id, old=link.link_id)
                link.discard(LinkLost("the listener started a new link"))
                link = self.link = self._new_link()
            link.epoch, link.link_id = epoch, link_id
        self._mark = (link, link.peer_consumed_total)
        # on the next turn: the caller attaches the link first
        self.clock.callLater(0, self._linked_waiters.fire, link)
        if relinked is not None:
            self.clock.callLater(0, self._relink_waiters.fire, relinked)
        return link, resumed

    def connection_lost(self, protocol):
        linked = self.protocol is protocol
        if linked:
            self.protocol = None
        reconnector = self._reconnector or self._stopping
        if reconnector is not None:
            # a connection that linked worked: connect again at once; one
            # that never got through its handshake counts as a failure, and
            # so does one that linked but got none of our messages consumed
            # while some waited (a listener whose store fails discards the
            # link at each append: resending at once would spin)
            worked = linked and self._worked()
            if worked:
                reconnector.progress()
            reconnector.lost(Failure(ConnectionLost("relink connection closed")),
                             failed=not worked)
        link = self.link
        if link.lost is not None and self._reconnector is not None:
            # the link ended for good (shutdown or protocol error): start afresh
            if link.shutdown_sent and link.peer_shutdown:
                self.stop()
            else:
                self.link = self._new_link()


    def _worked(self) -> bool:
        link, mark = self._mark
        if link is not self.link:
            return True
        if link.peer_consumed_total > mark:
            return True
        return all(ch.idle for ch in link.out_channels.values())


def _cancelling(timer):
    def cancel(result):
        if timer.active():
            timer.cancel()
        return result
    return cancel


__all__ = [
    "ChannelHandler", "Connector", "IChannelHandler", "ListenerFactory", "RelinkEndpoint",
    "Relinked",
]
