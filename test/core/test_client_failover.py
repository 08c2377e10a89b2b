"""
Clients moving between front-ends of one store: L{FailoverEndpoint}, the
command line's several C{-s}, and the Lumberjack and Pravega clients when
the front-end they use dies mid-stream (two servers in this process on one
shared store: what two front-ends on one JetStream cluster are).
"""

import json
import time

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial import unittest
from zope.interface import implementer

from streamproto.core.failover import AllAddressesFailed, FailoverEndpoint
from streamproto.log import MemoryLogStore
from streamproto.lumberjack.sink import IEventSink
from test.support.netutil import free_port
from test.reliable.test_reliable_e2e import TrackingFactory


def sleep(seconds):
    return deferLater(reactor, seconds, lambda: None)


class _Fake:
    def __init__(self, name, works):
        self.name, self.works, self.calls = name, works, 0

    def connect(self, factory):
        self.calls += 1
        if self.works:
            return defer.succeed(self.name)
        return defer.fail(ConnectionRefusedError(f"{self.name} refused"))


class FailoverEndpointTests(unittest.SynchronousTestCase):

    def test_moves_on_and_remembers(self):
        a, b, c = _Fake("a", False), _Fake("b", True), _Fake("c", True)
        endpoint = FailoverEndpoint([a, b, c], ["a", "b", "c"])
        self.assertEqual(self.successResultOf(endpoint.connect(None)), "b")
        # the one that worked is tried first next time
        self.assertEqual(self.successResultOf(endpoint.connect(None)), "b")
        self.assertEqual((a.calls, b.calls, c.calls), (1, 2, 0))
        b.works = False
        self.assertEqual(self.successResultOf(endpoint.connect(None)), "c")

    def test_every_address_failed(self):
        endpoint = FailoverEndpoint([_Fake("a", False), _Fake("b", False)], ["a", "b"])
        failure = self.failureResultOf(endpoint.connect(None), AllAddressesFailed)
        self.assertIn("a: ", str(failure.value))
        self.assertIn("b refused", str(failure.value))

    def test_command_line_takes_several_servers(self):
        from streamproto.lumberjack import cli
        args = cli.parse_args(["send", "-s", "h1:1,h2:2", "-s", "h3", "-"])
        self.assertEqual([s.address for s in args.servers], ["h1:1", "h2:2", "h3:5044"])
        self.assertIsInstance(cli.CONVENTION.endpoint(reactor, args), FailoverEndpoint)
        args = cli.parse_args(["send", "-s", "h1:1", "-"])
        self.assertNotIsInstance(cli.CONVENTION.endpoint(reactor, args), FailoverEndpoint)


@implementer(IEventSink)
class SlowSink:
    """A sink whose writes take C{delay} seconds more (a slow front-end)."""

    def __init__(self, inner, delay):
        self.inner = inner
        self.delay = delay
        self.log_name = inner.log_name

    def write(self, connection, events):
        return deferLater(reactor, self.delay, self.inner.write, connection, events)


@defer.inlineCallbacks
def pravega_events(endpoint, segment, count):
    """Read up to C{count} events of C{segment} from its start."""
    from streamproto.pravega.client import SegmentReader
    reader = SegmentReader(endpoint, segment)
    events = []
    while len(events) < count:
        got = yield reader.read()
        if not got:
            break
        events.extend(got)
    yield reader.close()
    return events


class FrontEnds:
    """Two servers of one protocol on one store; C{kill(i)} ends front-end i."""

    def __init__(self, testcase, make_factory, count=2):
        self.testcase = testcase
        self.make_factory = make_factory
        self.count = count
        self.ports = [free_port() for _ in range(count)]
        self.listening = [None] * count
        self.trackers = [None] * count

    @defer.inlineCallbacks
    def start(self):
        for i in range(self.count):
            tracker = TrackingFactory(self.make_factory())
            port = yield TCP4ServerEndpoint(reactor, self.ports[i],
                                            interface="127.0.0.1").listen(tracker)
            self.listening[i], self.trackers[i] = port, tracker
            self.testcase.addCleanup(self.kill, i)

    @defer.inlineCallbacks
    def kill(self, i):
        """As a kill -9 of front-end i: no more listening, every connection cut."""
        port, self.listening[i] = self.listening[i], None
        if port is not None:
            yield port.stopListening()
            yield self.trackers[i].close_all()

    def endpoint(self):
        return FailoverEndpoint(self.endpoints(), self.names())

    def endpoints(self):
        return [TCP4ClientEndpoint(reactor, "127.0.0.1", p, timeout=5) for p in self.ports]

    def names(self):
        return [f"127.0.0.1:{p}" for p in self.ports]


class ClientFailoverTests(unittest.TestCase):
    timeout = 120

    def setUp(self):
        self.store = MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def ingest_across_a_kill(self, fronts, send_one, what, n=400, before_kill=None):
        acked = []
        results = []
        killed_at = None
        ack_times = []
        for i in range(n):
            d = send_one(i)
            d.addCallback(lambda _, i=i: (acked.append(i), ack_times.append(time.monotonic())))
            d.addErrback(results.append)
            results.append(d)
            if i == n // 3:
                yield d
                if before_kill is not None:
                    before_kill()
                killed_at = time.monotonic()
                yield fronts.kill(0)
        yield defer.DeferredList([r for r in results if isinstance(r, defer.Deferred)])
        errors = [r for r in results if isinstance(r, Failure)]
        after = [t for t in ack_times if t >= killed_at]
        switch = (after[0] - killed_at) if after else float("inf")
        print(f"\n{what}: front-end killed after {n // 3 + 1} items; first ack on the other "
              f"{switch:.2f} s later; {len(acked)} acknowledged, {len(errors)} failed")
        self.assertEqual(errors, [])
        self.assertEqual(sorted(acked), list(range(n)))
        return acked

    @defer.inlineCallbacks
    def test_lumberjack(self):
        """
        Lumberjack resends a batch not acknowledged on the dead front-end to
        the next one: every event stored (at least once: Lumberjack has no
        de-duplication, so a batch whose ack was lost may be stored twice).
        """
        from streamproto.lumberjack.client import LumberjackClient
        from streamproto.lumberjack.server import LumberjackServerFactory
        from streamproto.lumberjack.sink import LogStoreSink
        yield self.store.create("lumberjack")
        fronts = FrontEnds(self, lambda: LumberjackServerFactory(LogStoreSink(self.store)))
        yield fronts.start()
        client = LumberjackClient(fronts.endpoint(), clock=reactor)
        self.addCleanup(client.close)
        yield self.ingest_across_a_kill(fronts, lambda i: client.send([{"n": i}]),
                                        "lumberjack")
        log_ = yield self.store.get("lumberjack")
        batch = yield log_.read(0, max_bytes=1 << 30)
        stored = [json.loads(r)["event"]["n"] for r in batch.records()]
        self.assertEqual(set(stored), set(range(400)))
        print(f"lumberjack: {len(stored) - 400} events stored twice")

    @defer.inlineCallbacks
    def test_lumberjack_loadbalance(self):
        """
        The load-balancing client (Filebeat's C{loadbalance: true}) sends to
        both front-ends; one (slow: 50 ms a batch) dies with batches in
        flight, which go to the other: every event stored, at least once
        (a batch the dead one stored but could not acknowledge is stored
        twice).
        """
        from streamproto.lumberjack.client import LoadBalancingLumberjackClient
        from streamproto.lumberjack.server import LumberjackServerFactory
        from streamproto.lumberjack.sink import LogStoreSink
        yield self.store.create("lumberjack")
        servers = []

        def make_factory():
            sink = LogStoreSink(self.store)
            if not servers:
                sink = SlowSink(sink, 0.05)
            servers.append(LumberjackServerFactory(sink))
            return servers[-1]
        fronts = FrontEnds(self, make_factory)
        yield fronts.start()
        client = LoadBalancingLumberjackClient(fronts.endpoints(), clock=reactor,
                                               names=fronts.names())
        self.addCleanup(client.close)
        n = 1000
        acked, sent = set(), []
        killed = None
        while len(sent) < n or killed is None:
            self.assertLess(len(sent), 20 * n, "the slow front-end never held a batch")
            for _ in range(10):
                i = len(sent)
                sent.append(client.send([{"n": i}]).addCallback(
                    lambda _, i=i: acked.add(i)))
            yield sleep(0.002)
            if (killed is None and len(sent) >= n // 3 and client.senders[0].unacked
                    and all(s.events_persisted for s in servers)):
                # both front-ends stored events, and the slow one holds some
                killed = (client.acked_by_host(), client.senders[0].unacked,
                          [s.events_persisted for s in servers])
                yield fronts.kill(0)
        yield defer.gatherResults(sent)
        self.assertEqual(acked, set(range(len(sent))))
        log_ = yield self.store.get("lumberjack")
        batch = yield log_.read(0, max_bytes=1 << 30)
        stored = [json.loads(r)["event"]["n"] for r in batch.records()]
        self.assertEqual(set(stored), set(range(len(sent))))
        before, in_flight, persisted = killed
        after = client.acked_by_host()
        print(f"\nlumberjack loadbalance: {len(sent)} events; at the kill each front-end had "
              f"stored {persisted}, {in_flight} in flight on the killed one; acked by host "
              f"before {before}, at the end {after}; {len(stored) - len(sent)} stored twice")
        # the survivor carried the rest, the batches in flight on the dead one included
        survivor = fronts.names()[1]
        self.assertGreater(after[survivor], before[survivor])
        self.assertEqual(sum(after.values()), len(sent))

    @defer.inlineCallbacks
    def test_lumberjack_command_loadbalance(self):
        """C{streamproto lumberjack send -s a,b --loadbalance}: both servers take events."""
        import io

        from streamproto.lumberjack import cli
        from streamproto.lumberjack.server import LumberjackServerFactory
        from streamproto.lumberjack.sink import LogStoreSink
        servers = []

        def make_factory():
            servers.append(LumberjackServerFactory(LogStoreSink(self.store)))
            return servers[-1]
        fronts = FrontEnds(self, make_factory)
        yield fronts.start()
        args = cli.parse_args(["send", "-s", ",".join(fronts.names()), "--loadbalance",
                               "--batch", "50", "-q", "-"])
        lines = b"".join(b'{"n": %d}\n' % i for i in range(3000))
        out = io.StringIO()
        sent, skipped = yield cli.send(reactor, args, io.BytesIO(lines), out, io.StringIO())
        self.assertEqual((sent, skipped), (3000, 0))
        self.assertEqual(out.getvalue(), "sent 3000 events\n")
        self.assertEqual(sum(s.events_persisted for s in servers), 3000)
        self.assertTrue(all(s.events_persisted for s in servers),
                        [s.events_persisted for s in servers])

    @defer.inlineCallbacks
    def test_pravega_conditional_appends_through_both(self):
        """
        Pravega writers on both front-ends racing a ConditionalAppend on the
        same length: exactly one wins, whichever front-end it came through;
        a loser retried at the new length succeeds and its writer carries on.
        """
        from streamproto.pravega.client import ConditionalCheckFailedError, SegmentWriter
        from streamproto.pravega.client import connect
        from streamproto.pravega.server import PravegaServerFactory
        fronts = FrontEnds(self, lambda: PravegaServerFactory(self.store))
        yield fronts.start()
        segment = "cond/itional/0.#epoch.0"
        proto = yield connect(fronts.endpoint())
        yield proto.create_segment(segment)
        proto.transport.loseConnection()
        writers = []
        for i in range(4):
            port = fronts.ports[i % 2]
            writer = SegmentWriter(TCP4ClientEndpoint(reactor, "127.0.0.1", port), segment)
            self.addCleanup(lambda w=writer: w.close().addErrback(lambda _: None))
            writers.append(writer)
        yield defer.gatherResults([w.when_set_up() for w in writers])
        results = yield defer.DeferredList(
            [w.write_conditional(b"winner?", 0) for w in writers], consumeErrors=True)
        won = [w for w, (ok, _) in zip(writers, results) if ok]
        lost = [(w, f) for w, (ok, f) in zip(writers, results) if not ok]
        self.assertEqual(len(won), 1)
        for _, f in lost:
            f.trap(ConditionalCheckFailedError)
        # a loser on the other front-end than the winner's
        other = [w for w, _ in lost if writers.index(w) % 2 != writers.index(won[0]) % 2][0]
        # an event is stored framed: 8 bytes of header, then its bytes
        yield other.write_conditional(b"second", 8 + len(b"winner?"))
        yield other.write(b"plain")
        events = yield pravega_events(fronts.endpoint(), segment, 3)
        self.assertEqual(events, [b"winner?", b"second", b"plain"])

    @defer.inlineCallbacks
    def test_pravega_exactly_once(self):
        """
        The Pravega writer sets up again on the next front-end, which tells
        it the last event number the store has: every acknowledged event is
        stored exactly once.
        """
        from streamproto.pravega.client import SegmentWriter, connect
        from streamproto.pravega.server import PravegaServerFactory
        fronts = FrontEnds(self, lambda: PravegaServerFactory(self.store))
        yield fronts.start()
        segment = "fail/over/0.#epoch.0"
        proto = yield connect(fronts.endpoint())
        yield proto.create_segment(segment)
        proto.transport.loseConnection()
        writer = SegmentWriter(fronts.endpoint(), segment, max_retries=20, retry_delay=0.05)
        self.addCleanup(lambda: writer.close().addErrback(lambda _: None))
        yield self.ingest_across_a_kill(fronts, lambda i: writer.write(b"event %d" % i),
                                        "pravega")
        yield writer.close()
        events = yield pravega_events(fronts.endpoint(), segment, 400)
        self.assertEqual(events, [b"event %d" % i for i in range(400)])


class RelinkFailoverTests(unittest.TestCase):
    """
    Two relink servers (``log`` and ``log-tx`` on one store), the first
    killed mid-stream: the connector links to the second, which does not
    know its link, and sends everything not acknowledged again on a new
    link (L{streamproto.relink.api.Connector.when_relinked}).
    """

    timeout = 120

    def setUp(self):
        self.store = MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def fronts_and_connector(self, name, transactions=False):
        from streamproto.relink.api import Connector, ListenerFactory
        from streamproto.relink.endpoints import server_endpoints
        factories = []

        def make_factory():
            factories.append(ListenerFactory(server_endpoints(self.store)))
            return factories[-1]
        # after the kills (cleanups run last first): the tracking wrapper
        # does not pass the port's stop on, which discards the links left
        self.addCleanup(lambda: [f.stopFactory() for f in factories])
        fronts = FrontEnds(self, make_factory)
        yield fronts.start()
        connector = Connector(fronts.endpoint(), name, connector_id_size=4,
                              listener_id_size=4, connector_transactions=transactions,
                              clock=reactor).start()
        self.addCleanup(connector.stop)
        link = yield connector.when_linked()
        return fronts, connector, link

    @defer.inlineCallbacks
    def stored(self, channels):
        """Per channel: the records stored, and how many of them are repeats."""
        out, twice = {}, 0
        for c in channels:
            log_ = yield self.store.get(f"relink-{c}")
            batch = yield log_.read(0, max_bytes=1 << 30)
            records = [bytes(r) for r in batch.records()]
            first = list(dict.fromkeys(records))
            twice += len(records) - len(first)
            out[c] = first
        return out, twice

    @defer.inlineCallbacks
    def test_log(self):
        """
        Every message acknowledged and stored, in order per channel; a
        message the killed front-end stored whose acknowledgement was lost
        with it is stored twice (counted and printed).  The kill comes from
        an acknowledgement's callback, with thousands of messages in flight.
        """
        fronts, connector, link = yield self.fronts_and_connector("log")
        relinked = connector.when_relinked()
        n, acked, ack_times, kill = 4000, [], [], []

        def ack(_, i):
            acked.append(i)
            ack_times.append(time.monotonic())
        ds = []
        for i in range(n):
            ds.append(link.channel(i % 2).send([b"%d" % i]).addCallback(ack, i))
            if i % 40 == 39:
                if i == 1199:
                    # just sent, not yet acknowledged: in flight at the kill
                    kill.append(time.monotonic())
                    fronts.kill(0)
                yield sleep(0.002)
        yield defer.gatherResults(ds)
        what = yield relinked
        self.assertIs(connector.link, link)
        after = [kill[0]] + [t for t in ack_times if t >= kill[0]]
        stall = max(b - a for a, b in zip(after, after[1:]))
        by_channel, twice = yield self.stored([0, 1])
        for c in (0, 1):
            self.assertEqual(by_channel[c], [b"%d" % i for i in range(c, n, 2)])
        print(f"\nrelink log: front-end killed mid-stream after 1,200 of {n} messages "
              f"were sent; link re-established on the other, {what.resent} messages "
              f"resent, {twice} stored twice; longest time without an ack {stall:.3f} s")
        self.assertEqual(sorted(acked), list(range(n)))
        self.assertGreater(what.resent, 0)
        self.assertLessEqual(twice, what.resent)

    @defer.inlineCallbacks
    def test_log_tx(self):
        """
        Transactions: every committed one stored whole; one the killed
        front-end committed without its answer reaching us is committed
        again, whole (stored twice, never in part).
        """
        fronts, connector, link = yield self.fronts_and_connector("log-tx", transactions=True)
        ch = link.channel(0)

        def send_one(i):
            ch.send_many([[b"%d.%d" % (i, k)] for k in range(3)], ack=None)
            return ch.commit().addCallback(lambda ok: ok or defer.fail(AssertionError(i)))
        yield ClientFailoverTests.ingest_across_a_kill(self, fronts, send_one, "relink log-tx",
                                                       n=150)
        self.assertEqual(connector.relinks, 1)
        log_ = yield self.store.get("relink-0")
        batch = yield log_.read(0, max_bytes=1 << 30)
        records = [bytes(r) for r in batch.records()]
        first = list(dict.fromkeys(records))
        self.assertEqual(first, [b"%d.%d" % (i, k) for i in range(150) for k in range(3)])
        twice = len(records) - len(first)
        self.assertEqual(twice % 3, 0)      # whole transactions only
        print(f"relink log-tx: {connector.last_relink.resent} messages resent, "
              f"{twice // 3} transactions stored twice")

    def test_command_line_takes_several_servers(self):
        from streamproto.relink import cli
        args = cli.parse_args(["-s", "h1:1,h2:2", "send"])
        self.assertIsInstance(cli.CONVENTION.endpoint(reactor, args), FailoverEndpoint)


class ReliableFailoverTests(unittest.TestCase):
    """The reliable client resumes its session on the next front-end (shared sessions)."""

    timeout = 120

    @defer.inlineCallbacks
    def test_session_resumes_on_the_next_front_end(self):
        from streamproto.reliable.client import StatefulClient
        from streamproto.reliable.server import ReliableStreamFactory
        from streamproto.reliable.session import MemorySessionStore
        from test.reliable.test_reliable_e2e import check_stream
        sessions = MemorySessionStore()
        self.addCleanup(sessions.close)
        fronts = FrontEnds(self, lambda: ReliableStreamFactory(sessions, rate=2000))
        yield fronts.start()
        d = StatefulClient(fronts.endpoint(), 2000, ack_every=16).run()
        while True:
            yield sleep(0.02)
            known = list(sessions._table.sessions.values())
            if known and known[0].last_id >= 300:
                break
        yield fronts.kill(0)
        result = yield d
        check_stream(self, result, 2000)
        self.assertGreaterEqual(result.reconnects, 1)


class StyxFailoverTests(unittest.TestCase):
    timeout = 60

    def setUp(self):
        self.store = MemoryLogStore(reactor)

    @defer.inlineCallbacks
    def test_styx_http(self):
        """
        The Styx HTTP client over two front-ends (its pooled connection to
        the killed one included): every write acknowledged, once, in order;
        at most one write fails (the one on the connection the kill cut).
        """
        from twisted.protocols.policies import WrappingFactory
        from twisted.web.client import HTTPConnectionPool

        from streamproto.styx.api_client import StyxClient
        from streamproto.styx.resource import make_site
        wrappers, listening, ports = [], [], []
        for _ in range(2):
            wrapper = WrappingFactory(make_site(self.store))
            port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(wrapper)
            self.addCleanup(port.stopListening)
            wrappers.append(wrapper)
            listening.append(port)
            ports.append(port.getHost().port)

        @defer.inlineCallbacks
        def kill(i):
            # as a kill -9: no more listening, every connection cut
            yield listening[i].stopListening()
            for conn in list(wrappers[i].protocols):
                conn.transport.abortConnection()
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        client = StyxClient([f"http://127.0.0.1:{p}" for p in ports], reactor, pool=pool)
        yield client.create_log("events")
        acked, failed = [], 0
        for i in range(60):
            while True:
                # the caller's retry: a write on the pooled connection the
                # kill cut fails once (its outcome unknown); the next
                # attempt goes to the other front-end
                try:
                    yield client.write_record("events", b"%d" % i)
                    break
                except Exception:
                    failed += 1
                    self.assertLess(failed, 3)
            acked.append(b"%d" % i)
            if i == 20:
                yield kill(0)
        self.assertEqual(client.base_url, f"http://127.0.0.1:{ports[1]}")
        self.assertEqual((yield client.read_records("events")), acked)

    def test_styx_command_line_takes_several_servers(self):
        from streamproto.styx import cli
        args = cli.parse_args(["-s", "h1:1,h2:2", "-s", "h3", "logs", "list"])
        client = cli._client(args, reactor)
        self.addCleanup(client.close)
        self.assertEqual(client.base_urls, ["http://h1:1", "http://h2:2", "http://h3:7123"])

