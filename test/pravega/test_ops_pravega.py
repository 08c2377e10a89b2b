"""
Operating the Pravega segment store: its metrics, shutdown while a writer
streams (TCP and TLS), and /ready when the log under it fail-stops.
"""

import time

from twisted.internet import defer, reactor, task
from twisted.trial import unittest

from streamproto.core.tls import client_endpoint
from streamproto.log import open_store
from streamproto.pravega import codec, segments, tap
from streamproto.pravega.client import (
    NoSuchSegmentError, SegmentReader, SegmentWriter, ServerError, connect,
)
from test.support.netutil import wait_until
from test.support.test_ops_support import (
    RunningService, Samples, ShutdownWhileStreamingTests, assert_log_failed, sample,
    start_on_faulty_store,
)

SERVER = "pravega-server"
SEG = "ops/stream/0.#epoch.0"
#: no gRPC controller: its port is fixed, and these tests are about the store
NO_CONTROLLER = ["--controller", "none"]


def event(n):
    return b"e%08d" % n


class PravegaOpsTests(ShutdownWhileStreamingTests, unittest.TestCase):
    timeout = 30

    def endpoint(self, port, tls=None):
        return client_endpoint(reactor, "127.0.0.1", port, tls)

    @defer.inlineCallbacks
    def admin(self, port, tls=None):
        proto = yield connect(self.endpoint(port, tls))
        self.addCleanup(self.hang_up, proto)
        return proto

    def hang_up(self, proto):
        if not proto.closed.called:
            proto.transport.loseConnection()
            return proto.closed
        return None

    def writer(self, port, tls=None, **kw):
        w = SegmentWriter(self.endpoint(port, tls), SEG, clock=reactor, **kw)
        self.addCleanup(self.stop_writer, w)
        return w

    def stop_writer(self, w):
        w.stop(None)
        proto = getattr(w, "_setup_proto", None)
        if proto is not None and not proto.closed.called:
            proto.transport.loseConnection()
            return proto.closed
        return None

    @defer.inlineCallbacks
    def stored(self, data):
        """Every event of SEG in the store at C{data} (the server stopped)."""
        store = open_store(data)
        try:
            log = yield store.get(segments.log_name(SEG))
            raw = yield log.read_bytes(log.start_offset, log.end_offset - log.start_offset)
        finally:
            yield store.close()
        events, used = codec.split_events(raw)
        self.assertEqual(used, len(raw))
        return events

    @defer.inlineCallbacks
    def test_metrics_move(self):
        server = RunningService(tap, NO_CONTROLLER + ["--max-outstanding", "4096"])
        yield server.start(self)
        s = Samples(SERVER)
        admin = yield self.admin(server.port)
        yield admin.create_segment(SEG)
        w = self.writer(server.port)
        yield w.write_batch([event(n) for n in range(30)])
        yield w.write_batch([event(n) for n in range(30, 50)])
        self.assertEqual(s.delta("streamproto_records_in_total"), 50)
        self.assertEqual(s.delta("streamproto_acks_sent_total"), 2)   # one DataAppended each
        self.assertEqual(s.delta("streamproto_backpressure_pauses_total"), 0)
        # 64 KiB in one go: more than 4096 bytes unacknowledged pauses reading
        yield w.write_batch([b"x" * 1000] * 64)
        self.assertEqual(s.delta("streamproto_records_in_total"), 114)
        self.assertGreaterEqual(s.delta("streamproto_backpressure_pauses_total"), 1)

        # events out: counted across reads that cut events anywhere
        reader = SegmentReader(self.endpoint(server.port), SEG, read_size=100)
        self.addCleanup(reader.close)
        got = []
        while len(got) < 114:
            got += yield reader.read()
        self.assertEqual(got[:50], [event(n) for n in range(50)])
        self.assertEqual(s.delta("streamproto_records_out_total"), 114)
        self.assertEqual(s.delta("streamproto_connections_total"), 3)

        # errors, by reply name, and by reason for closed connections
        no_such = s.error_delta("NoSuchSegment")
        yield self.assertFailure(admin.segment_info("ops/missing/0"), NoSuchSegmentError)
        self.assertEqual(s.error_delta("NoSuchSegment") - no_such, 1)
        bad = s.error_delta("protocol_error")
        victim = yield self.admin(server.port)
        victim.transport.write(b"\x00\x00\x00\x63garbage!")     # unknown type 99
        yield victim.closed
        self.assertEqual(s.error_delta("protocol_error") - bad, 1)

    @defer.inlineCallbacks
    def shutdown_while_streaming(self, listen=None, tls=None):
        """
        The service stops while a writer streams: the appends received are
        made durable and acknowledged, then the connection closes; the store
        holds exactly the acknowledged events, in order.
        """
        server = RunningService(tap, NO_CONTROLLER, listen=listen)
        yield server.start(self)
        admin = yield self.admin(server.port, tls)
        yield admin.create_segment(SEG)
        yield self.hang_up(admin)
        w = self.writer(server.port, tls, max_retries=2, retry_delay=0.05)
        state = {"next": 0}

        def send_more():
            if w.error is None and w.pending < 5000:
                first = state["next"]
                state["next"] += 100
                w.write_batch([event(n) for n in range(first, first + 100)]) \
                    .addErrback(lambda f: None)
        pump = task.LoopingCall(send_more)
        pump.start(0.002)
        self.addCleanup(lambda: pump.running and pump.stop())
        yield wait_until(lambda: w.acked_event_number >= 2000)
        started = time.monotonic()
        yield server.stop()
        # drained by the protocol, not aborted at the 5 s deadline
        self.assertLess(time.monotonic() - started, 4.0)
        pump.stop()
        yield wait_until(lambda: w.error is not None)   # no server to reconnect to
        acked = w.acked_event_number
        self.assertGreaterEqual(acked, 2000)
        self.assertIsInstance(w.error, ConnectionError)
        stored = yield self.stored(server.data)
        self.assertEqual(stored, [event(n) for n in range(acked + 1)])


class ReadinessTests(unittest.TestCase):
    """/ready turns 503 once a segment's log fail-stops; /health stays 200."""

    timeout = 30

    @defer.inlineCallbacks
    def test_ready_flips_when_the_log_fail_stops(self):
        import treq

        io, port, base = yield start_on_faulty_store(self, tap, NO_CONTROLLER)
        endpoint = client_endpoint(reactor, "127.0.0.1", port, None)
        admin = yield connect(endpoint)
        self.addCleanup(lambda: admin.closed.called or admin.transport.loseConnection())
        yield admin.create_segment(SEG)
        w = SegmentWriter(endpoint, SEG, clock=reactor)
        self.addCleanup(w.stop, None)
        yield w.write_batch([event(n) for n in range(3)])
        r = yield treq.get(base + "/ready", persistent=False)
        self.assertEqual(r.code, 200)
        yield r.content()

        errors = sample("streamproto_protocol_errors_total", server=SERVER, code="ErrorMessage")
        io.fail_fsync = True
        e = yield self.assertFailure(w.write(event(3)), ServerError)
        self.assertIn("restart the server", str(e))
        self.assertEqual(sample("streamproto_protocol_errors_total", server=SERVER,
                                code="ErrorMessage") - errors, 1)
        yield assert_log_failed(self, base, segments.log_name(SEG))
        admin.transport.loseConnection()
        yield admin.closed
        proto = getattr(w, "_setup_proto", None)
        if proto is not None and not proto.closed.called:
            yield proto.closed
