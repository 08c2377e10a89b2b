"""
Tests for the native send thread: the accelerator's C{SendThread} on
socket pairs, and L{SocketSender}'s native mode on real TCP connections
(every byte once, in order, whether the thread sent it or gave it back).
"""

import errno
import os
import socket

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial import unittest

from streamproto.core import sendthread
from streamproto.core.sendpath import SocketSender
from test.support.ciutil import missing
from test.support.netutil import drain_socket, loopback_pair, readable, wait_until


def _require():
    if sendthread._SendThread is None:
        missing("the C accelerator's SendThread (python setup.py build_ext, Linux)")


def _chunks(n, size):
    """n distinct chunks: a reordering or a repeat shows."""
    return [(b"%08d" % i) * (size // 8) for i in range(n)]


class SendThreadTests(unittest.SynchronousTestCase):
    """The accelerator's C{SendThread} and C{SendSocket}, without a reactor."""

    def setUp(self):
        _require()
        self.thread = sendthread._SendThread()
        self.addCleanup(self.thread.close)
        self.a, self.b = socket.socketpair()
        self.addCleanup(self.a.close)
        self.addCleanup(self.b.close)
        self.a.setblocking(False)
        self.b.setblocking(False)

    def socket(self, token=1):
        s = self.thread.socket(os.dup(self.a.fileno()), token)
        self.addCleanup(s.close)
        return s

    def reported(self, token):
        """Wait until the thread reports C{token}."""
        for _ in range(1000):
            self.assertTrue(readable(self.thread.fileno(), 10), "the thread never reported")
            if token in self.thread.ready():
                return
        self.fail("never reported")

    def settle(self, s):
        """Wait until the thread has no send of C{s} left; the tokens it
        reported meanwhile."""
        reported = []
        if s.settle():
            return reported
        for _ in range(1000):
            self.assertTrue(readable(self.thread.fileno(), 10), "the thread never reported")
            reported += self.thread.ready()
            if s.token in reported:
                return reported
        self.fail("never settled")

    def test_sends_in_order(self):
        s = self.socket()
        chunks = _chunks(50, 64)    # far less than the pair's buffer holds
        for c in chunks:
            self.assertTrue(s.send(c))
        self.settle(s)
        self.assertEqual(s.inflight, 0)
        self.assertEqual(drain_socket(self.b), b"".join(chunks))
        self.assertEqual(s.returned(), ([], 0))

    def test_what_would_block_comes_back_in_order(self):
        """A peer that does not read: the thread sends what the socket
        takes and gives back the rest, later writes included, in order;
        the socket refuses more until it is unblocked."""
        self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s = self.socket(token=42)
        chunks = _chunks(400, 1000)
        accepted = [c for c in chunks if s.send(c)]
        self.reported(42)                   # blocked: reported without asking
        back, error = s.returned()
        self.assertEqual(error, 0)
        self.assertTrue(back)
        refused = chunks[len(accepted):]
        self.assertEqual(chunks[:len(accepted)], accepted)    # refused only at the end
        sent = drain_socket(self.b)
        self.assertEqual(sent + b"".join(back) + b"".join(refused), b"".join(chunks))
        self.assertGreater(len(sent), 0)
        # blocked until the reactor has sent what came back
        self.assertFalse(s.send(b"later"))
        self.assertTrue(s.unblock())
        self.assertTrue(s.send(b"later"))
        self.settle(s)
        self.assertEqual(drain_socket(self.b), b"later")

    def test_unblock_refused_while_something_is_held(self):
        self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s = self.socket()
        for c in _chunks(100, 2000):
            s.send(c)
        self.reported(s.token)
        self.assertFalse(s.unblock())      # what came back is not taken yet
        back, _ = s.returned()
        self.assertTrue(back)
        self.assertTrue(s.unblock())

    def test_a_failed_send_reports_its_errno(self):
        s = self.socket()
        self.b.close()
        s.send(b"x" * 1000)
        self.reported(s.token)
        back, error = s.returned()
        self.assertIn(error, (errno.EPIPE, errno.ECONNRESET))
        self.assertEqual(b"".join(back), b"x" * 1000)
        self.assertFalse(s.unblock())       # a failed connection stays blocked
        self.assertFalse(s.send(b"more"))

    def test_settle_reports_the_token_once_idle(self):
        s = self.socket(token=7)
        self.assertTrue(s.settle())
        for c in _chunks(50, 100):
            s.send(c)
        reported = self.settle(s)
        if reported:                         # not already done when asked
            self.assertEqual(reported, [7])
        self.assertEqual(s.returned(), ([], 0))

    def test_close_with_sends_out_closes_after_them(self):
        """The descriptor is the thread's to close once its last send is
        done: the peer gets everything, then the end of the stream."""
        self.b.setblocking(True)
        self.b.settimeout(10)
        s = self.thread.socket(os.dup(self.a.fileno()), 1)
        chunks = _chunks(200, 100)
        for c in chunks:
            s.send(c)
        s.close()
        self.a.close()          # the thread's duplicate is the last one open
        got = bytearray()
        while True:
            chunk = self.b.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        self.assertEqual(bytes(got), b"".join(chunks))
        self.assertRaises(ValueError, s.send, b"after close")

    def test_a_closed_thread_refuses_sends(self):
        s = self.socket()
        self.thread.close()
        self.assertFalse(s.send(b"x"))
        self.assertTrue(s.settle())
        self.assertEqual(s.returned(), ([], 0))
        self.assertRaises(RuntimeError, self.thread.ready)

    def test_no_memory_for_the_list_keeps_the_reports(self):
        """ready() that cannot make its list raises, and the connections it
        would have named are named by the next call (a lost report would
        leave a connection's answers waiting for good)."""
        try:
            import _testcapi
        except ImportError:
            missing("_testcapi (CPython's C-API test module)")
        token = 10 ** 12                    # not a cached small int: made here
        s = self.socket(token=token)
        self.b.close()
        s.send(b"x")                        # fails: reported
        self.assertTrue(readable(self.thread.fileno(), 10))
        ready = self.thread.ready
        # nothing between the hooks but the call (assertRaises allocates)
        _testcapi.set_nomemory(0)
        try:
            ready()
        except MemoryError:
            raised = True
        else:
            raised = False
        finally:
            _testcapi.remove_mem_hooks()
        self.assertTrue(raised)
        self.assertTrue(readable(self.thread.fileno(), 0))
        self.assertEqual(self.thread.ready(), [token])
        self.assertEqual(self.thread.ready(), [])

    def test_bad_arguments(self):
        self.assertRaises(ValueError, self.thread.socket, -1, 1)
        s = self.socket()
        self.assertRaises(TypeError, s.send, "text")
        self.assertTrue(s.send(b""))        # nothing to send
        self.assertEqual(s.inflight, 0)


class NativeSocketSenderTests(unittest.TestCase):
    """L{SocketSender} made C{native}, over a real loopback TCP connection."""

    timeout = 60

    def setUp(self):
        _require()

    def connect(self):
        return loopback_pair(self)

    @defer.inlineCallbacks
    def test_small_writes_go_to_the_thread(self):
        server, client = yield self.connect()
        counted = []
        sender = SocketSender(server.transport, reactor, eager=True, native=True,
                              on_sent=counted.append)
        self.assertIsNotNone(sender._native)
        thread = sendthread.for_reactor(reactor)
        self.assertIn(thread, reactor.getReaders())     # watched while in use
        chunks = _chunks(200, 80)
        for c in chunks:
            sender.write(c)
            self.assertEqual(sender.pending, 0)         # handed over, nothing queued
        self.assertNotIn(sender, reactor.getWriters())
        yield sender.when_drained()
        self.assertTrue(sender.drained)
        sender.close()
        self.assertNotIn(thread, reactor.getReaders())  # nothing left in the reactor
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, b"".join(chunks))
        self.assertEqual(sum(counted), len(received))
        self.assertEqual(sender.sent, len(received))

    @defer.inlineCallbacks
    def test_the_first_write_of_a_turn_is_sent_here(self):
        """
        An eager native sender sends a reactor turn's first write itself
        (no wake-up of the thread in that answer's latency) and hands the
        turn's others to the thread; the next turn's first is its own
        again.
        """
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True, native=True)
        handed = []

        class Spy:
            """The native socket, its sends recorded."""

            def __init__(self, native):
                self._native = native

            def send(self, data):
                handed.append(bytes(data))
                return self._native.send(data)

            def __getattr__(self, name):
                return getattr(self._native, name)
        sender._native = Spy(sender._native)
        yield deferLater(reactor, 0, lambda: None)   # a turn of its own
        sender.write(b"first")
        sender.write(b"second")
        sender.write(b"third")
        self.assertEqual(handed, [b"second", b"third"])
        yield sender.when_drained()
        yield deferLater(reactor, 0, lambda: None)
        sender.write(b"next")
        self.assertEqual(handed, [b"second", b"third"])
        sender.close()
        server.transport.loseConnection()
        self.assertEqual((yield client.done), b"firstsecondthirdnext")

    @defer.inlineCallbacks
    def test_writes_across_turns_keep_their_order(self):
        """
        A turn's first write goes out here only when the thread holds
        nothing of the connection: it never overtakes an earlier one.
        """
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True, native=True)
        chunks = _chunks(600, 400)
        for i in range(0, len(chunks), 3):
            for c in chunks[i:i + 3]:
                sender.write(c)
            yield deferLater(reactor, 0, lambda: None)
        yield sender.when_drained()
        sender.close()
        server.transport.loseConnection()
        self.assertEqual((yield client.done), b"".join(chunks))

    @defer.inlineCallbacks
    def test_a_slow_reader_gets_every_byte_once_in_order(self):
        """
        The client stops reading: the thread blocks, what it did not send
        comes back and goes out through the reactor once the client reads
        again, and then the thread sends again.  Every byte arrives once,
        in order, and is counted once.
        """
        server, client = yield self.connect()
        counted = []
        sender = SocketSender(server.transport, reactor, eager=True, native=True,
                              high_water=1 << 30, on_sent=counted.append)
        client.transport.pauseProducing()
        chunks = _chunks(600, 8000)     # more than both sockets' buffers hold
        for c in chunks:
            sender.write(c)
        yield wait_until(lambda: sender.pending > 0)
        self.assertGreater(sender.pending, 0)           # it came back to the reactor
        self.assertFalse(sender.drained)
        sender.write(b"tail")                            # behind what came back
        client.transport.resumeProducing()
        yield sender.when_drained()
        self.assertEqual(sender.pending, 0)
        sender.write(b"again")                           # the thread's once more
        self.assertEqual(sender.pending, 0)
        yield sender.when_drained()
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        expected = b"".join(chunks) + b"tail" + b"again"
        self.assertEqual(len(received), len(expected))
        self.assertEqual(received, expected)
        self.assertEqual(sum(counted), len(expected))
        self.assertEqual(sender.sent, len(expected))

    @defer.inlineCallbacks
    def test_close_right_after_writes(self):
        """
        What the thread still has goes out although the sender is closed
        (its descriptor is closed after): close() drops only what waits in
        the sender's own queue, as it always did.  The transport's own
        close shuts the socket down (Twisted's C{shutdown}), which is why
        a connection's owner closes it only once the sender is drained.
        """
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True, native=True)
        chunks = _chunks(10, 100)           # what any socket buffer takes
        for c in chunks:
            sender.write(c)
        sender.close()                      # the thread closes its descriptor after
        expected = b"".join(chunks)
        yield wait_until(lambda: len(client.received) >= len(expected))
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, expected)

    @defer.inlineCallbacks
    def test_peer_gone(self):
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True, native=True)
        client.transport.abortConnection()
        yield client.done
        for _ in range(500):
            if sender.failed is not None:
                break
            sender.write(b"x" * 65536)
            yield deferLater(reactor, 0.01, lambda: None)
        self.assertIsInstance(sender.failed, OSError)
        self.assertEqual(sender.fileno(), -1)
        yield sender.when_drained()
        sender.write(b"ignored")

    @defer.inlineCallbacks
    def test_records_are_framed_into_one_write(self):
        from array import array

        from streamproto.core.framing import frame_records_py
        server, client = yield self.connect()
        sender = SocketSender(server.transport, reactor, eager=True, native=True)
        lengths = array("I", [1000] * 50)
        data = bytes(range(250)) * 200
        sender.write(b"head")
        sender.write_records(lengths, data, b"\x00\x01")
        yield sender.when_drained()
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        self.assertEqual(received, b"head" + frame_records_py(lengths, data, b"\x00\x01"))

    def test_without_the_accelerator_the_reactor_sends(self):
        self.patch(sendthread, "_SendThread", None)
        self.assertIsNone(sendthread.for_reactor(reactor))
