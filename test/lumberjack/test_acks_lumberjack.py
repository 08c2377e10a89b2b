"""
Lumberjack ACK frames against a store that answers later (L{HeldStore}),
through L{LogStoreSink}: an ACK for sequence N only once the events up to
N are appended; a store that fails closes the connection without an ACK.
"""

import json

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from streamproto.lumberjack.codec import (
    VERSION_2, Ack, FrameDecoder, encode_batch, encode_json_frames, encode_window,
)
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import LogStoreSink
from test.support.heldstore import HeldStore, unreachable


def events(n, start=0):
    return [json.dumps({"n": i}).encode() for i in range(start, start + n)]


class LumberjackAckTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.store = HeldStore()
        self.factory = LumberjackServerFactory(LogStoreSink(self.store, "beats"),
                                               clock=self.clock, keepalive_interval=1000)

    def connect(self):
        proto = self.factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def acks(self, transport):
        decoder = FrameDecoder(validate=False)
        decoder.feed(transport.value())
        frames = decoder.decode()
        self.assertTrue(all(type(f) is Ack for f in frames), frames)
        return [f.seq for f in frames]

    def stored(self):
        log = self.store.inner.get("beats").result
        return log.read(0).result.records()

    def test_ack_after_the_log_opens_and_the_append(self):
        proto, transport = self.connect()
        proto.dataReceived(encode_batch(events(3), 0, first_seq=1))
        self.assertEqual([h.operation for h in self.store.pending()], ["get_or_create"])
        self.assertEqual(self.acks(transport), [])
        self.store.release_all("get_or_create")
        self.assertEqual(len(self.store.appended()), 3)
        self.assertEqual(self.acks(transport), [], "ACK before the append was stored")
        self.store.release_all()
        self.assertEqual(self.acks(transport), [3])
        self.assertEqual(len(self.stored()), 3)

    def test_partial_acks_each_after_its_append(self):
        size = len(events(1)[0])
        self.factory.flush_bytes = size * 2
        proto, transport = self.connect()
        proto.dataReceived(encode_window(4) + encode_json_frames(events(3), first_seq=1))
        self.store.release_all("get_or_create")
        [first] = self.store.pending("append")
        self.assertEqual(len(first.args[0]), 2)
        self.assertEqual(self.acks(transport), [])
        first.release()
        self.assertEqual(self.acks(transport), [2])
        transport.clear()
        proto.dataReceived(encode_json_frames(events(1, 3), first_seq=4))
        self.assertEqual(len(self.store.pending("append")), 1)
        self.assertEqual(self.acks(transport), [])
        self.store.release_all()
        self.assertEqual(self.acks(transport), [4])
        self.assertEqual(len(self.stored()), 4)

    def test_open_fails_closes_without_ack(self):
        proto, transport = self.connect()
        proto.dataReceived(encode_batch(events(2), 0, first_seq=1))
        self.store.fail_all(unreachable())
        self.assertEqual(self.acks(transport), [])
        self.assertTrue(transport.disconnecting)
        self.flushLoggedErrors()

    def test_append_fails_closes_without_ack(self):
        proto, transport = self.connect()
        proto.dataReceived(encode_batch(events(2), 0, first_seq=1))
        self.store.release_all("get_or_create")
        self.store.fail_all(unreachable())
        self.assertEqual(self.acks(transport), [])
        self.assertTrue(transport.disconnecting)
        self.flushLoggedErrors()

    def test_shutdown_acks_only_what_is_stored(self):
        proto, transport = self.connect()
        proto.dataReceived(encode_batch(events(2), 0, first_seq=1))
        self.store.release_all("get_or_create")
        gone = proto.gracefulShutdown()
        self.assertEqual(self.acks(transport), [])
        self.assertFalse(transport.disconnecting)
        self.store.release_all()
        self.assertEqual(self.acks(transport), [2])
        self.assertTrue(transport.disconnecting)
        proto.connectionLost(None)
        self.successResultOf(gone)

    def test_shutdown_with_failing_append_sends_no_ack(self):
        proto, transport = self.connect()
        proto.dataReceived(encode_batch(events(2), 0, first_seq=1))
        self.store.release_all("get_or_create")
        proto.gracefulShutdown()
        self.store.fail_all(unreachable())
        self.assertEqual(self.acks(transport), [])
        self.assertTrue(transport.disconnecting)
        self.flushLoggedErrors()


__all__ = ["LumberjackAckTests", "VERSION_2"]
