"""
The styx/0 stream: protocol logic with a fake clock and in-memory
transports, then end to end through the HTTP resource on real sockets (TCP
and TLS) with the file store.
"""

import os
import struct
import tempfile

from twisted.internet import defer, protocol, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, serverFromString
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from streamproto.log import LogConfig, MemoryLogStore, open_store

from streamproto.styx.codec import (
    HEARTBEAT, HEARTBEAT_BYTES, Ack, ErrorCode, ErrorMessage, decode_all, encode_ack,
    encode_error, encode_record, encode_records,
)
from streamproto.styx.errors import APIError
from streamproto.styx.resource import make_site
from streamproto.styx import stream as stream_module
from streamproto.styx.stream import ConsumerStream, ProducerStream
from streamproto.styx.stream_client import StyxConsumer, StyxProducer, StyxStreamError
from test.support.tlsutil import certs


class HalfCloseTransport(StringTransport):
    """A StringTransport that tracks pause/resume of reading and aborts."""

    def __init__(self):
        super().__init__()
        self.reading_paused = False
        self.aborted = False

    def abortConnection(self):
        self.aborted = True

    def pauseProducing(self):
        self.reading_paused = True

    def resumeProducing(self):
        self.reading_paused = False


def memory_log(clock, name="log", **config):
    store = MemoryLogStore(clock)
    d = store.create(name, LogConfig(**config) if config else None)
    return store, d.result


def sent_messages(transport):
    return decode_all(transport.value())


class ProducerStreamTests(unittest.SynchronousTestCase):
    """ProducerStream over a StringTransport, the memory log and a Clock."""

    def setUp(self):
        self.clock = Clock()
        self.store, self.log = memory_log(self.clock, max_record_size=1000)
        self.transport = HalfCloseTransport()
        self.stream = ProducerStream(self.log, timeout=10, remote_timeout=6, clock=self.clock)
        self.stream.makeConnection(self.transport)

    def test_records_appended_and_acked_once_per_group(self):
        """Records of one chunk go to the log in one append; one ack follows
        the fsync, with position = synced end and count = this stream's."""
        self.log.append([b"older"])
        appends = []
        original = self.log.append
        self.log.append = lambda records, attributes=None: (
            appends.append(len(records)) or original(records, attributes))
        self.stream.dataReceived(encode_records([b"a", b"bb", b"ccc"]))
        self.stream.dataReceived(encode_records([b"d"]))
        self.assertEqual(appends, [3, 1])
        self.assertEqual(self.transport.value(), b"")  # the ack waits for the group
        self.clock.advance(0)
        self.assertEqual(sent_messages(self.transport), [Ack(5, 4)])
        self.assertEqual(self.log._records, [b"older", b"a", b"bb", b"ccc", b"d"])

    def test_ack_only_after_append_fired(self):
        """Nothing is acked while the store has not confirmed the append."""
        pending = defer.Deferred()
        self.log.append = lambda records, attributes=None: pending
        self.stream.dataReceived(encode_records([b"x", b"y"]))
        self.clock.advance(1)
        self.assertEqual(self.transport.value(), b"")
        from streamproto.log import AppendResult
        pending.callback(AppendResult(0, 2, 2))
        self.clock.advance(0)
        self.assertEqual(sent_messages(self.transport), [Ack(2, 2)])

    def test_split_messages(self):
        """A record split across reads, byte by byte, is appended once whole."""
        data = encode_record(b"hello") + HEARTBEAT_BYTES + encode_record(b"world")
        for i in range(len(data)):
            self.stream.dataReceived(data[i:i + 1])
        self.clock.advance(0)
        self.assertEqual(self.log._records, [b"hello", b"world"])
        self.assertEqual(sent_messages(self.transport)[-1], Ack(2, 2))

    def test_backpressure_pauses_reading(self):
        """Too many undurable bytes pause the transport; the first append
        made durable that brings them back within the bound resumes it
        (not half of it: that waited for a second fsync)."""
        self.stream.max_pending_bytes = 100
        pending = []
        self.log.append = lambda records, attributes=None: pending.append(
            defer.Deferred()) or pending[-1]
        self.stream.dataReceived(encode_records([b"x" * 60]))
        self.assertFalse(self.transport.reading_paused)
        self.stream.dataReceived(encode_records([b"y" * 60]))
        self.stream.dataReceived(encode_records([b"z" * 30]))   # already read
        self.assertTrue(self.transport.reading_paused)
        from streamproto.log import AppendResult
        pending[0].callback(AppendResult(0, 1, 60))
        self.assertFalse(self.transport.reading_paused)   # 90 pending, within 100
        self.stream.dataReceived(encode_records([b"w" * 20]))
        self.assertTrue(self.transport.reading_paused)    # 110
        pending[1].callback(AppendResult(1, 2, 120))
        self.assertFalse(self.transport.reading_paused)

    def test_pending_bound_by_store(self):
        """A log that keeps what waits for fsync in memory (the memory store,
        JetStream) bounds a stream at 16 MiB; the file store, whose appends
        are in the page cache at once, at 128 MiB (a 100 MB burst taken in
        while fsync catches up)."""
        self.assertTrue(self.log.holds_unsynced)
        self.assertEqual(self.stream.max_pending_bytes, 16 * 1024 * 1024)
        from streamproto.log.file import synchronous
        directory = self.mktemp()
        os.makedirs(directory)
        store = open_store(os.path.join(directory, "data"), run_blocking=synchronous)
        self.addCleanup(store.close)
        log = self.successResultOf(store.create("bound"))
        self.assertFalse(log.holds_unsynced)
        self.assertEqual(ProducerStream(log, clock=self.clock).max_pending_bytes,
                         128 * 1024 * 1024)
        self.assertEqual(ProducerStream(log, clock=self.clock,
                                        max_pending_bytes=5).max_pending_bytes, 5)

    def test_heartbeat_when_idle(self):
        """A heartbeat goes out after half the client's timeout without sending."""
        self.clock.advance(2.9)
        self.assertEqual(self.transport.value(), b"")
        self.stream.dataReceived(HEARTBEAT_BYTES)   # keeps us alive, sends nothing
        self.clock.advance(0.2)
        self.assertEqual(sent_messages(self.transport), [HEARTBEAT])
        self.transport.clear()
        self.clock.advance(2.9)
        self.assertEqual(self.transport.value(), b"")
        self.clock.advance(0.2)
        self.assertEqual(sent_messages(self.transport), [HEARTBEAT])

    def test_heartbeat_postponed_by_acks(self):
        """An ack counts as a message: no heartbeat right after one."""
        self.clock.advance(2)
        self.stream.dataReceived(encode_record(b"r"))
        self.clock.advance(0)
        self.transport.clear()
        self.clock.advance(1.5)     # 3 s since start, 1.5 s since the ack
        self.assertEqual(self.transport.value(), b"")
        self.clock.advance(1.5)
        self.assertEqual(sent_messages(self.transport), [HEARTBEAT])

    def test_idle_timeout_closes(self):
        """No message for the server's timeout: Error(TIMEOUT), closed."""
        self.clock.advance(5)
        self.stream.dataReceived(HEARTBEAT_BYTES)
        self.clock.advance(9.9)
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(0.2)
        self.assertTrue(self.transport.disconnecting)
        messages = sent_messages(self.transport)
        # heartbeats, then the error (no ack: nothing was produced)
        self.assertEqual(messages[-1], ErrorMessage(ErrorCode.TIMEOUT))
        self.assertEqual(set(messages[:-1]), {HEARTBEAT})

    def test_peer_that_never_reads_is_aborted(self):
        """After the last messages, a peer has the timeout to take them."""
        self.stream.dataReceived(b"\x00\x63")
        self.assertTrue(self.transport.disconnecting)
        self.clock.advance(9)
        self.assertFalse(self.transport.aborted)
        self.clock.advance(1)
        self.assertTrue(self.transport.aborted)
        self.stream.connectionLost(None)
        self.assertIsNone(self.successResultOf(self.stream.closed))

    def test_no_timeout_while_paused(self):
        """A client we stopped reading from is not timed out."""
        self.stream.max_pending_bytes = 1
        self.log.append = lambda records, attributes=None: defer.Deferred()
        self.stream.dataReceived(encode_record(b"xy"))
        self.assertTrue(self.transport.reading_paused)
        self.clock.advance(30)
        self.assertFalse(self.transport.disconnecting)

    def test_timeout_counts_from_resume(self):
        """Time spent not reading is not the client's silence: once reading
        resumes the client has the whole timeout again."""
        self.stream.max_pending_bytes = 1
        pending = []
        self.log.append = lambda records, attributes=None: pending.append(
            defer.Deferred()) or pending[-1]
        self.stream.dataReceived(encode_record(b"xy"))
        self.assertTrue(self.transport.reading_paused)
        self.clock.advance(30)
        from streamproto.log import AppendResult
        pending[0].callback(AppendResult(0, 1, 2))
        self.assertFalse(self.transport.reading_paused)
        self.clock.advance(9.9)
        self.assertNotIn(ErrorMessage(ErrorCode.TIMEOUT), sent_messages(self.transport))
        self.assertFalse(self.transport.disconnecting)
        self.clock.advance(0.2)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(sent_messages(self.transport)[-1], ErrorMessage(ErrorCode.TIMEOUT))

    def test_unknown_type(self):
        """Records before the bad message are kept and acked, then the error."""
        self.stream.dataReceived(encode_records([b"ok1", b"ok2"]) + b"\x00\x09junk")
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(sent_messages(self.transport),
                         [Ack(2, 2), ErrorMessage(ErrorCode.UNKNOWN_MESSAGE_TYPE)])
        self.assertEqual(self.log._records, [b"ok1", b"ok2"])

    def test_negative_size(self):
        self.stream.dataReceived(struct.pack(">hi", 1, -5))
        self.assertEqual(sent_messages(self.transport)[-1],
                         ErrorMessage(ErrorCode.INVALID_RECORD_SIZE))
        self.assertTrue(self.transport.disconnecting)

    def test_record_too_large(self):
        """The log's max_record_size bounds records as soon as the header is in."""
        self.stream.dataReceived(struct.pack(">hi", 1, 1001))
        self.assertEqual(sent_messages(self.transport)[-1],
                         ErrorMessage(ErrorCode.RECORD_TOO_LARGE))
        self.assertEqual(self.log._records, [])

    def test_ack_from_client_is_unexpected(self):
        self.stream.dataReceived(encode_ack(1, 1))
        self.assertEqual(sent_messages(self.transport)[-1],
                         ErrorMessage(ErrorCode.UNEXPECTED_MESSAGE))

    def test_storage_failure(self):
        """An append failing (fsync error) is Error(LOG_NOT_AVAILABLE)."""
        from streamproto.log import LogFailed
        self.log.append = lambda records, attributes=None: defer.fail(LogFailed("disk"))
        self.stream.dataReceived(encode_record(b"x"))
        self.assertEqual(sent_messages(self.transport),
                         [ErrorMessage(ErrorCode.LOG_NOT_AVAILABLE)])
        self.assertTrue(self.transport.disconnecting)
        self.flushLoggedErrors(LogFailed)

    def test_half_close_drains_then_final_ack(self):
        """The Go client's Close: half-close, then wait for our close.  Pending
        appends finish and a final ack goes out before the close."""
        pending = defer.Deferred()
        self.log.append = lambda records, attributes=None: pending
        self.stream.dataReceived(encode_records([b"x", b"y", b"z"]))
        self.stream.readConnectionLost()
        self.assertFalse(self.transport.disconnecting)
        from streamproto.log import AppendResult
        pending.callback(AppendResult(0, 3, 3))
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(sent_messages(self.transport), [Ack(3, 3)])

    def test_client_error_ends_stream(self):
        self.stream.dataReceived(encode_record(b"x") + encode_error(0))
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(sent_messages(self.transport), [Ack(1, 1)])


class LingeringTransport(HalfCloseTransport):
    """A HalfCloseTransport that can also half-close (like TCP's)."""

    def __init__(self):
        super().__init__()
        self.write_closed = False

    def loseWriteConnection(self):
        self.write_closed = True


class LingeringCloseTests(unittest.SynchronousTestCase):
    """
    The producer's lingering close over TCP: half-close, keep reading (and
    dropping) until the client closes its side, then close.  Closing while
    the client's records still arrive would answer them with a reset that
    can keep the last Ack and Error from the client.
    """

    def setUp(self):
        self.clock = Clock()
        self.store, self.log = memory_log(self.clock)
        self.transport = LingeringTransport()
        self.stream = ProducerStream(self.log, timeout=10, clock=self.clock)
        self.stream.makeConnection(self.transport)
        self.stream.dataReceived(encode_records([b"a", b"b"]))
        self.clock.advance(0)

    def test_shutdown_half_closes_and_waits_for_the_client(self):
        self.stream.gracefulShutdown()
        self.assertEqual(sent_messages(self.transport),
                         [Ack(2, 2), ErrorMessage(ErrorCode.SHUTDOWN)])
        self.assertTrue(self.transport.write_closed)
        # our FIN is out: the socket must stay open while the client writes
        self.stream.writeConnectionLost()
        self.assertFalse(self.transport.disconnecting)
        self.assertFalse(self.transport.reading_paused)
        self.stream.dataReceived(encode_records([b"late"]))
        self.clock.advance(0)
        self.assertEqual(self.log._records, [b"a", b"b"])      # dropped
        self.assertFalse(self.transport.disconnecting)
        # the client read the Error and closed its side
        self.stream.readConnectionLost()
        self.assertTrue(self.transport.disconnecting)

    def test_client_that_never_closes_is_aborted(self):
        self.stream.gracefulShutdown()
        self.stream.writeConnectionLost()
        self.clock.advance(9.9)
        self.assertFalse(self.transport.aborted)
        self.clock.advance(0.1)
        self.assertTrue(self.transport.aborted)

    def test_no_linger_once_the_client_half_closed(self):
        """The Go client's Close: nothing more can arrive, so no half-close."""
        self.stream.dataReceived(encode_records([b"c"]))
        self.stream.readConnectionLost()
        self.assertFalse(self.transport.write_closed)
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(sent_messages(self.transport)[-1], Ack(3, 3))


class ConsumerStreamTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.store, self.log = memory_log(self.clock)
        self.log.append([b"r%d" % i for i in range(10)])
        self.transport = HalfCloseTransport()

    def start(self, position=0, count=-1, follow=False, **kw):
        kw.setdefault("start_delay", 0)
        stream = ConsumerStream(self.log, position, count, follow, timeout=10,
                                remote_timeout=4, clock=self.clock, **kw)
        stream.makeConnection(self.transport)
        return stream

    def records(self):
        return [m for m in sent_messages(self.transport) if type(m) is bytes]

    def test_no_delay(self):
        """Nagle is off on a stream's TCP connection (as Go sets it): an
        ack or a batch's last piece never waits for the peer's ACK."""
        calls = []
        self.transport.setTcpNoDelay = calls.append
        self.start(3)
        self.assertEqual(calls, [True])

    def test_to_end_then_close(self):
        self.start(3)
        self.assertEqual(self.records(), [b"r%d" % i for i in range(3, 10)])
        self.assertTrue(self.transport.disconnecting)

    def test_count(self):
        self.start(2, count=3, read_bytes=4)   # several small reads
        self.assertEqual(self.records(), [b"r2", b"r3", b"r4"])
        self.assertTrue(self.transport.disconnecting)

    def test_follow_waits_for_durable_records(self):
        stream = self.start(8, follow=True)
        self.assertEqual(self.records(), [b"r8", b"r9"])
        self.assertFalse(self.transport.disconnecting)
        self.log.append([b"new"])
        self.assertEqual(self.records()[-1], b"new")
        self.assertEqual(stream.sent_count, 3)

    def test_follow_with_count_closes(self):
        self.start(9, count=2, follow=True)
        self.assertFalse(self.transport.disconnecting)
        self.log.append([b"a", b"b", b"c"])
        self.assertEqual(self.records(), [b"r9", b"a"])
        self.assertTrue(self.transport.disconnecting)

    def test_paused_transport_stops_reading(self):
        """While the transport holds us paused no batch is read: a slow
        consumer does not make the server buffer the log."""
        stream = self.start(0, follow=True, read_bytes=1)
        # StringTransport never pauses by itself: pause as a full buffer would
        stream.pauseProducing()
        self.transport.clear()
        self.log.append([b"x"])
        self.assertEqual(self.transport.value(), b"")
        stream.resumeProducing()
        self.assertEqual(self.records(), [b"x"])

    def test_reads_at_most_one_batch_per_resume(self):
        stream = self.start(0, read_bytes=2, start_delay=1)
        reads = []
        original = self.log.read

        def read(position, max_records=-1, max_bytes=1048576):
            reads.append(position)
            stream.pauseProducing()     # as a full send buffer would
            return original(position, max_records, max_bytes)
        self.log.read = read
        self.clock.advance(1)
        self.assertEqual(reads, [0])
        stream.resumeProducing()
        self.assertEqual(reads, [0, 1])

    def test_start_delay(self):
        """Records wait a moment after the 101 (the Go client's net/http
        would swallow bytes arriving with the response)."""
        self.start(0, start_delay=0.05)
        self.assertEqual(self.transport.value(), b"")
        self.clock.advance(0.05)
        self.assertEqual(len(self.records()), 10)

    def test_heartbeat_and_timeout(self):
        self.start(10, follow=True)
        self.clock.advance(2)
        self.assertEqual(sent_messages(self.transport), [HEARTBEAT])
        self.clock.advance(8)
        self.assertEqual(sent_messages(self.transport)[-1], ErrorMessage(ErrorCode.TIMEOUT))
        self.assertTrue(self.transport.disconnecting)

    def test_record_from_client_is_unexpected(self):
        stream = self.start(10, follow=True)
        stream.dataReceived(encode_record(b"nope"))
        self.assertEqual(sent_messages(self.transport)[-1],
                         ErrorMessage(ErrorCode.UNEXPECTED_MESSAGE))
        self.assertTrue(self.transport.disconnecting)

    def test_log_deleted_while_following(self):
        self.start(10, follow=True)
        self.store.delete("log")
        self.assertEqual(sent_messages(self.transport)[-1],
                         ErrorMessage(ErrorCode.LOG_NOT_AVAILABLE))
        self.flushLoggedErrors()

    def test_position_truncated_away(self):
        """Retention removed the records the consumer was about to read."""
        self.start(0, start_delay=1)
        self.log.truncate(5)
        self.clock.advance(1)
        self.assertEqual(sent_messages(self.transport),
                         [ErrorMessage(ErrorCode.POSITION_OUT_OF_RANGE)])
        self.assertTrue(self.transport.disconnecting)
        self.flushLoggedErrors()

    def test_connection_lost_cancels_wait(self):
        stream = self.start(10, follow=True)
        self.assertEqual(len(self.log._waiters), 1)
        stream.connectionLost(None)
        self.assertEqual(len(self.log._waiters), 0)


class UpgradeTests(unittest.SynchronousTestCase):
    """The upgrade through the HTTP resource, on an in-memory connection."""

    def setUp(self):
        self.clock = Clock()
        self.store, self.log = memory_log(self.clock)
        self.log.append([b"one", b"two"])
        self.site = make_site(self.store, timeout=5, clock=self.clock)
        # the HTTP channel's idle timer must not land on the global reactor
        self.site.reactor = self.clock

    def connect(self, head):
        channel = self.site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(head)
        return transport

    def test_active_streams_metric(self):
        gauge = self.site.resource.metrics.active_streams.labels("styx0_producer")
        transport = self.connect(b"POST /logs/log/records HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        self.assertEqual(gauge._value.get(), 1)
        transport.protocol.connectionLost(None)
        self.assertEqual(gauge._value.get(), 0)

    def test_produce(self):
        transport = self.connect(b"POST /logs/log/records HTTP/1.1\r\nHost: x\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n"
                                 b"X-Styx-Timeout: 8\r\nContent-Length: 0\r\n\r\n")
        head, _, rest = transport.value().partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.assertEqual(lines[0], b"HTTP/1.1 101 Switching Protocols")
        self.assertIn(b"Upgrade: styx/0", lines)
        self.assertIn(b"Connection: Upgrade", lines)
        self.assertIn(b"X-Styx-Timeout: 5", lines)
        self.assertEqual(rest, b"")
        stream = transport.protocol
        self.assertIsInstance(stream, ProducerStream)
        self.assertEqual(stream.heartbeat_interval, 4)
        stream.dataReceived(encode_record(b"three"))
        self.clock.advance(0)
        self.assertEqual(decode_all(transport.value().partition(b"\r\n\r\n")[2]), [Ack(3, 1)])

    def test_upgrade_leaves_no_cycle_for_the_collector(self):
        """twisted.web's channel and request of an upgraded connection go
        with their last reference, not at the next full collection (rare in
        a server: core.gcpolicy): 10,000 idle connections held them."""
        import gc
        gc.collect()
        gc.disable()
        self.addCleanup(gc.enable)
        channel = self.site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(b"POST /logs/log/records HTTP/1.1\r\n"
                             b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        self.assertIsInstance(transport.protocol, ProducerStream)
        del channel
        # what only the collector could free (cycles): nothing
        self.assertEqual(gc.collect(), 0)
        transport.protocol.connectionLost(None)

    def test_timeout_never_below_two(self):
        site = make_site(self.store, timeout=2, clock=self.clock)
        site.reactor = self.clock
        channel = site.buildProtocol(None)
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(b"GET /logs/log/records HTTP/1.1\r\nUpgrade: styx/0\r\n"
                             b"Connection: Upgrade\r\nX-Styx-Timeout: 0\r\n\r\n")
        self.assertIn(b"X-Styx-Timeout: 2\r\n", transport.value())
        self.assertEqual(transport.protocol.heartbeat_interval, 1)

    def test_consume_with_params(self):
        transport = self.connect(b"GET /logs/log/records?whence=end&position=-1 HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        self.assertEqual(transport.value().partition(b"\r\n\r\n")[2], b"")  # start delay
        self.clock.advance(1)
        body = transport.value().partition(b"\r\n\r\n")[2]
        self.assertEqual(decode_all(body), [b"two"])
        self.assertTrue(transport.disconnecting)

    def test_own_client_needs_no_start_delay(self):
        transport = self.connect(b"GET /logs/log/records HTTP/1.1\r\n"
                                 b"User-Agent: streamproto-styx\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        body = transport.value().partition(b"\r\n\r\n")[2]
        self.assertEqual(decode_all(body), [b"one", b"two"])

    def test_unknown_client_waits(self):
        """Neither our client nor Go's over TCP (here: Go's agent on a transport
        that is not TCP): the records wait for the start delay."""
        transport = self.connect(b"GET /logs/log/records HTTP/1.1\r\n"
                                 b"User-Agent: Go-http-client/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertEqual(body, b"")
        self.assertNotIn(b"X-Styx-Padding", head)
        self.clock.advance(stream_module.DEFAULT_CONSUMER_START_DELAY)
        body = transport.value().partition(b"\r\n\r\n")[2]
        self.assertEqual(decode_all(body), [b"one", b"two"])

    def test_switching_head(self):
        head = stream_module.switching_head(30)
        self.assertEqual(head, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: styx/0\r\n"
                               b"Connection: Upgrade\r\nX-Styx-Timeout: 30\r\n\r\n")
        padded = stream_module.switching_head(30, 4096)
        self.assertEqual(len(padded), 4096)
        self.assertTrue(padded.startswith(head[:-2]))
        self.assertTrue(padded.endswith(b"-\r\n\r\n"))
        self.assertEqual(padded.count(b"\r\n\r\n"), 1)
        self.assertRaises(ValueError, stream_module.switching_head, 30, 64)

    def test_early_bytes(self):
        """Bytes after the request head, before the 101: Error(EARLY_DATA)."""
        transport = self.connect(b"POST /logs/log/records HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n"
                                 + encode_record(b"too soon"))
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 101 "))
        self.assertEqual(decode_all(body), [ErrorMessage(ErrorCode.EARLY_DATA)])
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.log._records, [b"one", b"two"])

    def test_unknown_log(self):
        transport = self.connect(b"POST /logs/nope/records HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        self.assertIn(b" 404 ", transport.value().split(b"\r\n")[0])
        self.assertIn(b'"log_not_found"', transport.value())

    def test_bad_timeout_header(self):
        transport = self.connect(b"POST /logs/log/records HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n"
                                 b"X-Styx-Timeout: soon\r\n\r\n")
        self.assertIn(b" 400 ", transport.value().split(b"\r\n")[0])

    def test_position_out_of_range(self):
        transport = self.connect(b"GET /logs/log/records?position=7 HTTP/1.1\r\n"
                                 b"Upgrade: styx/0\r\nConnection: Upgrade\r\n\r\n")
        self.assertIn(b" 400 ", transport.value().split(b"\r\n")[0])
        self.assertIn(b'"invalid_params"', transport.value())


# -- end to end ------------------------------------------------------------

class RawClient(protocol.Protocol):
    """Sends bytes, collects everything until the server closes."""

    def __init__(self, send):
        self.send = send
        self.received = bytearray()
        self.closed = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.send)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.closed.callback(bytes(self.received))


def track_streams(case):
    """Make C{case} wait, at cleanup, until every server-side stream is closed
    (the server may see the close a moment after the client)."""
    streams = []
    original = stream_module._StyxStream.connectionMade

    def made(stream):
        streams.append(stream)
        original(stream)
    case.patch(stream_module._StyxStream, "connectionMade", made)
    case.addCleanup(lambda: defer.DeferredList([s.closed for s in streams]))


class EndToEndMixin:
    timeout = 30
    tls = False

    @defer.inlineCallbacks
    def setUp(self):
        track_streams(self)
        self.directory = tempfile.mkdtemp()
        self.store = open_store(os.path.join(self.directory, "data"))
        self.addCleanup(self.store.close)
        yield self.store.create("log")
        site = make_site(self.store, timeout=10)
        if self.tls == "mtls":      # client certificates required
            description = certs().server_endpoint()
        elif self.tls:
            description = certs().ssl_endpoint()
        else:
            description = "tcp:0:interface=127.0.0.1"
        self.port = yield serverFromString(reactor, description).listen(site)
        self.addCleanup(self.port.stopListening)
        self.portnum = self.port.getHost().port
        self.client_tls = (certs().client_options(with_cert=self.tls == "mtls")
                           if self.tls else None)

    @defer.inlineCallbacks
    def test_produce_then_consume(self):
        """Acks carry the synced end and this stream's count; records read
        back are the records written, in order."""
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              tls=self.client_tls)
        records = [os.urandom(i % 300) for i in range(3000)]
        first = yield producer.writeMany(records[:1000])
        self.assertEqual(first.count, 1000)     # one append, one fsync, one ack
        self.assertEqual(first.position, 1000)
        acks = yield defer.gatherResults([producer.writeMany(records[1000:2000]),
                                          producer.write(records[2000])])
        self.assertGreaterEqual(acks[1].count, 2001)
        rest = producer.writeMany(records[2001:])
        final = yield producer.close()
        self.assertTrue(rest.called)
        self.assertEqual(final, Ack(3000, 3000))
        log = yield self.store.get("log")
        self.assertEqual(log.end_position, 3000)

        batches = []
        consumer = yield StyxConsumer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              batches.append, whence="start", position=10,
                                              tls=self.client_tls)
        total = yield consumer.done
        received = [r for batch in batches for r in batch]
        self.assertEqual(total, 2990)
        self.assertEqual(received, records[10:])
        # the same as RecordBatches
        batches = []
        consumer = yield StyxConsumer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              batches.append, whence="end", position=-5,
                                              tls=self.client_tls, batches=True)
        total = yield consumer.done
        self.assertEqual(total, 5)
        self.assertEqual([r for batch in batches for r in batch.records()], records[-5:])

    @defer.inlineCallbacks
    def test_follow(self):
        batches = []
        consumer = yield StyxConsumer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              batches.append, whence="end", count=3,
                                              follow=True, tls=self.client_tls)
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              tls=self.client_tls)
        yield producer.writeMany([b"a", b"b"])
        yield producer.writeMany([b"c", b"d"])
        yield producer.close()
        total = yield consumer.done
        self.assertEqual(total, 3)
        self.assertEqual([r for b in batches for r in b], [b"a", b"b", b"c"])

    @defer.inlineCallbacks
    def test_bad_input_closes_only_that_stream(self):
        """Garbage gets the documented error and a closed stream; another
        producer carries on."""
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              tls=self.client_tls)
        yield producer.write(b"before")
        bad = yield self.raw(b"POST /logs/log/records HTTP/1.1\r\nUpgrade: styx/0\r\n"
                             b"Connection: Upgrade\r\nContent-Length: 0\r\n\r\n",
                             b"\x00\x07garbage")
        head, _, body = bad.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 101"))
        self.assertEqual(decode_all(body)[-1], ErrorMessage(ErrorCode.UNKNOWN_MESSAGE_TYPE))
        ack = yield producer.write(b"after")
        self.assertEqual(ack.count, 2)
        yield producer.close()

    @defer.inlineCallbacks
    def test_early_bytes(self):
        data = yield self.raw(b"POST /logs/log/records HTTP/1.1\r\nUpgrade: styx/0\r\n"
                              b"Connection: Upgrade\r\nContent-Length: 0\r\n\r\n"
                              + encode_record(b"early"))
        head, _, body = data.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 101"))
        self.assertEqual(decode_all(body)[-1], ErrorMessage(ErrorCode.EARLY_DATA))
        log = yield self.store.get("log")
        self.assertEqual(log.end_position, 0)

    @defer.inlineCallbacks
    def test_unknown_log_refused(self):
        d = StyxProducer.connect(reactor, "127.0.0.1", self.portnum, "missing",
                                 tls=self.client_tls)
        error = yield self.assertFailure(d, APIError)
        self.assertEqual((error.code, error.status), ("log_not_found", 404))

    @defer.inlineCallbacks
    def produce(self, records):
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", self.portnum, "log",
                                              tls=self.client_tls)
        yield producer.writeMany(records)
        yield producer.close()

    @defer.inlineCallbacks
    def raw(self, head, after=b""):
        """Send C{head}, then (after the 101 arrived) C{after}; return all."""
        client = RawClient(head)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.portnum)
        if self.tls:
            from twisted.internet.endpoints import wrapClientTLS
            endpoint = wrapClientTLS(self.client_tls, endpoint)
        yield endpoint.connect(protocol.Factory.forProtocol(lambda: client))
        if after:
            while b"\r\n\r\n" not in client.received:
                yield deferLater(0.01)
            client.transport.write(after)
        data = yield client.closed
        return data


def deferLater(seconds):
    from twisted.internet.task import deferLater as later
    return later(reactor, seconds, lambda: None)


#: A consume request exactly as Go's net/http writes it for the styx client.
GO_CONSUME_REQUEST = (
    b"GET /logs/log/records?count=-1&follow=false&position=0&whence=origin "
    b"HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: Go-http-client/1.1\r\n"
    b"Connection: upgrade\r\nUpgrade: styx/0\r\nX-Styx-Timeout: 30\r\n"
    b"Accept-Encoding: gzip\r\n\r\n")


class EndToEndTCPTests(EndToEndMixin, unittest.TestCase):
    @defer.inlineCallbacks
    def test_half_close_like_the_go_client(self):
        """The Go producer writes, half-closes, and reads until EOF: the
        server finishes the appends, sends the final ack, then closes."""
        # the request exactly as Go's net/http writes it for the styx client
        head = (b"POST /logs/log/records HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"User-Agent: Go-http-client/1.1\r\nContent-Length: 0\r\n"
                b"Connection: upgrade\r\nUpgrade: styx/0\r\nX-Styx-Timeout: 30\r\n"
                b"Accept-Encoding: gzip\r\n\r\n")
        client = RawClient(head)
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", self.portnum)
        yield endpoint.connect(protocol.Factory.forProtocol(lambda: client))
        while b"\r\n\r\n" not in client.received:
            yield deferLater(0.01)
        client.transport.write(encode_records([b"x"] * 500))
        client.transport.loseWriteConnection()
        data = yield client.closed
        messages = decode_all(data.partition(b"\r\n\r\n")[2])
        self.assertEqual(messages[-1], Ack(500, 500))

    @defer.inlineCallbacks
    def test_go_style_consumer(self):
        """A GET as the Go consumer sends it: records after the 101, then the
        close at the end of the log."""
        yield self.produce([b"r%d" % i for i in range(100)])
        data = yield self.raw(GO_CONSUME_REQUEST)
        head, _, body = data.partition(b"\r\n\r\n")
        self.assertIn(b"X-Styx-Timeout: 10", head)
        self.assertEqual(decode_all(body), [b"r%d" % i for i in range(100)])


    @defer.inlineCallbacks
    def test_go_clients_first_read_takes_the_head_alone(self):
        """
        Go's net/http reads the 101 with one 4 KiB read and throws away
        whatever else that read took.  Over loopback the server starts at
        once and pads the head to exactly 4 KiB: a 4 KiB read taken when the
        records are already waiting in the socket (the worst case) holds
        the head and nothing else, and every record follows.
        """
        import socket
        import time

        from twisted.internet.threads import deferToThread
        yield self.produce([b"r%d" % i for i in range(1000)])

        def as_go_reads():
            with socket.create_connection(("127.0.0.1", self.portnum), timeout=10) as s:
                s.sendall(GO_CONSUME_REQUEST)
                # let the head and the records arrive before the first read
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    waiting = len(s.recv(1 << 20, socket.MSG_PEEK))
                    if waiting > stream_module.GO_HTTP_READ_BUFFER:
                        break
                    time.sleep(0.01)
                first = s.recv(stream_module.GO_HTTP_READ_BUFFER)
                rest = []
                while True:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        return first, b"".join(rest)
                    rest.append(chunk)
        first, rest = yield deferToThread(as_go_reads)
        self.assertTrue(first.startswith(b"HTTP/1.1 101 "), first[:40])
        self.assertTrue(first.endswith(b"\r\n\r\n"), "the first read took records too")
        self.assertEqual(decode_all(rest), [b"r%d" % i for i in range(1000)])


class EndToEndTLSTests(EndToEndMixin, unittest.TestCase):
    tls = True

    @defer.inlineCallbacks
    def test_go_agent_over_tls_waits(self):
        """
        Over TLS the 101 is not padded (the head is read through TLS
        records, whatever the segment size): a Go client gets the plain
        head, and its records after the start delay, all of them.
        """
        yield self.produce([b"r%d" % i for i in range(100)])
        data = yield self.raw(GO_CONSUME_REQUEST)
        head, _, body = data.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 101 "))
        self.assertNotIn(b"X-Styx-Padding", head)
        self.assertEqual(decode_all(body), [b"r%d" % i for i in range(100)])


class EndToEndMutualTLSTests(EndToEndMixin, unittest.TestCase):
    tls = "mtls"


class StreamErrorTests(unittest.TestCase):
    """Client-side view of server errors."""

    timeout = 20

    @defer.inlineCallbacks
    def test_producer_sees_record_too_large(self):
        track_streams(self)
        store = MemoryLogStore()
        yield store.create("small", LogConfig(max_record_size=10))
        port = yield serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(
            make_site(store))
        self.addCleanup(port.stopListening)
        producer = yield StyxProducer.connect(reactor, "127.0.0.1", port.getHost().port,
                                              "small")
        ok = yield producer.write(b"fits")
        self.assertEqual(ok, Ack(1, 1))
        error = yield self.assertFailure(producer.write(b"x" * 11), StyxStreamError)
        self.assertEqual(error.code, ErrorCode.RECORD_TOO_LARGE)
        yield self.assertFailure(producer.close(), StyxStreamError)





class ErrorMappingTests(unittest.SynchronousTestCase):
    def test_store_errors_map_to_codes(self):
        from streamproto.log.errors import (
            CorruptLog, LogFailed, LogNotFound, PositionOutOfRange, RecordTooLarge, WriteFailed,
        )
        from streamproto.styx.codec import ErrorCode
        from streamproto.styx.stream import error_code_for
        self.assertEqual(error_code_for(WriteFailed("disk full")), ErrorCode.LOG_NOT_AVAILABLE)
        self.assertEqual(error_code_for(LogFailed("fsync")), ErrorCode.LOG_NOT_AVAILABLE)
        self.assertEqual(error_code_for(CorruptLog("crc")), ErrorCode.LOG_NOT_AVAILABLE)
        self.assertEqual(error_code_for(LogNotFound("x")), ErrorCode.LOG_NOT_FOUND)
        self.assertEqual(error_code_for(PositionOutOfRange("x")),
                         ErrorCode.POSITION_OUT_OF_RANGE)
        self.assertEqual(error_code_for(RecordTooLarge("x")), ErrorCode.RECORD_TOO_LARGE)
        self.assertEqual(error_code_for(ValueError("x")), ErrorCode.UNKNOWN)
