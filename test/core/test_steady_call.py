"""L{SteadyCall}: a timer a step of the wall clock cannot fire early."""

from twisted.internet import task
from twisted.trial.unittest import SynchronousTestCase

from streamproto.core.clock import SteadyCall


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
