"""The Lumberjack server protocol over a fake transport and a fake clock."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from test.support.logutil import error_lines
from streamproto.log import LogConfig, MemoryLogStore
from streamproto.lumberjack.codec import (
    VERSION_1, VERSION_2, Ack, FrameDecoder, encode_ack, encode_batch, encode_compressed,
    encode_json, encode_json_frames, encode_key_values, encode_window,
)
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import ConnectionInfo, IEventSink, LogStoreSink


@implementer(IEventSink)
class ControlledSink:
    """A sink whose Deferreds the test fires."""

    def __init__(self):
        self.calls = []  # (connection, events, deferred)

    def write(self, connection, events):
        d = Deferred()
        self.calls.append((connection, list(events), d))
        return d

    def fire_all(self):
        for _, _, d in self.calls:
            if not d.called:
                d.callback(None)


@implementer(IEventSink)
class FailingSink:
    def write(self, connection, events):
        return fail(OSError("disk on fire"))


@implementer(IEventSink)
class ImmediateSink:
    def __init__(self):
        self.events = []

    def write(self, connection, events):
        self.events.extend(events)
        return succeed(None)


def acks(data):
    d = FrameDecoder(validate=False)
    d.feed(data)
    frames = d.decode()
    assert all(type(f) is Ack for f in frames), frames
    return [(f.version, f.seq) for f in frames]


def payloads(n, start=0):
    return [json.dumps({"n": i, "message": "x" * 20}).encode() for i in range(start, start + n)]


class LogCapture:
    def __init__(self, case):
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        case.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def warnings(self):
        return [e for e in self.events if e.get("log_level") in (LogLevel.warn, LogLevel.error)]

    def codes(self):
        return [e.get("code") for e in self.warnings()]


class ServerTestMixin:
    def make(self, sink=None, **kwargs):
        self.clock = Clock()
        self.sink = sink if sink is not None else ControlledSink()
        self.factory = LumberjackServerFactory(self.sink, clock=self.clock, **kwargs)
        proto = self.factory.buildProtocol(None)
        transport = StringTransport(peerAddress=_Addr("10.1.2.3", 4567))
        proto.makeConnection(transport)
        return proto, transport

    def take(self, transport):
        data = transport.value()
        transport.clear()
        return acks(data)


class _Addr:
    def __init__(self, host, port):
        self.host = host
        self.port = port


class BatchTests(ServerTestMixin, SynchronousTestCase):
    def test_ack_highest_seq_after_sink_fires(self):
        proto, transport = self.make()
        proto.dataReceived(encode_batch(payloads(3), 0, first_seq=41))
        [(conn, events, d)] = self.sink.calls
        self.assertEqual(events, payloads(3))
        self.assertEqual(conn.peer, "10.1.2.3:4567")
        # durable first, acked second
        self.assertEqual(transport.value(), b"")
        self.assertEqual(transport.producerState, "paused")
        d.callback(None)
        self.assertEqual(self.take(transport), [(VERSION_2, 43)])
        self.assertEqual(transport.producerState, "producing")

    def test_window_one(self):
        proto, transport = self.make(sink=ImmediateSink())
        data = b"".join(encode_batch([p], 0, first_seq=i + 1) for i, p in enumerate(payloads(3)))
        proto.dataReceived(data)
        self.assertEqual(self.take(transport), [(VERSION_2, 1), (VERSION_2, 2), (VERSION_2, 3)])

    def test_window_zero_gets_ack_zero(self):
        proto, transport = self.make()
        proto.dataReceived(encode_window(0))
        self.assertEqual(self.take(transport), [(VERSION_2, 0)])
        self.assertEqual(self.sink.calls, [])
        # and the connection goes on normally
        proto.dataReceived(encode_batch(payloads(1), 3))
        self.sink.fire_all()
        self.assertEqual(self.take(transport), [(VERSION_2, 1)])

    def test_pipelined_batches_acked_in_order(self):
        proto, transport = self.make()
        data = encode_batch(payloads(2), 3) + encode_batch(payloads(3, 2), 3)
        proto.dataReceived(data)
        # the second batch waits in the buffer until the first is durable
        self.assertEqual(len(self.sink.calls), 1)
        self.sink.calls[0][2].callback(None)
        self.assertEqual(self.take(transport), [(VERSION_2, 2)])
        self.assertEqual(len(self.sink.calls), 2)
        self.assertEqual(self.sink.calls[1][1], payloads(3, 2))
        self.assertEqual(transport.producerState, "paused")
        self.sink.calls[1][2].callback(None)
        self.assertEqual(self.take(transport), [(VERSION_2, 3)])
        self.assertEqual(transport.producerState, "producing")

    def test_compressed_frame_spanning_batches(self):
        # one compressed frame holding two whole batches (window frames included)
        inner = (encode_window(2) + encode_json_frames(payloads(2))
                 + encode_window(1) + encode_json_frames(payloads(1, 2), first_seq=7))
        proto, transport = self.make(sink=ImmediateSink())
        proto.dataReceived(encode_compressed(inner))
        self.assertEqual(self.take(transport), [(VERSION_2, 2), (VERSION_2, 7)])
        self.assertEqual(self.sink.events, payloads(3))

    def test_window_across_several_compressed_frames(self):
        proto, transport = self.make(sink=ImmediateSink())
        data = (encode_window(4) + encode_compressed(encode_json_frames(payloads(2)))
                + encode_compressed(encode_json_frames(payloads(2, 2), first_seq=3)))
        for i in range(len(data)):  # split across reads, a byte at a time
            proto.dataReceived(data[i:i + 1])
        self.assertEqual(self.take(transport), [(VERSION_2, 4)])
        self.assertEqual(self.sink.events, payloads(4))

    def test_v1_key_value_batch_acked_with_v1(self):
        proto, transport = self.make(sink=ImmediateSink())
        proto.dataReceived(encode_window(2, VERSION_1) + encode_key_values(1, {"line": "a"})
                           + encode_key_values(2, {"line": "b"}))
        self.assertEqual(self.take(transport), [(VERSION_1, 2)])
        self.assertEqual([json.loads(e) for e in self.sink.events], [{"line": "a"}, {"line": "b"}])

    def test_counting_across_batches(self):
        # pylogbeat numbers across batches: the ack must be the seq, not the count
        proto, transport = self.make(sink=ImmediateSink())
        proto.dataReceived(encode_batch(payloads(2), 0, first_seq=1)
                           + encode_batch(payloads(2), 0, first_seq=3))
        self.assertEqual(self.take(transport), [(VERSION_2, 2), (VERSION_2, 4)])


class PartialAndKeepaliveTests(ServerTestMixin, SynchronousTestCase):
    def test_keepalive_while_persisting(self):
        proto, transport = self.make(keepalive_interval=2.0)
        proto.dataReceived(encode_batch(payloads(5), 3))
        self.clock.advance(1.9)
        self.assertEqual(transport.value(), b"")
        self.clock.advance(0.2)
        self.assertEqual(self.take(transport), [(VERSION_2, 0)])
        self.clock.advance(2.0)
        self.assertEqual(self.take(transport), [(VERSION_2, 0)])
        self.sink.fire_all()
        self.assertEqual(self.take(transport), [(VERSION_2, 5)])
        # no keepalive once nothing is pending
        self.clock.advance(10)
        self.assertEqual(transport.value(), b"")

    def test_keepalive_while_batch_incomplete(self):
        proto, transport = self.make(keepalive_interval=3.0)
        data = encode_window(3) + encode_json_frames(payloads(1))
        proto.dataReceived(data)
        self.clock.advance(3.0)
        self.assertEqual(self.take(transport), [(VERSION_2, 0)])

    def test_partial_acks_for_large_batch(self):
        events = payloads(10)
        size = len(events[0])
        proto, transport = self.make(flush_bytes=size * 4)
        head = encode_window(10) + encode_json_frames(events[:5], first_seq=100)
        tail = encode_json_frames(events[5:], first_seq=105)
        proto.dataReceived(head)
        # 4 events pending -> that part goes to the sink; reading stops
        self.assertEqual([len(c[1]) for c in self.sink.calls], [4])
        self.assertEqual(transport.producerState, "paused")
        self.sink.calls[0][2].callback(None)
        self.assertEqual(self.take(transport), [(VERSION_2, 103)])
        self.assertEqual(transport.producerState, "producing")
        # the rest completes the batch within one read: persisted (and acked) whole
        proto.dataReceived(tail)
        self.assertEqual([len(c[1]) for c in self.sink.calls], [4, 6])
        self.assertEqual(transport.value(), b"")
        self.sink.calls[1][2].callback(None)
        self.assertEqual(self.take(transport), [(VERSION_2, 109)])
        self.assertEqual([e for c in self.sink.calls for e in c[1]], events)

    def test_no_ack_before_durable_then_connection_lost(self):
        proto, transport = self.make()
        proto.dataReceived(encode_batch(payloads(2), 3))
        proto.connectionLost(None)
        self.sink.fire_all()  # storage finishes after the client left: nothing written
        self.assertEqual(transport.value(), b"")


class BoundsTests(ServerTestMixin, SynchronousTestCase):
    def assertClosed(self, transport, code):
        self.assertTrue(transport.disconnecting)
        self.assertIn(code, self.logs.codes())

    def setUp(self):
        self.logs = LogCapture(self)

    def test_window_too_large(self):
        proto, transport = self.make(max_window=100)
        proto.dataReceived(encode_window(101))
        self.assertClosed(transport, "window_too_large")

    def test_frame_too_large(self):
        proto, transport = self.make(max_frame=100)
        proto.dataReceived(encode_window(1) + encode_json(1, b'"' + b"x" * 200 + b'"'))
        self.assertClosed(transport, "frame_too_large")
        self.assertEqual(self.sink.calls, [])

    def test_zip_bomb(self):
        proto, transport = self.make(max_decompressed=65536)
        bomb = encode_compressed(encode_json(1, b'"' + b"a" * 1048576 + b'"'), level=9)
        proto.dataReceived(encode_window(1) + bomb)
        self.assertClosed(transport, "decompressed_too_large")

    def test_malformed_json(self):
        proto, transport = self.make()
        proto.dataReceived(encode_window(2) + encode_json(1, b"{}") + encode_json(2, b"{oops"))
        self.assertClosed(transport, "malformed_json")
        self.assertEqual(self.sink.calls, [])

    def test_unknown_frame_type(self):
        proto, transport = self.make()
        proto.dataReceived(b"2X\x00\x00")
        self.assertClosed(transport, "unknown_frame_type")

    def test_unsupported_version(self):
        proto, transport = self.make()
        proto.dataReceived(b"\x00W\x00\x00\x00\x01")
        self.assertClosed(transport, "unsupported_version")

    def test_ack_from_writer(self):
        proto, transport = self.make()
        proto.dataReceived(encode_ack(3))
        self.assertClosed(transport, "unexpected_frame")

    def test_data_before_window(self):
        proto, transport = self.make()
        proto.dataReceived(encode_json(1, b"{}"))
        self.assertClosed(transport, "unexpected_frame")

    def test_window_inside_batch(self):
        proto, transport = self.make()
        proto.dataReceived(encode_window(3) + encode_json(1, b"{}") + encode_window(3))
        self.assertClosed(transport, "unexpected_frame")

    def test_idle_timeout(self):
        proto, transport = self.make(idle_timeout=30)
        self.clock.advance(20)
        proto.dataReceived(encode_window(2))
        self.clock.advance(20)
        self.assertFalse(transport.disconnecting)  # input reset the clock
        self.clock.advance(10.1)
        self.assertClosed(transport, "idle_timeout")

    def test_no_idle_timeout_while_storage_is_slow(self):
        proto, transport = self.make(idle_timeout=30, keepalive_interval=0)
        proto.dataReceived(encode_batch(payloads(1), 3))
        self.clock.advance(100)
        self.assertFalse(transport.disconnecting)
        self.sink.fire_all()
        self.assertEqual(self.take(transport), [(VERSION_2, 1)])
        self.clock.advance(30.1)
        self.assertClosed(transport, "idle_timeout")

    def test_sink_failure_closes_without_ack(self):
        proto, transport = self.make(sink=FailingSink())
        proto.dataReceived(encode_batch(payloads(2), 3))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), b"")
        self.flushLoggedErrors(OSError)

    def test_other_connections_carry_on(self):
        bad, bad_transport = self.make(sink=ImmediateSink())
        good = self.factory.buildProtocol(None)
        good_transport = StringTransport()
        good.makeConnection(good_transport)
        bad.dataReceived(b"garbage!")
        good.dataReceived(encode_batch(payloads(2), 3))
        self.assertTrue(bad_transport.disconnecting)
        self.assertEqual(acks(good_transport.value()), [(VERSION_2, 2)])


class MemoryBudgetTests(ServerTestMixin, SynchronousTestCase):
    def connect(self):
        proto = self.factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        return proto, transport

    def test_new_batches_wait_for_the_shared_budget(self):
        size = len(payloads(1)[0])
        a, a_transport = self.make(max_buffered=size * 3, idle_timeout=10, keepalive_interval=4)
        b, b_transport = self.connect()
        c, c_transport = self.connect()
        a.dataReceived(encode_batch(payloads(3), 3))
        self.assertEqual(self.factory.buffered, size * 3)
        # over budget: b's batch waits, without reading, until a's is stored
        b.dataReceived(encode_batch(payloads(2, 10), 3))
        self.assertEqual(len(self.sink.calls), 1)
        self.assertEqual(b_transport.producerState, "paused")
        self.assertEqual(list(self.factory.throttled), [b])
        c.dataReceived(encode_batch(payloads(1, 20), 3))
        self.assertEqual(list(self.factory.throttled), [b, c])
        # waiting for the budget is not idleness; the client still gets keepalives
        for _ in range(3):
            self.clock.advance(4)
        self.assertFalse(b_transport.disconnecting)
        self.assertEqual(acks(b_transport.value()), [(VERSION_2, 0), (VERSION_2, 0), (VERSION_2, 0)])
        b_transport.clear()
        self.sink.calls[0][2].callback(None)
        self.assertEqual(acks(a_transport.value())[-1], (VERSION_2, 3))
        # b and c resume in order; both fit in the budget now
        self.assertEqual([c[1] for c in self.sink.calls[1:]], [payloads(2, 10), payloads(1, 20)])
        self.assertEqual(b_transport.producerState, "paused")  # now waiting for its own store
        self.sink.fire_all()
        self.assertEqual(acks(b_transport.value()), [(VERSION_2, 2)])
        self.assertEqual(acks(c_transport.value()), [(VERSION_2, 0)] * 3 + [(VERSION_2, 1)])
        self.assertEqual(self.factory.buffered, 0)
        self.assertEqual(b_transport.producerState, "producing")

    def test_throttled_connection_leaving_frees_its_place(self):
        size = len(payloads(1)[0])
        a, _ = self.make(max_buffered=size)
        b, b_transport = self.connect()
        a.dataReceived(encode_batch(payloads(2), 3))
        b.dataReceived(encode_batch(payloads(1), 3))
        self.assertEqual(list(self.factory.throttled), [b])
        b.connectionLost(None)
        self.assertEqual(list(self.factory.throttled), [])
        a.connectionLost(None)  # events never stored: their bytes leave the budget too
        self.assertEqual(self.factory.buffered, 0)


class FuzzTests(ServerTestMixin, SynchronousTestCase):
    pieces = st.sampled_from([
        encode_window(2), encode_window(0), encode_json(1, b'{"a":1}'), encode_json(2, b"[]"),
        encode_ack(1), encode_compressed(encode_json(1, b"1") + encode_json(2, b"2")),
        encode_compressed(encode_window(1) + encode_json(5, b"{}")),
        encode_key_values(3, {"a": "b"}), b"2J\x00", b"\x00", b"2C\x00\x00\x00\x03abc"])

    @given(st.lists(pieces | st.binary(max_size=12), max_size=15), st.integers(1, 9),
           st.booleans())
    @settings(max_examples=300, deadline=None)
    def test_any_input_is_answered_or_closed(self, chunks, step, slow_sink):
        proto, transport = self.make(sink=ControlledSink() if slow_sink else ImmediateSink(),
                                     max_frame=64, max_decompressed=256, max_window=5)
        data = b"".join(chunks)
        for i in range(0, len(data), step):
            if transport.disconnecting:
                break
            proto.dataReceived(data[i:i + step])  # never raises
            if slow_sink:
                self.sink.fire_all()
        acks(transport.value())  # whatever was written is whole ack frames
        self.flushLoggedErrors()


class MetricsTests(ServerTestMixin, SynchronousTestCase):
    def test_records_acks_pauses_and_errors_counted(self):
        from prometheus_client import REGISTRY

        def value(name, **labels):
            return REGISTRY.get_sample_value(name, dict(server="lj-metrics-test", **labels)) or 0

        proto, transport = self.make(server_name="lj-metrics-test")
        proto.dataReceived(encode_batch(payloads(3), 3))
        self.sink.fire_all()
        self.assertEqual(value("streamproto_records_in_total"), 3)
        self.assertEqual(value("streamproto_acks_sent_total"), 1)
        self.assertEqual(value("streamproto_backpressure_pauses_total"), 1)
        proto.dataReceived(encode_window(10**9))
        self.assertEqual(value("streamproto_protocol_errors_total", code="window_too_large"), 1)


class LogStoreSinkTests(SynchronousTestCase):
    def test_records_carry_connection_metadata(self):
        store = MemoryLogStore(Clock())
        sink = LogStoreSink(store, "beats")
        verifyObject(IEventSink, sink)
        conn = ConnectionInfo("127.0.0.1:5000", {"cn": "beat-1", "sha256": "AB:CD"})
        self.successResultOf(sink.write(conn, [b'{"a":1}', b'[1, 2]']))
        self.successResultOf(sink.write(ConnectionInfo("[::1]:6"), [b'"x"']))
        log = self.successResultOf(store.get("beats"))
        records = [json.loads(r) for r in self.successResultOf(log.read(0)).records()]
        self.assertEqual(records, [
            {"peer": "127.0.0.1:5000", "tls": {"cn": "beat-1", "sha256": "AB:CD"},
             "event": {"a": 1}},
            {"peer": "127.0.0.1:5000", "tls": {"cn": "beat-1", "sha256": "AB:CD"},
             "event": [1, 2]},
            {"peer": "[::1]:6", "event": "x"},
        ])

    def test_server_acks_only_after_store_append(self):
        store = MemoryLogStore(Clock())
        clock = Clock()
        factory = LumberjackServerFactory(LogStoreSink(store, "lj"), clock=clock)
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(encode_batch(payloads(3), 3))
        self.assertEqual(acks(transport.value()), [(VERSION_2, 3)])
        log = self.successResultOf(store.get("lj"))
        self.assertEqual(log.end_position, 3)

    def test_store_refusing_records_closes(self):
        logged = error_lines(self)
        store = MemoryLogStore(Clock())
        self.successResultOf(store.create("small", LogConfig(max_record_size=64)))
        factory = LumberjackServerFactory(LogStoreSink(store, "small"), clock=Clock())
        proto = factory.buildProtocol(None)
        transport = StringTransport()
        proto.makeConnection(transport)
        proto.dataReceived(encode_batch(payloads(1), 3))
        self.assertTrue(transport.disconnecting)
        self.assertEqual(transport.value(), b"")
        # the store said why (the record is too large): one line, no traceback
        self.assertEqual(len([line for line in logged if "closing without ack" in line]), 1,
                         logged)
