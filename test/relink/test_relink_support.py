"""
In-memory Relink peers for the link tests: a listener and a connector on a
Clock, joined by a L{test.support.memnet.Connection} that the test pumps (in random
pieces and with cuts at random byte positions when asked).  No tests here.
"""

import random

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.relink.api import (
    ChannelHandler, Connector, IChannelHandler, ListenerFactory, RelinkEndpoint,
)
from streamproto.relink.config import LinkConfig
from streamproto.relink.protocol import ConnectorProtocol
from test.support.memnet import CLIENT, SERVER, Connection

#: the addresses StringTransport gives (the link tests used it)
SERVER_ADDRESS = IPv4Address("TCP", "10.0.0.1", 12345)
CLIENT_ADDRESS = IPv4Address("TCP", "192.168.1.1", 54321)


@implementer(IChannelHandler)
class Recorder(ChannelHandler):
    """Records what arrives; consumes at once, or holds Deferreds when told to."""

    def __init__(self, hold=False, commit_result=True, rng=None):
        self.messages = {}        # channel -> list of messages
        self.committed = {}       # channel -> list of committed messages
        self.commits = []         # (channel, count) in order
        self.closed = []
        self.hold = hold
        self.held = []
        self.rng = rng
        self.commit_result = commit_result
        self.links_closed = []
        self.attached = []
        self.shutdowns = 0

    def link_attached(self, link, resumed):
        self.attached.append(resumed)

    def messages_received(self, link, channel_id, messages):
        self.messages.setdefault(channel_id, []).extend(messages)
        if self.hold or (self.rng is not None and self.rng.random() < 0.3):
            d = Deferred()
            self.held.append(d)
            return d
        return None

    def release(self, n=None):
        held, self.held = (self.held, []) if n is None else (self.held[:n], self.held[n:])
        for d in held:
            d.callback(None)

    def commit_received(self, link, channel_id, messages):
        self.commits.append((channel_id, len(messages)))
        result = self.commit_result
        if callable(result):
            result = result(channel_id, messages)
        if result is True and self.rng is not None and self.rng.random() < 0.3:
            # decide later (release() fires it), like a log append being fsynced
            d = Deferred()

            def decided(_):
                self.committed.setdefault(channel_id, []).extend(messages)
                return True
            d.addCallback(decided)
            self.held.append(d)
            return d
        if result is True:
            self.committed.setdefault(channel_id, []).extend(messages)
        return result

    def channel_closed(self, link, channel_id):
        self.closed.append(channel_id)

    def peer_shutdown(self, link):
        self.shutdowns += 1

    def link_closed(self, link, reason):
        self.links_closed.append(reason)


class Pair:
    """
    A listener endpoint and a connector, connected in memory.

    @ivar server: the listener's handler; C{client}: the connector's.
    """

    def __init__(self, *, server=None, client=None, name="test", id_sizes=(2, 2),
                 transactions=(False, False), config=None, endpoint_name=None,
                 connector_sizes=None, connector_transactions=None, seed=0):
        self.clock = Clock()
        self.rng = random.Random(seed)
        self.config = config or LinkConfig()
        self.server = server or Recorder()
        self.client = client or Recorder()
        self.endpoint = RelinkEndpoint(
            name, self.server, connector_id_size=id_sizes[0], listener_id_size=id_sizes[1],
            connector_transactions=transactions[0], listener_transactions=transactions[1],
            config=self.config, clock=self.clock, first_link_id=1)
        self.factory = ListenerFactory([self.endpoint], config=self.config, clock=self.clock)
        sizes = connector_sizes or id_sizes
        tx = connector_transactions or transactions
        self.connector = Connector(None, endpoint_name or name, self.client,
                                   connector_id_size=sizes[0], listener_id_size=sizes[1],
                                   connector_transactions=tx[0], listener_transactions=tx[1],
                                   config=self.config, clock=self.clock)
        self.sp = self.cp = self.conn = None
        self.st = self.ct = None     # the transports of the last connection
        self.connections = 0
        #: deliver nothing to a side whose transport was paused (it stopped reading)
        self.honour_pauses = False

    def fail_over(self, server=None):
        """
        Another listener from now on (another front-end: a new endpoint with
        its own epoch and links, and C{server} as its handler, default a new
        L{Recorder}); the current connection is cut first, nothing in
        flight delivered (as a kill -9).  @return: the new handler.
        """
        self.cut()
        self.clock.advance(1)   # a listener instance started later: another epoch
        old = self.endpoint
        self.server = server or Recorder()
        self.endpoint = RelinkEndpoint(
            old.name, self.server, connector_id_size=old.connector_id_size,
            listener_id_size=old.listener_id_size,
            connector_transactions=old.connector_transactions,
            listener_transactions=old.listener_transactions, config=self.config,
            clock=self.clock, first_link_id=1)
        self.factory = ListenerFactory([self.endpoint], config=self.config, clock=self.clock)
        return self.server

    @property
    def link(self):
        """The connector's link."""
        return self.connector.link

    @property
    def server_link(self):
        links = list(self.endpoint.links.values())
        assert len(links) == 1, links
        return links[0]

    def connect(self, run=True, server_limit=None, client_limit=None):
        """
        A new connection between the listener and the connector.

        @param run: deliver what the handshakes write (L{run}).
        @param server_limit: the flow-control C{limit} of the listener's
            transport (L{test.support.memnet.MemoryTransport}); C{client_limit}:
            the connector's.
        """
        self.connections += 1
        self.sp = self.factory.buildProtocol(None)
        self.cp = ConnectorProtocol(self.connector, self.clock)
        self.conn = Connection(self.sp, self.cp, self.clock,
                               server_address=SERVER_ADDRESS, client_address=CLIENT_ADDRESS,
                               server_limit=server_limit, client_limit=client_limit,
                               honour_pauses=self.honour_pauses)
        self.st, self.ct = self.conn.server_transport, self.conn.client_transport
        if run:
            self.run()
        return self

    @property
    def connected(self):
        return self.sp is not None

    def step(self, chunk=None):
        """Deliver pending bytes both ways (in random chunks if C{chunk})."""
        moved = 0
        self.clock.advance(0)
        size = (lambda: self.rng.randint(1, chunk)) if chunk else None
        if self.conn is not None:
            self.conn.honour_pauses = self.honour_pauses
        for to in (SERVER, CLIENT):
            while self.sp is not None:
                n = self.conn.send(to, size)
                if not n:
                    break
                moved += n
                self._check_closed()
        self.clock.advance(0)
        self._check_closed()
        return moved

    def run(self, rounds=200, chunk=None):
        for _ in range(rounds):
            if not self.connected:
                return
            pending = self.ct.value() or self.st.value() or self.clock.getDelayedCalls() and \
                any(c.getTime() <= self.clock.seconds() for c in self.clock.getDelayedCalls())
            if not pending:
                return
            self.step(chunk)

    def _check_closed(self):
        if self.sp is not None and (self.st.disconnecting or self.ct.disconnecting):
            self.cut(deliver=True)

    def cut(self, deliver=False, rng=None):
        """
        End the connection.  With C{rng}, a random prefix of the bytes in
        flight each way is delivered first (the rest is lost).
        """
        if self.sp is None:
            return
        conn = self.conn
        self.sp = self.cp = None
        if deliver:
            arrives = None
        elif rng is not None:
            def arrives(data):
                return rng.randint(0, len(data))
        else:
            arrives = 0
        conn.cut(to_server=arrives, to_client=arrives, reason=Failure(ConnectionError("cut")))
        self.clock.advance(0)
