"""
Tests for L{streamproto.core.sendpath}: the C accelerator's C{send_frames}
against the pure framing, and L{SocketSender} on real TCP connections.
"""

import os
import socket

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor
from twisted.internet.interfaces import IPushProducer
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from zope.interface import implementer

from streamproto.core.framing import _speedups, frame_records_py
from streamproto.core.sendpath import SocketSender
from streamproto.log.batch import lengths_array
from test.support.ciutil import missing
from test.support.memnet import RecordingProducer
from test.support.netutil import drain_socket, loopback_pair

PREFIX = b"\x00\x01"


class SendFramesTests(unittest.SynchronousTestCase):
    """C{_speedups.send_frames} sends exactly what C{frame_records_py} builds,
    however the socket cuts the sends."""

    def setUp(self):
        if _speedups is None:
            missing("the C accelerator (python setup.py build_ext)")

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(0, 3000), min_size=1, max_size=1200), st.sampled_from([b"", PREFIX]))
    def test_same_bytes_as_framing(self, sizes, prefix):
        lengths = lengths_array(sizes)
        data = bytes(i % 251 for i in range(sum(sizes)))
        expected = frame_records_py(lengths, data, prefix)
        a, b = socket.socketpair()
        try:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # many short sends
            a.setblocking(False)
            b.setblocking(False)
            index, skip, got = 0, 0, bytearray()
            while index < len(lengths):
                index, skip, n = _speedups.send_frames(a.fileno(), lengths, data, prefix,
                                                       index, skip)
                got += drain_socket(b)
            got += drain_socket(b)
            self.assertEqual(bytes(got), expected)
        finally:
            a.close()
            b.close()

    def test_would_block_sends_nothing(self):
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        a.setblocking(False)
        lengths = lengths_array([100_000] * 50)
        data = bytes(5_000_000)
        index, skip, total = 0, 0, 0
        while True:
            index, skip, n = _speedups.send_frames(a.fileno(), lengths, data, PREFIX, index, skip)
            if n == 0:
                break
            total += n
        self.assertGreater(total, 0)
        self.assertLess(index, 50)          # the socket is full: stopped mid-way
        self.assertEqual(_speedups.send_frames(a.fileno(), lengths, data, PREFIX, index, skip),
                         (index, skip, 0))

    def test_bad_arguments(self):
        lengths = lengths_array([10, 10])
        self.assertRaises(ValueError, _speedups.send_frames, 0, lengths, bytes(5), PREFIX, 0, 0)
        self.assertRaises(ValueError, _speedups.send_frames, 0, lengths, bytes(20), PREFIX, 3, 0)

    def test_closed_peer_raises(self):
        a, b = socket.socketpair()
        self.addCleanup(a.close)
        b.close()
        lengths = lengths_array([10])
        self.assertRaises(OSError, _speedups.send_frames, a.fileno(), lengths, bytes(10),
                          PREFIX, 0, 0)


class SocketSenderTests(unittest.TestCase):
    """L{SocketSender} over a real loopback TCP connection."""

    timeout = 60

    def connect(self):
        return loopback_pair(self)

    def test_usable(self):
        self.assertFalse(SocketSender.usable(StringTransport(), reactor))

    @defer.inlineCallbacks
    def test_order_and_content(self):
        if _speedups is None:
            missing("the C accelerator (python setup.py build_ext)")
        server, client = yield self.connect()
        self.assertTrue(SocketSender.usable(server.transport, reactor))
        counted = []
        sender = SocketSender(server.transport, reactor, high_water=1 << 20,
                              on_sent=counted.append)
        producer = RecordingProducer()
        sender.registerProducer(producer)
        sizes = [700, 1500, 0, 3000] * 2000
        lengths = lengths_array(sizes)
        data = bytes(i % 253 for i in range(sum(sizes)))
        small = lengths_array([3, 4])
        sender.write(b"first")
        sender.write_records(lengths, data, PREFIX)          # iovec path
        sender.write_records(small, b"abcdefg", PREFIX)      # tiny records: one framed copy
        sender.write(b"last")
        self.assertIn("pause", producer.events)              # over the high water mark
        yield sender.when_drained()
        yield deferLater(reactor, 0, lambda: None)    # resumed right after the waiters
        self.assertEqual(producer.events, ["pause", "resume"])
        self.assertEqual(sender.pending, 0)
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        expected = (b"first" + frame_records_py(lengths, data, PREFIX)
                    + frame_records_py(small, b"abcdefg", PREFIX) + b"last")
        self.assertEqual(received, expected)
        self.assertEqual(sum(counted), len(expected))
        self.assertEqual(sender.sent, len(expected))

    @defer.inlineCallbacks
    def test_close_releases_the_duplicate(self):
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor)
        fd = sender.fileno()
        self.assertNotEqual(fd, server.transport.getHandle().fileno())
        os.fstat(fd)
        sender.close()
        self.assertEqual(sender.fileno(), -1)
        self.assertRaises(OSError, os.fstat, fd)
        sender.write(b"ignored after close")
        yield sender.when_drained()
        # the connection still closes normally (the duplicate no longer holds it)
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, b"")

    @defer.inlineCallbacks
    def test_eager_sends_at_once(self):
        """An eager sender sends small writes inside write(), without
        registering its descriptor; what the socket does not take waits
        for the reactor, in order."""
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True)
        sender.write(b"answer")
        self.assertEqual((sender.sent, sender.pending), (6, 0))
        self.assertNotIn(sender, reactor.getWriters())
        big = bytes(range(256)) * 40000     # more than a socket buffer takes at once
        sender.write(big)
        sender.write(b"tail")               # behind the queued rest, not sent first
        self.assertIn(sender, reactor.getWriters())
        yield sender.when_drained()
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, b"answer" + big + b"tail")

    @defer.inlineCallbacks
    def test_eager_peer_gone(self):
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True)
        client.transport.abortConnection()
        yield client.done
        for _ in range(100):    # the first sends may still be taken by the kernel
            sender.write(b"x" * 65536)
            if sender.failed is not None:
                break
        self.assertIsNotNone(sender.failed)
        self.assertEqual(sender.fileno(), -1)
        yield sender.when_drained()

    @defer.inlineCallbacks
    def test_peer_gone(self):
        if _speedups is None:
            missing("the C accelerator (python setup.py build_ext)")
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, high_water=1 << 30)
        client.transport.abortConnection()
        yield client.done
        lengths = lengths_array([1000] * 20000)
        sender.write_records(lengths, bytes(20_000_000), PREFIX)
        yield sender.when_drained()      # fails quietly rather than raising
        self.assertIsNotNone(sender.failed)
        self.assertEqual(sender.fileno(), -1)

    @defer.inlineCallbacks
    def test_drained_waits_for_what_a_resumed_producer_writes(self):
        """
        A producer resumed because the queue emptied may write more and
        then wait for the sender to drain (a response's last records, then
        its end): that waiter fires only once those are sent too.
        """
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, high_water=64 * 1024)
        fired = []

        @implementer(IPushProducer)
        class Last:
            def pauseProducing(self):
                pass

            def resumeProducing(self):
                sender.unregisterProducer()
                sender.write(b"y" * 3_000_000)
                sender.when_drained().addCallback(
                    lambda _: fired.append(sender.pending))

            def stopProducing(self):
                pass

        sender.registerProducer(Last())
        sender.write(b"x" * 3_000_000)      # over the high water mark: pauses Last
        yield client_reads(client, 6_000_000)
        self.assertEqual(fired, [0])
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, b"x" * 3_000_000 + b"y" * 3_000_000)


def client_reads(client, n):
    """Fires once C{client} has received C{n} bytes."""
    @defer.inlineCallbacks
    def wait():
        while len(client.received) < n:
            yield deferLater(reactor, 0.01, lambda: None)
    return wait()


class StyxDirectSendTests(unittest.TestCase):
    """
    Consumers on plain TCP switch to a L{SocketSender} once the transport
    has sent what it held: the bytes arrive whole and in order after the
    101 (styx/0) or the headers (HTTP), with no start delay to hide a race.
    """

    timeout = 120

    def make_store(self):
        from streamproto.log import MemoryLogStore
        return MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def append(self, log):
        yield log.append(self.records)

    @defer.inlineCallbacks
    def setUp(self):
        from streamproto.styx import consume, stream
        from streamproto.styx.resource import make_site

        self.senders = []
        senders = self.senders

        class Counting(SocketSender):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                senders.append(self)

        self.patch(stream, "SocketSender", Counting)
        self.patch(consume, "SocketSender", Counting)
        self.store = self.make_store()
        log = yield self.store.create("events")
        self.records = [bytes([i % 256]) * 1000 for i in range(20_000)]
        yield self.append(log)
        self.port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            make_site(self.store))
        self.addCleanup(self.port.stopListening)

    def fetch(self, head):
        """The whole answer to C{head}, read in a thread (a blocking socket)."""
        from twisted.internet.threads import deferToThread

        def run():
            s = socket.create_connection(("127.0.0.1", self.port.getHost().port))
            s.sendall(head)
            out = bytearray()
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                out += chunk
            s.close()
            return bytes(out)
        return deferToThread(run)

    @defer.inlineCallbacks
    def test_styx0(self):
        import struct
        answer = yield self.fetch(
            b"GET /logs/events/records?count=20000 HTTP/1.1\r\nHost: x\r\n"
            b"User-Agent: streamproto-styx/test\r\n"         # ours: no start delay
            b"Connection: upgrade\r\nUpgrade: styx/0\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        self.assertIn(b" 101 ", head.split(b"\r\n")[0])
        expected = b"".join(struct.pack(">hi", 1, len(r)) + r for r in self.records)
        self.assertEqual(body[:len(expected)], expected)
        self.assertEqual(len(self.senders), 1)

    @defer.inlineCallbacks
    def test_http(self):
        import struct
        answer = yield self.fetch(
            b"GET /logs/events/records?count=20000 HTTP/1.1\r\nHost: x\r\n"
            b"Accept: application/vnd.styx.binary-records\r\nConnection: close\r\n\r\n")
        head, _, rest = answer.partition(b"\r\n\r\n")
        self.assertIn(b" 200 ", head.split(b"\r\n")[0])
        body, pos = bytearray(), 0
        while True:                                 # de-chunk
            eol = rest.index(b"\r\n", pos)
            n = int(rest[pos:eol], 16)
            if n == 0:
                break
            body += rest[eol + 2:eol + 2 + n]
            self.assertEqual(rest[eol + 2 + n:eol + 4 + n], b"\r\n")
            pos = eol + 4 + n
        expected = b"".join(struct.pack(">i", len(r)) + r for r in self.records)
        self.assertEqual(bytes(body), expected)
        self.assertEqual(len(self.senders), 1)


class FileStoreDirectSendTests(StyxDirectSendTests):
    """
    The same through the file store, appended in stored batches of uneven
    sizes: a read of 1 MiB then spans several of them, and the consumers
    send each stored batch's payloads from the buffer it was read into
    (L{RecordBatch.chunks}), read on the reactor thread from the page
    cache where the build can (L{FileIO.pread_cached}).
    """

    def make_store(self):
        from streamproto.log.filestore import FileLogStore
        store = FileLogStore(self.mktemp(), reactor, retention_interval=None)
        self.addCleanup(store.close)
        return store

    @defer.inlineCallbacks
    def append(self, log):
        i = 0
        for n in [37, 500, 1, 1200, 64, 999, 3000] * 10:
            if i >= len(self.records):
                break
            yield log.append(self.records[i:i + n])
            i += n
        yield log.append(self.records[i:])
        # reads do span several stored batches
        batch = yield log.read(0, -1, 1 << 20)
        self.assertGreater(len(batch.chunks()), 1)
