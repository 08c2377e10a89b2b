"""L{streamproto.core.endpoints}: endpoint strings read as Twisted reads them."""

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial import unittest

from streamproto.core.endpoints import parse_endpoint, split_fields


class EndpointTests(unittest.SynchronousTestCase):

    def test_tcp(self):
        e = parse_endpoint("tcp:7123:interface=127.0.0.1")
        self.assertEqual((e.kind, e.args, e.port, e.interface), ("tcp", ("7123",), 7123, "127.0.0.1"))
        self.assertEqual(parse_endpoint("tcp:port=80").port, 80)
        self.assertIsNone(parse_endpoint("tcp:7123").interface)

    def test_escaped_colons(self):
        """C{\\:} is a literal colon (an IPv6 interface, a Windows path)."""
        e = parse_endpoint(r"mtls:443:interface=\:\:1:caCerts=/a\:b.pem")
        self.assertEqual(e.options, {"interface": "::1", "caCerts": "/a:b.pem"})
        self.assertEqual(e.port, 443)

    def test_not_a_port(self):
        self.assertIsNone(parse_endpoint("unix:/run/x.sock").port)
        self.assertIsNone(parse_endpoint("tcp:http").port)
        self.assertRaises(ValueError, parse_endpoint, ":80")

    @given(st.lists(st.text(alphabet="ab:\\=", max_size=6), min_size=1, max_size=5))
    def test_split_inverts_escaping(self, fields):
        """Fields escaped and joined with C{:} split back into the same fields."""
        escaped = ":".join(f.replace("\\", "\\\\").replace(":", "\\:") for f in fields)
        self.assertEqual(split_fields(escaped), fields)


class BacklogTests(unittest.SynchronousTestCase):
    """
    L{streamproto.core.tap.server_endpoint} listens with a queue for bursts
    of connections (Twisted's default of 50 made 8,000 connections opened
    250 at a time take 46 s: every dropped SYN waited for a retransmission).
    """

    def test_default_backlog(self):
        from streamproto.core.tap import LISTEN_BACKLOG, with_backlog
        self.assertEqual(with_backlog("tcp:7123:interface=127.0.0.1"),
                         f"tcp:7123:interface=127.0.0.1:backlog={LISTEN_BACKLOG}")
        self.assertEqual(with_backlog("mtls:443:privateKey=k.pem"),
                         f"mtls:443:privateKey=k.pem:backlog={LISTEN_BACKLOG}")

    def test_named_backlog_and_other_kinds_left_alone(self):
        from streamproto.core.tap import with_backlog
        for description in ("tcp:7123:backlog=10", "unix:/run/x.sock", "systemd:domain=INET:index=0"):
            self.assertEqual(with_backlog(description), description)

    def test_listening_port_gets_it(self):
        from twisted.internet.testing import MemoryReactor

        from streamproto.core.tap import LISTEN_BACKLOG, server_endpoint
        reactor = MemoryReactor()
        server_endpoint("tcp:0:interface=127.0.0.1", reactor).listen(object())
        server_endpoint("tcp:0:backlog=7", reactor).listen(object())
        # (port, factory, backlog, interface)
        self.assertEqual([t[2] for t in reactor.tcpServers], [LISTEN_BACKLOG, 7])
