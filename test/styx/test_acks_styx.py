"""
Styx acknowledgements against a store that answers later (L{HeldStore}):
the single-record POST, log creation, the styx/0 producer's Acks.  No 2xx
and no Ack before the append it stands for is stored; a store that fails
is the protocol's error, never an acknowledgement.  (The batch produce is
covered by test_styx_http's LateOpeningStoreTests; WebSocket produce by
test_acks_styx_websocket.)
"""

import json

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore
from streamproto.styx.codec import Ack, ErrorCode, ErrorMessage, decode_all, encode_records
from streamproto.styx.resource import make_site
from streamproto.styx.stream import ProducerStream
from test.support.heldstore import HeldStore, unreachable


class _SiteBase(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.memory = MemoryLogStore(self.clock)
        self.memory.create("log", LogConfig(max_record_size=100))
        self.memory.get("log").result.append([b"older"])
        self.store = HeldStore(self.memory)
        self.site = make_site(self.store, timeout=5, clock=self.clock)
        self.site.reactor = self.clock

    def request(self, head, body=b""):
        channel = self.site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(head + body)
        self.addCleanup(lambda: getattr(transport, "protocol", channel).connectionLost(None))
        return transport

    def response(self, transport):
        """(status, JSON body) of a finished HTTP answer, None while there is none."""
        if not transport.value():
            return None
        head, _, body = transport.value().partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"chunked" in head.lower():
            body = body.split(b"\r\n", 2)[1]
        return status, json.loads(body)


class SingleRecordTests(_SiteBase):
    """POST /logs/NAME/records with application/octet-stream: one record."""

    def post(self, record=b"new"):
        return self.request(b"POST /logs/log/records HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/octet-stream\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(record), record)

    def test_answer_after_the_append(self):
        transport = self.post()
        self.assertEqual([h.operation for h in self.store.pending()], ["get"])
        self.assertIsNone(self.response(transport))
        self.store.release_all("get")
        self.clock.advance(0)  # the turn's records go to the log together
        self.assertEqual(self.store.appended(), [b"new"])
        self.assertIsNone(self.response(transport), "answered before the append was stored")
        self.store.release_all()
        self.assertEqual(self.response(transport), (200, {"position": 2, "count": 1}))

    def test_store_unreachable_at_get(self):
        transport = self.post()
        self.store.fail_all(unreachable())
        status, body = self.response(transport)
        self.assertGreaterEqual(status, 400)
        self.assertEqual(body["code"], "log_not_available")
        self.assertEqual(self.store.appended(), [])

    def test_append_fails(self):
        transport = self.post()
        self.store.release_all("get")
        self.clock.advance(0)
        self.store.fail_all(unreachable())
        status, body = self.response(transport)
        self.assertGreaterEqual(status, 400)
        self.assertEqual(body["code"], "log_not_available")


class CreateLogTests(_SiteBase):
    """POST /logs answers the new log only once the store created it."""

    def create(self):
        body = b"name=fresh"
        return self.request(b"POST /logs HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/x-www-form-urlencoded\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body), body)

    def test_answer_after_the_create(self):
        transport = self.create()
        self.assertEqual([(h.operation, h.name) for h in self.store.pending()],
                         [("create", "fresh")])
        self.assertIsNone(self.response(transport))
        self.store.release_all()
        status, body = self.response(transport)
        self.assertEqual((status, body["name"]), (200, "fresh"))
        self.assertIn("fresh", self.memory.names())

    def test_create_fails(self):
        transport = self.create()
        self.store.fail_all(unreachable())
        status, body = self.response(transport)
        self.assertGreaterEqual(status, 400)
        self.assertEqual(body["code"], "log_not_available")


class StyxZeroProducerTests(_SiteBase):
    """The styx/0 upgrade (POST): the 101 after the log is open, Acks after appends."""

    def upgrade(self):
        return self.request(b"POST /logs/log/records HTTP/1.1\r\nHost: x\r\n"
                            b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")

    def messages(self, transport):
        return decode_all(transport.value().partition(b"\r\n\r\n")[2])

    def test_upgrade_waits_for_the_log(self):
        transport = self.upgrade()
        self.assertEqual(transport.value(), b"", "101 before the log was open")
        self.store.release_all("get")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 101 "))
        self.assertIsInstance(transport.protocol, ProducerStream)
        transport.protocol.dataReceived(encode_records([b"a", b"b"]))
        self.assertEqual(self.store.appended(), [b"a", b"b"])
        self.clock.advance(0)
        self.assertEqual(self.messages(transport), [], "Ack before the append was stored")
        self.store.release_all()
        self.clock.advance(0)
        self.assertEqual(self.messages(transport), [Ack(3, 2)])

    def test_store_unreachable_at_get(self):
        transport = self.upgrade()
        self.store.fail_all(unreachable())
        status, body = self.response(transport)
        self.assertGreaterEqual(status, 400)
        self.assertEqual(body["code"], "log_not_available")

    def test_append_fails(self):
        transport = self.upgrade()
        self.store.release_all("get")
        transport.protocol.dataReceived(encode_records([b"a"]))
        self.store.fail_all(unreachable())
        self.clock.advance(0)
        self.assertEqual(self.messages(transport),
                         [ErrorMessage(ErrorCode.LOG_NOT_AVAILABLE)])
        self.flushLoggedErrors()

    def test_later_append_after_a_failed_one_is_not_counted(self):
        """
        Acks count the stream's records from its first: when an append
        fails and a later one (of the same stream) is stored all the same
        (a JetStream store whose answer timed out sends the next message),
        an Ack counting the later records would tell the client its
        earlier, lost, records are stored.
        """
        transport = self.upgrade()
        self.store.release_all("get")
        stream = transport.protocol
        stream.dataReceived(encode_records([b"a", b"b"]))
        stream.dataReceived(encode_records([b"c"]))
        first, second = self.store.pending("append")
        first.fail(unreachable())
        second.release()
        self.clock.advance(0)
        acks = [m for m in self.messages(transport) if isinstance(m, Ack)]
        self.assertEqual([a for a in acks if a.count], [], "lost records acknowledged")
        self.assertIn(ErrorMessage(ErrorCode.LOG_NOT_AVAILABLE), self.messages(transport))
        self.flushLoggedErrors()
