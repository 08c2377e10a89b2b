"""L{streamproto.core.observer}: the waiters every protocol shares."""

from twisted.internet.defer import CancelledError, Deferred
from twisted.trial import unittest

from streamproto.core.observer import Observers, OneShotObserver, SharedCall


class ObserversTests(unittest.SynchronousTestCase):

    def test_next_occurrence(self):
        """A waiter gets the next occurrence only; one added later waits for the one after."""
        o = Observers()
        first = o.when()
        self.assertNoResult(first)
        o.fire(1)
        self.assertEqual(self.successResultOf(first), 1)
        second = o.when()
        self.assertNoResult(second)
        o.fire(2)
        self.assertEqual(self.successResultOf(second), 2)

    def test_each_waiter_its_own_result(self):
        """One waiter's callbacks never change what another receives."""
        o = Observers()
        a, b = o.when(), o.when()
        a.addCallback(lambda r: r + ["changed"])
        o.fire([])
        self.assertEqual(self.successResultOf(b), [])

    def test_waiter_added_while_firing_waits(self):
        o = Observers()
        later = []
        o.when().addCallback(lambda _: later.append(o.when()))
        o.fire("now")
        self.assertNoResult(later[0])
        self.assertEqual(len(o), 1)

    def test_fail(self):
        o = Observers()
        d = o.when()
        o.fail(ValueError("no"))
        self.failureResultOf(d, ValueError)

    def test_take(self):
        """The waiters taken are the caller's to fire; later ones wait for the next."""
        o = Observers()
        a, b = o.when(), o.when()
        taken = o.take()
        self.assertEqual(taken, [a, b])
        later = o.when()
        o.fire("next")
        self.assertNoResult(a)
        self.assertEqual(self.successResultOf(later), "next")
        for d in taken:
            d.callback("mine")
        self.assertEqual(self.successResultOf(b), "mine")

    def test_cancel_forgets(self):
        o = Observers()
        d = o.when()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(len(o), 0)
        o.fire(None)


class OneShotObserverTests(unittest.SynchronousTestCase):

    def test_before_and_after(self):
        o = OneShotObserver()
        before = o.when_fired()
        self.assertFalse(o.fired)
        o.fire("closed")
        o.fire("again")    # it happens once
        self.assertTrue(o.fired)
        self.assertEqual(self.successResultOf(before), "closed")
        self.assertEqual(self.successResultOf(o.when_fired()), "closed")

    def test_failure_latched(self):
        from twisted.python.failure import Failure
        o = OneShotObserver()
        before = o.when_fired()
        o.fire(Failure(KeyError("gone")))
        self.failureResultOf(before, KeyError)
        self.failureResultOf(o.when_fired(), KeyError)


class SharedCallTests(unittest.SynchronousTestCase):

    def test_callers_share_one_run(self):
        calls = []

        def connect():
            calls.append(Deferred())
            return calls[-1]
        shared = SharedCall(connect)
        a, b = shared(), shared()
        self.assertEqual(len(calls), 1)
        self.assertTrue(shared.running)
        calls[0].callback("up")
        self.assertEqual((self.successResultOf(a), self.successResultOf(b)), ("up", "up"))
        self.assertFalse(shared.running)
        c = shared()
        self.assertEqual(len(calls), 2)       # runs again once finished
        calls[1].errback(OSError("down"))
        self.failureResultOf(c, OSError)

    def test_shared_per_arguments(self):
        calls = {}

        def open_log(name):
            calls[name] = Deferred()
            return calls[name]
        shared = SharedCall(open_log)
        a1, b, a2 = shared("a"), shared("b"), shared("a")
        self.assertEqual(sorted(calls), ["a", "b"])
        calls["a"].callback("log a")
        self.assertEqual((self.successResultOf(a1), self.successResultOf(a2)),
                         ("log a", "log a"))
        self.assertNoResult(b)
        self.assertTrue(shared.running)
        calls["b"].callback("log b")
        self.assertFalse(shared.running)

    def test_synchronous_results_and_exceptions(self):
        self.assertEqual(self.successResultOf(SharedCall(lambda: 3)()), 3)

        def broken():
            raise RuntimeError("bug")
        shared = SharedCall(broken)
        self.failureResultOf(shared(), RuntimeError)
        self.assertFalse(shared.running)
