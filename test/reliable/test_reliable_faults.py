"""
Fault injection: clients stream through an in-memory network that delivers
bytes in random chunks, cuts connections at random points (losing whatever
was in flight, sometimes telling the server only much later), and refuses
some reconnection attempts.  Hundreds of seeded runs; each must end with
the whole sequence exactly once and the right CRC.
"""

import os
import random
import zlib
from struct import pack

from twisted.internet import defer, error, reactor, task
from twisted.internet.address import IPv4Address
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from streamproto.reliable import codec
from streamproto.reliable.client import StatefulClient, StatelessClient, _StatefulSession
from streamproto.reliable.errors import StreamGaveUp
from streamproto.reliable.mt19937 import first_random_int
from streamproto.reliable.server import ReliableStreamFactory
from streamproto.reliable.session import MemorySessionStore, SQLiteSessionStore
from test.support.memnet import CLIENT, SERVER, Connection
from test.reliable.test_reliable_server import TurnClock
from test.reliable.test_reliable_session import crash

SERVER_ADDRESS = IPv4Address("TCP", "10.0.0.1", 7341)
CLIENT_ADDRESS = IPv4Address("TCP", "10.0.0.2", 40000)


class Network:
    """
    Connections on demand, each a L{Connection} moved in random chunks and
    cut at random (sometimes telling the server only much later), and
    refused connection attempts.
    """

    def __init__(self, rng, clock, server_factory, cut_rate, refuse_rate):
        self.rng = rng
        self.clock = clock
        self.server_factory = server_factory
        self.cut_rate = cut_rate
        self.refuse_rate = refuse_rate
        self.links = []
        self.late = []
        self.failures_in_a_row = 0
        self.cuts = 0
        self.chunk = rng.choice([40, 400, 3000])

    def connect(self, client_factory):
        d = defer.Deferred()
        # At most 3 failed attempts in a row (refused, or cut before the
        # server said anything, which the client treats alike): 3 x 5 s
        # stays within the client's 30 s.
        if self.failures_in_a_row < 3 and self.rng.random() < self.refuse_rate:
            self.failures_in_a_row += 1
            self.clock.callLater(0, d.errback, error.ConnectionRefusedError())
            return d

        def established():
            server = self.server_factory.buildProtocol(CLIENT_ADDRESS)
            client = client_factory.buildProtocol(SERVER_ADDRESS)
            link = Connection(server, client, self.clock, server_address=SERVER_ADDRESS,
                              client_address=CLIENT_ADDRESS)
            self.links.append(link)
            d.callback(client)
        self.clock.callLater(0, established)
        return d

    def cut(self, link, server_late=False):
        """The connection breaks: bytes in flight are lost."""
        if server_late:
            # half-open: the client knows, the server hears much later
            link.cut(tell=[CLIENT])
            self.late.append(link)
        elif self.rng.random() < 0.5:
            link.cut(tell=[SERVER, CLIENT])
        else:
            link.cut(tell=[CLIENT, SERVER])

    def deliver(self, link):
        """Move a random chunk each way; finish a clean close. True if anything happened."""
        before = link.delivered[CLIENT]
        moved = link.step(lambda: self.rng.randint(1, self.chunk))
        if link.delivered[CLIENT] > before:
            self.failures_in_a_row = 0
        return moved

    def step(self):
        moved = False
        for link in list(self.links):
            if not link.up:
                self.links.remove(link)
                continue
            if self.rng.random() < self.cut_rate and (
                    link.delivered[CLIENT] or self.failures_in_a_row < 3):
                if not link.delivered[CLIENT]:
                    self.failures_in_a_row += 1
                self.cuts += 1
                self.cut(link, server_late=self.rng.random() < 0.2)
                moved = True
            else:
                moved = self.deliver(link) or moved
        if self.late and self.rng.random() < 0.1:
            self.late.pop(0).notify(SERVER, Failure(error.ConnectionLost("noticed late")))
            moved = True
        return moved

    def run(self, d, max_steps=200000):
        for _ in range(max_steps):
            if d.called:
                for link in self.late:
                    link.notify(SERVER, Failure(error.ConnectionDone()))
                self.clock.advance(0)
                return
            moved = self.step()
            self.clock.advance(0)
            if not moved and not self.links and not self.late:
                # nothing on the wire: jump to the next timer (a retry wait)
                pending = [c.getTime() for c in self.clock.getDelayedCalls()]
                if pending:
                    self.clock.advance(max(0.0, min(pending) - self.clock.seconds()))
        raise AssertionError("the run did not finish")


class Endpoint:
    def __init__(self, network):
        self.network = network

    def connect(self, factory):
        return self.network.connect(factory)


class RecordingRandom(random.Random):
    """Remembers the seeds the server draws for new sessions."""

    def __init__(self, seed):
        super().__init__(seed)
        self.drawn = []

    def getrandbits(self, k):
        value = super().getrandbits(k)
        self.drawn.append(value)
        return value


def crc_of(values):
    crc = 0
    for v in values:
        crc = zlib.crc32(pack(">I", v), crc)
    return crc


class FaultInjectionTests(SynchronousTestCase):
    def setup_run(self, seed):
        rng = random.Random(seed)
        clock = TurnClock()
        store = MemorySessionStore(clock, expiry=30)
        server_rng = RecordingRandom(seed)
        factory = ReliableStreamFactory(store, clock=clock, rng=server_rng,
                                        window=rng.randint(1, 64), turn_batch=rng.randint(1, 64))
        network = Network(rng, clock, factory, cut_rate=rng.choice([0.02, 0.05, 0.1, 0.2]),
                          refuse_rate=rng.choice([0.0, 0.1, 0.3]))
        return rng, clock, store, server_rng, factory, network

    def test_stateful_runs(self):
        total_cuts = total_reconnects = 0
        for seed in range(200):
            rng, clock, store, server_rng, factory, network = self.setup_run(seed)
            count = rng.choice([1, 2, 15, 16, 17, rng.randint(1, 300)])
            client = StatefulClient(Endpoint(network), count, uuid=f"run-{seed}", clock=clock,
                                    ack_every=rng.choice([0, 1, 5, 16]), rng=rng)
            d = client.run()
            network.run(d)
            result = self.successResultOf(d)
            values = result.values
            self.assertEqual(len(values), count, seed)
            self.assertIn(values[0], [first_random_int(s) for s in server_rng.drawn], seed)
            for previous, value in zip(values, values[1:]):
                self.assertEqual(first_random_int(previous), value, seed)
            self.assertEqual(result.crc, crc_of(values), seed)
            total_cuts += network.cuts
            total_reconnects += result.reconnects
            # every session is let go and expires
            self.assertEqual(factory.active, {}, seed)
            clock.advance(31)
            clock.advance(0)
            self.assertNotIn(f"run-{seed}", store, seed)
        # the runs did exercise the faults
        self.assertGreater(total_cuts, 500)
        self.assertGreater(total_reconnects, 500)

    def test_stateless_runs(self):
        for seed in range(1000, 1100):
            rng, clock, store, server_rng, factory, network = self.setup_run(seed)
            count = rng.randint(1, 400)
            d = StatelessClient(Endpoint(network), count, clock=clock, rng=rng).run()
            network.run(d)
            values = [int(v) for v in self.successResultOf(d).values]
            self.assertEqual(len(values), count)
            self.assertTrue(1 <= values[0] <= 255)
            self.assertEqual(values, [values[0] << i for i in range(count)], seed)

    def attempts_after_server_vanishes(self, **client_options):
        rng, clock, store, server_rng, factory, network = self.setup_run(1)
        network.cut_rate = 0.0
        network.refuse_rate = 0.0
        d = StatefulClient(Endpoint(network), 2000, clock=clock, **client_options).run()
        for _ in range(5):
            network.step()
            clock.advance(0)
        self.assertNoResult(d)
        attempts_at = []
        original = network.connect

        def counting_connect(f):
            attempts_at.append(clock.seconds())
            return original(f)
        network.connect = counting_connect
        # the server goes away for good
        network.refuse_rate = 1.0
        network.failures_in_a_row = -1000
        clock.advance(3)
        dropped_at = clock.seconds()
        for link in network.links:
            link.cut()
        clock.advance(0)
        for _ in range(200):
            clock.advance(0.5)
            clock.advance(0)
        return d, dropped_at, attempts_at

    def test_reconnect_at_once_then_every_5_s_then_give_up(self):
        d, dropped_at, attempts_at = self.attempts_after_server_vanishes(jitter=0)
        self.failureResultOf(d, StreamGaveUp)
        self.assertEqual(attempts_at[0], dropped_at)
        self.assertEqual([b - a for a, b in zip(attempts_at, attempts_at[1:])], [5.0] * 6)
        self.assertLessEqual(attempts_at[-1] - dropped_at, 30)

    def test_backoff(self):
        d, dropped_at, attempts_at = self.attempts_after_server_vanishes(backoff=2.0,
                                                                        retry_delay=5.0,
                                                                        jitter=0)
        self.failureResultOf(d, StreamGaveUp)
        self.assertEqual([b - a for a, b in zip(attempts_at, attempts_at[1:])], [5.0, 10.0])

    def test_jittered_waits(self):
        """
        By default each wait is drawn between 5 and 7.5 s (never less than the
        spec's 5 s), and the client still gives up within 30 s.
        """
        d, dropped_at, attempts_at = self.attempts_after_server_vanishes(
            rng=random.Random(5))
        self.failureResultOf(d, StreamGaveUp)
        self.assertEqual(attempts_at[0], dropped_at)
        # the test clock moves in steps of 0.5 s
        gaps = [b - a for a, b in zip(attempts_at, attempts_at[1:])]
        self.assertGreaterEqual(len(gaps), 3)
        self.assertTrue(all(5.0 <= gap <= 8.0 for gap in gaps), gaps)
        self.assertGreater(len(set(gaps)), 1)
        self.assertLessEqual(attempts_at[-1] - dropped_at, 30)


class _ReferenceLikeSession(_StatefulSession):
    """
    The reference Ruby client's habit: on a reconnect it sends C{state} and,
    right behind it, the ack it could not deliver before the connection
    broke (the same id: it acks every 16th id as it arrives).  Here also,
    at random, when no ack was due.  The network splits and cuts these
    bytes at random, between the two lines too.
    """

    def __init__(self, *args, rng):
        super().__init__(*args)
        self.rng = rng

    def initial_message(self):
        first = super().initial_message()
        if self.last_id == 0:
            return first
        if self.last_id % (self.ack_every or 16) == 0 or self.rng.random() < 0.5:
            return first + codec.encode_ack(self.uuid, self.last_id)
        return first


class ReferenceLikeClient(StatefulClient):
    def __init__(self, *args, rng, **kwargs):
        super().__init__(*args, rng=rng, **kwargs)   # the backoff's jitter too
        self.rng = rng

    def _session(self):
        return _ReferenceLikeSession(self.count, self.uuid, self.ack_every, rng=self.rng)


class ResumeThenAckTests(SynchronousTestCase):
    """The fault-injection runs with a client that acks right behind its resume."""

    setup_run = FaultInjectionTests.setup_run

    def test_stateful_runs(self):
        resumes = 0
        for seed in range(300, 450):
            rng, clock, store, server_rng, factory, network = self.setup_run(seed)
            count = rng.choice([17, 33, rng.randint(20, 300)])
            client = ReferenceLikeClient(Endpoint(network), count, uuid=f"ref-{seed}",
                                         clock=clock, ack_every=16, rng=rng)
            d = client.run()
            network.run(d)
            result = self.successResultOf(d)
            self.assertEqual(len(result.values), count, seed)
            self.assertEqual(result.crc, crc_of(result.values), seed)
            resumes += result.reconnects
        self.assertGreater(resumes, 200)


class DurableFaultInjectionTests(TestCase):
    """
    The same network over the SQLite store, and in each run the server is
    killed (nothing queued is committed) and restarted on the same file at a
    random moment.  Commits run on the real reactor's database thread, the
    protocols on the fake clock.
    """

    timeout = 60

    @defer.inlineCallbacks
    def run_with_restart(self, seed, reference_like=False):
        rng = random.Random(seed)
        clock = TurnClock()
        path = os.path.join(self.mktemp(), "sessions.sqlite")
        stores = []

        def start_server():
            store = SQLiteSessionStore(path, clock=clock, expiry=30)
            stores.append(store)
            return ReliableStreamFactory(store, clock=clock, rng=RecordingRandom(rng.random()),
                                         window=rng.randint(1, 16),
                                         turn_batch=rng.randint(1, 16))
        network = Network(rng, clock, start_server(), cut_rate=rng.choice([0.0, 0.02, 0.05]),
                          refuse_rate=rng.choice([0.0, 0.1]))
        count = rng.randint(50, 400)
        if reference_like:
            client = ReferenceLikeClient(Endpoint(network), count, uuid=f"durable-{seed}",
                                         clock=clock, ack_every=16, rng=rng)
        else:
            client = StatefulClient(Endpoint(network), count, uuid=f"durable-{seed}",
                                    clock=clock, ack_every=rng.choice([0, 5, 16]), rng=rng)
        d = client.run()
        # kill the server once it has generated this many messages
        restart_when = rng.randint(1, count - 1)
        restarted_at = None
        steps = 0
        while not d.called:
            steps += 1
            session = stores[0]._table.sessions.get(f"durable-{seed}")
            if restarted_at is None and session and session.last_id >= restart_when:
                restarted_at = session.last_id
                crash(stores[-1])
                for link in list(network.links) + network.late:
                    link.cut()
                network.late = []
                network.server_factory = start_server()
            moved = network.step()
            clock.advance(0)
            if not moved and not network.links and not network.late:
                pending = [c.getTime() for c in clock.getDelayedCalls()]
                if pending:
                    clock.advance(max(0.0, min(pending) - clock.seconds()))
            if not moved or steps % 10 == 0:
                # let the database thread's commits come back
                yield task.deferLater(reactor, 0.001, lambda: None)
            self.assertLess(steps, 100000)
        result = yield d
        self.assertEqual(len(result.values), count, seed)
        for previous, value in zip(result.values, result.values[1:]):
            self.assertEqual(first_random_int(previous), value, seed)
        self.assertEqual(result.crc, crc_of(result.values), seed)
        for store in stores[1:]:
            yield store.close()
        # the server was killed before the client had everything
        self.assertIsNotNone(restarted_at, seed)

    @defer.inlineCallbacks
    def test_runs_with_a_server_restart(self):
        for seed in range(2000, 2015):
            yield self.run_with_restart(seed)

    @defer.inlineCallbacks
    def test_ack_right_behind_the_resume(self):
        """
        The reference client's resume (C{state}, then at once the ack it
        could not deliver) on the durable store, whose ack and replay take
        a commit: the ack must wait for them.
        """
        for seed in range(2100, 2115):
            yield self.run_with_restart(seed, reference_like=True)
