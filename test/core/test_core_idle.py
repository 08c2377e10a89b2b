"""L{streamproto.core.idle}: the idle timeout every server protocol shares."""

from twisted.internet.task import Clock
from twisted.trial import unittest

from streamproto.core.idle import IdleTimeout


class IdleTimeoutTests(unittest.SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.fired = []

    def make(self, seconds=10):
        return IdleTimeout(self.clock, seconds, lambda: self.fired.append(self.clock.seconds()))

    def test_not_running_until_started(self):
        """Nothing is scheduled before L{IdleTimeout.start}."""
        idle = self.make()
        self.assertFalse(idle.running)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(100)
        self.assertEqual(self.fired, [])

    def test_expires(self):
        """The callback runs once, C{seconds} after the start."""
        idle = self.make()
        idle.start()
        self.assertTrue(idle.running)
        self.clock.advance(9.5)
        self.assertEqual(self.fired, [])
        self.clock.advance(0.5)
        self.assertEqual(self.fired, [10])
        self.assertFalse(idle.running)
        self.clock.advance(100)
        self.assertEqual(self.fired, [10])

    def test_reset_on_activity(self):
        """L{IdleTimeout.reset} starts the countdown again from now."""
        idle = self.make()
        idle.start()
        self.clock.advance(7)
        idle.reset()
        self.clock.advance(9)
        self.assertEqual(self.fired, [])
        self.clock.advance(1)
        self.assertEqual(self.fired, [17])

    def test_reset_does_not_start(self):
        """Activity before the start, or after the expiry, schedules nothing."""
        idle = self.make()
        idle.reset()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        idle.start()
        self.clock.advance(10)
        idle.reset()
        self.assertFalse(idle.running)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_start_again_after_expiry(self):
        """A protocol that decides it was not idle after all starts a new period."""
        idle = self.make()
        idle.start()
        self.clock.advance(10)
        idle.start()
        self.clock.advance(10)
        self.assertEqual(self.fired, [10, 20])

    def test_start_while_running_restarts(self):
        """L{IdleTimeout.start} while running restarts; it never schedules twice."""
        idle = self.make()
        idle.start()
        self.clock.advance(5)
        idle.start()
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.advance(10)
        self.assertEqual(self.fired, [15])

    def test_pause_resume(self):
        """Paused time does not count; L{IdleTimeout.resume} starts a full period."""
        idle = self.make()
        idle.start()
        self.clock.advance(8)
        idle.pause()
        self.assertFalse(idle.running)
        idle.reset()                # activity while paused does not restart it
        idle.start()                # nor does a start
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(100)
        self.assertEqual(self.fired, [])
        idle.resume()
        self.clock.advance(9)
        self.assertEqual(self.fired, [])
        self.clock.advance(1)
        self.assertEqual(self.fired, [118])

    def test_resume_without_pause(self):
        """L{IdleTimeout.resume} when not paused changes nothing."""
        idle = self.make()
        idle.start()
        self.clock.advance(6)
        idle.resume()
        self.clock.advance(4)
        self.assertEqual(self.fired, [10])

    def test_cancel(self):
        """After L{IdleTimeout.cancel} (the connection is gone) nothing runs or starts."""
        idle = self.make()
        idle.start()
        idle.cancel()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        idle.start()
        idle.resume()
        idle.reset()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.clock.advance(100)
        self.assertEqual(self.fired, [])
        idle.cancel()               # twice is fine (connectionLost after a close)

    def test_cancel_paused(self):
        """A cancelled timer stays off even when L{IdleTimeout.resume} comes after."""
        idle = self.make()
        idle.start()
        idle.pause()
        idle.cancel()
        idle.resume()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_off(self):
        """None, 0 and infinity turn it off: L{IdleTimeout.start} schedules nothing."""
        for seconds in (None, 0, 0.0, float("inf")):
            idle = self.make(seconds)
            self.assertIsNone(idle.seconds)
            idle.start()
            idle.reset()
            idle.pause()
            idle.resume()
            self.assertFalse(idle.running)
            self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_bounds(self):
        """A negative or NaN timeout is refused (it would fire at once, or never)."""
        for seconds in (-1, -0.5, float("nan")):
            self.assertRaises(ValueError, self.make, seconds)
        self.assertEqual(self.make(2).seconds, 2.0)
