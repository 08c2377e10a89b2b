"""
Tests for held answers: an answer made before its fsync
(C{SendSocket.hold}, L{SocketSender.hold}) that the accelerator's syncer
sends from its own thread the moment the fsync succeeds, and never when it
fails; the connection's other bytes stay behind it, in order.
"""

import errno
import gc
import os
import socket
import tempfile
import time

from twisted.internet import defer, reactor
from twisted.trial import unittest

from streamproto.base.durable import DirectoryIO
from streamproto.core import sendthread
from streamproto.core.sendpath import SocketSender
from streamproto.log import syncer
from streamproto.log.file import synchronous
from test.support.ciutil import missing
from test.support.netutil import drain_socket, loopback_pair, readable

#: a descriptor no process has: its fsync fails with EBADF
BAD_FD = 10 ** 6


def _require():
    if sendthread._SendThread is None or syncer._Syncer is None:
        missing("the C accelerator's SendThread and Syncer (python setup.py build_ext, Linux)")


class NativeHeldTests(unittest.SynchronousTestCase):
    """C{SendSocket.hold} and C{Syncer.submit(..., answers)}, on a socket
    pair and a file, without a reactor."""

    def setUp(self):
        _require()
        self.thread = sendthread._SendThread()
        self.addCleanup(self.thread.close)
        self.syncer = syncer._Syncer(2)
        self.addCleanup(self.syncer.close)
        self.a, self.b = socket.socketpair()
        for s in (self.a, self.b):
            s.setblocking(False)
            self.addCleanup(s.close)
        fd, path = tempfile.mkstemp()
        self.addCleanup(os.unlink, path)
        self.addCleanup(os.close, fd)
        os.write(fd, b"data")
        self.fd = fd
        self.s = self.thread.socket(os.dup(self.a.fileno()), 1)
        self.addCleanup(self.s.close)

    def run_job(self, fds, lane, answers):
        """Submit a job; its (errno, ...) once reported, and its answers finished."""
        job = self.syncer.submit(fds, None, lane, answers)
        for _ in range(1000):
            self.assertTrue(readable(self.syncer.fileno(), 10), "the job never completed")
            done = {j: error for j, error, _ in self.syncer.completed()}
            if job in done:
                break
        else:
            self.fail("never completed")
        # the thread finishes the answers just after it reports the job
        deadline = time.monotonic() + 10
        while any(h.pending for h in answers):
            self.assertLess(time.monotonic(), deadline, "answers never finished")
            time.sleep(0.001)
        return done[job]

    def settled(self):
        """Wait until no job of the socket is out; what came back."""
        deadline = time.monotonic() + 10
        while not self.s.settle():
            self.assertLess(time.monotonic(), deadline, "never settled")
            readable(self.thread.fileno(), 0.1)
            self.thread.ready()
        return self.s.returned()

    def test_sent_once_durable(self):
        held = self.s.hold(b"answer")
        self.assertTrue(held.pending)
        self.assertEqual(self.s.inflight, 1)
        self.assertEqual(drain_socket(self.b), b"")       # not before the fsync
        self.assertEqual(self.run_job([self.fd], 1, [held]), 0)
        self.assertTrue(held.sent)
        self.assertFalse(held.pending)
        self.assertEqual(self.settled(), ([], 0))
        self.assertEqual(drain_socket(self.b), b"answer")
        held.cancel()                                       # too late: a no-op
        self.assertTrue(held.sent)

    def test_later_sends_wait_behind_it(self):
        """What the connection sends meanwhile comes back to the caller (who
        queues it, as for a blocked socket) and may go once it is done."""
        held = self.s.hold(b"first")
        self.assertFalse(self.s.send(b"second"))
        self.assertIsNone(self.s.hold(b"another"))         # one at a time
        self.run_job([self.fd], 1, [held])
        self.assertEqual(self.settled(), ([], 0))
        self.assertTrue(self.s.unblock())
        self.assertTrue(self.s.send(b"second"))
        self.settled()
        self.assertEqual(drain_socket(self.b), b"firstsecond")

    def test_a_send_racing_the_held_one_goes_after_it(self):
        """The reactor, told of the fsync, may answer the next request while
        the fsync's thread still sends the held one: that send comes back
        (to the reactor's queue) until the held one is out, never ahead."""
        self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self.b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        first = b"A" * 60000      # long enough for the send to take a while
        for _ in range(30):
            held = self.s.hold(first)
            job = self.syncer.submit([self.fd], None, 1, [held])
            deadline = time.monotonic() + 10
            while not self.s.send(b"B"):
                self.assertLess(time.monotonic(), deadline)
                if not held.pending and self.s.settle():
                    self.s.returned()
                    self.s.unblock()
            self.assertTrue(held.sent)
            self.assertEqual(self.settled(), ([], 0))
            got = b""
            while len(got) < len(first) + 1:
                self.assertTrue(readable(self.b.fileno(), 10))
                got += drain_socket(self.b)
            self.assertEqual(got, first + b"B")
            readable(self.syncer.fileno(), 10)
            self.assertIn(job, [j for j, _, _ in self.syncer.completed()])

    def test_behind_sends_still_out(self):
        """Held after sends the thread has not made yet: it goes after them."""
        chunks = [b"%06d" % i for i in range(200)]
        for c in chunks:
            self.assertTrue(self.s.send(c))
        held = self.s.hold(b"|held")
        self.assertIsNotNone(held)
        self.run_job([self.fd], 1, [held])
        self.assertTrue(held.sent)
        self.assertEqual(self.settled(), ([], 0))
        self.assertEqual(drain_socket(self.b), b"".join(chunks) + b"|held")

    def test_a_failed_fsync_cancels_it(self):
        held = self.s.hold(b"answer")
        self.assertEqual(self.run_job([BAD_FD], 1, [held]), errno.EBADF)
        self.assertFalse(held.sent)
        self.assertFalse(held.pending)
        self.assertEqual(self.settled(), ([], 0))
        self.assertEqual(drain_socket(self.b), b"")
        self.assertTrue(self.s.send(b"error"))              # the caller answers instead
        self.settled()
        self.assertEqual(drain_socket(self.b), b"error")

    def test_nothing_sent_on_a_lane_after_it_failed(self):
        """A later fsync's success does not make durable what the failed
        one lost: the lane's answers are never sent from the thread again;
        other lanes' are."""
        self.run_job([BAD_FD], 7, [self.s.hold(b"x")])
        self.settled()
        later = self.s.hold(b"later")
        self.assertEqual(self.run_job([self.fd], 7, [later]), 0)
        self.assertFalse(later.sent)
        self.settled()
        other = self.s.hold(b"other")
        self.assertEqual(self.run_job([self.fd], 8, [other]), 0)
        self.assertTrue(other.sent)
        self.settled()
        self.assertEqual(drain_socket(self.b), b"other")

    def test_several_connections_in_order(self):
        c, d = socket.socketpair()
        self.addCleanup(c.close)
        self.addCleanup(d.close)
        d.setblocking(False)
        s2 = self.thread.socket(os.dup(c.fileno()), 2)
        self.addCleanup(s2.close)
        one, two = self.s.hold(b"one"), s2.hold(b"two")
        self.assertEqual(self.run_job([self.fd], 1, [one, two]), 0)
        self.assertTrue(one.sent and two.sent)
        self.assertTrue(readable(self.b.fileno(), 10) and readable(d.fileno(), 10))
        self.assertEqual((drain_socket(self.b), drain_socket(d)), (b"one", b"two"))

    def test_cancelled_before_its_fsync(self):
        held = self.s.hold(b"answer")
        held.cancel()
        self.assertFalse(held.pending or held.sent)
        self.assertEqual(self.s.inflight, 0)
        self.assertTrue(self.s.send(b"instead"))
        self.assertRaises(ValueError, self.syncer.submit, [self.fd], None, 1, [held])
        self.settled()
        self.assertEqual(drain_socket(self.b), b"instead")

    def test_given_once(self):
        held = self.s.hold(b"answer")
        self.syncer.submit([self.fd], None, 1, [held])
        self.assertRaises(ValueError, self.syncer.submit, [self.fd], None, 1, [held])
        self.assertRaises(TypeError, self.syncer.submit, [self.fd], None, 1, [b"not held"])
        self.assertRaises(TypeError, self.syncer.submit, [self.fd], None, 1, 3)

    def test_dropped_before_its_fsync(self):
        """Never given to a syncer and let go: cancelled, the connection free."""
        held = self.s.hold(b"answer")
        del held
        gc.collect()
        self.assertEqual(self.s.inflight, 0)
        self.assertTrue(self.s.send(b"next"))

    def test_a_closed_connection_gets_nothing(self):
        """The connection let go while its answer waits: not sent (the
        descriptor is closed once the answer is finished)."""
        held = self.s.hold(b"answer")
        self.s.close()
        self.run_job([self.fd], 1, [held])
        self.assertFalse(held.sent)
        self.assertEqual(drain_socket(self.b), b"")

    def test_what_the_socket_does_not_take_comes_back(self):
        self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = bytes(range(256)) * 4096      # 1 MiB: far more than the pair holds
        held = self.s.hold(big)
        self.run_job([self.fd], 1, [held])
        self.assertTrue(held.sent)           # handed to the socket; the rest is the reactor's
        back, error = self.settled()
        self.assertEqual(error, 0)
        self.assertEqual(drain_socket(self.b) + b"".join(back), big)

    def test_peek_shows_done_jobs_until_taken(self):
        """What a reader's catch-up looks at: the jobs done, whether their
        answers went out, left for completed()."""
        held = self.s.hold(b"a")
        job = self.syncer.submit([self.fd], None, 1, [held])
        self.assertTrue(readable(self.syncer.fileno(), 10))
        self.assertEqual(self.syncer.peek(), [(job, True)])
        self.assertEqual(self.syncer.peek(), [(job, True)])
        self.assertEqual([j for j, _, _ in self.syncer.completed()], [job])
        self.assertEqual(self.syncer.peek(), [])
        # without answers, or with answers its failed fsync did not send
        bare = self.syncer.submit([self.fd], None, 1)
        self.assertTrue(readable(self.syncer.fileno(), 10))
        self.assertEqual(self.syncer.peek(), [(bare, False)])
        self.syncer.completed()
        self.settled()
        failed = self.syncer.submit([BAD_FD], None, 2, [self.s.hold(b"b")])
        self.assertTrue(readable(self.syncer.fileno(), 10))
        self.assertEqual(self.syncer.peek(), [(failed, False)])

    def test_a_closed_thread_holds_nothing(self):
        self.thread.close()
        self.assertIsNone(self.s.hold(b"answer"))


class SocketSenderHeldTests(unittest.TestCase):
    """L{SocketSender.hold} and L{SocketSender.finish_held} over real TCP,
    with L{syncer.NativeSyncer} on the reactor."""

    timeout = 60

    def setUp(self):
        _require()
        self.syncer = syncer.NativeSyncer(reactor)
        self.addCleanup(self.syncer.close)
        fd, path = tempfile.mkstemp()
        self.addCleanup(os.unlink, path)
        self.addCleanup(os.close, fd)
        self.fd = fd

    @defer.inlineCallbacks
    def sender(self):
        server, client = yield loopback_pair(self)
        counted = []
        sender = SocketSender(server.transport, reactor, eager=True, native=True,
                              on_sent=counted.append)
        return server, client, sender, counted

    @defer.inlineCallbacks
    def received(self, server, client, sender):
        """Once C{sender} has sent everything and the connection is closed:
        what the client got."""
        yield sender.when_drained()
        sender.close()
        server.transport.loseConnection()
        received = yield client.done
        return received

    @defer.inlineCallbacks
    def test_held_then_written_in_order(self):
        server, client, sender, counted = yield self.sender()
        held = sender.hold(b"held;")
        self.assertIsNotNone(held)
        self.assertTrue(self.syncer.sends_answers)
        d = self.syncer.sync([self.fd], None, 1, [held])
        sender.write(b"after;")                 # waits behind the held answer
        sender.write(b"more")
        yield d
        self.assertTrue(sender.finish_held(held, 5))
        received = yield self.received(server, client, sender)
        self.assertEqual(received, b"held;after;more")
        self.assertEqual(sum(counted), len(received))
        self.assertEqual(sender.sent, len(received))

    @defer.inlineCallbacks
    def test_failed_fsync_then_the_caller_writes(self):
        server, client, sender, counted = yield self.sender()
        held = sender.hold(b"ok")
        d = self.syncer.sync([BAD_FD], None, 1, [held])
        yield self.assertFailure(d, OSError)
        self.assertFalse(sender.finish_held(held, 2))
        sender.write(b"error")
        received = yield self.received(server, client, sender)
        self.assertEqual(received, b"error")
        self.assertEqual(sum(counted), 5)

    @defer.inlineCallbacks
    def test_not_held_while_output_waits(self):
        server, client, sender, _ = yield self.sender()
        first = sender.hold(b"a")
        self.assertIsNone(sender.hold(b"b"))     # one at a time
        sender.write(b"queued")
        self.assertIsNone(sender.hold(b"c"))     # output waits in the queue
        yield self.syncer.sync([self.fd], None, 1, [first])
        self.assertTrue(sender.finish_held(first, 1))
        received = yield self.received(server, client, sender)
        self.assertEqual(received, b"aqueued")

    @defer.inlineCallbacks
    def test_the_thread_syncer_cancels_answers(self):
        """Without the native syncer the reactor answers: what it is given is
        cancelled, never sent."""
        server, client, sender, _ = yield self.sender()
        held = sender.hold(b"never")
        threads = syncer.ThreadSyncer(synchronous, DirectoryIO())
        self.assertFalse(threads.sends_answers)
        yield threads.sync([self.fd], None, 1, [held])
        self.assertFalse(sender.finish_held(held, 5))
        sender.write(b"instead")
        received = yield self.received(server, client, sender)
        self.assertEqual(received, b"instead")
