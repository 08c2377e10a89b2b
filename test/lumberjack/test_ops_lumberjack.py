"""Operating the Lumberjack server: its metrics, and shutdown while a writer streams."""

import json
import struct
import time

from twisted.internet import defer
from twisted.trial import unittest

from streamproto.lumberjack import tap
from streamproto.lumberjack.codec import encode_batch, encode_json_frames, encode_window
from test.support.netutil import connect, wait_until
from test.support.test_ops_support import (
    RunningService, Samples, assert_log_failed, sample, start_on_faulty_store, stored_records,
)

SERVER = "lumberjack-server"


def events(n, start=0):
    return [json.dumps({"n": i}).encode() for i in range(start, start + n)]


def acks(data):
    """The sequence numbers of the ACK frames in C{data} (6 bytes each), keepalives left out."""
    seqs = [struct.unpack_from(">I", data, i + 2)[0] for i in range(0, len(data) - 5, 6)
            if data[i + 1] == 0x41]
    return [seq for seq in seqs if seq]


class LumberjackOpsTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def stored(self, data):
        records = yield stored_records(data, "lumberjack")
        return [json.loads(r)["event"]["n"] for r in records]

    @defer.inlineCallbacks
    def test_metrics_move(self):
        server = RunningService(tap)
        yield server.start(self)
        s = Samples(SERVER)
        client = yield connect(server.port)
        client.transport.write(encode_batch(events(30)) + encode_batch(events(20, 30)))
        yield wait_until(lambda: len(acks(client.received)) >= 2)
        self.assertEqual(acks(client.received), [30, 20])
        self.assertEqual(s.delta("streamproto_records_in_total"), 50)
        self.assertEqual(s.delta("streamproto_acks_sent_total"), 2)
        # the pipelined second batch waited for the first one's fsync at least once
        self.assertGreaterEqual(s.delta("streamproto_backpressure_pauses_total"), 1)
        self.assertEqual(s.delta("streamproto_connections_total"), 1)
        errors = sample("streamproto_protocol_errors_total", server=SERVER,
                        code="unexpected_frame")
        client.transport.write(b"2A\x00\x00\x00\x01")  # an ack from a writer
        yield client.closed
        self.assertEqual(s.error_delta("unexpected_frame", errors), 1)

    def test_shutdown_acks_what_arrived_then_closes(self):
        return self.shutdown_mid_batch()

    def test_shutdown_acks_what_arrived_then_closes_mtls(self):
        from test.support.tlsutil import certs
        return self.shutdown_mid_batch(certs().server_endpoint(),
                                       certs().client_options(with_cert=True))

    @defer.inlineCallbacks
    def shutdown_mid_batch(self, listen=None, tls=None):
        """
        Stopped while a writer is in the middle of its fourth batch: the
        events of that batch received so far are stored and acked (a
        partial ack), then the connection closes; every acked event is in
        the store after a restart, and nothing was acked that is not.
        """
        server = RunningService(tap, listen=listen)
        yield server.start(self)
        s = Samples(SERVER)
        client = yield connect(server.port, tls=tls)
        batches = [events(50, 50 * k) for k in range(3)]

        def next_batch(_data):
            done = len(acks(client.received))
            if done < len(batches) and done == client.sent:
                client.sent += 1
                client.transport.write(encode_batch(batches[done]))
        client.sent = 0
        client.on_data = next_batch
        next_batch(b"")
        yield wait_until(lambda: len(acks(client.received)) == 3)
        # half of a window of 40: the rest never comes
        bytes_in = sample("streamproto_received_bytes_total", server=SERVER)
        half = encode_window(40) + encode_json_frames(events(20, 150), first_seq=1)
        client.transport.write(half)
        yield wait_until(lambda: sample("streamproto_received_bytes_total", server=SERVER)
                         >= bytes_in + len(half))
        started = time.monotonic()
        yield server.stop()
        yield client.closed
        # closed by the protocol, not aborted at the 5 s deadline (a TLS
        # close needs the peer's close_notify read)
        self.assertLess(time.monotonic() - started, 4.0)
        self.assertEqual(acks(client.received), [50, 50, 50, 20])
        self.assertEqual(s.delta("streamproto_records_in_total"), 170)
        self.assertEqual((yield self.stored(server.data)), list(range(170)))

    @defer.inlineCallbacks
    def test_shutdown_between_batches_closes(self):
        server = RunningService(tap)
        yield server.start(self)
        client = yield connect(server.port)
        client.transport.write(encode_batch(events(5)))
        yield wait_until(lambda: acks(client.received) == [5])
        yield server.stop()
        yield client.closed
        self.assertEqual(acks(client.received), [5])
        self.assertEqual((yield self.stored(server.data)), list(range(5)))


class ReadinessTests(unittest.TestCase):
    """/ready turns 503 once the log under a server fail-stops; /health stays 200."""

    timeout = 30

    @defer.inlineCallbacks
    def test_ready_flips_when_the_log_fail_stops(self):
        import treq

        io, port, base = yield start_on_faulty_store(self, tap)

        client = yield connect(port)
        client.transport.write(encode_batch(events(3)))
        yield wait_until(lambda: acks(client.received) == [3])
        r = yield treq.get(base + "/ready", persistent=False)
        self.assertEqual(r.code, 200)
        yield r.content()

        io.fail_fsync = True
        client.transport.write(encode_batch(events(2, 3)))
        yield client.closed            # storing failed: closed without an ack
        self.assertEqual(acks(client.received), [3])
        yield assert_log_failed(self, base, "lumberjack")


class GracefulShutdownUnitTests(unittest.SynchronousTestCase):
    """gracefulShutdown against a sink the test completes by hand."""

    def setUp(self):
        from twisted.internet.address import IPv4Address
        from twisted.internet.task import Clock
        from twisted.internet.testing import StringTransport

        from streamproto.lumberjack.server import LumberjackServerFactory

        self.writes = []

        class HeldSink:
            def write(sink, connection, payloads):
                d = defer.Deferred()
                self.writes.append((d, list(payloads)))
                return d
        self.factory = LumberjackServerFactory(HeldSink(), clock=Clock())
        self.proto = self.factory.buildProtocol(None)
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 5555))
        self.proto.makeConnection(self.transport)

    def lose(self):
        from twisted.internet.error import ConnectionDone
        from twisted.python.failure import Failure
        self.proto.connectionLost(Failure(ConnectionDone()))

    def test_batch_with_the_sink_is_acked_then_closed(self):
        self.proto.dataReceived(encode_batch(events(10)))
        self.assertEqual(len(self.writes), 1)
        done = self.proto.gracefulShutdown()
        self.assertNoResult(done)
        self.proto.dataReceived(encode_batch(events(5, 10)))   # after the shutdown began
        self.assertEqual(self.transport.value(), b"")
        self.assertFalse(self.transport.disconnecting)
        stored = self.writes[0][0]
        stored.callback(None)
        self.successResultOf(stored)        # nothing raised on the way
        self.assertEqual(acks(self.transport.value()), [10])
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(len(self.writes), 1)                   # the late batch: not stored
        self.lose()
        self.successResultOf(done)

    def test_failed_store_closes_without_ack(self):
        self.proto.dataReceived(encode_batch(events(3)))
        done = self.proto.gracefulShutdown()
        self.writes[0][0].errback(OSError("disk gone"))
        self.assertEqual(self.transport.value(), b"")
        self.assertTrue(self.transport.disconnecting)
        self.lose()
        self.successResultOf(done)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)

    def test_nothing_pending_closes_at_once(self):
        done = self.proto.gracefulShutdown()
        self.assertTrue(self.transport.disconnecting)
        self.lose()
        self.successResultOf(done)
        self.assertEqual(self.writes, [])
