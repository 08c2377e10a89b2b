"""
Nagle's algorithm is off on every server's connections, as Go sets it on
every TCP connection.  With it on, a small answer written while the one
before was not yet acknowledged waits for the client's ACK, which a
keep-alive client sends with its next request: one-record HTTP produce
requests at 35% of the maximum were answered after 2.4 ms, the interval
between two requests of one connection, instead of 0.5 ms (and after 40
ms, the delayed ACK, when no next request came); doc/performance.rst,
run M.
"""

import socket

from twisted.internet import defer, reactor

from test.support.netutil import wait_until
from test.torture.test_torture_abuse import (
    AbuseCase, lumberjack_factory, pravega_factory, relink_factory, styx_site,
)


class ServersTurnNagleOff(AbuseCase):
    """Each server in-process on 127.0.0.1:0 (the abuse tests' harness)."""

    timeout = 30

    @defer.inlineCallbacks
    def no_delay_of_accepted(self, make_factory):
        """TCP_NODELAY of the server's side of one new connection."""
        yield self.serve(make_factory)
        yield self.raw()
        yield wait_until(self.served_connections)
        [accepted] = self.served_connections()
        handle = accepted.transport.getHandle()
        return handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    @defer.inlineCallbacks
    def test_styx_http(self):
        self.assertTrue((yield self.no_delay_of_accepted(styx_site)))

    @defer.inlineCallbacks
    def test_lumberjack(self):
        self.assertTrue((yield self.no_delay_of_accepted(lumberjack_factory)))

    @defer.inlineCallbacks
    def test_pravega(self):
        self.assertTrue((yield self.no_delay_of_accepted(pravega_factory)))

    @defer.inlineCallbacks
    def test_relink(self):
        self.assertTrue((yield self.no_delay_of_accepted(relink_factory)))

    @defer.inlineCallbacks
    def test_reliable(self):
        from streamproto.reliable.server import ReliableStreamFactory
        from streamproto.reliable.session import MemorySessionStore
        sessions = MemorySessionStore(reactor)
        self.addCleanup(sessions.close)
        self.assertTrue((yield self.no_delay_of_accepted(
            lambda store: ReliableStreamFactory(sessions, initial_timeout=5.0))))

    @defer.inlineCallbacks
    def test_a_plain_factory_leaves_it_on(self):
        """The check can fail: Twisted's own default is Nagle on."""
        from twisted.internet.protocol import Factory, Protocol
        self.assertFalse((yield self.no_delay_of_accepted(
            lambda store: Factory.forProtocol(Protocol))))
