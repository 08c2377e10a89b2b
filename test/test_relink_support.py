"""
In-memory Relink peers for the link tests: a listener and a connector on a
Clock, joined by StringTransports that the test pumps (in random pieces and
with cuts at random byte positions when asked).  No tests here.
"""

import random

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.relink.api import (
    ChannelHandler, Connector, IChannelHandler, ListenerFactory, RelinkEndpoint,
)
from streamproto.relink.config import LinkConfig
from streamproto.relink.protocol import ConnectorProtocol


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


class PausingTransport(StringTransport):
    """
    A StringTransport that flow-controls its streaming producer the way a
    real transport does: it pauses the producer when more than C{limit}
    bytes wait to be sent, and resumes it when the test takes them
    (L{take}: the peer read them).
    """

    def __init__(self, limit=65536):
        super().__init__()
        self.limit = limit
        self.largest = 0     # most bytes ever waiting
        self.paused_producer = False

    def write(self, data):
        super().write(data)
        self._written()

    def writeSequence(self, data):
        super().writeSequence(data)
        self._written()

    def _written(self):
        waiting = len(self.value())
        self.largest = max(self.largest, waiting)
        if (waiting > self.limit and self.producer is not None and self.streaming
                and not self.paused_producer):
            self.paused_producer = True
            self.producer.pauseProducing()

    def take(self):
        """The peer read everything: @return: the bytes; resumes the producer."""
        data = self.value()
        self.clear()
        if self.paused_producer:
            self.paused_producer = False
            if self.producer is not None:
                self.producer.resumeProducing()
        return data


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
            config=self.config, clock=self.clock)
        self.factory = ListenerFactory([self.endpoint], config=self.config, clock=self.clock)
        sizes = connector_sizes or id_sizes
        tx = connector_transactions or transactions
        self.connector = Connector(None, endpoint_name or name, self.client,
                                   connector_id_size=sizes[0], listener_id_size=sizes[1],
                                   connector_transactions=tx[0], listener_transactions=tx[1],
                                   config=self.config, clock=self.clock)
        self.sp = self.cp = None
        self.connections = 0
        #: deliver nothing to a side whose transport was paused (it stopped reading)
        self.honour_pauses = False

    @property
    def link(self):
        """The connector's link."""
        return self.connector.link

    @property
    def server_link(self):
        links = list(self.endpoint.links.values())
        assert len(links) == 1, links
        return links[0]

    def connect(self, run=True, server_transport=None, client_transport=None):
        self.connections += 1
        self.sp = self.factory.buildProtocol(None)
        self.st = server_transport or StringTransport()
        self.sp.makeConnection(self.st)
        self.cp = ConnectorProtocol(self.connector, self.clock)
        self.ct = client_transport or StringTransport()
        self.cp.makeConnection(self.ct)
        if run:
            self.run()
        return self

    @property
    def connected(self):
        return self.sp is not None

    def _move(self, src, dst_proto, limit=None):
        data = src.value()
        if limit is not None:
            data = data[:limit]
        src.io.seek(0)
        rest = src.value()[len(data):]
        src.clear()
        src.io.write(rest)
        if data:
            dst_proto.dataReceived(data)
        return len(data)

    def step(self, chunk=None):
        """Deliver pending bytes both ways (in random chunks if C{chunk})."""
        moved = 0
        self.clock.advance(0)
        for src, dst, reader in ((self.ct, self.sp, self.st), (self.st, self.cp, self.ct)):
            if self.sp is None:
                break
            while src.value() and self.sp is not None:
                if self.honour_pauses and reader.producerState == "paused":
                    break   # the reader stopped reading: bytes wait in flight
                limit = self.rng.randint(1, chunk) if chunk else None
                moved += self._move(src, dst, limit)
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
        sp, cp, st, ct = self.sp, self.cp, self.st, self.ct
        self.sp = self.cp = None
        if deliver:
            for src, dst in ((ct, sp), (st, cp)):
                data = src.value()
                src.clear()
                if data:
                    dst.dataReceived(data)
        elif rng is not None:
            for src, dst in ((ct, sp), (st, cp)):
                data = src.value()
                src.clear()
                n = rng.randint(0, len(data))
                if n:
                    dst.dataReceived(data[:n])
        lost = Failure(ConnectionError("cut"))
        sp.connectionLost(lost)
        cp.connectionLost(lost)
        self.clock.advance(0)
