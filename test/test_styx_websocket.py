"""WebSocket produce/consume on /logs/{name}/records, through the HTTP resource."""

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString, wrapClientTLS
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore
from streamproto.styx.resource import make_site
from test.tlsutil import certs


class Client(WebSocketClientProtocol):
    """Sends C{to_send} (then closes, if C{close_after}), records what comes."""

    def __init__(self):
        super().__init__()
        self.received = []
        self.opened = defer.Deferred()
        self.closed = defer.Deferred()

    def onOpen(self):
        self.opened.callback(self)

    def onMessage(self, payload, isBinary):
        self.received.append((payload, isBinary))

    def onClose(self, wasClean, code, reason):
        if not self.opened.called:
            self.opened.errback(Exception(f"refused: {code} {reason}"))
        self.close_reason = reason
        self.closed.callback((wasClean, code))


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
        factory = WebSocketClientFactory(f"{scheme}://127.0.0.1:{port}/logs/log/records{query}",
                                         headers=headers or {})
        factory.protocol = Client
        # autobahn's client gives the closing handshake 1 s by default: too
        # short on a loaded CI machine
        factory.setProtocolOptions(closeHandshakeTimeout=15, openHandshakeTimeout=15)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port)
        if self.tls:
            endpoint = wrapClientTLS(certs().client_options(with_cert=False), endpoint)
        return endpoint.connect(factory)

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
        client.sendMessage(b"one", isBinary=True)
        client.sendMessage(b"two", isBinary=True)
        client.sendClose(1000)
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
            client.sendMessage(b"rec%d" % i, isBinary=True)
        client.sendMessage(b"text too", isBinary=False)
        client.sendClose(1000)
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
        client.sendMessage(b"x" * 1001, isBinary=True)
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
