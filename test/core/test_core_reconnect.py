"""L{streamproto.core.reconnect}: the backoff policy and the reconnector every client shares."""

import random

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from streamproto.core.failover import AllAddressesFailed, FailoverEndpoint
from streamproto.core.reconnect import DEFAULT_JITTER, Reconnector, backoff_policy
from streamproto.pravega.client import SegmentWriter


class FixedRandom:
    """A random source that returns what it is told."""

    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


class BackoffPolicyTests(SynchronousTestCase):

    def test_exponential_without_jitter(self):
        policy = backoff_policy(1.0, 5.0, 2.0, jitter=0)
        self.assertEqual([policy(n) for n in range(6)], [1.0, 2.0, 4.0, 5.0, 5.0, 5.0])

    def test_constant(self):
        policy = backoff_policy(5.0, 30.0, 1.0, jitter=0)
        self.assertEqual([policy(n) for n in range(4)], [5.0] * 4)

    def test_no_overflow(self):
        self.assertEqual(backoff_policy(1.0, 60.0, 10.0, jitter=0)(10 ** 6), 60.0)

    def test_jitter_bounds(self):
        """The nominal delay is the floor; up to jitter times more; never above the maximum."""
        low = backoff_policy(1.0, 60.0, 2.0, jitter=0.5, rng=FixedRandom(0.0))
        high = backoff_policy(1.0, 60.0, 2.0, jitter=0.5, rng=FixedRandom(0.999999))
        self.assertEqual([low(n) for n in range(4)], [1.0, 2.0, 4.0, 8.0])
        for n, nominal in enumerate([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]):
            self.assertAlmostEqual(high(n), min(60.0, nominal * 1.5), places=4)
        self.assertEqual(high(6), 60.0)     # 64 capped: the maximum holds
        self.assertEqual(high(100), 60.0)

    def test_jitter_is_random_and_bounded(self):
        """Seeded, the waits are reproducible, spread out, and within the bounds."""
        policy = backoff_policy(5.0, 30.0, 1.0, jitter=0.5, rng=random.Random(7))
        waits = [policy(0) for _ in range(200)]
        self.assertTrue(all(5.0 <= w <= 7.5 for w in waits), waits)
        self.assertGreater(len(set(waits)), 150)
        self.assertLess(min(waits), 5.2)
        self.assertGreater(max(waits), 7.3)
        again = backoff_policy(5.0, 30.0, 1.0, jitter=0.5, rng=random.Random(7))
        self.assertEqual([again(0) for _ in range(200)], waits)

    def test_default_jitter(self):
        policy = backoff_policy(1.0, 10.0)
        waits = [policy(1) for _ in range(50)]
        self.assertTrue(all(2.0 <= w <= 2.0 * (1 + DEFAULT_JITTER) for w in waits), waits)
        self.assertGreater(len(set(waits)), 1)

    def test_negative_jitter(self):
        self.assertRaises(ValueError, backoff_policy, 1.0, 2.0, jitter=-0.1)


class Connections:
    """The connect callable of a reconnector: each attempt a Deferred the test settles."""

    def __init__(self):
        self.attempts = []
        self.cancelled = 0

    def __call__(self):
        d = Deferred(self._cancel)
        self.attempts.append(d)
        return d

    def _cancel(self, d):
        self.cancelled += 1
        d.errback(ConnectionRefusedError("cancelled"))

    def succeed(self):
        protocol = Protocol()
        protocol.makeConnection(StringTransport())
        self.attempts[-1].callback(protocol)
        return protocol

    def refuse(self):
        self.attempts[-1].errback(ConnectionRefusedError())


def lost(why=ConnectionLost):
    return Failure(why())


class ReconnectorTests(SynchronousTestCase):

    def make(self, initial=1.0, maximum=5.0, jitter=0, rng=random, connect=None, **kwargs):
        self.clock = Clock()
        self.connections = Connections()
        self.connected = []
        self.cannot = []
        self.gave_up = []
        self.reconnector = Reconnector(
            connect or self.connections, self.clock, backoff_policy(initial, maximum, 2.0, jitter, rng),
            connected=self.connected.append,
            cannot_connect=lambda reason, delay: self.cannot.append((reason.type, delay)),
            gave_up=self.gave_up.append, **kwargs)
        return self.reconnector

    def test_connects_on_start(self):
        r = self.make()
        self.assertEqual(self.connections.attempts, [])
        r.start()
        r.start()   # already connecting: no second attempt
        self.assertEqual(len(self.connections.attempts), 1)
        protocol = self.connections.succeed()
        self.assertEqual(self.connected, [protocol])
        self.assertIs(r.protocol, protocol)
        r.start()
        self.assertEqual(len(self.connections.attempts), 1)

    def test_failed_attempts_back_off(self):
        r = self.make()
        r.start()
        for delay in [1.0, 2.0, 4.0, 5.0, 5.0]:
            attempts = len(self.connections.attempts)
            self.connections.refuse()
            self.assertEqual(self.cannot[-1], (ConnectionRefusedError, delay))
            self.clock.advance(delay - 0.001)
            self.assertEqual(len(self.connections.attempts), attempts)
            self.clock.advance(0.001)
            self.assertEqual(len(self.connections.attempts), attempts + 1)
        self.assertEqual(r.failures, 5)
        self.connections.succeed()
        # a connection made is no proof: the count goes on until progress()
        self.assertEqual(r.failures, 5)
        self.assertEqual(r.lost(lost()), 5.0)
        r.progress()
        self.assertEqual(r.failures, 0)

    def test_progress_starts_the_count_over(self):
        r = self.make()
        r.start()
        self.connections.refuse()
        self.clock.advance(1)
        self.connections.refuse()
        self.clock.advance(2)
        self.connections.succeed()
        r.progress()
        self.assertEqual(r.lost(lost()), 1.0)
        self.assertEqual(self.cannot, [(ConnectionRefusedError, 1.0),
                                       (ConnectionRefusedError, 2.0)])

    def test_lost_as_failure_waits(self):
        r = self.make()
        r.start()
        self.connections.succeed()
        self.assertEqual(r.lost(lost()), 1.0)
        self.assertIsNone(r.protocol)
        self.assertEqual(r.failures, 1)
        self.clock.advance(0.999)
        self.assertEqual(len(self.connections.attempts), 1)
        self.clock.advance(0.001)
        self.assertEqual(len(self.connections.attempts), 2)
        self.assertEqual(self.cannot, [])   # a loss is the client's to log

    def test_lost_after_working_reconnects_at_once(self):
        r = self.make()
        r.start()
        self.connections.succeed()
        self.assertEqual(r.lost(lost(), failed=False), 0)
        self.assertEqual(len(self.connections.attempts), 2)
        self.assertEqual(r.failures, 0)

    def test_lost_resting_waits_for_start(self):
        r = self.make()
        r.start()
        self.connections.succeed()
        self.assertIsNone(r.lost(lost(ConnectionDone), reconnect=False))
        self.clock.advance(100)
        self.assertEqual(len(self.connections.attempts), 1)
        r.start()
        self.assertEqual(len(self.connections.attempts), 2)

    def test_max_retries(self):
        """C{max_retries} failures in a row are retried; the next gives up."""
        r = self.make(max_retries=2)
        r.start()
        self.connections.refuse()
        self.clock.advance(1)
        self.connections.succeed()
        r.lost(lost())
        self.clock.advance(2)
        self.connections.refuse()
        self.assertEqual(self.cannot[-1], (ConnectionRefusedError, None))
        self.assertEqual(self.gave_up, [])   # from the clock, not from within the call
        self.clock.advance(0)
        [reason] = self.gave_up
        self.assertIsInstance(reason.value, ConnectionRefusedError)
        self.assertEqual(len(self.connections.attempts), 3)
        self.successResultOf(r.stop())
        r.start()
        self.clock.advance(100)
        self.assertEqual(len(self.connections.attempts), 3)

    def test_give_up_after(self):
        """No attempt beyond C{give_up_after} seconds since the connection was lost."""
        r = self.make(initial=5.0, maximum=30.0, give_up_after=30.0)
        r.start()
        self.connections.succeed()
        self.clock.advance(10)
        r.lost(lost(), failed=False)       # down since 10, reconnecting at once
        for _ in range(3):                  # at 10, 15, 25: then 45 would be too late
            self.connections.refuse()
            self.clock.advance(r.delay or 0)
        self.assertEqual(self.cannot, [(ConnectionRefusedError, 5.0),
                                       (ConnectionRefusedError, 10.0),
                                       (ConnectionRefusedError, None)])
        self.assertEqual(len(self.gave_up), 1)
        self.assertEqual(len(self.connections.attempts), 4)

    def test_give_up_clock_restarts_with_progress(self):
        r = self.make(initial=5.0, maximum=5.0, give_up_after=12.0)
        r.start()
        self.connections.refuse()      # down since 0
        self.clock.advance(5)
        self.connections.succeed()
        self.clock.advance(100)
        r.progress()
        r.lost(lost())                 # down since 105, first failure again
        self.assertEqual(r.delay, 5.0)
        self.clock.advance(5)
        self.connections.refuse()
        self.assertEqual(r.delay, 5.0)
        self.clock.advance(5)
        self.connections.refuse()      # 115 + 5 > 105 + 12
        self.assertIsNone(r.delay)
        self.clock.advance(0)
        self.assertEqual(len(self.gave_up), 1)

    def test_stop_while_waiting(self):
        r = self.make()
        r.start()
        self.connections.refuse()
        self.successResultOf(r.stop())
        self.clock.advance(100)
        self.assertEqual(len(self.connections.attempts), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_before_giving_up(self):
        r = self.make(max_retries=0)
        r.start()
        self.connections.refuse()
        self.successResultOf(r.stop())
        self.clock.advance(0)
        self.assertEqual(self.gave_up, [])

    def test_stop_while_connecting(self):
        r = self.make()
        r.start()
        self.successResultOf(r.stop())
        self.assertEqual(self.connections.cancelled, 1)
        self.assertEqual(self.cannot, [])
        self.clock.advance(100)
        self.assertEqual(len(self.connections.attempts), 1)

    def test_stop_while_connecting_late_success(self):
        """An attempt that connects as it is cancelled: its connection is dropped, unseen."""
        protocol = Protocol()
        transport = StringTransport()

        def connected_anyway(d):
            protocol.makeConnection(transport)
            d.callback(protocol)
        r = self.make(connect=lambda: Deferred(connected_anyway))
        r.start()
        self.successResultOf(r.stop())
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.connected, [])
        self.assertIsNone(r.protocol)

    def test_stop_while_connected_waits_for_the_loss(self):
        r = self.make()
        r.start()
        protocol = self.connections.succeed()
        stopped = r.stop()
        again = r.stop()
        self.assertTrue(protocol.transport.disconnecting)
        self.assertNoResult(stopped)
        r.lost(lost(ConnectionDone))
        self.successResultOf(stopped)
        self.successResultOf(again)
        self.successResultOf(r.stop())
        r.lost(lost())     # a late report changes nothing
        self.assertEqual(len(self.connections.attempts), 1)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_when_idle(self):
        r = self.make()
        self.successResultOf(r.stop())
        r.start()
        self.assertEqual(self.connections.attempts, [])

    def test_jittered_waits(self):
        """Through the reconnector too: seeded waits, between the bounds, not all alike."""
        r = self.make(initial=1.0, maximum=60.0, jitter=0.5, rng=random.Random(3))
        r.start()
        waits = []
        for _ in range(8):
            self.connections.refuse()
            waits.append(r.delay)
            self.clock.advance(r.delay)
        for n, wait in enumerate(waits):
            nominal = min(60.0, 2.0 ** n)
            self.assertTrue(nominal <= wait <= min(60.0, nominal * 1.5), (n, wait))
        self.assertEqual(len(set(w / min(60.0, 2.0 ** n) for n, w in enumerate(waits[:5]))), 5)


@implementer(IStreamClientEndpoint)
class Refusing:
    def __init__(self):
        self.attempts = 0

    def connect(self, factory):
        self.attempts += 1
        return fail(ConnectionRefusedError())


@implementer(IStreamClientEndpoint)
class Accepting:
    def connect(self, factory):
        protocol = factory.buildProtocol(None)
        protocol.makeConnection(StringTransport())
        return succeed(protocol)


class FailoverTests(SynchronousTestCase):
    """With a L{FailoverEndpoint}, one attempt tries every address once."""

    def test_round_then_backoff(self):
        clock = Clock()
        first, second = Refusing(), Refusing()
        endpoint = FailoverEndpoint([first, second], names=["a", "b"])
        reasons = []
        connected = []
        r = Reconnector(lambda: endpoint.connect(Factory.forProtocol(Protocol)), clock,
                        backoff_policy(1.0, 10.0, jitter=0), connected=connected.append,
                        cannot_connect=lambda reason, delay: reasons.append((reason, delay)))
        r.start()
        self.assertEqual((first.attempts, second.attempts), (1, 1))
        [(reason, delay)] = reasons
        self.assertIsInstance(reason.value, AllAddressesFailed)
        self.assertEqual(delay, 1.0)
        endpoint.endpoints[1] = Accepting()
        clock.advance(1)
        self.assertEqual(first.attempts, 2)
        self.assertEqual(len(connected), 1)
        self.assertEqual(endpoint.current, 1)


class PravegaWriterScheduleTests(SynchronousTestCase):
    """The Pravega segment writer's retries come from the core: jittered, limited."""

    def attempts(self, **options):
        clock = Clock()
        endpoint = Refusing()
        times = []
        real = endpoint.connect

        def connect(factory):
            times.append(clock.seconds())
            return real(factory)
        endpoint.connect = connect
        writer = SegmentWriter(endpoint, "scope/stream/0.#epoch.0", clock=clock,
                               retry_delay=0.05, max_retry_delay=0.3, max_retries=5,
                               keepalive_interval=0, **options)
        d = writer.write(b"event")
        for _ in range(2000):
            clock.advance(0.001)
        return times, d

    def test_exact(self):
        times, d = self.attempts(jitter=0)
        self.assertEqual([round(b - a, 6) for a, b in zip(times, times[1:])],
                         [0.05, 0.1, 0.2, 0.3, 0.3])
        failure = self.failureResultOf(d, ConnectionError)
        self.assertIn("ConnectionRefusedError", str(failure.value))

    def test_jittered(self):
        times, d = self.attempts(rng=random.Random(1))
        gaps = [b - a for a, b in zip(times, times[1:])]
        self.assertEqual(len(gaps), 5)
        for gap, nominal in zip(gaps, [0.05, 0.1, 0.2, 0.3, 0.3]):
            # the test clock moves in 1 ms steps
            self.assertTrue(nominal - 1e-9 <= gap <= min(0.3, nominal * 1.5) + 0.001,
                            (gap, nominal))
        self.assertNotEqual([round(g, 3) for g in gaps[:3]], [0.05, 0.1, 0.2])
        self.failureResultOf(d, ConnectionError)
