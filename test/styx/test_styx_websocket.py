"""WebSocket produce/consume on /logs/{name}/records, through the HTTP resource."""

import struct

from twisted.internet import defer, reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString, wrapClientTLS
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage

from streamproto.log import LogConfig, MemoryLogStore
from streamproto.styx.resource import make_site
from streamproto.styx.websocket import ProduceProtocol
from test.support.tlsutil import certs
from test.support.wsclient import connect


class WebSocketTests(unittest.TestCase):
    timeout = 20
    tls = False

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore()
        self.log = yield self.store.create("log", LogConfig(max_record_size=1000))
        description = certs().ssl_endpoint() if self.tls else "tcp:0:interface=127.0.0.1"
        self.port = yield serverFromString(reactor, description).listen(
            make_site(self.store, timeout=10))
        self.addCleanup(self.port.stopListening)

    def start(self, query="", headers=None):
        """@return: Deferred firing with the connected (not yet open) client."""
        port = self.port.getHost().port
        scheme = "wss" if self.tls else "ws"
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        if self.tls:
            endpoint = wrapClientTLS(certs().client_options(with_cert=False), endpoint)
        return connect(endpoint, f"{scheme}://127.0.0.1:{port}/logs/log/records{query}",
                       headers)

    @defer.inlineCallbacks
    def connect(self, query="", headers=None):
        proto = yield self.start(query, headers)
        yield proto.opened
        return proto

    @defer.inlineCallbacks
    def test_close_answered_only_when_durable(self):
        """While appends are not durable the server holds its Close back."""
        pending = []
        original = self.log.append

        def slow_append(records, attributes=None):
            d = defer.Deferred()
            pending.append((d, records))
            return d
        self.log.append = slow_append
        client = yield self.connect(headers={"X-HTTP-Method-Override": "POST"})
        client.send(b"one")
        client.send(b"two")
        client.close(1000)
        yield deferLater(0.1)
        self.assertFalse(client.closed.called, client.close_reason if client.closed.called
                         else None)
        self.assertEqual([r for _, rs in pending for r in rs], [b"one", b"two"])
        for d, records in pending:
            d.callback(original(records).result)
        was_clean, code = yield client.closed
        self.assertEqual((was_clean, code), (True, 1000))

    @defer.inlineCallbacks
    def test_produce_durable_at_close(self):
        """One record per message; the server answers the Close only once
        they are all in the log."""
        client = yield self.connect(headers={"X-HTTP-Method-Override": "POST"})
        for i in range(300):
            client.send(b"rec%d" % i)
        client.send(b"text too", binary=False)
        client.close(1000)
        was_clean, code = yield client.closed
        self.assertEqual((was_clean, code), (True, 1000), client.close_reason)
        self.assertEqual(self.log._records, [b"rec%d" % i for i in range(300)] + [b"text too"])
        self.assertEqual(client.received, [])  # like the reference: no acks

    @defer.inlineCallbacks
    def test_consume_then_close(self):
        self.log.append([b"a", b"b", b"c", b"d"])
        client = yield self.connect("?whence=start&position=1&count=2")
        was_clean, code = yield client.closed
        self.assertEqual(code, 1000)
        self.assertEqual(client.received, [(b"b", True), (b"c", True)])

    @defer.inlineCallbacks
    def test_consume_to_end(self):
        self.log.append([b"x%d" % i for i in range(1000)])
        client = yield self.connect()
        yield client.closed
        self.assertEqual([p for p, _ in client.received], [b"x%d" % i for i in range(1000)])

    @defer.inlineCallbacks
    def test_consume_follow(self):
        client = yield self.connect("?follow=true&count=3")
        self.log.append([b"one"])
        self.log.append([b"two", b"three", b"four"])
        yield client.closed
        self.assertEqual([p for p, _ in client.received], [b"one", b"two", b"three"])

    @defer.inlineCallbacks
    def test_record_too_large(self):
        """A message above max_record_size: Close 1009, nothing appended."""
        client = yield self.connect(headers={"X-HTTP-Method-Override": "POST"})
        client.send(b"x" * 1001)
        _, code = yield client.closed
        self.assertEqual(code, 1009)
        self.assertEqual(self.log._records, [])

    @defer.inlineCallbacks
    def test_bad_position_refused(self):
        """An out-of-range position is refused before the upgrade (400)."""
        proto = yield self.start("?position=5")
        error = yield self.assertFailure(proto.opened, Exception)
        self.assertIn("400", str(error))
        yield proto.closed


class WebSocketTLSTests(WebSocketTests):
    tls = True


def deferLater(seconds):
    from twisted.internet.task import deferLater as later
    return later(reactor, seconds, lambda: None)


class _Raw(Protocol):
    """Sends C{request}, keeps what comes back until the server closes."""

    def __init__(self, request):
        self.request = request
        self.received = b""
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.done.callback(self.received)


HANDSHAKE = (b"Host: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


class HandshakeTests(unittest.TestCase):
    """The opening handshake, on the wire."""

    timeout = 20

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore()
        self.log = yield self.store.create("log", LogConfig(max_record_size=1000))
        self.port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            make_site(self.store, timeout=10))
        self.addCleanup(self.port.stopListening)

    def raw(self, request):
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port)
        d = endpoint.connect(Factory.forProtocol(lambda: _Raw(request)))
        return d.addCallback(lambda p: p.done)

    @defer.inlineCallbacks
    def test_other_version_refused(self):
        """RFC 6455 4.4: 426 naming the version we speak."""
        response = yield self.raw(b"GET /logs/log/records HTTP/1.0\r\n" + HANDSHAKE
                                  + b"Sec-WebSocket-Version: 8\r\n\r\n")
        head = response.split(b"\r\n\r\n")[0].lower()
        self.assertIn(b" 426 ", head.split(b"\r\n")[0])
        self.assertIn(b"\r\nsec-websocket-version: 13", head)

    @defer.inlineCallbacks
    def test_missing_key_refused(self):
        response = yield self.raw(
            b"GET /logs/log/records HTTP/1.0\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.assertIn(b" 400 ", response.split(b"\r\n")[0])
        self.assertIn(b"Sec-WebSocket-Key", response)

    @defer.inlineCallbacks
    def test_frames_right_behind_the_handshake(self):
        """A client that does not wait for the 101: its frames are not lost."""
        client = Connection(ConnectionType.CLIENT)
        frames = (client.send(BytesMessage(b"early")) + client.send(BytesMessage(b"bird"))
                  + client.send(CloseConnection(1000)))
        response = yield self.raw(
            b"GET /logs/log/records HTTP/1.1\r\nX-HTTP-Method-Override: POST\r\n" + HANDSHAKE
            + b"Sec-WebSocket-Version: 13\r\n\r\n" + frames)
        head, _, rest = response.partition(b"\r\n\r\n")
        self.assertIn(b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=", head)
        self.assertEqual(rest, b"\x88\x02" + struct.pack(">H", 1000))
        self.assertEqual(self.log._records, [b"early", b"bird"])


class StreamTests(unittest.SynchronousTestCase):
    """One stream on a fake transport and clock: fragments, bounds, idle peers."""

    def setUp(self):
        self.clock = Clock()
        self.store = MemoryLogStore(self.clock)
        self.log = self.successResultOf(
            self.store.create("log", LogConfig(max_record_size=1000)))
        self.transport = StringTransport()
        self.client = Connection(ConnectionType.CLIENT)

    def produce(self, **options):
        stream = ProduceProtocol(self.log, self.clock, timeout=10, **options)
        stream.makeConnection(self.transport)
        return stream

    def server_events(self):
        """What the server sent since the last call, as wsproto events."""
        self.client.receive_data(self.transport.value())
        self.transport.clear()
        return list(self.client.events())

    def test_fragments_make_one_record(self):
        stream = self.produce()
        for part, last in ((b"ab", False), (b"cd", False), (b"ef", True)):
            stream.dataReceived(self.client.send(BytesMessage(part, message_finished=last)))
        stream.dataReceived(self.client.send(TextMessage("\u00e9t\u00e9")))
        self.clock.advance(0)
        self.assertEqual(self.log._records, [b"abcdef", "\u00e9t\u00e9".encode()])

    def test_fragments_too_large_refused_from_their_header(self):
        """
        The announced sizes of a message's frames add up past the log's
        max_record_size: Close 1009 before the payload arrives.
        """
        stream = self.produce()
        stream.dataReceived(self.client.send(BytesMessage(b"x" * 600, message_finished=False)))
        last = bytes(self.client.send(BytesMessage(b"y" * 600)))
        stream.dataReceived(last[:8])    # header, length, mask: no payload
        [close] = self.server_events()
        self.assertEqual(close.code, 1009)
        self.assertTrue(self.transport.disconnecting)
        stream.dataReceived(last[8:])
        self.clock.advance(0)
        self.assertEqual(self.log._records, [])

    def test_ping_answered(self):
        self.produce().dataReceived(self.client.send(Ping(b"hi")))
        [pong] = self.server_events()
        self.assertIsInstance(pong, Pong)
        self.assertEqual(pong.payload, b"hi")

    def test_silent_peer_pinged_then_dropped(self):
        stream = self.produce()
        self.clock.advance(9)
        stream.dataReceived(self.client.send(Pong(b"")))   # anything will do
        self.clock.advance(9)
        self.assertEqual(self.server_events(), [])
        self.clock.advance(1)                                # 10 s quiet
        [ping] = self.server_events()
        self.assertIsInstance(ping, Ping)
        self.clock.advance(9.9)
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(0.1)
        self.assertTrue(self.transport.disconnected)         # aborted

    def test_answered_ping_keeps_the_peer(self):
        """A peer that answers every Ping (and says nothing else) stays."""
        stream = self.produce()
        for _ in range(5):
            self.clock.advance(10)
            [ping] = self.server_events()
            self.assertIsInstance(ping, Ping)
            stream.dataReceived(self.client.send(ping.response()))
        self.assertFalse(self.transport.disconnecting)
        self.assertFalse(self.transport.disconnected)

    def test_our_pause_is_not_the_peers_silence(self):
        """A producer we stopped reading (the disk is behind) is not pinged."""
        held = []
        self.log.append = lambda records, attributes=None: held.append(records) or Deferred()
        stream = self.produce(max_pending_bytes=5)
        stream.dataReceived(self.client.send(BytesMessage(b"123456")))
        self.clock.advance(0)
        self.assertEqual(self.transport.producerState, "paused")
        self.clock.advance(100)
        self.assertEqual(self.server_events(), [])
        self.assertFalse(self.transport.disconnecting)

    def test_close_held_then_answered(self):
        """The closing handshake is the ack: answered once the append is durable."""
        held = []
        self.log.append = lambda records, attributes=None: held.append(Deferred()) or held[-1]
        stream = self.produce()
        stream.dataReceived(self.client.send(BytesMessage(b"r")))
        stream.dataReceived(self.client.send(CloseConnection(1000)))
        self.assertEqual(self.server_events(), [])
        self.clock.advance(100)                 # our disk, not the peer: no timeout
        self.assertFalse(self.transport.disconnecting)
        held[0].callback(None)
        [close] = self.server_events()
        self.assertEqual(close.code, 1000)
        self.assertTrue(self.transport.disconnecting)
