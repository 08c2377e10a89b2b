"""The styx/0 clients against a scripted server (StringTransport, Clock)."""

from twisted.internet import defer
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial import unittest

from streamproto.styx.codec import (
    ACK, ERROR, HEARTBEAT, HEARTBEAT_BYTES, HEARTBEAT_TYPE, RECORD, Ack, ErrorCode, ErrorMessage,
    decode_all, encode_ack, encode_error, encode_records,
)
from streamproto.styx.errors import APIError
from streamproto.styx.handshake import request_head as _request_head
from streamproto.styx.stream_client import (
    StyxConnectionLost, StyxConsumer, StyxProducer, StyxStreamError,
    _StyxClientProtocol,
)
from test.support.memnet import RecordingProducer

SWITCH = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: styx/0\r\nConnection: Upgrade\r\n"
          b"X-Styx-Timeout: 6\r\n\r\n")


class PausableTransport(StringTransport):
    def __init__(self):
        super().__init__()
        self.reading_paused = False

    def pauseProducing(self):
        self.reading_paused = True

    def resumeProducing(self):
        self.reading_paused = False


def attach(owner, method, accept, clock, timeout=10, query=None):
    head = _request_head(method, "127.0.0.1:7123", owner.name, query, timeout)
    proto = _StyxClientProtocol(owner, head, accept, timeout, clock)
    owner._protocol = proto
    transport = PausableTransport()
    proto.makeConnection(transport)
    return proto, transport


class ProducerTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.producer = StyxProducer("my log", timeout=10, window_bytes=10, clock=self.clock)
        self.proto, self.transport = attach(self.producer, "POST", (ACK, HEARTBEAT_TYPE, ERROR),
                                            self.clock)
        self.head = self.transport.value()
        self.transport.clear()
        self.proto.dataReceived(SWITCH)
        self.assertTrue(self.proto.ready is None)

    def sent(self):
        data = self.transport.value()
        self.transport.clear()
        return decode_all(data)

    def test_request_head(self):
        lines = self.head.split(b"\r\n")
        self.assertEqual(lines[0], b"POST /logs/my%20log/records HTTP/1.1")
        for line in (b"Connection: upgrade", b"Upgrade: styx/0", b"X-Styx-Timeout: 10",
                     b"Content-Length: 0"):
            self.assertIn(line, lines)
        self.assertTrue(self.head.endswith(b"\r\n\r\n"))

    def test_deferreds_fire_on_covering_ack(self):
        d1 = self.producer.write(b"abc")
        d2 = self.producer.writeMany([b"de", b"f"])
        self.assertEqual(self.sent(), [b"abc", b"de", b"f"])
        self.proto.dataReceived(encode_ack(11, 1))
        self.assertEqual(self.successResultOf(d1), Ack(11, 1))
        self.assertNoResult(d2)
        self.proto.dataReceived(encode_ack(13, 3))
        self.assertEqual(self.successResultOf(d2), Ack(13, 3))

    def test_window_holds_writes_back(self):
        """Beyond window_bytes unacked, records wait locally; acks let them
        go; whenWritable and a registered producer follow the window."""
        pausable = RecordingProducer()
        self.producer.registerProducer(pausable)
        self.producer.writeMany([b"12345678"])
        self.assertTrue(self.producer.writable)
        d2 = self.producer.writeMany([b"abcdef"])       # 14 > 10: held back
        self.assertEqual(self.sent(), [b"12345678"])
        self.assertFalse(self.producer.writable)
        self.assertEqual(pausable.events, ["pause"])
        ready = self.producer.whenWritable()
        self.assertNoResult(ready)
        self.proto.dataReceived(encode_ack(1, 1))
        self.assertEqual(self.sent(), [b"abcdef"])
        self.assertIsNone(self.successResultOf(ready))
        self.assertEqual(pausable.events, ["pause", "resume"])
        self.assertNoResult(d2)
        self.proto.dataReceived(encode_ack(2, 2))
        self.assertEqual(self.successResultOf(d2), Ack(2, 2))

    def test_large_write_alone_goes_out(self):
        """A write larger than the window is sent when nothing is in flight."""
        self.producer.writeMany([b"x" * 50])
        self.assertEqual(self.sent(), [b"x" * 50])

    def test_close_waits_for_final_ack(self):
        self.producer.writeMany([b"a", b"b"])
        closed = self.producer.close()
        self.assertFalse(self.transport.disconnecting)
        self.proto.dataReceived(encode_ack(2, 2))
        self.assertTrue(self.transport.disconnecting)
        self.proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.successResultOf(closed), Ack(2, 2))

    def test_server_error_fails_pending(self):
        d = self.producer.write(b"a")
        self.proto.dataReceived(encode_error(ErrorCode.LOG_NOT_AVAILABLE))
        self.proto.connectionLost(Failure(ConnectionDone()))
        error = self.failureResultOf(d, StyxStreamError).value
        self.assertEqual(error.code, ErrorCode.LOG_NOT_AVAILABLE)
        self.failureResultOf(self.producer.write(b"b"), StyxStreamError)

    def test_connection_lost_with_unacked(self):
        d = self.producer.write(b"a")
        self.proto.connectionLost(Failure(ConnectionLost()))
        self.failureResultOf(d, StyxConnectionLost)

    def test_heartbeat_every_half_server_timeout(self):
        self.clock.advance(2.9)
        self.assertEqual(self.sent(), [])
        self.clock.advance(0.2)
        self.assertEqual(self.sent(), [HEARTBEAT])

    def test_idle_timeout(self):
        d = self.producer.write(b"a")
        self.sent()
        self.clock.advance(5)
        self.proto.dataReceived(HEARTBEAT_BYTES)
        self.clock.advance(9)
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(1.1)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(self.sent()[-1], ErrorMessage(ErrorCode.TIMEOUT))
        self.proto.connectionLost(Failure(ConnectionDone()))
        error = self.failureResultOf(d, StyxStreamError).value
        self.assertEqual(error.code, ErrorCode.TIMEOUT)

    def test_records_from_server_are_a_violation(self):
        self.proto.dataReceived(encode_records([b"nope"]))
        self.assertEqual(self.sent()[-1], ErrorMessage(ErrorCode.UNEXPECTED_MESSAGE))
        self.assertTrue(self.transport.disconnecting)


class HandshakeTests(unittest.SynchronousTestCase):
    def start(self):
        clock = Clock()
        producer = StyxProducer("log", clock=clock)
        proto, transport = attach(producer, "POST", (ACK, HEARTBEAT_TYPE, ERROR), clock)
        return proto, transport

    def test_error_response_with_length(self):
        proto, transport = self.start()
        body = b'{"code": "log_not_found", "message": "api: log not found"}'
        proto.dataReceived(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body))
        self.assertFalse(transport.disconnecting)
        proto.dataReceived(body)
        self.assertTrue(transport.disconnecting)
        ready = proto.ready
        proto.connectionLost(Failure(ConnectionDone()))
        error = self.failureResultOf(ready, APIError).value
        self.assertEqual((error.code, error.status), ("log_not_found", 404))

    def test_error_response_chunked(self):
        proto, transport = self.start()
        ready = proto.ready
        proto.dataReceived(b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"11\r\n{\"code\": \"invalid\r\n13\r\n_params\", \"message\"\r\n"
                           b"6\r\n: \"x\"}\r\n0\r\n\r\n")
        self.assertTrue(transport.disconnecting)
        proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.failureResultOf(ready, APIError).value.code, "invalid_params")

    def test_connection_header_spelled_as_the_go_server_wants(self):
        # the Go reference's router takes the upgrade only for this exact value
        self.assertIn(b"\r\nConnection: upgrade\r\n", _request_head("GET", "h:1", "x", None, 30))

    def test_heartbeat_within_our_own_timeout_too(self):
        # a server may announce a longer timeout than it keeps (the Go one
        # says 100 and closes after 30): heartbeat within the shorter one
        clock = Clock()
        producer = StyxProducer("log", clock=clock)
        proto, transport = attach(producer, "POST", (ACK, HEARTBEAT_TYPE, ERROR), clock,
                                  timeout=30)
        proto.dataReceived(SWITCH.replace(b"X-Styx-Timeout: 6", b"X-Styx-Timeout: 100"))
        self.assertEqual(proto.heartbeat_interval, 15)

    def test_data_in_the_same_segment_as_the_101(self):
        clock = Clock()
        batches = []
        consumer = StyxConsumer("log", batches.append, clock)
        proto, transport = attach(consumer, "GET", (RECORD, HEARTBEAT_TYPE, ERROR), clock,
                                  query={"whence": "start"})
        self.assertIn(b"GET /logs/log/records?whence=start HTTP/1.1", transport.value())
        proto.dataReceived(SWITCH + encode_records([b"a", b"b"]))
        self.assertEqual(batches, [[b"a", b"b"]])


class ConsumerTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.batches = []
        self.result = None
        self.consumer = StyxConsumer("log", self.on_records, self.clock)
        self.proto, self.transport = attach(self.consumer, "GET",
                                            (RECORD, HEARTBEAT_TYPE, ERROR), self.clock)
        self.proto.dataReceived(SWITCH)

    def on_records(self, records):
        self.batches.append(records)
        return self.result

    def test_batches_and_end(self):
        self.proto.dataReceived(encode_records([b"a", b"b"]) + HEARTBEAT_BYTES)
        self.proto.dataReceived(encode_records([b"c"]))
        self.proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.batches, [[b"a", b"b"], [b"c"]])
        self.assertEqual(self.successResultOf(self.consumer.done), 3)

    def test_slow_callback_pauses_reading(self):
        self.result = defer.Deferred()
        self.proto.dataReceived(encode_records([b"a"]))
        self.assertTrue(self.transport.reading_paused)
        self.clock.advance(20)      # not a timeout: we are the ones not reading
        self.assertFalse(self.transport.disconnecting)
        self.result.callback(None)
        self.assertFalse(self.transport.reading_paused)

    def test_server_error(self):
        self.proto.dataReceived(encode_records([b"a"]) + encode_error(ErrorCode.LOG_NOT_FOUND))
        self.proto.connectionLost(Failure(ConnectionDone()))
        error = self.failureResultOf(self.consumer.done, StyxStreamError).value
        self.assertEqual(error.code, ErrorCode.LOG_NOT_FOUND)
        self.assertEqual(self.batches, [[b"a"]])

    def test_garbage_from_server(self):
        self.proto.dataReceived(b"\x00\x63")
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(decode_all(self.transport.value().split(b"\r\n\r\n", 1)[1])[-1],
                         ErrorMessage(ErrorCode.UNKNOWN_MESSAGE_TYPE))
        self.proto.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(self.consumer.done, StyxStreamError)

    def test_batches_mode(self):
        """batches=True hands over RecordBatches (positions count the stream)."""
        batches = []
        consumer = StyxConsumer("log", batches.append, self.clock, batches=True)
        proto, transport = attach(consumer, "GET", (RECORD, HEARTBEAT_TYPE, ERROR), self.clock)
        proto.batch_mode = True
        proto.dataReceived(SWITCH + encode_records([b"a", b"bc"]) + HEARTBEAT_BYTES)
        proto.dataReceived(encode_records([b"d" * 10] * 20)[:-3])
        proto.dataReceived(encode_records([b"d" * 10] * 20)[-3:])
        self.assertEqual([b.records() for b in batches],
                         [[b"a", b"bc"], [b"d" * 10] * 19, [b"d" * 10]])
        self.assertEqual([b.position for b in batches], [0, 2, 21])
        proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.successResultOf(consumer.done), 22)

    def test_close_by_client(self):
        self.consumer.close()
        self.assertTrue(self.transport.disconnecting)
        self.proto.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.successResultOf(self.consumer.done), 0)
