"""
Exactly-once under arbitrary connection failures: hypothesis drives a
SegmentWriter against the real server over in-memory connections
(L{test.support.memnet.Connection}) that deliver bytes in random pieces and can be
cut at any byte (in the middle of a frame, of a block, of an ack), and
checks that the segment holds every event written, in order, once.
"""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from streamproto.log import MemoryLogStore
from streamproto.pravega import codec, segments
from streamproto.pravega.client import SegmentWriter
from streamproto.pravega.server import PravegaServerFactory
from test.support.memnet import Connection

SEG = "scope/stream/0.#epoch.0"


class Endpoint:
    """Connects each writer's connection to a new server connection (a L{Connection})."""

    def __init__(self, server_factory, clock):
        self.server_factory = server_factory
        self.clock = clock
        self.links = []
        self.refuse = 0

    def connect(self, factory):
        if self.refuse:
            self.refuse -= 1
            return defer.fail(ConnectionRefusedError())
        client = factory.buildProtocol(None)
        server = self.server_factory.buildProtocol(None)
        n = len(self.links)
        self.links.append(Connection(
            server, client, self.clock,
            server_address=IPv4Address("TCP", "127.0.0.1", 2 * n + 1),
            client_address=IPv4Address("TCP", "127.0.0.1", 2 * n)))
        return defer.succeed(client)

    @property
    def live(self):
        return [link for link in self.links if link.up]


class SlowDiskStore(MemoryLogStore):
    """Appends become durable (and visible) 20 ms of clock time later, in order."""

    def create(self, name, config=None):
        def slow(log):
            real = log.append

            def append(records, attributes=None, **conditions):
                d = defer.Deferred()
                self._clock.callLater(
                    0.02, lambda: real(records, attributes, **conditions).chainDeferred(d))
                return d
            log.append = append
            return log
        return super().create(name, config).addCallback(slow)


class ExactlyOnce(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.store = SlowDiskStore(self.clock)
        factory = PravegaServerFactory(self.store, clock=self.clock, idle_timeout=0)
        factory.segments.create(SEG)
        self.endpoint = Endpoint(factory, self.clock)
        self.writer = SegmentWriter(self.endpoint, SEG, clock=self.clock, block_size=64,
                                    window_events=25, retry_delay=0.01, max_retry_delay=0.05,
                                    max_retries=10 ** 6, keepalive_interval=0,
                                    rng=random.Random(0))   # jittered, the same each run
        self.written = []
        self.results = []
        self.failures = []
        self.cuts = 0

    def _track(self, d):
        d.addCallbacks(self.results.append, self.failures.append)

    @rule(events=st.lists(st.binary(max_size=40), min_size=1, max_size=12),
          single=st.booleans())
    def write(self, events, single):
        if single:
            for e in events:
                self._track(self.writer.write(e))
        else:
            self._track(self.writer.write_batch(events))
        self.written += events

    @rule(size=st.integers(1, 300), steps=st.integers(1, 20))
    def run(self, size, steps):
        """Time passes (5 ms a step) and bytes move, in pieces of C{size}."""
        for _ in range(steps):
            self.clock.advance(0.005)
            for link in self.endpoint.live:
                link.step(size)

    @precondition(lambda self: self.endpoint.live)
    @rule(nbytes=st.integers(0, 400))
    def cut_after(self, nbytes):
        """The server gets C{nbytes} more of what the client sent, then the link dies."""
        link = self.endpoint.live[-1]
        self.cuts += 1
        link.cut(to_server=nbytes)              # its acks are lost

    @rule(refusals=st.integers(0, 2))
    def refuse(self, refusals):
        self.endpoint.refuse = refusals

    @invariant()
    def nothing_failed(self):
        assert not self.failures, self.failures

    def teardown(self):
        # let the writer finish: no more cuts, everything delivered
        self.endpoint.refuse = 0
        for _ in range(2000):
            if self.writer.pending == 0:
                break
            self.clock.advance(0.06)
            for link in self.endpoint.live:
                while link.step(4096):
                    self.clock.advance(0)
        assert self.writer.pending == 0, "writer did not finish"
        assert not self.failures, self.failures
        log = self.store._logs[segments.log_name(SEG)]
        data = b"".join(log._records)
        events, used = codec.split_events(data)
        assert used == len(data)
        assert events == self.written, (len(events), len(self.written), self.cuts)
        self.writer.stop(None)
        for link in self.endpoint.live:
            link.cut()


class ExactlyOnceTests(SynchronousTestCase):
    def test_exactly_once(self):
        machine = ExactlyOnce
        machine.TestCase.settings = settings(max_examples=100, stateful_step_count=50,
                                             deadline=None, database=None,
                                             suppress_health_check=list(HealthCheck))
        machine.TestCase().runTest()
