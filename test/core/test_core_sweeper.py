"""
L{streamproto.core.sweeper}: many deadlines on one reactor call, on a
L{Clock} (no real time), and the styx/0 streams that use it.
"""

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest

from streamproto.core.idle import IdleTimeout
from streamproto.core.sweeper import Sweeper, shared_sweeper
from streamproto.log import MemoryLogStore
from streamproto.styx.codec import HEARTBEAT_BYTES
from streamproto.styx.stream import ProducerStream


class SweeperTests(unittest.SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.sweeper = Sweeper(self.clock)
        self.fired = []

    def deadline(self, name):
        return self.sweeper.deadline(lambda: self.fired.append((name, self.clock.seconds())))

    def test_fires_at_its_time(self):
        """A deadline fires at its exact time, once, and is then not active."""
        d = self.deadline("a")
        self.assertFalse(d.active)
        d.arm(5)
        self.assertTrue(d.active)
        self.clock.advance(4.999)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.001)
        self.assertEqual(self.fired, [("a", 5.0)])
        self.assertFalse(d.active)
        self.clock.advance(100)
        self.assertEqual(self.fired, [("a", 5.0)])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_wall_clock_step_forward(self):
        """
        A real reactor's timers follow the wall clock: a step of it forward
        runs the sweeper's call at once.  Deadlines are on the monotonic
        clock, so nothing times out early; the call is made again for the
        rest (before, every idle connection timed out on the step).
        """
        monotonic = [0.0]
        self.sweeper.now = lambda: monotonic[0]
        d = self.deadline("a")
        d.arm(30)
        self.clock.advance(3600)            # the wall clock steps an hour forward
        self.assertEqual(self.fired, [])
        self.assertTrue(d.active)
        monotonic[0] = 29.0
        self.clock.advance(29)
        self.assertEqual(self.fired, [])
        monotonic[0] = 30.0
        self.clock.advance(1)
        self.assertEqual([name for name, _ in self.fired], ["a"])

    def test_real_reactor_uses_the_monotonic_clock(self):
        import time
        from twisted.internet import reactor
        self.assertIs(Sweeper(reactor).now, time.monotonic)
        self.assertEqual(Sweeper(self.clock).now, self.clock.seconds)

    def test_one_reactor_call_for_many(self):
        """A thousand deadlines hold one reactor call, at the earliest;
        each fires at its own time, in order."""
        deadlines = [self.deadline(i) for i in range(1000)]
        for i, d in enumerate(deadlines):
            d.arm(1000 - i)
        calls = self.clock.getDelayedCalls()
        self.assertEqual(len(calls), 1)
        self.assertEqual(calls[0].getTime(), 1)
        self.clock.pump([1] * 1000)
        self.assertEqual(self.fired, [(999 - i, i + 1.0) for i in range(1000)])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_later_moves_no_reactor_call(self):
        """Arming later (activity) leaves the reactor call where it is, and
        the deadline fires at its new time, not the old one."""
        d = self.deadline("a")
        d.arm(10)
        call = self.clock.getDelayedCalls()[0]
        for _ in range(9):
            self.clock.advance(1)
            d.arm(10)
        self.assertEqual(self.clock.getDelayedCalls(), [call])
        self.assertEqual(len(self.sweeper), 1)
        self.clock.advance(1)       # t=10, the first time: moved, not fired
        self.assertEqual(self.fired, [])
        self.clock.advance(8.5)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.5)
        self.assertEqual(self.fired, [("a", 19.0)])

    def test_sooner(self):
        """Arming sooner fires at the sooner time, once."""
        d = self.deadline("a")
        d.arm(10)
        d.arm(3)
        self.clock.advance(3)
        self.assertEqual(self.fired, [("a", 3.0)])
        self.clock.advance(10)
        self.assertEqual(self.fired, [("a", 3.0)])

    def test_cancel(self):
        """A cancelled deadline does not fire; with none left armed, no
        reactor call is left behind."""
        a, b = self.deadline("a"), self.deadline("b")
        a.arm(5)
        b.arm(6)
        a.cancel()
        self.assertFalse(a.active)
        self.clock.advance(5)
        self.assertEqual(self.fired, [])
        b.cancel()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(len(self.sweeper), 0)
        a.arm(1)        # armed again after the heap was cleared
        self.clock.advance(1)
        self.assertEqual(self.fired, [("a", 6.0)])

    def test_rearm_in_callback(self):
        """A callback arming its own deadline again (a heartbeat) repeats."""
        times = []

        def beat():
            times.append(self.clock.seconds())
            d.arm(2)
        d = self.sweeper.deadline(beat)
        d.arm(2)
        self.clock.pump([1] * 7)
        self.assertEqual(times, [2.0, 4.0, 6.0])

    def test_failing_callback(self):
        """One callback raising does not keep the others due from firing."""
        def boom():
            raise ZeroDivisionError()
        self.sweeper.deadline(boom).arm(1)
        self.deadline("b").arm(1)
        self.deadline("c").arm(2)
        self.clock.advance(1)
        self.assertEqual(self.fired, [("b", 1.0)])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.clock.advance(1)
        self.assertEqual(self.fired, [("b", 1.0), ("c", 2.0)])

    def test_cancelled_entries_dropped(self):
        """The entries of cancelled deadlines (closed connections) do not
        pile up until their time: the heap is compacted."""
        keep = self.deadline("keep")
        keep.arm(1000)
        for i in range(1000):
            d = self.deadline(i)
            d.arm(500)
            d.cancel()
        self.assertLess(len(self.sweeper), 100)
        self.clock.advance(1000)
        self.assertEqual(self.fired, [("keep", 1000.0)])

    def test_moved_sooner_then_cancelled_after_compaction(self):
        """A deadline whose entries were dropped by a compaction is queued
        again when armed again."""
        others = [self.deadline(i) for i in range(200)]
        for d in others:
            d.arm(50)
        a = self.deadline("a")
        a.arm(100)
        a.cancel()
        for d in others[:150]:
            d.cancel()      # compacts, dropping a's entry
        a.arm(10)
        self.clock.advance(10)
        self.assertEqual(self.fired, [("a", 10.0)])

    def test_shared(self):
        """One sweeper per clock."""
        other = Clock()
        self.assertIs(shared_sweeper(self.clock), shared_sweeper(self.clock))
        self.assertIsNot(shared_sweeper(self.clock), shared_sweeper(other))
        self.assertIs(shared_sweeper(other).clock, other)


class IdleTimeoutOnSweeperTests(unittest.SynchronousTestCase):
    """L{IdleTimeout}s share their clock's sweeper."""

    def test_one_reactor_call(self):
        """Many running idle timeouts, reset on activity, hold one reactor
        call between them (it was one each, reset on every message)."""
        clock = Clock()
        expired = []
        timeouts = [IdleTimeout(clock, 30, lambda i=i: expired.append(i)) for i in range(500)]
        for t in timeouts:
            t.start()
        clock.advance(10)
        for t in timeouts[:250]:
            t.reset()
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        clock.advance(20)
        self.assertEqual(sorted(expired), list(range(250, 500)))
        clock.advance(10)
        self.assertEqual(sorted(expired), list(range(500)))
        self.assertEqual(clock.getDelayedCalls(), [])


class StyxStreamTimersTests(unittest.SynchronousTestCase):
    """styx/0 streams keep their heartbeat and idle timeout on the sweeper."""

    def test_idle_streams_share_one_reactor_call(self):
        """A thousand open streams: one reactor call for all their heartbeats
        and idle timeouts (two per stream before); each still heartbeats,
        and a silent one still times out."""
        clock = Clock()
        store = MemoryLogStore(clock)
        log = store.create("log").result
        transports = []
        streams = []
        for _ in range(1000):
            t = StringTransport()
            s = ProducerStream(log, timeout=10, remote_timeout=6, clock=clock)
            s.makeConnection(t)
            transports.append(t)
            streams.append(s)
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        clock.advance(3)
        self.assertTrue(all(t.value() == HEARTBEAT_BYTES for t in transports))
        for s in streams[1:]:
            s.dataReceived(HEARTBEAT_BYTES)     # the peers' heartbeats
        clock.advance(7)
        self.assertTrue(transports[0].disconnecting)      # silent for 10 s
        self.assertFalse(any(t.disconnecting for t in transports[1:]))
        for t in transports:
            t.loseConnection()
        for s in streams:
            s.connectionLost(None)
        clock.advance(100)
        self.assertEqual(clock.getDelayedCalls(), [])
