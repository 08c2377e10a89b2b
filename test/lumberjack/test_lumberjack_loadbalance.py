"""
The load-balancing Lumberjack client (Filebeat's C{loadbalance: true})
against real L{LumberjackServerFactory} servers over the in-memory network
(L{test.support.memnet}) on a fake clock: batches spread over every host, a dead
host's batches retried on the others with nothing lost, a host coming
back taking load again, slow start per connection, close.
"""

import json

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from streamproto.lumberjack.client import ClientClosed, LoadBalancingLumberjackClient
from streamproto.lumberjack.server import LumberjackServerFactory
from streamproto.lumberjack.sink import IEventSink
from test.support.memnet import Connection


@implementer(IEventSink)
class Disk:
    """
    Keeps what one server stored, as (connection number, events): durable at
    once, or C{delay} seconds of clock time later, or (C{hold}) never.
    """

    def __init__(self, clock):
        self.clock = clock
        self.delay = 0
        self.hold = False
        self.writes = []      # (connection number, [event n, ...])

    def write(self, connection, events):
        numbers = [json.loads(e)["n"] for e in events]
        if self.hold:
            return defer.Deferred()
        d = defer.Deferred()

        def durable():
            self.writes.append((connection.peer, numbers))
            d.callback(None)
        if self.delay:
            self.clock.callLater(self.delay, durable)
        else:
            durable()
        return d

    @property
    def stored(self):
        return [n for _, numbers in self.writes for n in numbers]


class Host:
    """
    One Lumberjack server on the in-memory network, and the endpoint of the
    client's connections to it; L{kill} cuts them all and refuses new ones
    until L{revive}.
    """

    def __init__(self, number, clock):
        self.number = number
        self.clock = clock
        self.disk = Disk(clock)
        self.factory = LumberjackServerFactory(self.disk, clock=clock, idle_timeout=0,
                                               keepalive_interval=0)
        self.links = []
        self.up = True
        self.attempts = []    # clock time of every connection attempt

    def connect(self, factory):
        self.attempts.append(self.clock.seconds())
        if not self.up:
            return defer.fail(ConnectionRefusedError(f"host {self.number} is down"))
        client = factory.buildProtocol(None)
        server = self.factory.buildProtocol(None)
        n = len(self.links)
        self.links.append(Connection(
            server, client, self.clock,
            server_address=IPv4Address("TCP", f"10.0.0.{self.number}", 5044),
            client_address=IPv4Address("TCP", "10.0.1.1", 40000 + n)))
        return defer.succeed(client)

    @property
    def live(self):
        return [link for link in self.links if link.up]

    def kill(self):
        self.up = False
        for link in self.live:
            link.cut()

    def revive(self):
        self.up = True


class LoadBalanceTests(SynchronousTestCase):

    def make(self, hosts=2, **kwargs):
        self.clock = Clock()
        self.hosts = [Host(i, self.clock) for i in range(hosts)]
        kwargs.setdefault("jitter", 0)
        kwargs.setdefault("timeout", 30)
        self.client = LoadBalancingLumberjackClient(
            self.hosts, clock=self.clock, names=[f"h{i}" for i in range(hosts)], **kwargs)
        return self.client

    def step(self):
        moved = False
        for host in self.hosts:
            for link in host.live:
                moved = link.step() or moved
        self.clock.advance(0)
        return moved

    def run_until(self, done, limit=100000, max_jump=None):
        """Move bytes, and time when none move, until C{done()}."""
        for _ in range(limit):
            if done():
                return
            if not self.step():
                pending = [c.getTime() for c in self.clock.getDelayedCalls()]
                self.assertTrue(pending, "nothing moves and nothing is due")
                jump = max(0.0, min(pending) - self.clock.seconds())
                if max_jump is not None:
                    jump = min(jump, max_jump)
                self.clock.advance(jump)
        self.fail("never done")

    def send(self, count, start=0, per_call=10):
        return [self.client.send([{"n": i} for i in range(first, min(first + per_call,
                                                                        start + count))])
                for first in range(start, start + count, per_call)]

    def all_fired(self, ds):
        return lambda: all(d.called for d in ds)

    def test_batches_spread_over_every_host(self):
        client = self.make(hosts=3, slow_start=False, bulk_max_size=10, pipelining=1)
        ds = self.send(600)
        self.run_until(self.all_fired(ds))
        self.assertEqual(sum(self.successResultOf(d) for d in ds), 600)
        stored = [h.disk.stored for h in self.hosts]
        self.assertEqual(sorted(n for s in stored for n in s), list(range(600)))
        # three equal hosts, one batch in flight each: a third each
        self.assertEqual([len(s) for s in stored], [200, 200, 200])
        self.assertEqual(client.acked_by_host(), {"h0": 200, "h1": 200, "h2": 200})
        self.assertEqual([len(h.links) for h in self.hosts], [1, 1, 1])
        self.assertEqual(client.pending, 0)

    def test_a_faster_host_takes_more(self):
        self.make(slow_start=False, bulk_max_size=10, pipelining=1)
        self.hosts[1].disk.delay = 0.01
        ds = self.send(400)
        self.run_until(self.all_fired(ds))
        fast, slow = (len(h.disk.stored) for h in self.hosts)
        self.assertEqual(fast + slow, 400)
        self.assertGreater(slow, 0)
        self.assertGreater(fast, 2 * slow)

    def test_one_send_call_is_spread(self):
        self.make(slow_start=False, bulk_max_size=10, pipelining=2)
        d = self.client.send([{"n": i} for i in range(100)])
        self.run_until(lambda: d.called)
        self.assertEqual(self.successResultOf(d), 100)
        self.assertTrue(all(h.disk.stored for h in self.hosts))

    def test_dead_host_batches_retried_on_the_others(self):
        client = self.make(hosts=3, slow_start=False, bulk_max_size=10, pipelining=2,
                           backoff_initial=1, backoff_max=8)
        dead = self.hosts[0]
        dead.disk.delay = 0.5     # its batches are in flight when it dies
        ds = self.send(300)
        self.run_until(lambda: dead.disk.stored and dead.factory.connections)
        in_flight_on_dead = client.senders[0].unacked
        self.assertEqual(in_flight_on_dead, 20)
        killed_at = self.clock.seconds()
        stored_before = set(dead.disk.stored)
        dead.kill()
        self.run_until(self.all_fired(ds))
        self.assertEqual(sum(self.successResultOf(d) for d in ds), 300)
        stored = [n for h in self.hosts for n in h.disk.stored]
        # nothing lost; what the dead host had not acked went to the others
        self.assertEqual(set(stored), set(range(300)))
        others = set(self.hosts[1].disk.stored) | set(self.hosts[2].disk.stored)
        self.assertEqual(others | stored_before, set(range(300)))
        self.assertFalse(set(dead.disk.stored) - stored_before)
        # the dead host is retried with backoff (1, 2, 4 s...) meanwhile
        self.run_until(lambda: len(dead.attempts) >= 5)
        waits = [b - a for a, b in zip(dead.attempts[1:], dead.attempts[2:])]
        self.assertEqual(dead.attempts[1], killed_at + 1)
        self.assertEqual(waits, [2, 4, 8][:len(waits)])
        self.flushLoggedErrors()

    def test_host_coming_back_takes_load_again(self):
        client = self.make(slow_start=False, bulk_max_size=10, pipelining=1,
                           backoff_initial=1, backoff_max=4)
        ds = self.send(100)
        self.run_until(self.all_fired(ds))
        self.hosts[0].kill()
        ds = self.send(100, start=100)
        self.run_until(self.all_fired(ds), max_jump=0.5)
        self.assertTrue(set(self.hosts[1].disk.stored) >= set(range(100, 200)))
        self.assertFalse([n for n in self.hosts[0].disk.stored if n >= 100])
        self.run_until(lambda: len(self.hosts[0].attempts) >= 4)   # still down: backoff
        self.hosts[0].revive()
        self.run_until(lambda: self.hosts[0].live)
        ds = self.send(200, start=200)
        self.run_until(self.all_fired(ds))
        back = [n for n in self.hosts[0].disk.stored if n >= 200]
        self.assertGreater(len(back), 50)
        self.assertEqual(client.pending, 0)
        self.flushLoggedErrors()

    def test_slow_start_per_connection(self):
        client = self.make(bulk_max_size=100, pipelining=1)
        self.hosts[1].disk.delay = 5       # a slow host
        ds = self.send(2000, per_call=100)
        self.run_until(lambda: len(self.hosts[0].disk.writes) >= 5)
        first = [h.disk.writes[0][1] for h in self.hosts if h.disk.writes]
        fast, slow = client.senders
        # each connection starts at 10 events and grows on its own acks
        self.assertEqual(len(first[0]), 10)
        self.assertEqual(fast.batch_size, 75)            # 10 x 1.5^5
        self.assertEqual(slow.batch_size, 10)
        self.run_until(lambda: self.hosts[1].disk.writes)
        self.assertEqual(len(self.hosts[1].disk.writes[0][1]), 10)
        # an error halves the window of its connection only
        before = fast.window
        self.hosts[1].links[-1].cut()
        self.assertEqual((fast.window, slow.window), (before, 5))
        self.run_until(self.all_fired(ds))
        self.flushLoggedErrors()

    def test_timeout_sends_the_batch_to_another_host(self):
        client = self.make(slow_start=False, bulk_max_size=10, pipelining=1, timeout=10)
        self.hosts[0].disk.hold = True     # takes the batch and never acks
        ds = self.send(50)
        self.run_until(self.all_fired(ds))
        self.assertEqual(sorted(self.hosts[1].disk.stored), list(range(50)))
        self.assertGreaterEqual(len(self.hosts[0].links), 1)
        self.assertEqual(client.acked_by_host(), {"h0": 0, "h1": 50})
        self.flushLoggedErrors()

    def test_close_fails_pending_sends(self):
        client = self.make(slow_start=False, bulk_max_size=10, pipelining=1)
        self.hosts[0].kill()
        self.hosts[1].disk.hold = True
        ds = self.send(50)
        for _ in range(10):
            self.step()
        self.assertEqual(client.pending, 50)
        closed = client.close()
        self.run_until(lambda: closed.called)
        self.successResultOf(closed)
        for d in ds:
            self.failureResultOf(d, ClientClosed)
        self.assertRaises(ClientClosed, client.send, [{"n": 1}])
        attempts = len(self.hosts[0].attempts)
        self.clock.advance(1000)
        self.assertEqual(len(self.hosts[0].attempts), attempts)   # no retry after close
        self.assertFalse(self.hosts[1].live)
        self.flushLoggedErrors()

    def test_workers_per_host(self):
        client = self.make(slow_start=False, bulk_max_size=10, pipelining=1, workers=2)
        ds = self.send(200)
        self.run_until(self.all_fired(ds))
        self.assertEqual(len(client.senders), 4)
        self.assertEqual([len(h.links) for h in self.hosts], [2, 2])
        self.assertEqual(client.acked_by_host(), {"h0": 100, "h1": 100})

    def test_arguments(self):
        self.assertRaises(ValueError, LoadBalancingLumberjackClient, [])
        self.assertRaises(ValueError, LoadBalancingLumberjackClient, [object()], workers=0)
        self.assertRaises(ValueError, LoadBalancingLumberjackClient, [object()],
                          names=["a", "b"])
