"""
WebSocket produce against a store whose opens and appends answer later
(L{HeldStore}), over real sockets as test_styx_websocket: the 101 only
once the log is open, the closing handshake (WebSocket produce's only
acknowledgement) only once every record received is stored, 1011 when an
append fails.
"""

from twisted.internet import defer, reactor, task
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore
from streamproto.styx.resource import make_site
from test.support.heldstore import HeldStore, unreachable
from test.support.wsclient import Refused, connect

POST = {"X-HTTP-Method-Override": "POST"}


def turn(seconds=0.01):
    return task.deferLater(reactor, seconds, lambda: None)


class WebSocketProduceAckTests(unittest.TestCase):
    timeout = 20

    @defer.inlineCallbacks
    def setUp(self):
        self.memory = MemoryLogStore()
        yield self.memory.create("log", LogConfig(max_record_size=1000))
        self.store = HeldStore(self.memory)
        self.port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            make_site(self.store, timeout=10))
        self.addCleanup(self.port.stopListening)

    @defer.inlineCallbacks
    def until(self, condition):
        for _ in range(500):
            if condition():
                return
            yield turn()
        self.fail("timed out")

    @defer.inlineCallbacks
    def open(self):
        port = self.port.getHost().port
        client = yield connect(TCP4ClientEndpoint(reactor, "127.0.0.1", port),
                               f"ws://127.0.0.1:{port}/logs/log/records", POST)
        self.addCleanup(lambda: client.transport.abortConnection())
        yield self.until(lambda: self.store.pending("get"))
        yield turn(0.05)
        self.assertFalse(client.opened.called, "101 before the log was open")
        return client

    @defer.inlineCallbacks
    def test_close_answered_once_stored(self):
        client = yield self.open()
        self.store.release_all("get")
        yield client.opened
        client.send(b"one")
        client.send(b"two")
        client.close(1000)
        yield self.until(lambda: len(self.store.appended()) == 2)
        yield turn(0.05)
        self.assertFalse(client.closed.called, "Close answered before the append was stored")
        self.store.release_all()
        self.assertEqual((yield client.closed), (True, 1000))
        log = yield self.memory.get("log")
        self.assertEqual((yield log.read(0)).records(), [b"one", b"two"])

    @defer.inlineCallbacks
    def test_failed_append_is_1011(self):
        client = yield self.open()
        self.store.release_all("get")
        yield client.opened
        client.send(b"one")
        client.close(1000)
        yield self.until(lambda: self.store.pending("append"))
        self.store.fail_all(unreachable())
        _, code = yield client.closed
        self.assertEqual(code, 1011)
        self.flushLoggedErrors()

    @defer.inlineCallbacks
    def test_store_unreachable_at_open_is_refused(self):
        client = yield self.open()
        self.store.fail_all(unreachable())
        error = yield self.assertFailure(client.opened, Refused)
        self.assertIn(b"log_not_available", error.body)
