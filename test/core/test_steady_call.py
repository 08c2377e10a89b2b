"""
L{SteadyCall}: a timer a step of the wall clock cannot fire early; and
L{steady_timers}: a reactor whose timers no step moves.
"""

import time

from twisted.internet import task
from twisted.trial.unittest import SynchronousTestCase

from streamproto.base.clock import SteadySeconds
from streamproto.core.clock import SteadyCall, monotonic_seconds, steady_timers, wall_seconds


class SteadyCallTests(SynchronousTestCase):
    def setUp(self):
        self.wall = task.Clock()
        self.mono = [0.0]
        self.calls = []
        self.call = SteadyCall(self.wall, 10, self.calls.append, "x",
                               monotonic=lambda: self.mono[0])

    def elapse(self, seconds):
        self.mono[0] += seconds
        self.wall.advance(seconds)

    def test_on_time(self):
        self.elapse(9.5)
        self.assertEqual(self.calls, [])
        self.elapse(0.5)
        self.assertEqual(self.calls, ["x"])
        self.assertFalse(self.call.active())

    def test_forward_step_waits_the_rest(self):
        self.elapse(4)
        self.wall.advance(7200)
        self.assertEqual(self.calls, [])
        self.assertTrue(self.call.active())
        self.elapse(5.9)
        self.assertEqual(self.calls, [])
        self.elapse(0.1)
        self.assertEqual(self.calls, ["x"])

    def test_cancel(self):
        self.wall.advance(7200)     # re-armed
        self.call.cancel()
        self.assertFalse(self.call.active())
        self.elapse(20)
        self.assertEqual(self.calls, [])
        self.call.cancel()          # again: nothing to do

    def test_default_clock_is_its_own_monotonic(self):
        wall = task.Clock()
        SteadyCall(wall, 10, self.calls.append, "y")
        wall.advance(10)
        self.assertEqual(self.calls, ["y"])


class _Times:
    """A wall clock that steps and a monotonic clock that does not."""

    def __init__(self):
        self.now_wall, self.now_mono = 1_800_000_000.0, 50.0

    def wall(self):
        return self.now_wall

    def mono(self):
        return self.now_mono

    def elapse(self, seconds):
        self.now_wall += seconds
        self.now_mono += seconds

    def step(self, seconds):
        self.now_wall += seconds


class SteadyTimersTests(SynchronousTestCase):
    """
    L{steady_timers}: a real reactor's timers (its C{callLater} queue, run
    by C{runUntilCurrent} as its loop does) neither fire early after a
    forward step of the wall clock nor late after a step back.
    """

    def setUp(self):
        from twisted.internet.selectreactor import SelectReactor
        self.times = _Times()
        self.reactor = SelectReactor()   # never run: its queue is driven here
        self.addCleanup(self.reactor.disconnectAll)
        self.fired = []

    def steady(self):
        self.assertTrue(steady_timers(self.reactor,
                                      SteadySeconds(self.times.wall, self.times.mono)))

    def on_wall_clock(self):
        """The reactor as it is without: its time is the wall clock."""
        self.reactor.seconds = self.times.wall

    def schedule(self, delay=10):
        self.reactor.callLater(delay, self.fired.append, "x")

    def run_timers(self):
        self.reactor.runUntilCurrent()

    def test_step_back_does_not_delay(self):
        self.steady()
        self.schedule()
        self.times.step(-3600)
        self.times.elapse(9.9)
        self.run_timers()
        self.assertEqual(self.fired, [])
        self.times.elapse(0.1)
        self.run_timers()
        self.assertEqual(self.fired, ["x"])

    def test_step_forward_does_not_fire_early(self):
        self.steady()
        self.schedule()
        self.times.step(3600)
        self.times.elapse(1)
        self.run_timers()
        self.assertEqual(self.fired, [])
        self.times.elapse(9)
        self.run_timers()
        self.assertEqual(self.fired, ["x"])

    def test_without_it_a_step_back_delays(self):
        """What it is for: on the wall clock the same timer waits the step too."""
        self.on_wall_clock()
        self.schedule()
        self.times.step(-3600)
        self.times.elapse(10)
        self.run_timers()
        self.assertEqual(self.fired, [])
        self.times.elapse(3600)
        self.run_timers()
        self.assertEqual(self.fired, ["x"])

    def test_wall_time_still_told(self):
        """Starts at the wall time; L{wall_seconds} and L{monotonic_seconds}
        give the clocks themselves, for instants and durations."""
        self.steady()
        self.assertEqual(self.reactor.seconds(), self.times.wall())
        self.times.step(-3600)
        self.assertEqual(wall_seconds(self.reactor)(), self.times.wall())
        self.assertEqual(self.reactor.seconds(), self.times.wall() + 3600)
        self.assertEqual(monotonic_seconds(self.reactor), self.times.mono)

    def test_only_a_wall_clock_reactor(self):
        """A test's clock is left alone, and so is a reactor made steady already."""
        clock = task.Clock()
        self.assertFalse(steady_timers(clock))
        self.assertEqual(wall_seconds(clock), clock.seconds)
        self.reactor.seconds = time.time
        self.assertTrue(steady_timers(self.reactor))
        self.assertIsInstance(self.reactor.seconds, SteadySeconds)
        self.assertFalse(steady_timers(self.reactor))
        self.assertLess(abs(self.reactor.seconds() - time.time()), 1.0)
